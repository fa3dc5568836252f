"""JetStream KV and object store helpers against a real server."""

from __future__ import annotations

import asyncio

import pytest

from fleetbus.bus import Bus, EmbeddedServer, KeyUpdates, key_value, object_store
from fleetbus.errors import KeyNotFoundError, RevisionMismatchError, StoreError


async def test_key_value_put_get_delete_and_keys(bus: Bus) -> None:
    kv = await key_value(bus, "state")
    assert kv.bucket == f"{bus.prefix}_state"
    assert await kv.keys() == []
    assert await kv.get_or_none("a") is None
    rev = await kv.put("a", b"1")
    entry = await kv.get("a")
    assert (entry.key, entry.value, entry.revision) == ("a", b"1", rev)
    await kv.put("b.c", b"2")
    assert await kv.keys() == ["a", "b.c"]
    await kv.delete("a")
    with pytest.raises(KeyNotFoundError, match="no key 'a'"):
        await kv.get("a")
    assert await kv.keys() == ["b.c"]


async def test_compare_and_set_lets_only_one_writer_win(bus: Bus) -> None:
    kv = await key_value(bus, "cas")
    rev = await kv.create("session", b"v1")
    with pytest.raises(RevisionMismatchError, match="already exists"):
        await kv.create("session", b"other")
    results = await asyncio.gather(
        kv.update("session", b"writer-1", revision=rev),
        kv.update("session", b"writer-2", revision=rev),
        return_exceptions=True,
    )
    assert sum(isinstance(r, int) for r in results) == 1
    loser = next(r for r in results if isinstance(r, BaseException))
    assert isinstance(loser, RevisionMismatchError)
    assert loser.expected == rev
    assert (await kv.get("session")).value in {b"writer-1", b"writer-2"}


async def test_opening_a_missing_bucket_without_create_is_an_error(bus: Bus) -> None:
    with pytest.raises(StoreError, match="does not exist"):
        await key_value(bus, "never", create=False)
    with pytest.raises(StoreError, match="does not exist"):
        await object_store(bus, "never", create=False)


async def test_object_store_holds_large_blobs(bus: Bus) -> None:
    store = await object_store(bus, "blobs")
    blob = bytes(range(256)) * 8192  # 2 MiB: larger than one NATS message
    summary = await store.put("result-1", blob)
    assert summary.size == len(blob)
    assert await store.get("result-1") == blob
    assert [s.name for s in await store.list()] == ["result-1"]
    assert store.url("result-1") == f"nats-object://{bus.prefix}_blobs/result-1"
    await store.delete("result-1")
    with pytest.raises(KeyNotFoundError):
        await store.get("result-1")
    with pytest.raises(KeyNotFoundError):
        await store.delete("result-1")


async def test_without_jetstream_the_error_says_so() -> None:
    with EmbeddedServer(jetstream=False) as plain:
        bus = await Bus.connect(plain.url)
        try:
            with pytest.raises(StoreError, match="JetStream"):
                await key_value(bus, "x")
        finally:
            await bus.close()


async def test_a_purge_leaves_a_marker_that_expires_and_a_key_to_create_again(bus: Bus) -> None:
    kv = await key_value(bus, "expiring", expiring_markers=True)
    assert kv.expiring_markers
    first = await kv.create("lease", b"held")
    with pytest.raises(RevisionMismatchError):
        await kv.purge("lease", revision=first + 100, ttl=1)
    marker = await kv.purge("lease", revision=first, ttl=1)
    assert await kv.get_or_none("lease") is None
    assert await kv.revision("lease") == marker
    assert await kv.subjects() == ["lease"]
    # Taken again over the marker, then purged and left to expire.
    again = await kv.update("lease", b"held again", revision=marker)
    await kv.purge("lease", revision=again, ttl=1)
    for _ in range(50):  # the server expires markers about once a second
        if not await kv.subjects():
            break
        await asyncio.sleep(0.2)
    assert await kv.subjects() == []
    assert await kv.revision("lease") is None
    assert await kv.create("lease", b"new") > again


async def test_a_delete_returns_its_marker_to_write_over(bus: Bus) -> None:
    kv = await key_value(bus, "markers")
    revision = await kv.create("k", b"1")
    marker = await kv.delete("k", revision=revision)
    assert await kv.revision("k") == marker
    with pytest.raises(KeyNotFoundError):
        await kv.get("k")
    assert await kv.update("k", b"2", revision=marker) > marker
    assert (await kv.get("k")).value == b"2"


async def test_the_last_write_of_a_key_is_read_deletions_included(bus: Bus) -> None:
    kv = await key_value(bus, "last")
    assert await kv.last("k") is None  # never written
    written = await kv.put("k", b"v")
    entry = await kv.last("k")
    assert entry is not None
    assert (entry.value, entry.revision, entry.deleted) == (b"v", written, False)
    marker = await kv.delete("k")
    entry = await kv.last("k")
    assert entry is not None
    assert (entry.value, entry.revision, entry.deleted) == (b"", marker, True)
    assert await kv.get_or_none("k") is None
    assert await kv.update("k", b"again", revision=entry.revision) > marker


async def test_a_republishing_bucket_tells_followers_each_stored_write_and_its_revision(
    bus: Bus,
) -> None:
    plain = await key_value(bus, "repeated", expiring_markers=True)
    assert plain.republished is None
    # Opened again with republish, the existing bucket is updated.
    kv = await key_value(bus, "repeated", expiring_markers=True, republish=True)
    assert kv.republished == f"{bus.prefix}.kv.repeated."
    heard: list[tuple[str, bytes | None, int | None]] = []
    updates = KeyUpdates(bus, kv, "*.lease", lambda k, v, r: heard.append((k, v, r)))
    await updates.start()
    try:
        first = await kv.create("a.lease", b"held")
        with pytest.raises(RevisionMismatchError):
            await kv.update("a.lease", b"lost", revision=first + 100)  # not stored: not heard
        marker = await kv.purge("a.lease", revision=first, ttl=5)
        await kv.put("a.other", b"not followed")
        again = await kv.update("a.lease", b"taken", revision=marker)
        for _ in range(100):
            if len(heard) >= 3:
                break
            await asyncio.sleep(0.02)
    finally:
        await updates.close()
    assert heard == [
        ("a.lease", b"held", first),
        ("a.lease", None, marker),
        ("a.lease", b"taken", again),
    ]
    # A follower of a bucket without it still hears writes, without revisions.
    old = await key_value(bus, "not-repeated")
    plain_heard: list[tuple[str, bytes | None, int | None]] = []
    follower = KeyUpdates(bus, old, ">", lambda k, v, r: plain_heard.append((k, v, r)))
    await follower.start()
    try:
        await old.put("k", b"1")
        for _ in range(100):
            if plain_heard:
                break
            await asyncio.sleep(0.02)
    finally:
        await follower.close()
    assert plain_heard == [("k", b"1", None)]
