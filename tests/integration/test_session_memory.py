"""A session's memory as its journal keeps it: appended to fact by fact and
read back exactly, rolled up into a snapshot when rewritten or when the facts
outgrow the last snapshot, facts larger than a message stored by reference,
and stored data that cannot be read."""

from __future__ import annotations

import itertools
import logging

import orjson
import pytest

from fleetbus.agents import Msg
from fleetbus.agents.serving.sessions import (
    SNAPSHOT_BYTES,
    SNAPSHOT_MULTIPLE,
    SessionStore,
    session_key,
)
from fleetbus.bus import Bus
from fleetbus.bus.journal import JournalEntry
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


async def test_memory_written_over_many_saves_reads_back_and_stays_bounded(bus: Bus) -> None:
    """Turns saved one by one, each a fact of what it adds: a store that never
    saw the session reads every message back, and rollups keep the journal
    within five times the session (and a snapshot's minimum) however many facts."""
    store = await SessionStore.open(bus, owner="writer")
    written: list[Msg] = []
    for n in range(300):  # about 210 KB of memory: rolled up at least once
        messages = turn(n)
        written += messages
        await save(store, "long", messages)
    key = session_key(AGENT, "long")
    entries = await store.journal.read(key)
    size = len(orjson.dumps(dumped(written)))
    assert len(entries) < 2 * 300  # 2 facts a turn written: some were rolled up
    assert b'"k":"snapshot"' in entries[0].data
    assert sum(len(e.data) for e in entries) <= (1 + SNAPSHOT_MULTIPLE) * size + SNAPSHOT_BYTES
    reader = await SessionStore.open(bus, owner="reader")
    record = await reader.get(AGENT, "long")
    assert record is not None
    assert dumped(record.state.memory) == dumped(written)
    assert record.messages == len(written)
    # And it goes on from there in the reader's hands.
    last = turn(300)
    await save(reader, "long", last)
    again = await SessionStore.open(bus, owner="third")
    record = await again.get(AGENT, "long")
    assert record is not None
    assert dumped(record.state.memory) == dumped(written + last)


async def test_memory_rewritten_is_rolled_up_into_a_snapshot(bus: Bus) -> None:
    """A compression puts a summary in place of older messages: the fact is a
    snapshot that removes the facts before it, and memory reads back as
    rewritten."""
    store = await SessionStore.open(bus, owner="writer")
    for n in range(30):
        await save(store, "squeezed", turn(n))
    lease = await store.acquire(AGENT, "squeezed")
    summary = Msg.text_message("user", "summary of 29 turns", marks=frozenset({"compressed"}))
    lease.record.state.memory[:] = [summary, *lease.record.state.memory[-4:], *turn(30)]
    kept = list(lease.record.state.memory)
    await store.save(lease, state=lease.record.state, status="idle", release=True)
    facts = await store.history(AGENT, "squeezed")
    assert [f.kind for f in facts] == ["snapshot"]
    reader = await SessionStore.open(bus, owner="reader")
    record = await reader.get(AGENT, "squeezed")
    assert record is not None
    assert dumped(record.state.memory) == dumped(kept)


async def test_a_fact_larger_than_a_message_is_stored_by_reference(bus: Bus) -> None:
    """A tool result over ``max_payload`` kept whole: its fact goes to the
    object store, the journal holds a reference, it reads back, and the
    object is deleted once a snapshot rolls the fact up."""
    store = await SessionStore.open(bus, owner="writer")
    big = "x" * (bus.max_payload + 1000)
    result = Msg(role="tool", content=[ToolResultBlock(id="b", name="look", output=big)])
    await save(store, "big", [result])
    key = session_key(AGENT, "big")
    entries = await store.journal.read(key)
    assert all(len(e.data) < bus.max_payload for e in entries)
    assert b'"$blob"' in entries[-1].data
    blobs = await store._blob_store()
    names = [o.name for o in await blobs.list() if o.name.startswith(key + ".")]
    assert len(names) == 1
    reader = await SessionStore.open(bus, owner="reader")
    record = await reader.get(AGENT, "big")
    assert record is not None
    assert record.state.memory[-1].tool_results[0].output == big
    # Rewritten memory rolls the reference up: its object goes.
    lease = await store.acquire(AGENT, "big")
    lease.record.state.memory[:] = [Msg.text_message("user", "summary")]
    await store.save(lease, state=lease.record.state, status="idle", release=True)
    assert [o.name for o in await blobs.list() if o.name.startswith(key + ".")] == []


async def test_a_fact_that_cannot_be_read_is_a_store_error(bus: Bus) -> None:
    """A fact whose messages are no messages, or that is no JSON object at
    all, raises a StoreError naming what is wrong."""
    store = await SessionStore.open(bus, owner="writer")
    await save(store, "broken", turn(0))
    key = session_key(AGENT, "broken")
    last = await store.journal.last(key)
    assert last is not None
    bad = orjson.dumps({"k": "step", "m": 4, "add": [{"role": "nobody", "content": []}]})
    seq = await store.journal.append(key, bad, expected=last.seq)
    reader = await SessionStore.open(bus, owner="reader")
    with pytest.raises(StoreError, match=r"unreadable memory.*role"):
        await reader.get(AGENT, "broken")
    await store.journal.append(key, b"[1, 2", expected=seq)
    with pytest.raises(StoreError, match="unreadable"):
        await reader.get(AGENT, "broken")


async def test_a_listing_reads_sessions_at_once_and_leaves_out_one_it_cannot_read(
    bus: Bus, caplog: pytest.LogCaptureFixture
) -> None:
    """A listing reads its sessions many at once (more than one chunk of
    reads here): a session that cannot be read is left out with a warning,
    and every other one is listed, its memory whole."""
    store = await SessionStore.open(bus, owner="writer")
    names = [f"many{n}" for n in range(150)]
    for n, name in enumerate(names):
        await save(store, name, turn(n))
    key = session_key(AGENT, "many77")
    last = await store.journal.last(key)
    assert last is not None
    await store.journal.append(key, b"[1, 2", expected=last.seq)
    reader = await SessionStore.open(bus, owner="reader")
    with caplog.at_level(logging.WARNING, logger="fleetbus"):
        records = await reader.records(AGENT, where=lambda _agent, s: s.startswith("many"))
    assert sorted(r.session_id for r in records) == sorted(set(names) - {"many77"})
    for record in records:  # each its own memory, whole
        n = int(record.session_id.removeprefix("many"))
        assert [m.text for m in record.state.memory] == [m.text for m in turn(n)]
        assert record.state.memory[1].tool_uses[0].input == {"n": n}
    assert [r.updated_at for r in records] == sorted((r.updated_at for r in records), reverse=True)
    assert "session archivist.many77 is unreadable" in caplog.text


async def test_a_listing_that_meets_a_failure_that_may_pass_raises_it(
    bus: Bus, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read that fails as a store electing its leader fails (transient)
    ends the listing with that error itself, whichever of the reads made at
    once met it: the caller waits for the store rather than list less."""
    store = await SessionStore.open(bus, owner="writer")
    for n in range(3):
        await save(store, f"flaky{n}", turn(n))
    reader = await SessionStore.open(bus, owner="reader")
    load = reader._load

    async def flaky(key: str, base: object = None) -> object:
        if key.endswith("flaky1"):
            raise StoreError("the stream is electing a leader", transient=True)
        return await load(key)

    monkeypatch.setattr(reader, "_load", flaky)
    with pytest.raises(StoreError, match="electing a leader"):
        await reader.records(AGENT, where=lambda _agent, s: s.startswith("flaky"))


async def test_a_release_the_store_refuses_for_a_moment_is_tried_again(
    bus: Bus, caplog: pytest.LogCaptureFixture
) -> None:
    """A lease release that fails as a cluster electing the bucket's leader
    makes it fail is tried again: the lease is gone, not left to lapse (it
    held the session's next request for a lease's TTL); a failure that will
    not pass still leaves it to lapse, and says so."""
    store = await SessionStore.open(bus, owner="writer", lease_ttl=5.0)
    key = session_key(AGENT, "flaky")
    leases = store._leases
    original = leases._remove
    failures: list[StoreError] = []

    async def refusing(key: str, revision: int) -> int:
        if failures:
            raise failures.pop()
        return await original(key, revision)

    leases._remove = refusing  # type: ignore[method-assign]
    failures += [StoreError("purge failed: nats: timeout", transient=True)] * 2
    with caplog.at_level(logging.WARNING, logger="fleetbus.agents.serving.leases"):
        await save(store, "flaky", turn(0))
    assert failures == []
    assert await store.leases.get_or_none(key) is None
    assert "will lapse" not in caplog.text
    failures.append(StoreError("purge failed: refused"))  # not transient
    with caplog.at_level(logging.WARNING, logger="fleetbus.agents.serving.leases"):
        await save(store, "flaky", turn(1))
    assert failures == []
    assert await store.leases.get_or_none(key) is not None
    assert "not released (it will lapse)" in caplog.text


async def test_a_reader_of_snapshots_reads_the_last_message_first_and_folds_the_rest_whole(
    bus: Bus,
) -> None:
    """A store whose last journal read whole was one snapshot reads a
    journal's last message first: a snapshot is the whole session (one
    message); a journal that ends otherwise is still read and folded whole."""
    writer = await SessionStore.open(bus, owner="writer")
    turns = [turn(n) for n in range(3)]
    lease = await writer.acquire(AGENT, "small")
    lease.record.state.memory.extend(turns[0])
    await writer.save(
        lease, state=lease.record.state, status="idle", release=True, small_rollup=True
    )
    for messages in turns:
        await save(writer, "facts", messages)  # three facts: the last is no snapshot
    reader = await SessionStore.open(bus, owner="reader")
    reads: list[str] = []
    whole = reader.journal.read

    async def counted(key: str, *, after: int = 0) -> list[JournalEntry]:
        reads.append(key)
        return await whole(key, after=after)

    reader.journal.read = counted  # type: ignore[method-assign]
    for session, memory, read_whole in [
        ("small", turns[0], True),  # the first read is whole
        ("small", turns[0], False),  # then the last message is the snapshot: all of it
        ("facts", [m for t in turns for m in t], True),  # not a snapshot: read whole
        ("small", turns[0], True),  # (and the next read whole again)
        ("small", turns[0], False),
    ]:
        reads.clear()
        reader._cache.clear()
        record = await reader.get(AGENT, session)
        assert record is not None
        assert dumped(record.state.memory) == dumped(memory)
        assert reads == ([session_key(AGENT, session)] if read_whole else [])


async def test_a_small_rollup_keeps_the_journal_one_snapshot_while_it_stays_small(
    bus: Bus,
) -> None:
    """A population's saves (``small_rollup``): each is the snapshot of the
    whole session while that stays under ``SNAPSHOT_BYTES``; the save that
    would pass it appends what it adds instead, and so do the next ones."""
    store = await SessionStore.open(bus, owner="writer")
    key = session_key(AGENT, "grows")
    written: list[Msg] = []
    sizes: list[tuple[int, int]] = []  # (messages in the journal, bytes of its last)
    for n in range(40):  # about 28 KB of memory in the end
        lease = await store.acquire(AGENT, "grows")
        messages = turn(n)
        written += messages
        lease.record.state.memory.extend(messages)
        await store.save(
            lease, state=lease.record.state, status="idle", release=True, small_rollup=True
        )
        entries = await store.journal.read(key)
        sizes.append((len(entries), len(entries[-1].data)))
    small = [i for i, (count, _) in enumerate(sizes) if count == 1]
    assert small == list(range(len(small)))  # one snapshot, then never again
    assert 5 < len(small) < 40
    assert all(last <= SNAPSHOT_BYTES for _, last in sizes[: len(small)])
    past = sizes[len(small)][1]  # the first save that did not roll up: its turn alone
    assert past < SNAPSHOT_BYTES // 4
    counts = [c for c, _ in sizes[len(small) :]]
    assert counts[0] > 1
    assert all(b > a for a, b in itertools.pairwise(counts))
    reader = await SessionStore.open(bus, owner="reader")
    record = await reader.get(AGENT, "grows")
    assert record is not None
    assert dumped(record.state.memory) == dumped(written)
