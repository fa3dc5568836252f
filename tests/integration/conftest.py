"""Fixtures of the integration tests that need more than the session's
single server: a real 3-node NATS cluster (see ``cluster.py``)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest

from fleetbus.bus import Bus
from tests.integration.cluster import NatsCluster


@pytest.fixture(scope="module")
def nats_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsCluster]:
    """Three nats-servers from the shipped configs, for this module."""
    cluster = NatsCluster(tmp_path_factory.mktemp("nats-cluster")).start()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def cluster(nats_cluster: NatsCluster) -> NatsCluster:
    """The cluster with all three nodes up (a previous test may have killed one)."""
    nats_cluster.restart_stopped()
    nats_cluster.wait_ready()
    return nats_cluster


@pytest.fixture
async def cluster_bus(cluster: NatsCluster, prefix: str) -> AsyncIterator[Bus]:
    """A bus that knows all three servers, on the test's own prefix."""
    bus = await Bus.connect(cluster.urls, prefix=prefix, name="cluster-test")
    try:
        await cluster.wait_placement(bus)
        yield bus
    finally:
        await bus.close()
