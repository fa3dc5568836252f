"""Fixtures shared by every test: a real nats-server for the session, and a
bus per test on a prefix of its own."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator

import pytest

from fleetbus.bus import Bus, EmbeddedServer


@pytest.fixture(scope="session")
def nats_server() -> Iterator[EmbeddedServer]:
    """One embedded nats-server (random port, JetStream in a temp dir) for the run."""
    with EmbeddedServer() as server:
        yield server


@pytest.fixture
def prefix() -> str:
    """A subject prefix no other test uses."""
    return f"t{uuid.uuid4().hex[:12]}"


@pytest.fixture
async def bus(nats_server: EmbeddedServer, prefix: str) -> AsyncIterator[Bus]:
    """A connected bus on the test's own prefix."""
    connection = await Bus.connect(nats_server.url, prefix=prefix, name="test-client")
    try:
        yield connection
    finally:
        await connection.close()
