"""The child processes of a run: started, awaited until ready, stopped.

``fleetbus sim run`` starts its hosts, tool workers and (without ``--nats``)
its nats-server as ``python -m fleetbus sim …`` children. Each one:

- announces itself with one line on its stdout, ``ready`` and what it has to
  say (the server its URL), then sends its stdout to its stderr, which goes
  to a log file of the run (``OUT/logs/<name>.log``);
- is in a session of its own, so a Ctrl-C in the terminal reaches the runner
  only, which stops its children in order;
- stops by itself when its stdin closes (``--parent-pipe``): when the runner
  dies, even by SIGKILL, nothing it started keeps running.

The children's process ids are kept in ``OUT/logs/children.json``: a runner
resuming a crashed run waits for the previous run's children to finish
draining before it restores the environment, so none of their late work
lands on the restored state.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from fleetbus.errors import ConfigError

__all__ = [
    "READY",
    "Child",
    "Children",
    "announce_ready",
    "server_threads",
    "stop_when_parent_exits",
]

READY = "ready"
"""The first word of the line a child prints once it serves."""

SERVER_CORE_SHARE = 4
"""A run's embedded server gets one thread per this many cores."""


def server_threads() -> int | None:
    """The threads (``GOMAXPROCS``) of a run's embedded nats-server: a
    quarter of the cores this process may run on, at least one; ``None``
    when ``GOMAXPROCS`` is set, which the server then inherits.

    The server shares the machine with the run's hosts, which take most of
    the machine's CPU: on two cores, rounds of 10,000 agents spent
    0.11-0.14 ms of the server's CPU a reply with two threads and
    0.07-0.09 with one, and took a tenth less time (docs/performance.md).
    A fleet whose work is mostly messages (tool calls) wants every core for
    its server, so only a simulation's server is held to a share.
    """
    if os.environ.get("GOMAXPROCS"):
        return None
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # (no affinity on macOS, Windows)
        cores = os.cpu_count() or 1
    return max(1, cores // SERVER_CORE_SHARE)


@dataclass(slots=True)
class Child:
    """A started child process.

    Attributes:
        name: its name in the run (``host-1``, ``tools-1``, ``server``).
        process: the process.
        log: where its output goes.
    """

    name: str
    process: asyncio.subprocess.Process
    log: Path

    @property
    def pid(self) -> int:
        """Its process id."""
        return self.process.pid


class Children:
    """The child processes of a run.

    Args:
        logs: the directory of their log files.
        env: their environment (this process's by default).
    """

    def __init__(self, logs: Path, *, env: dict[str, str] | None = None) -> None:
        self.logs = logs
        self.env = env
        self.children: list[Child] = []

    @property
    def record(self) -> Path:
        """Where the children's process ids are kept."""
        return self.logs / "children.json"

    async def wait_for_previous(self, timeout: float = 60.0, *, kind: str = "") -> list[int]:
        """Wait until the children a runner recorded (those whose name starts
        with ``kind``: ``host-``, ``tools-``) have exited (they stop by
        themselves once that runner is gone); the ids of those still running
        after ``timeout`` seconds. This process is not waited for."""
        try:
            recorded = json.loads(self.record.read_text()).items()
            pids = [int(p) for n, p in recorded if n.startswith(kind) and int(p) != os.getpid()]
        except (OSError, ValueError, TypeError, AttributeError):
            return []
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        alive = [p for p in pids if _running(p)]
        while alive and loop.time() < deadline:
            await asyncio.sleep(0.1)
            alive = [p for p in alive if _running(p)]
        return alive

    async def start(
        self, name: str, args: Sequence[str], *, ready_timeout: float = 60.0
    ) -> tuple[Child, str]:
        """Start ``python -m fleetbus ARGS --parent-pipe`` and wait for its ready line.

        Returns:
            The child and the rest of its ready line.

        Raises:
            ConfigError: it exited first (the message is its last error line)
                or was not ready within ``ready_timeout`` seconds.
        """
        self.logs.mkdir(parents=True, exist_ok=True)
        log = self.logs / f"{name}.log"
        with log.open("wb") as err:
            process = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "fleetbus",
                *args,
                "--parent-pipe",
                "--run-logs",
                str(self.logs),
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=err,
                env=self.env,
                start_new_session=True,
            )
        child = Child(name, process, log)
        self.children.append(child)
        self.record.write_text(json.dumps({c.name: c.pid for c in self.children}))
        assert process.stdout is not None
        try:
            async with asyncio.timeout(ready_timeout):
                while True:
                    line = await process.stdout.readline()
                    if not line:
                        await process.wait()
                        raise ConfigError(
                            f"{name} exited with code {process.returncode}: {last_error(log)}"
                        )
                    text = line.decode(errors="replace").strip()
                    if text == READY or text.startswith(READY + " "):
                        return child, text[len(READY) :].strip()
        except TimeoutError:
            raise ConfigError(
                f"{name} was not ready within {ready_timeout:g} s (see {log})"
            ) from None

    async def stop(
        self, timeout: float = 30.0, *, names: Sequence[str] | None = None
    ) -> dict[str, int]:
        """Stop children at once (those named, else all): SIGTERM, then
        SIGKILL after ``timeout`` seconds; their exit codes by name."""
        chosen = [c for c in self.children if names is None or c.name in names]
        codes = await asyncio.gather(*(_stop(c.process, timeout) for c in chosen))
        self.children = [c for c in self.children if c not in chosen]
        return {c.name: code for c, code in zip(chosen, codes, strict=True)}


async def _stop(process: asyncio.subprocess.Process, timeout: float) -> int:
    if process.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signal.SIGTERM)
    try:
        async with asyncio.timeout(timeout):
            await process.wait()
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            process.kill()
        await process.wait()
    if process.stdin is not None:
        process.stdin.close()
    return process.returncode if process.returncode is not None else -1


def _running(pid: int) -> bool:
    """Whether ``pid`` is a live fleetbus process (not a zombie, not a stranger
    that reused the id)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return False  # another user's: not ours
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return True  # no /proc: trust kill(0)
    return stat.rsplit(")", 1)[-1].split()[:1] != ["Z"] and b"fleetbus" in cmdline


def last_error(log: Path) -> str:
    """The last line of a child's log that says what went wrong."""
    try:
        lines = [line.strip() for line in log.read_text(errors="replace").splitlines()]
    except OSError:
        return "(no log)"
    lines = [line for line in lines if line]
    for line in reversed(lines):
        if line.startswith("error:"):
            return line.removeprefix("error:").strip()
    return lines[-1] if lines else f"nothing in {log}"


def announce_ready(detail: str = "") -> None:
    """Print the ready line, then send this process's stdout to its stderr
    (the parent reads no more of it)."""
    sys.stdout.write(f"{READY} {detail}".rstrip() + "\n")
    sys.stdout.flush()
    with contextlib.suppress(OSError, ValueError):
        os.dup2(sys.stderr.fileno(), sys.stdout.fileno())


def stop_when_parent_exits(stop: Callable[[], None]) -> None:
    """Call ``stop`` (in the running loop) once stdin closes: the parent that
    holds its other end is gone."""
    loop = asyncio.get_running_loop()

    def wait_for_eof() -> None:
        # The descriptor itself, not sys.stdin's buffered reader: a daemon
        # thread blocked in that reader holds its lock, and the interpreter
        # aborted at exit when it could not take it ("Fatal Python error:
        # _enter_buffered_busy"), so every child ended with a core dump.
        with contextlib.suppress(OSError, ValueError):
            while os.read(sys.stdin.fileno(), 4096):
                pass
        with contextlib.suppress(RuntimeError):  # the loop is closed: nothing to stop
            loop.call_soon_threadsafe(stop)

    threading.Thread(target=wait_for_eof, name="parent-pipe", daemon=True).start()
