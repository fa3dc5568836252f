"""A host in raw nats-py that does a reply's bus work and nothing else: the
protocol floor ``bench/simulation.py`` measures fleetbus's host against.

It mimics what a fleetbus host sends for a reply with ``--checkpoints
reply`` on the session layout of journals (``fleetbus.agents.serving.
sessions``), on streams fleetbus itself made (``SessionStore.open`` on the
floor's prefix: the journal stream ``<prefix>_session`` as
``fleetbus.bus.journal.journal()`` creates it, the lease bucket
``<prefix>_session_leases``). For each request on
``<prefix>.agent.*.inbox`` (queue group ``hosts``), in the session the
request names (the lease and the journal of ``<agent>.<session_id>``, as
fleetbus's), in order, each awaited:

1. take the session's lease: a compare-and-set write on the lease bucket
   against the marker its release left while that lives (``MARKER_LIFE``),
   else as new first (a create), the other second; the lease read and
   written over only when both fail, or when no release is known and the
   create fails;
2. read the session's journal when its end is not known: one direct get
   batch (``$JS.API.DIRECT.GET.<stream>`` with ``{"seq", "next_by_subj",
   "batch"}``), every message of the session to its end of batch; or, as
   fleetbus's journals do while the journals read last were each one
   snapshot, its last message first (``$JS.API.DIRECT.GET.<stream>.
   <subject>``: a snapshot is the whole journal). Like
   fleetbus's session cache, the ends of the last 256 sessions released here
   are known (with 10,000 agents played in order, none is when its turn
   comes again, and fleetbus's cache then holds nothing: it holds folds
   only while sessions come back);
3. append the ``taken`` fact (``Nats-Expected-Last-Subject-Sequence``: the
   journal's end) when the session is new; a session its last owner
   released is taken cleanly, its request carried in the lease;
4. call the tool on the worker;
5. append the ``end`` fact against the journal's end, rolling the journal
   up (``Nats-Rollup: sub``) as fleetbus's population host does while a
   session is under ``SNAPSHOT_BYTES``: the end is then a snapshot of the
   whole session, which grows by a reply's four messages each round;
6. answer, then release the lease (a purge leaving a marker that expires,
   compare-and-set), in fleetbus's order: written, answered, released.

Like a fleetbus host, it follows every lease write the server republishes on
``<prefix>.kv.session_leases.>`` (a release heard is known for the next
take). Messages have the sizes fleetbus sends for the benchmark's reply
(one tool call: four messages), measured on the wire: the lease and a
``taken`` fact carry the request; the first ``end`` is a snapshot of the
four messages and the final answer, each later one that snapshot and four
messages more; the tool call and the answer as fleetbus encodes them.

What it does not do is fleetbus's work in Python: no fact is decoded nor
folded, no state built. A journal read shares one inbox subscription, as
fleetbus's does.

Usage: python bench/_raw_host.py URL PREFIX TOOL_SUBJECT CONCURRENCY
"""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from collections import OrderedDict

import nats
import orjson
from nats.aio.msg import Msg

TAKEN_BYTES = 529
"""A ``taken`` fact of the benchmark's reply (the request it serves, owner, status)."""
LEASE = orjson.dumps(
    {
        "owner": "bench@raw-host",
        "epoch": 0,
        "renewals": 0,
        "request": {"reply_to": "_INBOX.x", "input": "r" * 277},
    }
)
"""The lease while a reply runs, the request it serves in it (371 bytes, as fleetbus's)."""
SESSION_ID = b'"session_id":"'
"""What comes before the session of a request (the runner's, as fleetbus encodes it)."""
FIRST_END_BYTES = 1333
"""The ``end`` of a session's first reply: a snapshot of its four messages,
the final answer, the status."""
END_GROWTH_BYTES = 699
"""What each later reply adds to the snapshot its ``end`` is: four messages."""
SNAPSHOT_BYTES = 16 * 1024
"""The ``end`` rolls the journal up while it is under this size (fleetbus's
``SNAPSHOT_BYTES``); past it, the floor appends a reply's four messages
alone."""
ANSWER = b"a" * 313
TOOL_CALL = orjson.dumps(
    {
        "type": "tool_call",
        "v": 1,
        "call_id": "c" * 32,
        "sender": "raw-host",
        "tool_name": "noop",
        "parameters": {},
        "pad": "p" * 158,
    }
)
"""A tool call the size of fleetbus's (293 bytes)."""
CACHED = 256
"""Sessions whose journal end is known (fleetbus's session cache)."""
BATCH = 256
"""Messages a direct get returns at most (as fleetbus's journal asks)."""
MARKER_TTL = "5"
"""Seconds the marker of a released lease stays (as fleetbus's leases)."""
MARKER_LIFE = 5.0
"""Seconds after a release during which its marker is written against first
(fleetbus's ``Leases.marker_life``); past them, the lease is written as new
first, and the marker is tried second."""
MARKER_GONE = 7.5
"""Seconds after a release by which its marker has surely expired: a take
then writes the lease as new only (fleetbus's ``Leases._marker_gone``)."""
_OPERATION = "KV-Operation"
_EXPECTED = "Nats-Expected-Last-Subject-Sequence"
_SEQUENCE = "Nats-Sequence"
_WRONG_LAST_SEQUENCE = (10071, 10164)


def fact(replies: int, kind: bytes, size: int) -> bytes:
    """A fact of ``size`` bytes that says how many replies the session had,
    and its kind: ``t`` taken, ``s`` a snapshot, ``d`` a reply's messages."""
    return b"%08d" % replies + kind + b"f" * (size - 9)


def replies_in(data: bytes) -> int:
    """The replies the session had, as its fact says."""
    return int(data[:8]) if data[:8].isdigit() else 0


class Mismatch(Exception):
    """A compare-and-set found another last sequence."""


async def main(url: str, prefix: str, tool: str, concurrency: int) -> None:
    nc = await nats.connect(url)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    bucket = f"{prefix}_session_leases"
    leases = f"$KV.{bucket}."
    journals = f"{prefix}.session."
    direct = f"$JS.API.DIRECT.GET.{prefix}_session"
    republished = f"{prefix}.kv.session_leases."
    released: dict[str, tuple[int, float]] = {}  # (marker, when released)
    ends: OrderedDict[str, tuple[tuple[int, int], int]] = OrderedDict()
    limiter = asyncio.Semaphore(concurrency)
    reads: dict[str, tuple[list[tuple[int, int, bool]], asyncio.Future[bool]]] = {}
    snapshots_last = False
    inbox = nc.new_inbox()
    numbers = iter(range(1 << 62))

    async def heard(msg: Msg) -> None:
        headers = msg.headers or {}
        if headers.get(_OPERATION) == "PURGE":
            marker = int(headers.get(_SEQUENCE, "0"))
            released[msg.subject[len(republished) :]] = (marker, time.monotonic())

    async def part(msg: Msg) -> None:
        waiting = reads.get(msg.subject[len(inbox) + 1 :])
        if waiting is None:
            return
        headers = msg.headers or {}
        status = headers.get("Status")
        if status is None:  # (sequence, replies the session had, a snapshot: the fact says)
            seq = int(headers.get(_SEQUENCE, "0"))
            waiting[0].append((seq, replies_in(msg.data), msg.data[8:9] == b"s"))
        elif not waiting[1].done():
            waiting[1].set_result(status == "204" and int(headers.get("Nats-Num-Pending") or 0) > 0)

    async def acked(subject: str, data: bytes, headers: dict[str, str]) -> int:
        answer = orjson.loads((await nc.request(subject, data, timeout=60, headers=headers)).data)
        error = answer.get("error")
        if error:
            if error.get("err_code") in _WRONG_LAST_SEQUENCE:
                raise Mismatch(subject)
            raise RuntimeError(f"{subject}: {error}")
        return int(answer["seq"])

    async def journal_end(key: str) -> tuple[int, int]:
        """The sequence of the journal's last message (0: empty), read whole,
        and the replies the session had. As fleetbus's journals do, while the
        journals read last were each one snapshot, its last message is read
        first: a snapshot is the whole journal."""
        nonlocal snapshots_last
        if snapshots_last:
            got = await nc.request(f"{direct}.{journals}{key}", b"", timeout=60)
            status = (got.headers or {}).get("Status")
            if status == "404":
                return 0, 0
            if status is None and got.data[8:9] == b"s":
                return int((got.headers or {})[_SEQUENCE]), replies_in(got.data)
        start, end, facts = 1, (0, 0), 0
        while True:
            token = str(next(numbers))
            seqs: list[tuple[int, int, bool]] = []
            done: asyncio.Future[bool] = loop.create_future()
            reads[token] = (seqs, done)
            query = {"seq": start, "next_by_subj": journals + key, "batch": BATCH}
            try:
                await nc.publish(direct, orjson.dumps(query), reply=f"{inbox}.{token}")
                more = await asyncio.wait_for(done, 60)
            finally:
                del reads[token]
            facts += len(seqs)
            if seqs:
                end = seqs[-1][:2]
            if not more or not seqs:
                snapshots_last = facts == 1 and seqs[-1][2]
                return end
            start = end[0] + 1

    async def take(key: str) -> tuple[int, int | None]:
        """The lease taken: its revision, and the marker it was taken over.
        As fleetbus's leases: against the marker its release left while
        that lives, else as new first and against the marker second; only
        when both fail (or no release is known), the lease is read."""
        known = released.pop(key, None)
        ways: list[int] = [0]
        if known is not None and time.monotonic() - known[1] < MARKER_GONE:
            fresh = time.monotonic() - known[1] < MARKER_LIFE
            ways = [known[0], 0] if fresh else [0, known[0]]
        for way in ways:
            try:
                return await acked(leases + key, LEASE, {_EXPECTED: str(way)}), way or None
            except Mismatch:
                continue
        while True:  # read the lease, then write over what it holds
            query = orjson.dumps({"last_by_subj": leases + key})
            got = orjson.loads(
                (await nc.request(f"$JS.API.STREAM.MSG.GET.KV_{bucket}", query, 60)).data
            )
            marker = int(got["message"]["seq"]) if "message" in got else 0
            try:
                return await acked(leases + key, LEASE, {_EXPECTED: str(marker)}), None
            except Mismatch:
                continue

    async def reply(msg: Msg) -> None:
        async with limiter:
            # The session as fleetbus's keys it, <agent>.<session>: the
            # request's session_id, found without decoding the request.
            data = msg.data
            start = data.find(SESSION_ID) + len(SESSION_ID)
            session = data[start : data.index(b'"', start)].decode()
            key = f"{msg.subject.split('.')[-2]}.{session}"
            lease, marker = await take(key)
            known = ends.pop(key, None)
            # Known when nobody took the lease since this host released it.
            last = known[0] if known is not None and marker == known[1] else None
            while last is None or last[0] == 0:
                if last is None:
                    last = await journal_end(key)
                if last[0] == 0:  # a new session begins with its taken fact
                    try:
                        taken = fact(0, b"t", TAKEN_BYTES)
                        last = (await acked(journals + key, taken, {_EXPECTED: "0"}), 0)
                    except Mismatch:
                        last = None
            await nc.request(tool, TOOL_CALL, timeout=60)
            replies = last[1] + 1
            size = FIRST_END_BYTES + END_GROWTH_BYTES * (replies - 1)
            headers = {_EXPECTED: str(last[0])}
            kind = b"s"
            if size <= SNAPSHOT_BYTES:
                headers["Nats-Rollup"] = "sub"  # the end is a snapshot of the session
            else:
                kind, size = b"d", END_GROWTH_BYTES
            end = await acked(journals + key, fact(replies, kind, size), headers)
            await nc.publish(msg.reply, ANSWER)
            sent = time.monotonic()  # (as fleetbus's: the marker is stamped later)
            marker = await acked(
                leases + key,
                b"",
                {
                    _OPERATION: "PURGE",
                    "Nats-Rollup": "sub",
                    "Nats-TTL": MARKER_TTL,
                    _EXPECTED: str(lease),
                },
            )
            released[key] = (marker, sent)
            ends[key] = ((end, replies), marker)
            if len(ends) > CACHED:
                ends.popitem(last=False)

    running: set[asyncio.Task[None]] = set()

    async def dispatch(msg: Msg) -> None:
        task = loop.create_task(reply(msg))
        running.add(task)
        task.add_done_callback(running.discard)

    await nc.subscribe(f"{inbox}.*", cb=part)
    await nc.subscribe(republished + ">", cb=heard)
    await nc.subscribe(f"{prefix}.agent.*.inbox", queue="hosts", cb=dispatch)
    await nc.flush()
    print("ready", flush=True)
    await stop.wait()
    await nc.drain()


if __name__ == "__main__":
    import uvloop

    uvloop.run(main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])))
