"""A session taken again by the replica that released it last is taken
without reading its journal (nobody held the lease since, so nobody appended
since); a session another replica held meanwhile is read — only the facts
appended since — whether this replica heard that replica's release or not."""

from __future__ import annotations

from typing import Any

import pytest

from fleetbus.agents.messages import Msg
from fleetbus.agents.serving.sessions import SessionStore, session_key
from fleetbus.agents.state import AgentState
from fleetbus.bus import Bus
from fleetbus.protocol import TextBlock


def counting_reads(store: SessionStore, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The journals ``store`` reads from now on (with the sequence read after)."""
    reads: list[str] = []
    original = store.journal.read

    async def read(key: str, *, after: int = 0) -> Any:
        reads.append(f"{key}@{after}")
        return await original(key, after=after)

    monkeypatch.setattr(store.journal, "read", read)
    return reads


async def serve(store: SessionStore, text: str) -> list[str]:
    """One reply's worth of session work: take, add ``text``, save, release;
    the texts memory held when taken."""
    lease = await store.acquire("ann", "s1", fresh=AgentState(agent_name="ann"))
    seen = [m.text for m in lease.record.state.memory]
    state = lease.record.state
    state.memory.append(Msg(name="user", role="user", content=[TextBlock(text=text)]))
    await store.save(lease, state=state, status="idle")
    await store.release(lease)
    return seen


async def test_taken_again_by_its_last_owner_the_journal_is_not_read(
    bus: Bus, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = await SessionStore.open(bus, owner="a")
    assert await serve(store, "one") == []
    reads = counting_reads(store, monkeypatch)
    assert await serve(store, "two") == ["one"]
    assert await serve(store, "three") == ["one", "two"]
    assert reads == []
    record = await store.get("ann", "s1")
    assert record is not None
    assert [m.text for m in record.state.memory] == ["one", "two", "three"]


@pytest.mark.parametrize("heard", [True, False], ids=["heard", "unheard"])
async def test_held_by_another_replica_meanwhile_only_what_it_appended_is_read(
    bus: Bus, monkeypatch: pytest.MonkeyPatch, heard: bool
) -> None:
    a = await SessionStore.open(bus, owner="a")
    b = await SessionStore.open(bus, owner="b")
    assert await serve(a, "one") == []
    assert await serve(b, "two") == ["one"]
    if heard:  # as a's recovery hears b's release: a's next take writes over its marker
        key = session_key("ann", "s1")
        marker = b._leases._released[key][0]
        assert marker is not None
        a.note_released(key, marker)
    known = a._cache[session_key("ann", "s1")][0].seq  # the end of a's own last reply
    reads = counting_reads(a, monkeypatch)
    assert await serve(a, "three") == ["one", "two"]
    # One read, from the end a knew: b's facts only.
    assert reads == [f"{session_key('ann', 's1')}@{known - 1}"]
