"""The embedded nats-server: start, stop, clear errors, kept state."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from fleetbus.bus import Bus, EmbeddedServer, find_server_binary, key_value
from fleetbus.errors import PortInUseError, ServerBinaryNotFoundError, ServerError


def test_start_picks_a_free_port_and_stop_cleans_up() -> None:
    server = EmbeddedServer().start()
    try:
        assert server.running
        assert server.url.startswith("nats://127.0.0.1:")
        with socket.create_connection(("127.0.0.1", server.port), timeout=2):
            pass
        run_dir = server.state_dir.parent
    finally:
        server.stop()
    assert server.pid is None
    assert not run_dir.exists()
    with pytest.raises(ServerError, match="not running"):
        _ = server.url


def test_a_taken_port_is_a_clear_error_not_a_hang() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(PortInUseError, match=f"port {port} on 127.0.0.1 is already in use"):
            EmbeddedServer(port=port, start_timeout=5).start()


def test_a_missing_binary_says_how_to_install_it(tmp_path: Path) -> None:
    with pytest.raises(ServerBinaryNotFoundError, match="does not exist"):
        EmbeddedServer(binary=tmp_path / "nats-server").start()
    assert find_server_binary().name == "nats-server"


def test_a_binary_that_is_not_nats_server_fails_clearly(tmp_path: Path) -> None:
    fake = tmp_path / "nats-server"
    fake.write_text("#!/bin/sh\necho 'not a server' >&2\nexit 3\n")
    fake.chmod(0o755)
    with pytest.raises(ServerError, match="exited with code 3"):
        EmbeddedServer(binary=fake).start()


async def test_state_survives_a_restart_in_the_same_state_dir(tmp_path: Path) -> None:
    with EmbeddedServer(state_dir=tmp_path / "js") as first:
        bus = await Bus.connect(first.url)
        await (await key_value(bus, "keep")).put("k", b"v")
        await bus.close()
    with EmbeddedServer(state_dir=tmp_path / "js") as second:
        bus = await Bus.connect(second.url)
        assert (await (await key_value(bus, "keep", create=False)).get("k")).value == b"v"
        await bus.close()
