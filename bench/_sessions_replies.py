"""Replies through a served agent, their session writes counted on the
server: the driver of ``bench/sessions.py``.

One agent is served by a real :class:`AgentService` on its own connection;
its model is a ``ScriptedModel`` that answers a request with a thought and
one call of a local tool (``search``), then, once the result is in, with a
text. A reply is sent as a ``user_request`` on the agent's inbox (one
request, no receipt, no event subscription) and timed from the client: the
reply's time over its 2 steps is its time per step. The model's turns carry
their token usage, and the context is far larger than any conversation here:
no compression rewrites memory.

For each conversation length ``N``, new sessions are seeded by ``N``
messages of earlier replies through the same service (``N // 4`` replies
with a tool call, 4 messages each, and a reply without one, 2 messages, for
the rest), then ``REPLIES`` replies are measured, spread over as many of
them as keep each within 40 % of ``N`` (a reply each at 10 messages, 10
each at 100, all in one at 1,000), taking turns. Counted from the server's
side, before and after the seeding and the measured replies:

- the stream state of each session stream: ``last_seq`` (messages stored)
  and ``messages`` (what is left of them: a rollup, or a KV bucket's history
  of one revision a key, removes the older ones);
- every write as published to the streams' subjects, seen by a plain core
  subscription on a connection of its own: ``len(data) + len(subject)`` plus
  the headers as sent (``NATS/1.0`` line, ``Key: value`` lines, blank line);
  a journal write with a ``Nats-Rollup`` header (a snapshot) is also
  counted apart (a KV purge, the lease's release, carries one too);
- the session as it folds (``SessionStore.get``): the JSON of its state
  (``state.model_dump(mode="json")``, memory included), whose growth is
  what the replies add.

Works with either session store: the journal of this tree (stream
``<prefix>_session``) or the KV buckets of the previous design
(``<prefix>_sessions``, ``<prefix>_session_chunks``), found by what
``fleetbus`` imports (``PYTHONPATH`` points at the tree to measure). Both
have the lease bucket ``<prefix>_session_leases`` and the object store
``<prefix>_session_blobs`` (a write too large for one message).

Usage: ``python bench/_sessions_replies.py URL PREFIX LENGTHS REPLIES``
(``LENGTHS`` comma-separated); prints one JSON line of raw totals (the
parent, ``bench/sessions.py``, combines runs and derives the figures).
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import math
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nats.js.errors
import orjson

import fleetbus
from fleetbus.agents import Agent
from fleetbus.agents.compression import ContextConfig
from fleetbus.agents.serving import AgentService
from fleetbus.agents.serving.sessions import SessionStore
from fleetbus.bus import Bus, Subjects
from fleetbus.models.model import ModelRequest, ModelResponse
from fleetbus.protocol import (
    FinalAnswer,
    TextBlock,
    ToolUseBlock,
    Usage,
    UserRequest,
    new_id,
)
from fleetbus.testing import ScriptedModel
from fleetbus.tools_workers import Toolkit, tool


def tuning(**values: Any) -> dict[str, Any]:
    """Keyword arguments of ``Agent`` tuning its loop, for whichever tree is
    measured: ``settings=`` where there is ``AgentSettings``, else the
    keywords the previous design's ``Agent`` took."""
    try:
        from fleetbus.agents import AgentSettings  # type: ignore[attr-defined,unused-ignore]
    except ImportError:
        return values
    return {"settings": AgentSettings(**values)}


AGENT = "bench"
STEPS = 2
"""Model steps of a measured reply: the tool call, then the answer."""
REQUEST = "How did the northern region do in Q1? Compare the three months."
PLAIN = "Thanks, that is all for now."
THOUGHT = (
    "The user wants the quarterly figures for the northern region. The last search "
    "returned the January report only; I will search again for February and March "
    "and then compare the three months before answering."
)
RESULT = (
    "Found 3 documents. 1) 'Northern region, February sales report' (2024-03-04): "
    "revenue 1.92M EUR, up 4.1% on January; 2) 'Northern region, March sales report' "
    "(2024-04-02): revenue 2.07M EUR, up 7.8% on February; 3) 'Q1 summary draft' "
    "(2024-04-10): quarter total 5.83M EUR, margin 18.2%, two open questions on returns."
)
ANSWER = (
    "Q1 in the northern region: 5.83M EUR in total, 1.84M in January, 1.92M in "
    "February (+4.1%) and 2.07M in March (+7.8%); margin 18.2%. Returns are still open."
)
USAGE = Usage(input_tokens=1000, output_tokens=60)
GROWTH = 0.4
"""How much longer than its seeded length a session may grow while measured."""
TREE = str(Path(fleetbus.__file__).resolve().parent.parent)
"""The tree whose ``fleetbus`` this process runs."""


@tool
async def search(query: str, limit: int = 5) -> str:
    """Search the sales reports."""
    return RESULT


def turn(request: ModelRequest) -> ModelResponse:
    """The scripted model: a search for a request, a text once a result is in
    (or for the plain request)."""
    last = request.messages[-1]
    texts = [b.text for b in last.content if isinstance(b, TextBlock)]
    if last.role == "tool" or PLAIN in texts:
        return ModelResponse(content=[TextBlock(text=ANSWER)], usage=USAGE, finish_reason="stop")
    use = ToolUseBlock(
        id=f"call_{new_id()[:12]}",
        name="search",
        input={"query": f"northern region sales report {new_id()[:6]}", "limit": 5},
    )
    return ModelResponse(
        content=[TextBlock(text=THOUGHT), use], usage=USAGE, finish_reason="tool_calls"
    )


# -- counting on the server ---------------------------------------------------------------


@dataclass
class Design:
    """The session store measured: its streams and the subjects they store."""

    name: str
    streams: dict[str, str]
    """Role (``journal``, ``heads``, ``chunks``, ``leases``, ``blobs``) to stream name."""
    subjects: dict[str, str]
    """Role to the subject pattern its writes are published on."""


def design(bus: Bus) -> Design:
    """The session store of the ``fleetbus`` imported (the journal, if it has one)."""
    kv = bus.subjects.kv_bucket
    streams = {"leases": f"KV_{kv('session_leases')}", "blobs": f"OBJ_{kv('session_blobs')}"}
    subjects = {
        "leases": Subjects.kv_keys(kv("session_leases"), ">"),
        "blobs": f"$O.{kv('session_blobs')}.>",
    }
    if importlib.util.find_spec("fleetbus.bus.journal") is not None:
        streams["journal"] = kv("session")
        subjects["journal"] = f"{bus.prefix}.session.>"
        return Design("journal", streams, subjects)
    for role, bucket in (("heads", "sessions"), ("chunks", "session_chunks")):
        streams[role] = f"KV_{kv(bucket)}"
        subjects[role] = Subjects.kv_keys(kv(bucket), ">")
    return Design("kv", streams, subjects)


def header_bytes(headers: dict[str, str] | None) -> int:
    """The size of ``headers`` as sent (``NATS/1.0\\r\\n``, ``K: v\\r\\n``, ``\\r\\n``)."""
    if not headers:
        return 0
    return 10 + sum(len(k) + len(v) + 4 for k, v in headers.items()) + 2


SNAPSHOTS = "snapshots"
"""The tally's name for the journal writes that carry a rollup (counted as
``journal`` writes too)."""


class Server:
    """The session streams as the server sees them."""

    def __init__(self, bus: Bus, measured: Design) -> None:
        self.bus = bus
        self.design = measured
        self.writes: Counter[str] = Counter()
        self.bytes: Counter[str] = Counter()
        self.facts: Counter[str] = Counter()
        """Journal appends (published) by kind."""
        self._subs: list[Any] = []

    async def start(self) -> None:
        for role, subject in self.design.subjects.items():

            async def count(msg: Any, role: str = role) -> None:
                size = len(msg.data) + len(msg.subject) + header_bytes(msg.headers)
                self.writes[role] += 1
                self.bytes[role] += size
                if role == "journal":
                    self.facts[kind_of(msg.data)] += 1
                    if msg.headers and "Nats-Rollup" in msg.headers:
                        self.writes[SNAPSHOTS] += 1
                        self.bytes[SNAPSHOTS] += size

            self._subs.append(await self.bus.nc.subscribe(subject, cb=count))
        await self.bus.flush()

    async def close(self) -> None:
        for sub in self._subs:
            await sub.unsubscribe()

    async def settle(self) -> dict[str, Any]:
        """The writes seen and the streams' states, once every write published
        so far has reached the subscription."""
        await asyncio.sleep(0.05)  # the lease is released after the answer is sent
        await self.bus.flush()
        await asyncio.sleep(0.02)  # let the subscription callbacks run
        js = self.bus.nc.jetstream(timeout=10.0)
        last_seq, messages = {}, {}
        for role, stream in self.design.streams.items():
            try:
                info = await js.stream_info(stream)
            except nats.js.errors.NotFoundError:
                last_seq[role], messages[role] = 0, 0
            else:
                last_seq[role], messages[role] = int(info.state.last_seq), int(info.state.messages)
        return {
            "facts": dict(self.facts),
            "writes": dict(self.writes),
            "bytes": dict(self.bytes),
            "last_seq": last_seq,
            "messages": messages,
        }


def delta(after: dict[str, Any], before: dict[str, Any]) -> dict[str, dict[str, int]]:
    """``after - before``, for each counter of :meth:`Server.settle`."""
    return {
        what: {k: v - before[what].get(k, 0) for k, v in after[what].items()}
        for what in ("facts", "writes", "bytes", "last_seq", "messages")
    }


async def fold(store: SessionStore, session_id: str) -> tuple[int, int]:
    """Bytes of the session's state as JSON, and its messages (0, 0 when none)."""
    record = await store.get(AGENT, session_id)
    if record is None:
        return 0, 0
    state = record.state
    return len(orjson.dumps(state.model_dump(mode="json"))), len(state.memory)


def kind_of(data: bytes) -> str:
    """What a journal fact is, told as ``SessionStore.history`` tells it: its
    ``k``, and for a ``step`` what it records (``input``: the request, with
    what the step adds), adds (``calls`` when its last message calls tools)
    or changes (``result``: a tool result arrived)."""
    try:
        fact = orjson.loads(data)
    except orjson.JSONDecodeError:
        return "unreadable"
    kind = str(fact.get("k", "step")) if isinstance(fact, dict) else "unreadable"
    if kind != "step":
        return kind
    added = fact.get("add") or []
    reply = (fact.get("set") or {}).get("reply")
    if fact.get("rec"):
        return "input"
    if added:
        uses = [b for b in added[-1].get("content", []) if b.get("type") == "tool_use"]
        return "calls" if uses else "step"
    if isinstance(reply, dict) and "arrived" in reply:
        return "result"
    return "state"


async def history_kinds(store: SessionStore, session_id: str, *, after: int) -> dict[str, int]:
    """The kinds ``SessionStore.history`` gives the facts after ``after`` (what
    rollups left of them), or the error it raises."""
    kinds: Counter[str] = Counter()
    try:
        for fact in await store.history(AGENT, session_id):
            if fact.seq > after:
                kinds[fact.kind] += 1
    except Exception as exc:  # (a bench: reported, not raised)
        return {f"error: {type(exc).__name__}: {exc}"[:160]: 0}
    return dict(kinds)


# -- the replies -----------------------------------------------------------------------------


async def ask(client: Bus, session_id: str, text: str) -> float:
    """Seconds of one reply; checks that it completed."""
    request = UserRequest(
        sender="bench-client", session_id=session_id, call_id=new_id(), content=text
    )
    started = time.perf_counter()
    answer = await client.request(client.subjects.agent_inbox(AGENT), request, timeout=120.0)
    elapsed = time.perf_counter() - started
    if not isinstance(answer, FinalAnswer) or answer.finished_reason != "completed":
        raise RuntimeError(f"the reply did not complete: {answer!r}")
    return elapsed


def sessions_for(length: int, replies: int) -> int:
    """Sessions the ``replies`` measured at ``length`` are spread over: as
    few as keep each within :data:`GROWTH` of ``length`` (one at 1,000
    messages; one a reply at 10)."""
    per_session = max(1, min(replies, math.ceil(length * GROWTH / 4)))
    return math.ceil(replies / per_session)


async def seed(client: Bus, model: ScriptedModel, session_id: str, length: int) -> None:
    """Make the session ``length`` messages long with replies of the measured shape."""
    for n in range(length // 4):
        await ask(client, session_id, f"{REQUEST} ({n})")
        model.requests.clear()  # (the model keeps every request otherwise)
    if length % 4 >= 2:
        await ask(client, session_id, PLAIN)


async def one_length(
    client: Bus,
    server: Server,
    store: SessionStore,
    model: ScriptedModel,
    length: int,
    replies: int,
) -> dict[str, Any]:
    """Seed new sessions with ``length`` messages each, then measure
    ``replies`` replies over them, taking turns."""
    sessions = [f"len{length}-{new_id()[:8]}" for _ in range(sessions_for(length, replies))]
    empty = await server.settle()
    for session_id in sessions:
        await seed(client, model, session_id, length)
    before = await server.settle()
    folds_before = [await fold(store, session_id) for session_id in sessions]
    if any(messages != length for _, messages in folds_before):
        raise RuntimeError(f"a seeded session does not hold {length} messages: {folds_before}")

    times = []
    for n in range(replies):
        session_id = sessions[n % len(sessions)]
        times.append(await ask(client, session_id, f"{REQUEST} (measured {n})"))
        model.requests.clear()
    after = await server.settle()
    folds_after = [await fold(store, session_id) for session_id in sessions]
    added = sum(m for _, m in folds_after) - sum(m for _, m in folds_before)
    if added != 4 * replies:
        raise RuntimeError(f"{added} messages added by {replies} replies, not 4 each")
    seeding = delta(before, empty)["bytes"]
    fold_before = sum(b for b, _ in folds_before)
    figures: dict[str, Any] = {
        "replies": replies,
        "sessions": len(sessions),
        "seconds": times,
        **delta(after, before),
        "fold_before": fold_before,
        "fold_after": sum(b for b, _ in folds_after),
        "seed": {
            "replies": len(sessions) * (length // 4 + (1 if length % 4 >= 2 else 0)),
            "bytes": sum(v for role, v in seeding.items() if role != SNAPSHOTS),
            "fold": fold_before,
        },
    }
    if server.design.name == "journal":
        kinds: Counter[str] = Counter()
        for session_id in sessions:
            after_seq = before["last_seq"]["journal"]
            kinds.update(await history_kinds(store, session_id, after=after_seq))
        figures["history"] = dict(kinds)
    return figures


async def measure(url: str, prefix: str, lengths: list[int], replies: int) -> dict[str, Any]:
    """Serve the agent, drive ``replies`` replies at each of ``lengths``."""
    service_bus = await Bus.connect(url, prefix=prefix, name="bench-service")
    client = await Bus.connect(url, prefix=prefix, name="bench-client")
    counter = await Bus.connect(url, prefix=prefix, name="bench-counter")
    model = ScriptedModel([turn], repeat_last=True, chunk_size=4096)
    agent = Agent(
        AGENT,
        "You answer questions on the sales reports.",
        model,
        toolkit=Toolkit([search]),
        **tuning(max_repeated_calls=None, context=ContextConfig(context_length=1_000_000_000)),
    )
    server = Server(counter, design(counter))
    results: dict[str, Any] = {}
    try:
        await server.start()
        store = await SessionStore.open(client, owner="bench@reader")
        service = AgentService(service_bus, agent, replica_id="bench@replies", drain_timeout=5.0)
        async with asyncio.TaskGroup() as tg:
            tg.create_task(service.run())
            try:
                await service.wait_ready(60.0)
                for length in lengths:
                    results[str(length)] = await one_length(
                        client, server, store, model, length, replies
                    )
            finally:
                service.stop()
    finally:
        await server.close()
        for bus in (client, counter, service_bus):
            await bus.close()
    snapshot_bytes = None
    if server.design.name == "journal":
        from fleetbus.agents.serving import sessions

        snapshot_bytes = getattr(sessions, "SNAPSHOT_BYTES", None)
    return {
        "design": server.design.name,
        "tree": TREE,
        "snapshot_bytes_min": snapshot_bytes,
        "lengths": results,
    }


if __name__ == "__main__":
    url, prefix, lengths, replies = sys.argv[1:5]
    report = asyncio.run(measure(url, prefix, [int(n) for n in lengths.split(",")], int(replies)))
    print(json.dumps(report, separators=(",", ":")), flush=True)
