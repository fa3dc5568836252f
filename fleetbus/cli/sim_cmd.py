"""``fleetbus sim``: run a simulation, or serve its agents or tools.

- ``sim run SPEC`` — connects (``--nats``, else an embedded nats-server whose
  JetStream lives in ``OUT/jetstream``), starts ``--hosts`` host processes
  and ``--tool-workers`` tool worker processes, waits until the agents
  answer, runs the rounds with a progress bar, prints a table of the rounds,
  and stops everything it started (at the end, on Ctrl-C, on an error).
  Rerun on the same ``--out`` after a crash: it resumes.
- ``sim report RUN_DIR`` — writes one HTML page of a run's charts
  (``RUN_DIR/report.html``, or ``--out FILE``) and prints its path.
- ``sim host SPEC`` — serves the population (one host; start more, on any
  machine, to share the load).
- ``sim tools SPEC`` — serves the simulation's tools and environment tools.
- ``sim server --state-dir DIR`` — the embedded nats-server of a run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

from fleetbus.bus import Bus, EmbeddedServer
from fleetbus.cli._common import (
    connect,
    console,
    err_console,
    model_options,
    on_stop_signals,
    run,
)
from fleetbus.cli._parsers import add_sim_parser as add_parser
from fleetbus.errors import CallTimeoutError, ConfigError, FleetbusError, NoRespondersError
from fleetbus.protocol import ErrorMessage, Event
from fleetbus.sim import (
    AgentReply,
    PopulationHost,
    RoundSummary,
    RunFiles,
    RunListener,
    RunState,
    Simulation,
    SimulationRunner,
    SimulationToolWorker,
    load_simulation,
)
from fleetbus.sim.processes import (
    Children,
    announce_ready,
    server_threads,
    stop_when_parent_exits,
)
from fleetbus.sim.report import write_report

__all__ = ["add_parser", "cmd"]

PROBE_TIMEOUT = 60.0
"""Seconds ``sim run`` waits for an agent to answer before the first round."""
SIBLINGS_WAIT = 45.0
"""Seconds the server of a runner that died waits for its hosts and workers
to stop before it stops (its tool workers, for its hosts)."""
LOCK_WAIT = 60.0
"""Seconds ``sim server`` waits for the server of a previous run to let go."""


def cmd(args: argparse.Namespace) -> int:
    """Run ``fleetbus sim <subcommand>``."""
    return {
        "run": cmd_run,
        "host": cmd_host,
        "tools": cmd_tools,
        "server": cmd_server,
        "report": cmd_report,
    }[args.sim_command](args)


def _model_environment(args: argparse.Namespace) -> None:
    """``--model`` and the model options into ``FLEETBUS_MODEL*``, for good:
    the spec and the child processes see them."""
    values = {f"FLEETBUS_MODEL_{k.upper()}": str(v) for k, v in model_options(args).items()}
    if getattr(args, "model", None) is not None:
        values["FLEETBUS_MODEL"] = args.model
    os.environ.update(values)


# -- sim run ---------------------------------------------------------------------------


def cmd_run(args: argparse.Namespace) -> int:
    """Run or resume a simulation."""
    _model_environment(args)
    simulation = load_simulation(args.spec, agents=args.agents, rounds=args.rounds)
    out: Path = args.out or Path(f"sim-{simulation.name}")
    files = RunFiles(out)
    files.prepare()
    state = files.load_state()  # a run of another simulation: say so before starting anything
    if state is not None and (
        state.simulation != simulation.name or state.agents != len(simulation.population)
    ):
        raise ConfigError(
            f"{out} holds a run of {state.simulation!r} with {state.agents} agents, not of "
            f"{simulation.name!r} with {len(simulation.population)}: give another --out"
        )
    if state is not None and state.completed >= simulation.rounds:
        _print_rounds(simulation, state, simulation.rounds)
        console.print(f"the run in {out} has finished its {simulation.rounds} rounds")
        return 0
    return run(_run(args, simulation, files))


async def _run(args: argparse.Namespace, simulation: Simulation, files: RunFiles) -> int:
    """Everything ``sim run`` starts, stopped at the end whatever happens;
    Ctrl-C (or SIGTERM) interrupts it at any moment."""
    children = Children(files.out / "logs")
    stop = asyncio.Event()
    on_stop_signals(stop.set)
    try:
        async with asyncio.TaskGroup() as tg:
            work = tg.create_task(_run_with(args, simulation, files, children))
            stopping = tg.create_task(stop.wait())
            await asyncio.wait({work, stopping}, return_when=asyncio.FIRST_COMPLETED)
            stopping.cancel()
            work.cancel()
    except* FleetbusError as group:
        raise group.exceptions[0] from None
    finally:
        with console.status("stopping the processes of the run…"):
            # The hosts first: they finish the replies they run (their
            # drain), whose tool calls need the tool workers and whose ends
            # the server stores; then the tool workers; the server last.
            for kind in ("host-", "tools-"):
                await children.stop(
                    names=[c.name for c in children.children if c.name.startswith(kind)]
                )
            await children.stop()
    if work.cancelled():
        state = files.load_state()
        done = state.completed if state is not None else 0
        err_console.print(f"interrupted after round {done}; run the same command again to resume")
        return 130
    return work.result()


async def _run_with(
    args: argparse.Namespace, simulation: Simulation, files: RunFiles, children: Children
) -> int:
    still = await children.wait_for_previous()
    if still:
        err_console.print(
            f"[yellow]processes of an earlier run in {files.out} still run: "
            f"{', '.join(map(str, still))}[/]"
        )
    url = args.nats
    if url is None:
        jetstream = files.out / "jetstream"
        _, url = await children.start("server", ["sim", "server", "--state-dir", str(jetstream)])
        console.print(f"[dim]nats-server at {url}, JetStream in {jetstream}[/]")
    bus = await connect(url, args.prefix, f"sim-{simulation.name}-runner")
    try:
        await _start_children(args, simulation, children, url, bus.prefix)
        await _wait_for_agents(bus, simulation)
        listener = _ProgressListener()
        runner = SimulationRunner(
            bus,
            simulation,
            files.out,
            deadline=args.deadline,
            concurrency=args.concurrency,
            listener=listener,
        )
        with listener.progress:
            result = await runner.run()
    finally:
        await bus.close()
    _print_rounds(simulation, result.state, runner.rounds)
    if result.resumed_from:
        console.print(f"resumed after round {result.resumed_from}")
    console.print(
        f"{result.state.records:,} records in {files.results}; summary in {files.summary}"
    )
    return 0


async def _start_children(
    args: argparse.Namespace, simulation: Simulation, children: Children, url: str, prefix: str
) -> None:
    """The hosts and tool workers, started at once (hosts wait for the tools)."""
    common = [args.spec, "--nats", url, "--prefix", prefix]
    if args.agents is not None:
        common += ["--agents", str(args.agents)]
    if args.model is not None:
        common += ["--model", args.model]
    starts = [
        children.start(f"tools-{i}", ["sim", "tools", *common, "--worker-id", f"tools-{i}"])
        for i in range(1, args.tool_workers + 1)
    ]
    host_options = ["--concurrency", str(args.host_concurrency)]
    starts += [
        children.start(
            f"host-{i}",
            ["sim", "host", *common, "--replica-id", f"{simulation.name}-host-{i}", *host_options],
        )
        for i in range(1, args.hosts + 1)
    ]
    if not starts:
        return
    with console.status(f"starting {args.hosts} host(s) and {args.tool_workers} tool worker(s)…"):
        await asyncio.gather(*starts)
    pids = ", ".join(f"{c.name} {c.pid}" for c in children.children if c.name != "server")
    console.print(f"[dim]{len(simulation.population)} agents; processes: {pids}[/]")


async def _wait_for_agents(bus: Bus, simulation: Simulation) -> None:
    """Until the first agent answers (a probe it answers with ``malformed``:
    no session, no model call).

    Raises:
        ConfigError: no host answers within ``PROBE_TIMEOUT`` seconds.
    """
    if not len(simulation.population):
        return
    name = simulation.population.name_at(0)
    deadline = time.monotonic() + PROBE_TIMEOUT
    probe = Event(sender=f"sim.{simulation.name}", event="sim_probe")
    while True:
        try:
            answer = await bus.request(bus.subjects.agent_inbox(name), probe, timeout=2.0)
        except (CallTimeoutError, NoRespondersError):
            answer = None
        if isinstance(answer, ErrorMessage):
            return
        if time.monotonic() >= deadline:
            raise ConfigError(
                f"no host serves {name!r} of {simulation.name} on prefix {bus.prefix!r} "
                f"(waited {PROBE_TIMEOUT:g} s); start one with `fleetbus sim host SPEC`"
            )
        await asyncio.sleep(0.2)


class _ProgressListener(RunListener):
    """A progress bar per round: agents answered, errors, late, rate."""

    def __init__(self) -> None:
        self.progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("[red]{task.fields[errors]} errors"),
            TextColumn("[yellow]{task.fields[late]} late"),
            TextColumn("{task.fields[rate]:>7.1f}/s"),
            TimeElapsedColumn(),
            console=console,
        )
        self._task: TaskID | None = None
        self._errors = self._late = self._answered = 0
        self._started = 0.0

    def run_started(self, state: RunState, rounds: int) -> None:
        if state.completed:
            console.print(
                f"resuming {state.simulation} after round {state.completed} of {rounds}",
                highlight=False,
            )

    def round_started(self, round_no: int, rounds: int, agents: int) -> None:
        self._errors = self._late = self._answered = 0
        self._started = time.monotonic()
        self._task = self.progress.add_task(
            f"round {round_no}/{rounds}", total=agents, errors=0, late=0, rate=0.0
        )

    def replied(self, reply: AgentReply) -> None:
        if reply.status in ("ok", "error"):
            self._answered += 1
        if reply.status == "error":
            self._errors += 1
        elif reply.status in ("late", "missing"):
            self._late += 1
        elapsed = max(time.monotonic() - self._started, 1e-6)
        if self._task is not None:
            self.progress.update(
                self._task,
                advance=1,
                errors=self._errors,
                late=self._late,
                rate=self._answered / elapsed,
            )

    def round_finished(self, summary: RoundSummary) -> None:
        if self._task is not None:
            self.progress.update(self._task, completed=summary.agents)


def _print_rounds(simulation: Simulation, state: RunState, rounds: int) -> None:
    table = Table(
        title=f"{simulation.name}: {state.agents:,} agents, {state.completed}/{rounds} rounds"
    )
    for column in ("round", "ok", "errors", "late", "missing", "seconds", "per s"):
        table.add_column(column, justify="right")
    table.add_column("figures (what apply returned)")
    for s in state.rounds:
        table.add_row(
            str(s.round),
            f"{s.ok:,}",
            f"{s.errors:,}",
            f"{s.late:,}",
            f"{s.missing:,}",
            f"{s.duration:.2f}",
            f"{s.rate:,.1f}",
            "  ".join(f"{k}={_show(v)}" for k, v in s.metrics.items()),
        )
    console.print(table)


def _show(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


# -- sim report ------------------------------------------------------------------------


def cmd_report(args: argparse.Namespace) -> int:
    """Write the HTML page of a run's charts; print its path."""
    path = write_report(args.run_dir, args.out)
    console.print(str(path), highlight=False, soft_wrap=True)
    return 0


# -- the serving processes --------------------------------------------------------------


def cmd_host(args: argparse.Namespace) -> int:
    """Serve the population until SIGTERM (or the parent's exit)."""
    _model_environment(args)
    simulation = load_simulation(args.spec, agents=args.agents)

    async def main() -> int:
        bus = await connect(args.nats, args.prefix, args.replica_id)
        try:
            host = PopulationHost(
                bus,
                simulation,
                replica_id=args.replica_id,
                model=args.model,
                concurrency=args.concurrency,
                lease_ttl=args.lease_ttl,
                tool_wait=args.tool_wait,
            )
            what = f"{len(simulation.population)} agents of {simulation.name}"
            await _serve(host, args, f"serving {what} on prefix {bus.prefix}")
        finally:
            await bus.close()
        return 0

    return run(main())


def cmd_tools(args: argparse.Namespace) -> int:
    """Serve the simulation's tools until SIGTERM (or the parent's exit)."""
    simulation = load_simulation(args.spec, agents=args.agents)
    names = ", ".join(simulation.tool_names()) or "no tools"

    async def main() -> int:
        bus = await connect(args.nats, args.prefix, args.worker_id)
        try:
            worker = SimulationToolWorker(
                bus, simulation, worker_id=args.worker_id, concurrency=args.concurrency
            )
            await _serve(worker, args, f"serving {names} on prefix {bus.prefix}", after="host-")
        finally:
            await bus.close()
        return 0

    return run(main())


async def _serve(
    service: PopulationHost | SimulationToolWorker,
    args: argparse.Namespace,
    what: str,
    *,
    after: str | None = None,
) -> None:
    """Run ``service`` until stopped; print the ready line once it serves.

    When the runner dies (``--parent-pipe``), it stops; with ``after``, once
    the run's processes of that kind (``host-``) have stopped first: the
    hosts finish the replies they run, and those call the tool workers.
    """
    on_stop_signals(service.stop)
    if args.parent_pipe:
        if after is None or args.run_logs is None:
            stop_when_parent_exits(service.stop)
        else:
            siblings, waiting = Children(args.run_logs), set[asyncio.Task[None]]()

            async def stop_after() -> None:
                await siblings.wait_for_previous(SIBLINGS_WAIT, kind=after)
                service.stop()

            def parent_gone() -> None:
                task = asyncio.create_task(stop_after())
                waiting.add(task)
                task.add_done_callback(waiting.discard)

            stop_when_parent_exits(parent_gone)

    async def announce() -> None:
        await service.wait_ready(float("inf"))
        err_console.print(what, highlight=False)
        announce_ready()

    try:
        async with asyncio.TaskGroup() as tg:
            announcing = tg.create_task(announce())
            try:
                await service.run()
            finally:
                announcing.cancel()
    except* FleetbusError as group:
        raise group.exceptions[0] from None


SYNC_INTERVAL = 1.0
"""Seconds between the fsyncs of the embedded server of ``fleetbus sim run``."""


def cmd_server(args: argparse.Namespace) -> int:
    """The embedded nats-server of a run, until SIGTERM (or the parent's exit)."""
    state_dir: Path = args.state_dir
    state_dir.mkdir(parents=True, exist_ok=True)

    async def main() -> int:
        stop = asyncio.Event()
        orphaned = asyncio.Event()
        on_stop_signals(stop.set)
        if args.parent_pipe:

            def parent_gone() -> None:
                orphaned.set()
                stop.set()

            stop_when_parent_exits(parent_gone)
        # fsync once a second, not at every write: a run's own resume point is
        # its state file (written atomically on the runner's disk), and
        # writing ahead at every reply of 10,000 agents with an fsync each is
        # what bounds a round (about 900 writes/s on this kind of disk against
        # 11,000 with a periodic flush). An OS crash loses at most the last
        # second of session writes; a killed process loses nothing.
        with EmbeddedServer(
            state_dir=state_dir, sync_interval=SYNC_INTERVAL, threads=server_threads()
        ) as server:
            err_console.print(f"nats-server at {server.url}, JetStream in {state_dir}")
            announce_ready(server.url)
            while not stop.is_set() and server.running:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), 0.5)
            if not server.running:
                raise ConfigError("nats-server exited unexpectedly")
            if orphaned.is_set():
                # The runner died: its hosts and workers stop too; let them
                # drain through the server before it goes.
                logs = Children(args.run_logs or state_dir.parent / "logs")
                await logs.wait_for_previous(SIBLINGS_WAIT)
        return 0

    with _locked(state_dir.with_name(state_dir.name + ".lock")):
        return run(main())


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``path``: one server on a state directory at a
    time (a crashed run's server may still be stopping)."""
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock
        yield
        return
    with path.open("a") as f:
        deadline = time.monotonic() + LOCK_WAIT
        while True:
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise ConfigError(
                        f"another nats-server still uses {path.with_suffix('')} "
                        f"(waited {LOCK_WAIT:g} s)"
                    ) from None
                time.sleep(0.1)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)
