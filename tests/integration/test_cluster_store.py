"""Replicated KV buckets and object stores on a real 3-node NATS cluster.

The cluster runs the shipped ``deploy/nats-cluster`` configs (see
``tests/integration/cluster.py``); the single-server cases use the session's
embedded server.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

import pytest

from fleetbus.bus import Bus, ConnectOptions, KeyValueStore, key_value, object_store
from fleetbus.errors import KeyNotFoundError, RevisionMismatchError, StoreError
from tests.integration.cluster import (
    ROOT,
    TEMPLATES,
    NatsCluster,
    server_name,
    stream_info,
    stream_message,
)

T = TypeVar("T")

RETRY_DEADLINE = 30.0
"""Seconds a write or read may take across a fail-over (measured: a new stream
leader in 4-7 s after SIGKILL of the old one)."""


def kv_stream(bus: Bus, name: str) -> str:
    return f"KV_{bus.subjects.kv_bucket(name)}"


def obj_stream(bus: Bus, name: str) -> str:
    return f"OBJ_{bus.subjects.kv_bucket(name)}"


async def replicas_of(bus: Bus, stream: str) -> int:
    return int((await stream_info(bus, stream))["config"]["num_replicas"])


async def wait_current_replicas(bus: Bus, stream: str, count: int, timeout: float = 20.0) -> None:
    """Until the stream has a leader and ``count - 1`` current followers."""
    deadline = asyncio.get_running_loop().time() + timeout
    cluster: dict[str, object] = {}
    while asyncio.get_running_loop().time() < deadline:
        cluster = (await stream_info(bus, stream)).get("cluster") or {}
        followers = cluster.get("replicas") or []
        assert isinstance(followers, list)
        current = [f for f in followers if f.get("current")]
        if cluster.get("leader") and len(current) == count - 1:
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"{stream} has not {count} current replicas: {cluster}")


# -- the default and the setting ------------------------------------------------------------


async def test_a_single_server_gets_one_replica_and_refuses_more(bus: Bus) -> None:
    await key_value(bus, "single")
    await object_store(bus, "single-blobs")
    assert await replicas_of(bus, kv_stream(bus, "single")) == 1
    assert await replicas_of(bus, obj_stream(bus, "single-blobs")) == 1
    with pytest.raises(StoreError, match="wants 3 replicas, but the NATS server is not part of"):
        await key_value(bus, "single-r3", replicas=3)
    with pytest.raises(StoreError, match="FLEETBUS_JS_REPLICAS"):
        await key_value(bus, "single", replicas=2)  # the update of an existing one, too
    assert await replicas_of(bus, kv_stream(bus, "single")) == 1


@pytest.mark.slow
async def test_a_cluster_gets_three_replicas(cluster_bus: Bus) -> None:
    kv = await key_value(cluster_bus, "sessions")
    await object_store(cluster_bus, "blobs")
    assert await replicas_of(cluster_bus, kv_stream(cluster_bus, "sessions")) == 3
    assert await replicas_of(cluster_bus, obj_stream(cluster_bus, "blobs")) == 3
    await wait_current_replicas(cluster_bus, kv_stream(cluster_bus, "sessions"), 3)
    assert await kv.get_or_none("nothing") is None


@pytest.mark.slow
async def test_the_setting_and_the_argument_choose_the_count(
    cluster: NatsCluster, prefix: str
) -> None:
    options = ConnectOptions(js_replicas=1)
    async with await Bus.connect(cluster.urls, prefix=prefix, options=options) as bus:
        await key_value(bus, "one")
        await key_value(bus, "two", replicas=2)
        assert await replicas_of(bus, kv_stream(bus, "one")) == 1
        assert await replicas_of(bus, kv_stream(bus, "two")) == 2


@pytest.mark.slow
async def test_more_replicas_than_the_cluster_holds_is_a_clear_error(cluster_bus: Bus) -> None:
    with pytest.raises(StoreError, match="wants 5 replicas, but JetStream cluster fleetbus"):
        await key_value(cluster_bus, "too-many", replicas=5)
    with pytest.raises(StoreError, match="set FLEETBUS_JS_REPLICAS"):
        await object_store(cluster_bus, "too-many-blobs", replicas=4)


# -- existing assets with fewer replicas ----------------------------------------------------


@pytest.mark.slow
async def test_an_r1_bucket_opened_wanting_r3_is_reported_and_updated(
    cluster: NatsCluster, cluster_bus: Bus, caplog: pytest.LogCaptureFixture
) -> None:
    old = await key_value(cluster_bus, "legacy", replicas=1)
    # An R1 stream lives on one node: until its interest reaches the node this
    # client talks to (a few ms), a write finds "no response from stream".
    revision = await _retrying(lambda: old.put("session-1", b"state"))
    await object_store(cluster_bus, "legacy-blobs", replicas=1)
    bucket = cluster_bus.subjects.kv_bucket("legacy")
    stream = kv_stream(cluster_bus, "legacy")
    # The cluster places three copies now: on a busy machine a node late
    # with its heartbeat counts as a peer offline for a moment, and the
    # update is then refused ("it keeps 1", the next open tries again).
    await cluster.wait_placement(cluster_bus)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="fleetbus"):
        kv = await key_value(cluster_bus, "legacy")
    (record,) = [r for r in caplog.records if bucket in r.getMessage()]
    assert record.levelno == logging.WARNING
    assert record.getMessage() == (
        f"KV bucket {bucket} had 1 replica(s), 3 wanted; updated it to 3"
    )
    assert await replicas_of(cluster_bus, stream) == 3
    await wait_current_replicas(cluster_bus, stream, 3)
    entry = await kv.get("session-1")
    assert (entry.value, entry.revision) == (b"state", revision)
    assert await kv.update("session-1", b"next", revision=revision) > revision
    blobs = await object_store(cluster_bus, "legacy-blobs")
    assert await replicas_of(cluster_bus, obj_stream(cluster_bus, "legacy-blobs")) == 3
    await blobs.put("r", b"blob")  # at once: the update waited for the new leader
    assert await blobs.get("r") == b"blob"
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="fleetbus"):
        await key_value(cluster_bus, "legacy")
    assert not caplog.records, "an asset at the wanted count is opened quietly"


@pytest.mark.slow
async def test_an_update_the_cluster_refuses_is_reported_not_fatal(
    cluster_bus: Bus, caplog: pytest.LogCaptureFixture
) -> None:
    old = await key_value(cluster_bus, "stuck", replicas=1)
    await _retrying(lambda: old.put("k", b"v"))
    bucket = cluster_bus.subjects.kv_bucket("stuck")
    with caplog.at_level(logging.WARNING, logger="fleetbus"):
        kv = await key_value(cluster_bus, "stuck", replicas=5)
    (message,) = [r.getMessage() for r in caplog.records if bucket in r.getMessage()]
    assert message.startswith(f"KV bucket {bucket} has 1 replica(s), 5 wanted; updating it failed")
    assert message.endswith("it keeps 1")
    assert (await kv.get("k")).value == b"v"
    assert await replicas_of(cluster_bus, kv_stream(cluster_bus, "stuck")) == 1


# -- fail-over ------------------------------------------------------------------------------


async def cas_update(
    kv: KeyValueStore, key: str, value: bytes, revision: int, failures: list[StoreError]
) -> int:
    """Compare-and-set until acknowledged, within RETRY_DEADLINE; a write whose
    acknowledgement was lost (the leader died after committing it) is
    recognised on the retry. Each failure is appended to ``failures``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + RETRY_DEADLINE
    while True:
        try:
            try:
                return await kv.update(key, value, revision=revision)
            except RevisionMismatchError as exc:
                # Said in full: which of the two cases it was, and what was read.
                if not failures:
                    raise AssertionError(
                        f"the update of {value!r} at revision {revision} was refused "
                        f"with no failure before it: {exc}"
                    ) from exc
                entry = await kv.get(key)
                if entry.value != value:
                    raise AssertionError(
                        f"the update of {value!r} at revision {revision} was refused after "
                        f"{len(failures)} failure(s), the last {failures[-1]!r}; the key "
                        f"holds {entry.value!r} at revision {entry.revision}"
                    ) from exc
                return entry.revision
        except StoreError as exc:
            failures.append(exc)
            if loop.time() > deadline:
                raise
            await asyncio.sleep(0.1)


@pytest.mark.slow
async def test_cas_writes_survive_killing_the_buckets_leader(
    cluster: NatsCluster, cluster_bus: Bus
) -> None:
    total, kill_after = 60, 20  # history 64 keeps every acknowledged revision
    kv = await key_value(cluster_bus, "failover", history=64)
    stream = kv_stream(cluster_bus, "failover")
    await wait_current_replicas(cluster_bus, stream, 3)
    acked: list[tuple[bytes, int]] = []
    failures: list[StoreError] = []
    paused, killed = asyncio.Event(), asyncio.Event()
    slowest = 0.0

    async def writer() -> None:
        nonlocal slowest
        revision = await kv.create("session", b"0")
        acked.append((b"0", revision))
        for i in range(1, total):
            if i == kill_after:  # the rest is written across the fail-over
                paused.set()
                await killed.wait()
            value = str(i).encode()
            started = loop.time()
            revision = await cas_update(kv, "session", value, revision, failures)
            slowest = max(slowest, loop.time() - started)
            acked.append((value, revision))

    loop = asyncio.get_running_loop()
    async with asyncio.TaskGroup() as tasks:
        tasks.create_task(writer())
        await asyncio.wait_for(paused.wait(), 10)
        leader = await cluster.stream_leader(cluster_bus, stream)
        cluster.kill(leader)
        killed.set()
        new_leader = await cluster.stream_leader(cluster_bus, stream, exclude=leader)
    assert new_leader != leader
    assert failures, "the writer felt the fail-over"
    assert len(acked) == total, "every update was acknowledged"
    assert [v for v, _ in acked] == [str(i).encode() for i in range(total)]
    revisions = [r for _, r in acked]
    assert revisions == sorted(set(revisions)), "each update landed once, in order"
    entry = await kv.get("session")
    assert (entry.value, entry.revision) == acked[-1], "the last acknowledged write is read"
    for value, revision in acked:
        stored = await stream_message(cluster_bus, stream, revision)
        assert stored == value, f"acknowledged revision {revision} lost ({slowest:.1f}s fail-over)"


@pytest.mark.slow
async def test_the_object_store_survives_killing_its_leader(
    cluster: NatsCluster, cluster_bus: Bus
) -> None:
    store = await object_store(cluster_bus, "results")
    stream = obj_stream(cluster_bus, "results")
    before = bytes(range(256)) * 8192  # 2 MiB: several chunks
    await store.put("before", before)
    await wait_current_replicas(cluster_bus, stream, 3)
    leader = await cluster.stream_leader(cluster_bus, stream)
    cluster.kill(leader)
    after = b"written after the kill " * 50_000
    assert await _retrying(lambda: store.get("before")) == before
    await _retrying(lambda: store.put("after", after))
    assert await _retrying(lambda: store.get("after")) == after
    assert [s.name for s in await _retrying(store.list)] == ["after", "before"]
    with pytest.raises(KeyNotFoundError):
        await store.get("never-written")
    assert await cluster.stream_leader(cluster_bus, stream, exclude=leader) != leader


@pytest.mark.slow
async def test_without_a_quorum_nothing_is_served_and_nothing_acknowledged_is_lost(
    cluster: NatsCluster, cluster_bus: Bus
) -> None:
    kv = await key_value(cluster_bus, "quorum")
    stream = kv_stream(cluster_bus, "quorum")
    revision = await kv.put("session", b"acknowledged")
    await wait_current_replicas(cluster_bus, stream, 3)
    leader = await cluster.stream_leader(cluster_bus, stream)
    follower, other = (n for n in (1, 2, 3) if n != leader)
    cluster.kill(leader)
    cluster.kill(other)  # one of three left: no majority
    write, read = await asyncio.gather(
        kv.update("session", b"never acknowledged", revision=revision),
        kv.get("session"),
        return_exceptions=True,
    )
    assert isinstance(write, StoreError), write
    assert isinstance(read, StoreError), read
    cluster.restart(other)  # a majority again, without the old leader
    entry = await _retrying(lambda: kv.get("session"))
    assert (entry.value, entry.revision) == (b"acknowledged", revision)
    assert await _retrying(lambda: kv.update("session", b"next", revision=revision)) > revision
    assert await cluster.stream_leader(cluster_bus, stream) in {follower, other}


async def _retrying(call: Callable[[], Awaitable[T]]) -> T:
    """``call()``, retried on StoreError (not on a missing key) for a while."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + RETRY_DEADLINE
    while True:
        try:
            return await call()
        except KeyNotFoundError:
            raise
        except StoreError:
            if loop.time() > deadline:
                raise
            await asyncio.sleep(0.1)


# -- the shipped configs --------------------------------------------------------------------


@pytest.mark.slow
def test_the_shipped_cluster_configs_fsync_every_write(cluster: NatsCluster) -> None:
    for node in cluster.nodes:
        varz = cluster.varz(node.number)
        assert varz["server_name"] == node.name
        assert varz["cluster"]["name"] == "fleetbus"
        assert varz["jetstream"]["config"]["sync_always"] is True
        assert varz["jetstream"]["meta"]["cluster_size"] == 3


def test_the_node_configs_differ_only_in_server_name() -> None:
    first = TEMPLATES[0].read_text(encoding="utf-8")
    names = [server_name(path.read_text(encoding="utf-8")) for path in TEMPLATES]
    assert names == ["nats-1", "nats-2", "nats-3"]
    for path, name in zip(TEMPLATES, names, strict=True):
        text = path.read_text(encoding="utf-8")
        assert text.replace(f"server_name: {name}\n", "server_name: nats-1\n") == first, path.name


def test_the_docs_show_the_shipped_config() -> None:
    docs = (ROOT / "docs" / "cluster.md").read_text(encoding="utf-8")
    blocks = [block.split("\n", 1)[1] for block in docs.split("```conf")[1:]]
    assert len(blocks) == 1
    shown = blocks[0].split("```", 1)[0]
    assert shown == TEMPLATES[0].read_text(encoding="utf-8")
