"""A host in raw nats-py that does a reply's bus work and nothing else: the
protocol floor ``bench/simulation.py`` measures fleetbus's host against.

For each request on ``<prefix>.agent.*.inbox`` (queue group ``hosts``), what
a fleetbus host sends for a reply with ``--checkpoints reply``, in order,
each awaited: take the session's lease (a compare-and-set write on the lease
stream, at the revision its release was heard with), read the session's
head (from the second round on), call the tool, write the head
(compare-and-set), release the lease (a deletion marker, compare-and-set),
answer. Like a fleetbus host, it follows every lease write the server
republishes on ``<prefix>.kv.leases.>``. The values have the sizes of the
fleetbus records they stand for: a lease carrying its request, and a head
that grows by a reply's messages each round.

Usage: python bench/_raw_host.py URL PREFIX TOOL_SUBJECT CONCURRENCY
"""

from __future__ import annotations

import asyncio
import base64
import signal
import sys

import nats
import orjson
from nats.aio.msg import Msg

LEASE_BYTES = 500
HEAD_BYTES = 800
HEAD_BYTES_PER_ROUND = 700
ANSWER = b"a" * 400
TOOL_CALL = orjson.dumps(
    {
        "type": "tool_call",
        "v": 1,
        "call_id": "c" * 32,
        "sender": "raw-host",
        "tool_name": "noop",
        "parameters": {},
    }
)
_DELETED = "KV-Operation"
_EXPECTED = "Nats-Expected-Last-Subject-Sequence"
_SEQUENCE = "Nats-Sequence"


def streams(prefix: str) -> tuple[str, str]:
    """The names of the floor's head and lease streams."""
    return f"KV_{prefix}_heads", f"KV_{prefix}_leases"


async def main(url: str, prefix: str, tool: str, concurrency: int) -> None:
    nc = await nats.connect(url)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    heads_stream, _ = streams(prefix)
    heads, leases = f"$KV.{prefix}_heads.", f"$KV.{prefix}_leases."
    republished = f"{prefix}.kv.leases."
    released: dict[str, int] = {}
    limiter = asyncio.Semaphore(concurrency)

    async def heard(msg: Msg) -> None:
        headers = msg.headers or {}
        if headers.get(_DELETED) == "DEL":
            released[msg.subject[len(republished) :]] = int(headers.get(_SEQUENCE, "0"))

    async def acked(subject: str, data: bytes, headers: dict[str, str] | None = None) -> int:
        answer = orjson.loads((await nc.request(subject, data, timeout=60, headers=headers)).data)
        if "error" in answer:
            raise RuntimeError(f"{subject}: {answer['error']}")
        return int(answer.get("seq", 0))

    async def reply(msg: Msg) -> None:
        async with limiter:
            key = f"{msg.subject.split('.')[-2]}.game"
            number = int(msg.data)
            lease = await acked(
                leases + key, b"l" * LEASE_BYTES, {_EXPECTED: str(released.get(key, 0))}
            )
            head = 0
            if number > 1:
                query = orjson.dumps({"last_by_subj": heads + key})
                got = await nc.request(f"$JS.API.STREAM.MSG.GET.{heads_stream}", query, timeout=60)
                stored = orjson.loads(got.data)["message"]
                head = int(stored["seq"])
                base64.b64decode(stored["data"])
            await nc.request(tool, TOOL_CALL, timeout=60)
            size = HEAD_BYTES + HEAD_BYTES_PER_ROUND * number
            await acked(heads + key, b"h" * size, {_EXPECTED: str(head)})
            await acked(leases + key, b"", {_DELETED: "DEL", _EXPECTED: str(lease)})
            await nc.publish(msg.reply, ANSWER)

    running: set[asyncio.Task[None]] = set()

    async def dispatch(msg: Msg) -> None:
        task = loop.create_task(reply(msg))
        running.add(task)
        task.add_done_callback(running.discard)

    await nc.subscribe(republished + ">", cb=heard)
    await nc.subscribe(f"{prefix}.agent.*.inbox", queue="hosts", cb=dispatch)
    await nc.flush()
    print("ready", flush=True)
    await stop.wait()
    await nc.drain()


if __name__ == "__main__":
    import uvloop

    uvloop.run(main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])))
