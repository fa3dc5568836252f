"""The embedded nats-server: start, stop, clear errors, kept state, fsync."""

from __future__ import annotations

import json
import socket
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from ruamel.yaml import YAML

from fleetbus.bus import Bus, EmbeddedServer, find_server_binary, key_value
from fleetbus.errors import ConfigError, PortInUseError, ServerBinaryNotFoundError, ServerError
from tests.helpers import free_port

ROOT = Path(__file__).resolve().parents[2]


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


def varz(monitor_port: int) -> dict[str, Any]:
    """The running server's ``/varz`` (waited for while the port opens)."""
    url = f"http://127.0.0.1:{monitor_port}/varz"
    deadline = time.monotonic() + 5
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                figures = json.loads(response.read())
                assert isinstance(figures, dict)
                return figures
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)


def jetstream_config(monitor_port: int) -> dict[str, Any]:
    """The running server's JetStream settings, from its ``/varz``."""
    config = varz(monitor_port)["jetstream"]["config"]
    assert isinstance(config, dict)
    return config


def test_jetstream_fsyncs_every_write_by_default() -> None:
    port = free_port()
    with EmbeddedServer(extra_args=["--http_port", str(port)]) as server:
        assert server.sync_interval == "always"
        config = jetstream_config(port)
        assert config["sync_always"] is True
        assert config["store_dir"].startswith(str(server.state_dir))


def test_a_periodic_sync_can_be_chosen() -> None:
    port = free_port()
    with EmbeddedServer(sync_interval=30, extra_args=["--http_port", str(port)]) as server:
        assert server.sync_interval == 30
        config = jetstream_config(port)
        assert not config.get("sync_always", False)
        assert config["sync_interval"] == 30 * 10**9  # nanoseconds


@pytest.mark.parametrize("bad", [0, -1.0, "sometimes"])
def test_a_bad_sync_interval_is_a_config_error(bad: Any) -> None:
    with pytest.raises(ConfigError, match="sync_interval is 'always' or seconds"):
        EmbeddedServer(sync_interval=bad)


def test_the_server_runs_on_as_many_threads_as_asked() -> None:
    port = free_port()
    with EmbeddedServer(threads=1, extra_args=["--http_port", str(port)]) as server:
        assert server.threads == 1
        assert varz(port)["gomaxprocs"] == 1


def test_without_threads_the_server_has_gos_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GOMAXPROCS", raising=False)
    port = free_port()
    with EmbeddedServer(extra_args=["--http_port", str(port)]) as server:
        assert server.threads is None
        figures = varz(port)
        # Every core, or fewer under a container's CPU limit (Go 1.25 on).
        assert 1 <= figures["gomaxprocs"] <= figures["cores"]
        environ = Path(f"/proc/{server.pid}/environ")
        if environ.exists():  # (Linux)
            assert b"GOMAXPROCS=" not in environ.read_bytes()


@pytest.mark.parametrize("bad", [0, -2])
def test_threads_below_one_are_a_config_error(bad: int) -> None:
    with pytest.raises(ConfigError, match="threads is at least 1"):
        EmbeddedServer(threads=bad)


def test_the_compose_nats_service_fsyncs_every_write(tmp_path: Path) -> None:
    """docker-compose.yml's nats command, run here: its config file and flags,
    with the volume paths and the monitoring port made local."""
    compose = YAML(typ="safe", pure=True).load((ROOT / "docker-compose.yml").read_text())
    nats = compose["services"]["nats"]
    mounts = {}
    for volume in nats["volumes"]:
        source, target = volume.split(":")[:2]
        mounts[target] = ROOT / source if source.startswith(".") else tmp_path / source
    port = free_port()
    args = []
    for word in nats["command"]:
        if word in mounts:
            word = str(mounts[word])
        elif word == "8222":
            word = str(port)
        args.append(word)
    with EmbeddedServer(jetstream=False, extra_args=args):
        config = jetstream_config(port)
    assert config["sync_always"] is True
    assert config["store_dir"].startswith(str(tmp_path / "nats-data"))
