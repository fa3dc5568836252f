"""A new session begins with one fact, the request taken, appended against
an empty journal (two replicas creating it race on that append). An owner
that dies after it leaves its request in the journal, and whoever takes the
session next serves it."""

from __future__ import annotations

import pytest

from fleetbus.agents.serving.sessions import SessionStore, session_key
from fleetbus.agents.state import AgentState
from fleetbus.bus import Bus
from fleetbus.errors import SessionBusyError, SessionLost
from fleetbus.protocol import ConfirmResult, UserRequest, to_builtins
from tests.helpers import lease_only, taken_over


async def _appends(store: SessionStore) -> int:
    return sum((await store.journal.keys()).values())


def _request(content: str, call_id: str) -> dict[str, object]:
    return to_builtins(UserRequest(content=content, session_id="s", call_id=call_id))


async def test_a_new_session_begins_with_the_request_taken(bus: Bus) -> None:
    store = await SessionStore.open(bus, owner="a")
    request = _request("hi", "q-1")
    lease = await store.acquire(
        "ann", "s", fresh=AgentState(agent_name="ann"), reply_to="_INBOX.x.1", pending_input=request
    )
    assert lease.record.status == "running"
    taken = await store.get("ann", "s")
    assert taken is not None
    assert (taken.status, taken.owner, taken.pending_input) == ("running", "a", request)
    carried = await store.leases.get(session_key("ann", "s"))
    assert b'"q-1"' in carried.value  # a copy of the request is known by the lease
    await store.save(lease, status="idle", final={"content": "done"}, release=True)
    record = await store.get("ann", "s")
    assert record is not None
    assert (record.status, record.final, record.pending_input) == (
        "idle",
        {"content": "done"},
        None,
    )
    assert await _appends(store) == 2  # taken, end


async def test_a_large_request_is_in_the_journal_from_the_start(bus: Bus) -> None:
    store = await SessionStore.open(bus, owner="a")
    request = _request("hi" * 20_000, "q-2")
    lease = await store.acquire(
        "ann", "s", fresh=AgentState(agent_name="ann"), reply_to="_INBOX.x.2", pending_input=request
    )
    record = await store.get("ann", "s")
    assert record is not None
    assert record.pending_input == request
    await store.save(lease, status="idle", release=True)


async def test_a_dead_owners_new_session_is_taken_over_from_its_journal(bus: Bus) -> None:
    dead = await SessionStore.open(bus, owner="a")
    heir = await SessionStore.open(bus, owner="b")
    request = _request("hi", "q-3")
    lost = await dead.acquire(
        "ann", "s", fresh=AgentState(agent_name="ann"), reply_to="_INBOX.x.3", pending_input=request
    )  # ...and its replica dies before saving anything
    lease = await taken_over(heir, "ann")
    assert lease.record.status == "running"
    assert lease.previous_owner == "a"  # (named in the take-over's log line)
    assert (lease.record.pending_input, lease.record.reply_to) == (request, "_INBOX.x.3")
    stored = await heir.get("ann", "s")
    assert stored is not None
    assert (stored.owner, stored.pending_input) == ("b", request)
    # The dead owner's late save lands nowhere.
    with pytest.raises(SessionLost):
        await dead.save(lost, status="idle", final={"content": "late"})
    await heir.save(lease, status="idle", final={"content": "done"}, release=True)
    record = await heir.get("ann", "s")
    assert record is not None
    assert record.final == {"content": "done"}


async def test_a_dead_owners_new_session_is_taken_over_from_its_lease(bus: Bus) -> None:
    """Its owner died between the lease and the first fact: the journal is
    empty, the request is in the lease, and the take-over begins the
    session with it (a host killed mid-round left such sessions to the
    requester's next copy)."""
    dead = await SessionStore.open(bus, owner="a")
    heir = await SessionStore.open(bus, owner="b")
    request = _request("hi", "q-7")
    await lease_only(dead, "ann", request, "_INBOX.x.7")
    assert await heir.get("ann", "s") is None
    lease = await taken_over(heir, "ann")
    assert (lease.record.status, lease.previous_owner) == ("running", "a")
    assert (lease.record.pending_input, lease.record.reply_to) == (request, "_INBOX.x.7")
    stored = await heir.get("ann", "s")
    assert stored is not None
    assert (stored.owner, stored.pending_input) == ("b", request)
    await heir.save(lease, status="idle", final={"content": "done"}, release=True)
    record = await heir.get("ann", "s")
    assert record is not None
    assert record.final == {"content": "done"}


async def test_a_dead_owners_confirmation_begins_no_session(bus: Bus) -> None:
    """A confirmation only continues a session: one that does not exist is
    not begun for it by a take-over either."""
    dead = await SessionStore.open(bus, owner="a")
    heir = await SessionStore.open(bus, owner="b")
    confirm = to_builtins(ConfirmResult(session_id="s", call_id="q-8", confirmations=[]))
    await lease_only(dead, "cy", confirm, "_INBOX.x.8")
    with pytest.raises(SessionBusyError, match="no longer exists"):
        await taken_over(heir, "cy")
    assert await heir.get("cy", "s") is None


@pytest.mark.parametrize("released", [False, True])
async def test_a_request_after_a_new_owner_died_serves_the_dead_ones_first(
    bus: Bus, released: bool
) -> None:
    """The dead owner took a new session (its request in the journal), or
    one released before (its request in its lease only): either way the
    next request's replica serves it first, and fences the dead owner."""
    dead = await SessionStore.open(bus, owner="a", lease_ttl=0.3)
    heir = await SessionStore.open(bus, owner="b", lease_ttl=0.3)
    first, second = _request("first", "q-4"), _request("second", "q-5")
    if released:
        before = await dead.acquire("ann", "s", fresh=AgentState(agent_name="ann"))
        await dead.save(before, status="idle", release=True)
    await dead.acquire(
        "ann", "s", fresh=AgentState(agent_name="ann"), reply_to="_INBOX.x.4", pending_input=first
    )  # ...and dies
    lease = await heir.acquire(
        "ann",
        "s",
        fresh=AgentState(agent_name="ann"),
        reply_to="_INBOX.x.5",
        pending_input=second,
        wait=10,
    )
    assert (lease.orphan_input, lease.orphan_reply_to) == (first, "_INBOX.x.4")
    assert (lease.record.pending_input, lease.record.reply_to) == (second, "_INBOX.x.5")
    stored = await heir.get("ann", "s")
    assert stored is not None
    assert stored.owner == "b"
    assert [f.kind for f in await heir.history("ann", "s")][-1] == "taken"
    await heir.save(lease, status="idle", release=True)


async def test_a_new_session_deleted_during_its_first_reply_is_not_written_again(
    bus: Bus,
) -> None:
    store = await SessionStore.open(bus, owner="a")
    lease = await store.acquire(
        "ann", "s", fresh=AgentState(agent_name="ann"), pending_input=_request("hi", "q-6")
    )
    await store.delete("ann", "s")
    with pytest.raises(SessionLost):
        await store.save(lease, status="idle", final={"content": "late"})
    assert await store.get("ann", "s") is None


async def test_a_deleted_session_begins_again(bus: Bus) -> None:
    store = await SessionStore.open(bus, owner="a")
    for round_ in ("first", "second"):
        request = _request(round_, round_)
        lease = await store.acquire(
            "ann", "s", fresh=AgentState(agent_name="ann"), pending_input=request
        )
        assert lease.record.pending_input == request
        await store.save(lease, status="idle", final={"content": round_}, release=True)
        record = await store.get("ann", "s")
        assert record is not None
        assert record.final == {"content": round_}
        await store.delete("ann", "s")
        assert await store.get("ann", "s") is None
