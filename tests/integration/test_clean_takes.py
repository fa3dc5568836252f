"""A session taken cleanly — released by its last owner, the request small
enough to ride in the lease — appends nothing before its first fact: the
request is in the lease until then, and whoever takes the session from a
dead owner that appended nothing serves it from there."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from types import SimpleNamespace
from typing import Any

import pytest

from fleetbus.agents.serving import leases as leases_module
from fleetbus.agents.serving.journals import JOURNAL_NAME
from fleetbus.agents.serving.leases import Leases
from fleetbus.agents.serving.sessions import SessionStore, session_key
from fleetbus.agents.state import AgentState
from fleetbus.bus import Bus
from fleetbus.bus.journal import journal
from fleetbus.protocol import UserRequest, to_builtins
from tests.helpers import taken_over


def _request(content: str, call_id: str | None) -> dict[str, object]:
    return to_builtins(UserRequest(content=content, session_id="s", call_id=call_id))


async def _released(store: SessionStore, agent: str) -> None:
    lease = await store.acquire(agent, "s", fresh=AgentState(agent_name=agent))
    await store.save(lease, status="idle", release=True)


async def _kinds(store: SessionStore, agent: str) -> list[str]:
    return [f.kind for f in await store.history(agent, "s")]


async def test_a_clean_take_appends_nothing_before_the_first_fact(bus: Bus) -> None:
    store = await SessionStore.open(bus, owner="a")
    await _released(store, "cal")
    before = await _kinds(store, "cal")
    request = _request("hi", "q-1")
    for reader in (store, await SessionStore.open(bus, owner="b")):  # cached, then read
        lease = await reader.acquire(
            "cal",
            "s",
            fresh=AgentState(agent_name="cal"),
            reply_to="_INBOX.c",
            pending_input=request,
        )
        assert (lease.record.status, lease.record.pending_input) == ("running", request)
        assert await _kinds(store, "cal") == before
        carried = await store.leases.get(session_key("cal", "s"))
        assert b'"hi"' in carried.value  # the whole request, until the journal has it
        await reader.save(lease, status="idle", final={"content": "done"}, release=True)
        before = await _kinds(store, "cal")
        assert before[-1] in ("end", "snapshot")
        record = await store.get("cal", "s")
        assert record is not None
        assert (record.status, record.owner, record.pending_input) == ("idle", None, None)
        assert record.final == {"content": "done"}


async def test_a_large_request_is_taken_in_the_journal(bus: Bus) -> None:
    store = await SessionStore.open(bus, owner="a")
    await _released(store, "lou")
    request = _request("hi" * 20_000, "q-2")
    lease = await store.acquire(
        "lou", "s", fresh=AgentState(agent_name="lou"), reply_to="_INBOX.l", pending_input=request
    )
    record = await store.get("lou", "s")  # (taken, rolled up into a snapshot)
    assert record is not None
    assert record.pending_input == request
    carried = await store.leases.get(session_key("lou", "s"))
    assert b'"hi' not in carried.value
    assert b'"q-2"' in carried.value
    await store.save(lease, status="idle", release=True)


@pytest.mark.parametrize("call_id", ["q-3", None])
async def test_a_dead_clean_takers_request_is_served_from_its_lease(
    bus: Bus, call_id: str | None
) -> None:
    """Each take-over writes the request it found in the lease into the
    journal: an heir that dies in turn leaves it there. (A request without
    a ``call_id`` rides in the lease too.)"""
    dead = await SessionStore.open(bus, owner="a")
    await _released(dead, "dee")
    request = _request("hi", call_id)
    await dead.acquire(
        "dee", "s", fresh=AgentState(agent_name="dee"), reply_to="_INBOX.d", pending_input=request
    )  # ...and its replica dies before appending anything
    for owner in ("b", "c"):
        heir = await SessionStore.open(bus, owner=owner)
        lease = await taken_over(heir, "dee")
        assert lease.record.status == "running"
        assert (lease.record.pending_input, lease.record.reply_to) == (request, "_INBOX.d")
        stored = await heir.get("dee", "s")
        assert stored is not None
        assert (stored.owner, stored.pending_input) == (owner, request)
        # ...and this heir dies too: the next finds the request in the journal.
    await heir.save(lease, status="idle", final={"content": "done"}, release=True)


async def test_a_lease_whose_marker_expired_is_taken_in_one_write(
    bus: Bus, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A marker that lives one second (the server's shortest per-message TTL).
    monkeypatch.setattr(leases_module, "_MARKER_TTL", 1.0)
    store = await SessionStore.open(bus, owner="a", lease_ttl=0.1)
    bucket = store.leases
    if not bucket.expiring_markers:
        pytest.skip("this nats-server keeps markers for ever")
    writes: list[str] = []
    for name in ("create", "update", "get_or_none", "last"):
        monkeypatch.setattr(bucket, name, _counted(writes, name, getattr(bucket, name)))
    await _released(store, "mae")
    key = session_key("mae", "s")
    async with asyncio.timeout(30):
        while await bucket.last(key) is not None:  # noqa: ASYNC110 - the server expires it
            await asyncio.sleep(0.1)
    writes.clear()
    lease = await store.acquire("mae", "s", fresh=AgentState(agent_name="mae"))
    assert writes == ["create"]  # not an update against the marker, failing, then a read
    await store.save(lease, status="idle", release=True)


async def test_a_marker_that_expired_while_trusted_costs_no_read(
    bus: Bus, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A marker trusted a little past its expiry: the write against it fails,
    and the lease is written as new at once, without reading it."""
    monkeypatch.setattr(leases_module, "_MARKER_TTL", 1.0)
    store = await SessionStore.open(bus, owner="a", lease_ttl=0.1)
    bucket = store.leases
    if not bucket.expiring_markers:
        pytest.skip("this nats-server keeps markers for ever")
    leases = store._leases
    leases.marker_life = leases._marker_gone = 3600.0  # trusted for an hour
    calls: list[str] = []
    for name in ("create", "update", "_read"):
        monkeypatch.setattr(bucket, name, _counted(calls, name, getattr(bucket, name)))
    await _released(store, "moe")
    key = session_key("moe", "s")
    async with asyncio.timeout(30):
        while await bucket.last(key) is not None:  # noqa: ASYNC110 - the server expires it
            await asyncio.sleep(0.1)
    calls.clear()
    lease = await store.acquire("moe", "s", fresh=AgentState(agent_name="moe"))
    assert calls == ["update", "create"]
    await store.save(lease, status="idle", release=True)


async def test_a_marker_past_the_time_it_is_trusted_costs_no_read(
    bus: Bus, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A marker older than its trusted life, yet still on the server: the
    lease written as new fails, and the write against the marker follows
    without reading the lease."""
    store = await SessionStore.open(bus, owner="a")
    bucket = store.leases
    if not bucket.expiring_markers:
        pytest.skip("this nats-server keeps markers for ever")
    store._leases.marker_life = 0.0  # every marker is past it; none has expired
    calls: list[str] = []
    for name in ("create", "update", "_read"):
        monkeypatch.setattr(bucket, name, _counted(calls, name, getattr(bucket, name)))
    await _released(store, "mo")
    calls.clear()
    lease = await store.acquire("mo", "s", fresh=AgentState(agent_name="mo"))
    assert calls == ["create", "update"]
    assert lease.record.status == "running"
    await store.save(lease, status="idle", release=True)


def _counted(
    calls: list[str], name: str, method: Callable[..., Awaitable[Any]]
) -> Callable[..., Awaitable[Any]]:
    async def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(name)
        return await method(*args, **kwargs)

    return counted


async def test_releases_heard_are_neither_read_at_a_resync_nor_at_the_next_take(
    bus: Bus, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another replica's releases, heard: the resync that lists their markers
    reads none of them, and taking one of those sessions is one write."""
    a = await SessionStore.open(bus, owner="a")
    b = await SessionStore.open(bus, owner="b")

    async def take_over(agent: str, session: str, revision: int) -> None:
        raise AssertionError(f"nothing died, yet {agent}/{session} was taken over")

    recovery = b.recovery(["rsy"], take_over)
    await recovery.start()
    try:
        keys = []
        for i in range(3):
            lease = await a.acquire("rsy", f"s{i}", fresh=AgentState(agent_name="rsy"))
            await a.save(lease, status="idle", release=True)
            keys.append(session_key("rsy", f"s{i}"))
        async with asyncio.timeout(10):
            while not all(b._leases.released(key) for key in keys):  # noqa: ASYNC110 - heard
                await asyncio.sleep(0.01)
        assert sorted(await b.leases.subjects("rsy.*")) == keys  # the markers are listed
        calls: list[str] = []
        for name in ("create", "update", "_read"):
            monkeypatch.setattr(b.leases, name, _counted(calls, name, getattr(b.leases, name)))
        await recovery._resync()
        assert calls == []
        lease = await b.acquire("rsy", "s0", fresh=AgentState(agent_name="rsy"), create=False)
        assert calls == ["update"]
        await b.save(lease, status="idle", release=True)
    finally:
        await recovery.close()


async def test_a_cache_no_session_comes_back_to_holds_no_fold_until_one_does(
    bus: Bus, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sessions that never come back (a population's agents, each asked once
    a round): after four times its size in such takes, the cache holds no
    new fold, since the reads it would spare never come. A session that
    comes back turns it on again, and its next take reads nothing."""
    leases = await Leases.open(bus, owner="a", ttl=10.0)
    store = SessionStore(bus, await journal(bus, JOURNAL_NAME), leases, cache_size=2)
    for i in range(10):
        await _released(store, f"pop{i}")

    def held() -> list[str]:
        return sorted(key.partition(".")[0] for key in store._cache)

    assert held() == ["pop6", "pop7"]  # pop8 and pop9 came after 8 takes with none back
    reads: list[str] = []
    monkeypatch.setattr(store, "_load", _counted(reads, "read", store._load))
    await _released(store, "pop9")  # released here, taken again here: it comes back
    assert reads == ["read"]  # (its fold was not held)
    assert "pop9" in held()
    reads.clear()
    await _released(store, "pop9")
    assert reads == []  # held now: nothing read


async def test_a_lease_heard_and_then_silent_for_its_ttl_is_taken_over_at_the_next_check(
    bus: Bus, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The write heard gives the lease's revision: the first check after a
    TTL of silence reads it at that revision, and the session is handed
    over then, not a TTL later (its owner had died a TTL before)."""
    dead = await SessionStore.open(bus, owner="a", lease_ttl=10.0)
    heir = await SessionStore.open(bus, owner="b", lease_ttl=10.0)
    handed: list[tuple[str, str, int]] = []

    async def take_over(agent: str, session: str, revision: int) -> None:
        handed.append((agent, session, revision))

    recovery = heir.recovery(["lea"], take_over)
    await recovery.start()
    try:
        await dead.acquire("lea", "s", fresh=AgentState(agent_name="lea"))  # ...and dies
        key = session_key("lea", "s")
        silent = await heir.leases.get(key)
        async with asyncio.timeout(10):
            while key not in recovery.watched:  # noqa: ASYNC110 - the write is heard
                await asyncio.sleep(0.01)
        await recovery.check()
        assert handed == []  # alive for all it knows
        later = time.monotonic() + 10.5  # a TTL of silence on
        monkeypatch.setattr(leases_module, "time", SimpleNamespace(monotonic=lambda: later))
        await recovery.check()
        assert handed == [("lea", "s", silent.revision)]
    finally:
        await recovery.close()
