"""Helpers for tests that run fleetbus commands as separate OS processes, and
for serving an agent in the test's own process."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import AbstractContextManager, asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fleetbus.agents import Agent, AgentService, AgentState
from fleetbus.agents.serving._replies import redoable
from fleetbus.agents.serving.sessions import Lease, SessionStore, session_key
from fleetbus.bus import Bus, ToolClient
from fleetbus.errors import SessionLost
from fleetbus.protocol import UserRequest, to_builtins
from fleetbus.tools_workers import ToolWorker

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on (now)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def pause(pid: int, timeout: float = 10.0) -> None:
    """Stop process ``pid`` (SIGSTOP) and wait until every thread of it is
    stopped: the signal returns before a busy multi-threaded process (a Go
    nats-server) has stopped, and a thread still running may answer what
    the test sends next.

    Raises:
        TimeoutError: not stopped within ``timeout``.
    """
    os.kill(pid, signal.SIGSTOP)
    async with asyncio.timeout(timeout):
        while not _stopped(pid):  # noqa: ASYNC110 - /proc has no event to wait for
            await asyncio.sleep(0.005)


def _stopped(pid: int) -> bool:
    """Whether every thread of ``pid`` is stopped (``T`` in ``/proc``)."""
    for thread in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{thread}/stat") as stat:
                state = stat.read().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, IndexError):
            continue  # (a thread that ended meanwhile)
        if state not in ("T", "t"):
            return False
    return True


def spawn(args: Sequence[str], *, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """Start ``python -m fleetbus ARGS`` from the project root."""
    return subprocess.Popen(
        [sys.executable, "-m", "fleetbus", *args],
        cwd=ROOT,
        env={**os.environ, **(env or {}), "PYTHONPATH": str(ROOT)},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )


def stop(proc: subprocess.Popen[bytes], *, timeout: float = 15.0) -> int:
    """SIGTERM a process and wait for it (SIGKILL after ``timeout``)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise
    finally:
        if proc.stdout is not None and not proc.stdout.closed:
            proc.stdout.close()


def output(proc: subprocess.Popen[bytes]) -> str:
    """What a finished process printed (closes its pipe)."""
    assert proc.stdout is not None
    with proc.stdout:
        return proc.stdout.read().decode(errors="replace")


@contextmanager
def running(
    commands: list[list[str]], *, env: dict[str, str] | None = None
) -> Iterator[list[subprocess.Popen[bytes]]]:
    """``fleetbus`` processes running ``commands``, stopped (SIGTERM) on exit."""
    procs = [spawn(command, env=env) for command in commands]
    try:
        yield procs
    finally:
        for proc in procs:
            try:
                stop(proc)
            except subprocess.TimeoutExpired:
                pass


def workers(
    url: str, prefix: str, count: int, *, spec: str, env: dict[str, str] | None = None
) -> AbstractContextManager[list[subprocess.Popen[bytes]]]:
    """``count`` worker processes serving ``spec``, stopped (SIGTERM) on exit."""
    return running(
        [
            ["worker", spec, "--nats", url, "--prefix", prefix, "--worker-id", f"w{i}"]
            for i in range(1, count + 1)
        ],
        env=env,
    )


def agents(
    url: str, prefix: str, spec: str, count: int, *extra: str
) -> AbstractContextManager[list[subprocess.Popen[bytes]]]:
    """``count`` replicas of ``tests.integration.agent_specs:<spec>`` (lease 1 s)."""
    return running(
        [
            [
                "agent",
                f"tests.integration.agent_specs:{spec}",
                "--nats",
                url,
                "--prefix",
                prefix,
                "--lease-ttl",
                "1",
                "--replica-id",
                f"r{i}",
                *extra,
            ]
            for i in range(1, count + 1)
        ]
    )


async def wait_for_workers(bus: Bus, tool_name: str, count: int, timeout: float = 30.0) -> None:
    """Wait until ``count`` workers serve ``tool_name`` (by micro discovery)."""
    client = ToolClient(bus)
    deadline = time.monotonic() + timeout
    seen = 0
    while time.monotonic() < deadline:
        tools = await client.discover(timeout=0.3)
        seen = tools[tool_name].workers if tool_name in tools else 0
        if seen >= count:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"only {seen} of {count} workers serve {tool_name} after {timeout}s")


@asynccontextmanager
async def worker_running(worker: ToolWorker) -> AsyncIterator[ToolWorker]:
    """``worker`` serving in this process until the block ends (then stopped
    and drained)."""
    async with asyncio.TaskGroup() as tg:
        task = tg.create_task(worker.run())
        await worker.wait_ready()
        try:
            yield worker
        finally:
            worker.stop()
            await task


@asynccontextmanager
async def serving(
    url: str | list[str],
    prefix: str,
    agent: Agent,
    *,
    replica: str = "test",
    settle: bool = True,
    ready_timeout: float = 30.0,
    **options: Any,
) -> AsyncIterator[AgentService]:
    """``agent`` served in this process, on its own connection of the fleet,
    until the block ends, once ready (within ``ready_timeout`` seconds: a
    cluster whose node has just restarted takes longer). ``options`` go to
    :class:`AgentService` (defaults here: a 1 s lease, a 5 s drain)."""
    server_bus = await Bus.connect(url, prefix=prefix, name=f"agent-{replica}")
    options.setdefault("lease_ttl", 1.0)
    options.setdefault("drain_timeout", 5.0)
    try:
        service = AgentService(server_bus, agent, replica_id=f"{agent.name}@{replica}", **options)
        async with asyncio.TaskGroup() as tg:
            tg.create_task(service.run())
            try:
                await service.wait_ready(ready_timeout)
                if settle:
                    # A further round trip on the serving connection, beyond
                    # what wait_ready() already makes sure of.
                    await server_bus.flush()
                yield service
            finally:
                service.stop()
    finally:
        await server_bus.close()


async def lease_only(
    store: SessionStore, agent: str, request: dict[str, Any], reply_to: str, session: str = "s"
) -> None:
    """Take a new session's lease for ``request`` (a message as JSON) the
    way ``acquire`` does first, and append nothing: its replica dies
    between the two."""
    await store._leases.take(
        session_key(agent, session),
        {"reply_to": reply_to, "call_id": request["call_id"], "input": request},
        wait=0,
        take_over=False,
        lease_revision=None,
        joins=None,
        what=(agent, session),
    )


async def taken_over(heir: SessionStore, agent: str, session: str = "s") -> Lease:
    """``heir`` takes ``agent``'s ``session`` over from a dead owner, as
    recovery does: against the lease revision found silent."""
    silent = await heir.leases.get(session_key(agent, session))
    return await heir.acquire(
        agent,
        session,
        fresh=AgentState(agent_name=agent),
        take_over=True,
        lease_revision=silent.revision,
    )


async def wait_for_file(directory: Path, pattern: str, timeout: float = 30.0) -> Path:
    """The first file in ``directory`` matching ``pattern``, once one exists."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = sorted(directory.glob(pattern))
        if found:
            return found[0]
        await asyncio.sleep(0.01)
    raise AssertionError(f"no {pattern} in {directory} after {timeout}s")


@dataclass
class Ghost:
    """A replica frozen mid-reply (see :func:`ghost_reply`)."""

    task: asyncio.Task[None]
    dead: asyncio.Event

    async def stop(self) -> None:
        self.dead.set()
        self.task.cancel()
        with contextlib.suppress(BaseException):
            await self.task


async def ghost_reply(
    bus: Bus,
    agent: Agent,
    request: UserRequest,
    reply_to: str,
    *,
    freeze_after: int,
    store: SessionStore | None = None,
    host_points: bool = False,
) -> Ghost:
    """A replica of ``agent`` that takes ``request`` like :class:`AgentService`
    does (the lease, the request recorded with it) and dies after
    ``freeze_after`` saves (0: right after taking the request): it stops
    writing and renewing, like a SIGKILLed process. ``store``: the ghost's
    (one that released the session before takes it back without reading).
    ``host_points``: it writes only the facts a host writes (not the input,
    nor a step's last result), so its saves are a host's fact boundaries."""
    session = request.session_id
    assert session is not None
    if store is None:
        store = await SessionStore.open(bus, owner=f"{agent.name}@ghost", lease_ttl=1.0)
    lease = await store.acquire(
        agent.name,
        session,
        fresh=agent.clone().state,
        reply_to=reply_to,
        pending_input=to_builtins(request),
    )
    saves = 0
    dead = asyncio.Event()
    frozen = asyncio.Event()

    async def checkpoint(state: AgentState) -> None:
        nonlocal saves
        if host_points and state.reply is not None and redoable(state, True):
            return
        if saves >= freeze_after:
            frozen.set()
            await dead.wait()  # set only to end the test: the process is gone
            raise SessionLost("the ghost is gone", agent=agent.name, session_id=session)
        saves += 1
        await store.save(lease, state=state, status="running", input_recorded=True)

    ghost = agent.clone(state=lease.record.state, checkpoint=checkpoint)

    async def run() -> None:
        async for _ in ghost.reply_stream(request, session_id=session):
            pass

    task = asyncio.create_task(run())
    # Let it get as far as it will: to its freeze, to the end of its reply, or
    # (waiting on something, a tool call) for 0.3 s.
    freeze = asyncio.create_task(frozen.wait())
    await asyncio.wait({task, freeze}, timeout=0.3, return_when=asyncio.FIRST_COMPLETED)
    freeze.cancel()
    return Ghost(task, dead)


def reset_tracer_provider() -> None:
    """Forget the process's OpenTelemetry tracer provider (the API lets a
    process set it once; tests set their own)."""
    from opentelemetry import trace
    from opentelemetry.util._once import Once

    trace._TRACER_PROVIDER_SET_ONCE = Once()
    trace._TRACER_PROVIDER = None


async def fleetbus_process(
    *args: str, timeout: float = 90.0, env: dict[str, str] | None = None
) -> tuple[int, str, str]:
    """``fleetbus ARGS`` as a process, run to its end: exit code, stdout, stderr."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "fleetbus",
        *args,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "1000", **(env or {})},
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


@dataclass
class OpenedPage:
    """A page opened in a headless browser, with what it reported while it ran."""

    page: Any
    url: str
    errors: list[str]
    """Uncaught errors and console errors."""
    requests: list[str]
    """Every URL it asked for (the page's own first)."""


async def open_page(browser: Any, url: str) -> OpenedPage:
    """``url`` opened in a new page of ``browser`` (playwright), loaded."""
    page = await browser.new_page(viewport={"width": 1280, "height": 1400})
    opened = OpenedPage(page, url, [], [])
    page.on("pageerror", lambda exc: opened.errors.append(str(exc)))
    page.on("console", lambda m: opened.errors.append(m.text) if m.type == "error" else None)
    page.on("request", lambda request: opened.requests.append(request.url))
    await page.goto(url, wait_until="load")
    return opened


async def charts_drawn(page: Any, min_height: float) -> set[str]:
    """The ids of the page's ``svg.chart`` elements, each checked visible and
    drawn with a size (wider than 300 px, taller than ``min_height``)."""
    from playwright.async_api import expect

    ids = set(await page.locator("svg.chart").evaluate_all("(svgs) => svgs.map((s) => s.id)"))
    for chart_id in sorted(ids):
        chart = page.locator(f"#{chart_id}")
        await chart.scroll_into_view_if_needed()
        await expect(chart).to_be_visible()
        box = await chart.bounding_box()
        assert box is not None
        assert box["width"] > 300, (chart_id, box)
        assert box["height"] > min_height, (chart_id, box)
    return ids


class CutProxy:
    """A TCP proxy to ``host:port`` that can cut its clients off: while cut,
    every connection through it is closed and new ones are closed as they
    come (a client's link down, as its server sees it); :meth:`restore`
    lets them through again.

    Use ``async with CutProxy(host, port) as proxy`` and connect to
    :attr:`url`."""

    def __init__(self, host: str, port: int) -> None:
        self.host = host
        self.port = port
        self.cut_off = False
        self._server: asyncio.Server | None = None
        self._links: set[asyncio.StreamWriter] = set()
        self._pumps: set[asyncio.Task[None]] = set()

    @property
    def url(self) -> str:
        """Where to connect."""
        assert self._server is not None
        return f"nats://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def __aenter__(self) -> CutProxy:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        self.cut()
        for pump in list(self._pumps):
            pump.cancel()
        await asyncio.gather(*self._pumps, return_exceptions=True)
        await self._server.wait_closed()

    def cut(self) -> None:
        """Close every connection through the proxy, and refuse new ones."""
        self.cut_off = True
        for writer in list(self._links):
            writer.close()

    def restore(self) -> None:
        """Let connections through again."""
        self.cut_off = False

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.cut_off:
            writer.close()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(self.host, self.port)
        except OSError:
            writer.close()
            return
        for end in (writer, up_writer):
            self._links.add(end)
        for source, sink in ((reader, up_writer), (up_reader, writer)):
            pump = asyncio.get_running_loop().create_task(self._pump(source, sink))
            self._pumps.add(pump)
            pump.add_done_callback(self._pumps.discard)

    async def _pump(self, source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
        try:
            while data := await source.read(65536):
                if self.cut_off:
                    break
                sink.write(data)
                await sink.drain()
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            self._links.discard(sink)
            sink.close()
