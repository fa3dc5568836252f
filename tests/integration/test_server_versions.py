"""The supported nats-server range on real connections: a server older than
``MIN_SERVER_VERSION`` is refused at connect, with both versions named;
a setting an old server drops is read back, not believed; and
``FLEETBUS_NATS_SERVER`` chooses the binary fleetbus and the test suite run.

The tests on an old release run its real binary when it is cached
(``scripts/test-server-versions.sh fetch``) and are skipped otherwise."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

import pytest

from fleetbus.bus import (
    MIN_SERVER_VERSION,
    Bus,
    EmbeddedServer,
    find_server_binary,
    key_value,
)
from fleetbus.bus import _server_version as server_version
from fleetbus.bus._server_version import server_release
from fleetbus.errors import ConnectError, ServerBinaryNotFoundError
from tests.server_versions import REFUSED, binary_version, cached_server


async def test_the_server_the_suite_runs_is_supported_and_says_so(bus: Bus) -> None:
    assert bus.server_version == binary_version()
    announced = server_release(bus.server_version)
    minimum = server_release(MIN_SERVER_VERSION)
    assert announced is not None
    assert minimum is not None
    assert announced >= minimum


async def test_a_server_announcing_an_old_version_is_refused_and_let_go() -> None:
    """A stand-in that speaks only the handshake (its INFO, a PONG to the
    client's PING), as a 2.10 server would: what follows is never asked."""
    asked: list[bytes] = []
    gone = asyncio.Event()

    async def handshake(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        info = {"server_id": "OLD", "version": "2.10.24", "proto": 1, "headers": True}
        info |= {"max_payload": 1 << 20, "host": "127.0.0.1", "port": port}
        writer.write(b"INFO " + json.dumps(info).encode() + b"\r\n")
        await writer.drain()
        while line := await reader.readline():
            asked.append(line.split(b" ", 1)[0].strip())
            if line.startswith(b"PING"):
                writer.write(b"PONG\r\n")
                await writer.drain()
        gone.set()
        writer.close()

    server = await asyncio.start_server(handshake, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        with pytest.raises(ConnectError) as caught:
            await Bus.connect(f"nats://127.0.0.1:{port}", timeout=10)
        await asyncio.wait_for(gone.wait(), 10)  # the connection is closed, not kept
    assert str(caught.value).startswith(
        f"nats-server 2.10.24 at nats://127.0.0.1:{port} is older than {MIN_SERVER_VERSION}, "
        "the oldest release fleetbus supports"
    )
    # Connected (CONNECT, PING) and let go: no subscription, no JetStream request.
    assert set(asked) <= {b"CONNECT", b"PING", b"PONG"}


@pytest.mark.slow
async def test_a_real_old_server_is_refused_before_anything_fails() -> None:
    old = cached_server(REFUSED)
    with EmbeddedServer(binary=old) as server:
        with pytest.raises(ConnectError) as caught:
            await Bus.connect(server.url, timeout=10)
        url = server.url
    assert str(caught.value).startswith(
        f"nats-server {REFUSED} at {url} is older than {MIN_SERVER_VERSION}, "
        "the oldest release fleetbus supports"
    )


@pytest.mark.slow
async def test_per_message_ttls_an_old_server_drops_are_not_believed(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, prefix: str
) -> None:
    """nats-server 2.10 takes the stream update asking for ``allow_msg_ttl``
    and drops it: the lease bucket falls back to deletions that stay instead
    of purges whose markers could never expire."""
    old = cached_server(REFUSED)
    monkeypatch.setattr(server_version, "_MINIMUM", (2, 10, 0))  # past the refusal
    caplog.set_level(logging.INFO, logger="fleetbus.bus.store")
    with EmbeddedServer(binary=old) as server:
        bus = await Bus.connect(server.url, prefix=prefix)
        try:
            kv = await key_value(bus, "leases", expiring_markers=True, republish=True)
            info = await bus.nc.jetstream().stream_info(f"KV_{prefix}_leases")
        finally:
            await bus.close()
    assert not info.config.allow_msg_ttl  # the server kept none
    assert not kv.expiring_markers
    assert kv.republished == f"{prefix}.kv.leases."  # which 2.10 has
    assert (
        f"KV bucket {prefix}_leases takes no per-message TTL "
        "(the server took the update without allow_msg_ttl): its deletions stay"
    ) in caplog.messages


def test_fleetbus_nats_server_chooses_the_binary(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    ran = tmp_path / "ran"
    chosen = tmp_path / "nats-server"
    chosen.write_text(f'#!/bin/sh\ntouch "{ran}"\nexec "{find_server_binary()}" "$@"\n')
    chosen.chmod(0o755)
    monkeypatch.setenv("FLEETBUS_NATS_SERVER", str(chosen))
    assert find_server_binary() == chosen
    with EmbeddedServer() as server:
        assert server.running
    assert ran.exists()
    monkeypatch.setenv("FLEETBUS_NATS_SERVER", str(tmp_path / "missing"))
    with pytest.raises(ServerBinaryNotFoundError, match=r"FLEETBUS_NATS_SERVER=.*missing"):
        EmbeddedServer().start()
