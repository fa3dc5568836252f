"""``fleetbus demo``: tool calls spread over worker processes, then an agent
fleet, live.

An embedded nats-server, N worker processes serving the built-in tools, and
a burst of calculator calls with a progress bar, then a table of calls per
worker, throughput, latency and failures. Then an agent with two replica
processes holds a conversation: it uses the tools, observes a broadcast, and
pauses for a confirmation that the demo grants (see ``demo_agents``).
Everything it starts, it stops.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

from fleetbus.bus import Bus, EmbeddedServer, ToolClient
from fleetbus.cli._common import console
from fleetbus.errors import FleetbusError

__all__ = ["run_demo"]

_OPS = ("+", "-", "*")


def _expression(rng: random.Random) -> tuple[str, int]:
    a, b, c = rng.randint(1, 999), rng.randint(1, 999), rng.randint(1, 99)
    op1, op2 = rng.choice(_OPS), rng.choice(_OPS)
    expr = f"({a} {op1} {b}) {op2} {c}"
    return expr, _eval_reference(a, op1, b, op2, c)


def _eval_reference(a: int, op1: str, b: int, op2: str, c: int) -> int:
    def apply(x: int, op: str, y: int) -> int:
        return x + y if op == "+" else x - y if op == "-" else x * y

    return apply(apply(a, op1, b), op2, c)


async def _start_workers(url: str, count: int, run_dir: Path) -> list[asyncio.subprocess.Process]:
    env = {**os.environ, "FLEETBUS_FILES_ROOT": str(run_dir / "workspace")}
    env.pop("FLEETBUS_PREFIX", None)
    procs = []
    for i in range(1, count + 1):
        log = (run_dir / f"worker-{i}.log").open("wb")
        procs.append(
            await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "fleetbus",
                "worker",
                "fleetbus.tools_workers.builtin",
                "--nats",
                url,
                "--worker-id",
                f"demo-worker-{i}",
                stdin=asyncio.subprocess.DEVNULL,
                stdout=log,
                stderr=asyncio.subprocess.STDOUT,
                env=env,
            )
        )
        log.close()
    return procs


async def _stop_workers(procs: list[asyncio.subprocess.Process]) -> None:
    for proc in procs:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            await asyncio.wait_for(proc.wait(), 15)
        except TimeoutError:
            proc.kill()
            await proc.wait()


async def _wait_for_workers(client: ToolClient, count: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        tools = await client.discover(timeout=0.3)
        calc = tools.get("calculator")
        if calc is not None and calc.workers >= count:
            return
    raise FleetbusError(f"{count} workers did not come up within {timeout:g}s")


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.2f} ms"


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def run_demo(
    *, calls: int = 2000, workers: int = 2, in_flight: int = 64, agents: bool = True
) -> int:
    """Run the demo; returns the exit code (0 when every call succeeded).

    ``calls``, ``workers`` and ``in_flight`` are at least 1 (``fleetbus demo``
    parses them so)."""
    with tempfile.TemporaryDirectory(prefix="fleetbus-demo-") as tmp, EmbeddedServer() as server:
        run_dir = Path(tmp)
        console.rule("[bold]fleetbus demo: distributed tool calls")
        console.print(f"embedded nats-server (JetStream) on [bold]{server.url}[/]")
        procs = await _start_workers(server.url, workers, run_dir)
        bus: Bus | None = None
        try:
            bus = await Bus.connect(server.url, name="demo-client")
            client = ToolClient(bus, timeout=10.0)
            with console.status(f"starting {workers} worker processes…"):
                await _wait_for_workers(client, workers)
            pids = ", ".join(str(p.pid) for p in procs)
            console.print(
                f"{workers} worker processes up (pids {pids}), queue group tool.calculator"
            )
            burst = await _burst(client, calls, in_flight)
            if not agents:
                return burst
            from fleetbus.cli.demo_agents import converse_with_fleet

            fleet = await converse_with_fleet(bus, server.url, run_dir)
            return burst or fleet
        finally:
            if bus is not None:
                await bus.close()
            with console.status("stopping workers (draining)…"):
                await _stop_workers(procs)
            codes = [p.returncode for p in procs]
            console.print(f"workers stopped (exit codes {codes}); stopping nats-server")


async def _burst(client: ToolClient, calls: int, in_flight: int) -> int:
    rng = random.Random(2026)
    jobs = [_expression(rng) for _ in range(calls)]
    latencies: list[float] = []
    per_worker: Counter[str] = Counter()
    failures: list[str] = []
    limiter = asyncio.Semaphore(in_flight)
    progress = Progress(
        TextColumn("calculator calls"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[rate]:>8} calls/s"),
        TimeElapsedColumn(),
        console=console,
    )

    async def one(expr: str, expected: int, task_id: TaskID) -> None:
        async with limiter:
            started = time.perf_counter()
            try:
                result = await client.call("calculator", {"expr": expr})
            except FleetbusError as exc:
                failures.append(f"{expr}: {exc}")
            else:
                latencies.append(time.perf_counter() - started)
                per_worker[result.sender] += 1
                if not result.ok:
                    detail = result.error_detail.message if result.error_detail else result.status
                    failures.append(f"{expr}: {detail}")
                elif result.content != expected:
                    failures.append(f"{expr}: got {result.content!r}, expected {expected}")
            done = len(latencies) + len(failures)
            rate = done / max(time.perf_counter() - t0, 1e-9)
            progress.update(task_id, advance=1, rate=f"{rate:,.0f}")

    with progress:
        task_id = progress.add_task("calls", total=calls, rate="0")
        t0 = time.perf_counter()
        async with asyncio.TaskGroup() as tg:
            for expr, expected in jobs:
                tg.create_task(one(expr, expected, task_id))
        elapsed = time.perf_counter() - t0

    table = Table(title=f"{calls:,} calculator calls, {in_flight} in flight")
    table.add_column("worker", style="bold")
    table.add_column("calls", justify="right")
    table.add_column("share", justify="right")
    for worker_id, count in sorted(per_worker.items()):
        table.add_row(worker_id, f"{count:,}", f"{count / calls:.0%}")
    console.print(table)
    summary = Table(show_header=False, box=None)
    summary.add_row("throughput", f"{calls / elapsed:,.0f} calls/s")
    summary.add_row("latency p50", _ms(statistics.median(latencies) if latencies else 0.0))
    summary.add_row("latency p99", _ms(_percentile(latencies, 0.99)))
    summary.add_row("failures", f"[{'red' if failures else 'green'}]{len(failures)}[/]")
    console.print(summary)
    for line in failures[:5]:
        console.print(f"  [red]{line}[/]", highlight=False)
    return 1 if failures else 0
