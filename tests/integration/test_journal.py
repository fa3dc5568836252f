"""Journals on a real server: appends fenced by the sequence expected last,
reads in pieces past a batch, rollups, listing and purging."""

from __future__ import annotations

import pytest

from fleetbus.bus import Bus
from fleetbus.bus.journal import journal
from fleetbus.errors import RevisionMismatchError


async def test_appends_are_fenced_and_read_back_in_order_past_a_batch(bus: Bus) -> None:
    stream = await journal(bus, "session")
    seq = 0
    for n in range(600):  # more than one direct-get batch (256)
        seq = await stream.append("ann.s1", b'{"n":%d}' % n, expected=seq)
    await stream.append("bob.s1", b"{}", expected=0)
    with pytest.raises(RevisionMismatchError):
        await stream.append("ann.s1", b"{}", expected=seq - 1)  # a writer behind the end
    entries = await stream.read("ann.s1")
    assert [e.data for e in entries] == [b'{"n":%d}' % n for n in range(600)]
    assert entries[-1].seq == seq
    assert all(e.time is not None for e in entries)
    after = await stream.read("ann.s1", after=entries[299].seq)
    assert [e.data for e in after] == [b'{"n":%d}' % n for n in range(300, 600)]
    last = await stream.last("ann.s1")
    assert last is not None
    assert last.seq == seq
    assert await stream.last("nobody.s1") is None
    assert await stream.read("nobody.s1") == []
    assert await stream.keys("*.s1") == {"ann.s1": 600, "bob.s1": 1}


async def test_a_rollup_replaces_the_journal_and_a_purge_removes_it(bus: Bus) -> None:
    stream = await journal(bus, "session")
    seq = 0
    for n in range(5):
        seq = await stream.append("ann.s2", b"%d" % n, expected=seq)
    seq = await stream.append("ann.s2", b"snapshot", expected=seq, rollup=True)
    assert [e.data for e in await stream.read("ann.s2")] == [b"snapshot"]
    await stream.append("ann.s2", b"after", expected=seq)
    assert await stream.keys("ann.s2") == {"ann.s2": 2}
    await stream.purge("ann.s2")
    assert await stream.read("ann.s2") == []
    assert await stream.append("ann.s2", b"again", expected=0) > seq  # begins anew
