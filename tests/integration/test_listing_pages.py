"""Listings past the server's page: a stream-info request names at most
100,000 subjects, so a listing of more (the journals or leases of a
population of 100,000 agents and up) reads page after page.

The streams are kept in memory here, where the server stores 100,000
messages in a fraction of a second (on disk, with the test server's
flushes, it took 17 s); the listing does not depend on the storage."""

from __future__ import annotations

import asyncio

import pytest
from nats.js.api import KeyValueConfig, StorageType

from fleetbus.bus import Bus, key_value
from fleetbus.bus.journal import Journal
from fleetbus.bus.store import stream_subjects
from fleetbus.bus.subjects import Subjects
from fleetbus.errors import StoreError

MORE_THAN_A_PAGE = 100_050
"""The server answers 100,000 subjects a request."""


async def _fill(bus: Bus, stream: str, subjects: list[str]) -> None:
    """A message on each of ``subjects`` of ``stream`` (which keeps one a
    subject): published in chunks, each waited for, and sent again whole
    if the server could not take all of it at once."""
    js = bus.nc.jetstream()
    stored = (await js.stream_info(stream)).state.messages
    for start in range(0, len(subjects), 25_000):
        chunk = subjects[start : start + 25_000]
        target = stored + len(chunk)
        for _ in range(10):
            for subject in chunk:
                await bus.nc.publish(subject, b"x")
            await bus.nc.flush()
            before = -1
            while stored < target and stored != before:  # until it stops growing
                before = stored
                await asyncio.sleep(0.02)
                stored = (await js.stream_info(stream)).state.messages
            if stored >= target:
                break
        else:
            pytest.fail(f"the server stored {stored} messages of {target}")


async def test_a_journal_listing_reads_every_page(bus: Bus) -> None:
    name = f"{bus.subjects.prefix}_pages"
    stem = f"{bus.subjects.prefix}.pages."
    await bus.nc.jetstream().add_stream(
        name=name, subjects=[stem + ">"], storage=StorageType.MEMORY, max_msgs_per_subject=1
    )
    stream = Journal(bus, name, stem)
    keys = [f"a{i}.s" for i in range(MORE_THAN_A_PAGE)]
    await _fill(bus, stream.stream, [stream.subject(k) for k in keys])
    listed = await stream.keys()
    assert len(listed) == MORE_THAN_A_PAGE
    assert sorted(listed) == sorted(keys)
    assert set(listed.values()) == {1}
    assert await stream.keys("a1.*") == {"a1.s": 1}  # one page: as before


async def test_a_key_listing_reads_every_page(bus: Bus) -> None:
    await bus.nc.jetstream().create_key_value(
        KeyValueConfig(bucket=bus.subjects.kv_bucket("pages"), storage=StorageType.MEMORY)
    )
    kv = await key_value(bus, "pages", create=False)
    keys = [f"k{i}" for i in range(MORE_THAN_A_PAGE)]
    await _fill(bus, Subjects.kv_stream(kv.bucket), [Subjects.kv_keys(kv.bucket, k) for k in keys])
    assert await kv.subjects() == sorted(keys)
    assert await kv.subjects("k7") == ["k7"]


async def test_a_listing_of_a_missing_stream_says_what_failed(bus: Bus) -> None:
    with pytest.raises(StoreError, match="list things failed: stream not found"):
        await stream_subjects(bus.nc, "NO_SUCH_STREAM", "x.>", timeout=5.0, what="list things")
