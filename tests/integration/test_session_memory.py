"""A session's memory as the store keeps it: the head's tail, appended to as
written and read straight from its JSON, sealed chunks, memory rewritten, and
stored data that cannot be read."""

from __future__ import annotations

import json
import logging

import orjson
import pytest

from fleetbus.agents import Msg
from fleetbus.agents.serving.sessions import CHUNK_BYTES, SessionStore, session_key
from fleetbus.bus import Bus
from fleetbus.errors import StoreError
from fleetbus.protocol import TextBlock, ToolResultBlock, ToolUseBlock

AGENT = "archivist"


def turn(n: int) -> list[Msg]:
    """A user request, a tool call, its result and an answer (about 700 bytes)."""
    return [
        Msg.text_message("user", f"question {n}: " + "why " * 40, name="asker"),
        Msg(role="assistant", content=[ToolUseBlock(id=f"c{n}", name="look", input={"n": n})]),
        Msg(
            role="tool",
            content=[ToolResultBlock(id=f"c{n}", name="look", output={"n": n, "ok": True})],
            metadata={"took_ms": n},
        ),
        Msg(
            role="assistant",
            content=[TextBlock(text=f"answer {n} ✓")],
            marks=frozenset({"observed"}),
        ),
    ]


def dumped(memory: list[Msg]) -> list[object]:
    return [m.model_dump(mode="json") for m in memory]


async def save(store: SessionStore, session: str, add: list[Msg] | None = None) -> None:
    lease = await store.acquire(AGENT, session)
    if add:
        lease.record.state.memory.extend(add)
    await store.save(lease, state=lease.record.state, status="idle", release=True)


async def test_memory_written_over_many_saves_reads_back_exactly(bus: Bus) -> None:
    """Turns saved one by one: each save appends to the head's tail, which is
    sealed into a chunk past CHUNK_BYTES; a store that never saw the session
    reads every message back, and the head holds the newest as JSON."""
    store = await SessionStore.open(bus, owner="writer")
    written: list[Msg] = []
    for n in range(60):  # about 42 KB: sealed at least twice
        messages = turn(n)
        written += messages
        await save(store, "long", messages)
    head = json.loads((await store.heads.get(session_key(AGENT, "long"))).value)
    assert len(head["chunks"]) >= 1
    sealed = sum(last - first + 1 for _, first, last in head["chunks"])
    assert sealed >= 2
    assert len(orjson.dumps(head["tail"])) <= CHUNK_BYTES + 1024
    assert head["tail"] == dumped(written[len(written) - len(head["tail"]) :])
    reader = await SessionStore.open(bus, owner="reader")
    record = await reader.get(AGENT, "long")
    assert record is not None
    assert dumped(record.state.memory) == dumped(written)
    assert record.messages == len(written)
    # And it goes on from there in the reader's hands.
    last = turn(60)
    await save(reader, "long", last)
    again = await SessionStore.open(bus, owner="third")
    record = await again.get(AGENT, "long")
    assert record is not None
    assert dumped(record.state.memory) == dumped(written + last)


async def test_memory_rewritten_is_stored_anew(bus: Bus) -> None:
    """A compression puts a summary in place of older messages: memory is
    stored anew, in new chunks, and reads back as rewritten."""
    store = await SessionStore.open(bus, owner="writer")
    for n in range(30):
        await save(store, "squeezed", turn(n))
    lease = await store.acquire(AGENT, "squeezed")
    summary = Msg.text_message("user", "summary of 29 turns", marks=frozenset({"compressed"}))
    lease.record.state.memory[:] = [summary, *lease.record.state.memory[-4:], *turn(30)]
    assert len(lease.record.state.memory) == 9
    kept = list(lease.record.state.memory)
    await store.save(lease, state=lease.record.state, status="idle", release=True)
    reader = await SessionStore.open(bus, owner="reader")
    record = await reader.get(AGENT, "squeezed")
    assert record is not None
    assert dumped(record.state.memory) == dumped(kept)


async def test_a_head_whose_memory_cannot_be_read_is_a_store_error(bus: Bus) -> None:
    """A head with a tail that is no list of messages, or that is no JSON
    object at all, raises a StoreError naming what is wrong."""
    store = await SessionStore.open(bus, owner="writer")
    await save(store, "broken", turn(0))
    key = session_key(AGENT, "broken")
    head = json.loads((await store.heads.get(key)).value)
    head["tail"] = [{"role": "nobody", "content": []}]
    await store.heads.put(key, json.dumps(head).encode())
    reader = await SessionStore.open(bus, owner="reader")
    with pytest.raises(StoreError, match=r"unreadable memory.*role"):
        await reader.get(AGENT, "broken")
    await store.heads.put(key, b"[1, 2")
    with pytest.raises(StoreError, match="unreadable"):
        await reader.get(AGENT, "broken")


async def test_memory_goes_on_after_a_tail_written_with_whitespace(bus: Bus) -> None:
    """A head written by another JSON writer (spaces, an empty tail as
    ``[ ]``) is appended to as well."""
    store = await SessionStore.open(bus, owner="writer")
    key = session_key(AGENT, "spaced")
    first = turn(0)
    await save(store, "spaced", first)
    head = json.loads((await store.heads.get(key)).value)
    tails: list[list[object]] = [[], head["tail"]]
    for tail in tails:
        head["tail"] = tail
        await store.heads.put(key, json.dumps(head, indent=1).replace("[]", "[ ]").encode())
        writer = await SessionStore.open(bus, owner="another")
        more = turn(1)
        await save(writer, "spaced", more)
        record = await (await SessionStore.open(bus, owner="reader")).get(AGENT, "spaced")
        assert record is not None
        assert dumped(record.state.memory) == dumped((first if tail else []) + more)


async def test_a_release_the_store_refuses_for_a_moment_is_tried_again(
    bus: Bus, caplog: pytest.LogCaptureFixture
) -> None:
    """A lease release that fails as a cluster electing the bucket's leader
    makes it fail is tried again: the lease is gone, not left to lapse (it
    held the session's next request for a lease's TTL); a failure that will
    not pass still leaves it to lapse, and says so."""
    store = await SessionStore.open(bus, owner="writer", lease_ttl=5.0)
    key = session_key(AGENT, "flaky")
    original = store._remove_lease
    failures: list[StoreError] = []

    async def refusing(key: str, revision: int) -> int:
        if failures:
            raise failures.pop()
        return await original(key, revision)

    store._remove_lease = refusing  # type: ignore[method-assign]
    failures += [StoreError("purge failed: nats: timeout", transient=True)] * 2
    with caplog.at_level(logging.WARNING, logger="fleetbus.agents.serving.sessions"):
        await save(store, "flaky", turn(0))
    assert failures == []
    assert await store.leases.get_or_none(key) is None
    assert "will lapse" not in caplog.text
    failures.append(StoreError("purge failed: refused"))  # not transient
    with caplog.at_level(logging.WARNING, logger="fleetbus.agents.serving.sessions"):
        await save(store, "flaky", turn(1))
    assert failures == []
    assert await store.leases.get_or_none(key) is not None
    assert "not released (it will lapse)" in caplog.text
