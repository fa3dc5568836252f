"""Offloading tool results to a JetStream object store on a real server."""

from __future__ import annotations

import pytest

from fleetbus.agents.offload import ObjectStoreOffloader, Offloader, cut, read_offloaded
from fleetbus.bus import Bus, object_store
from fleetbus.errors import KeyNotFoundError

TEXT = "".join(f"{i:06d}" for i in range(50_000))  # 300,000 characters: several chunks


async def test_object_store_offloader_round_trips_slices(bus: Bus) -> None:
    store = await object_store(bus, "offload")
    offloader = ObjectStoreOffloader(store)
    assert isinstance(offloader, Offloader)
    ref = await offloader.store("call-1", TEXT)
    assert ref == f"nats-object://{bus.prefix}_offload/call-1"
    assert await offloader.load(ref) == TEXT[:20_000]
    assert await offloader.load(ref, offset=299_994, limit=100) == TEXT[299_994:]
    assert await store.get("call-1") == TEXT.encode()


async def test_object_store_offloader_refuses_unknown_and_foreign_refs(bus: Bus) -> None:
    offloader = ObjectStoreOffloader(await object_store(bus, "offload"))
    with pytest.raises(KeyNotFoundError, match="no object 'missing'"):
        await offloader.load(f"nats-object://{bus.prefix}_offload/missing")
    for ref in ["nats-object://other_bucket/x", "file:x", f"nats-object://{bus.prefix}_offload/"]:
        with pytest.raises(KeyNotFoundError, match="is not an object of"):
            await offloader.load(ref)


async def test_cut_and_read_back_through_the_object_store(bus: Bus) -> None:
    offloader = ObjectStoreOffloader(await object_store(bus, "offload"))
    shown, ref = await cut(TEXT, 20_000, offloader, "call/with:odd chars")
    assert ref is not None
    assert ref in shown
    assert shown.startswith(TEXT[:20_000])
    more = await read_offloaded(offloader, {"ref": ref, "offset": 20_000, "limit": 10})
    assert more.startswith(TEXT[20_000:20_010])
    assert "offset=20010" in more
