"""What tracing costs, against the targets users need.

1. **A reply on a 50 ms model** (``reply_model_50ms``): an agent served by
   ``fleetbus agent`` whose model takes 50 ms a call, calling a no-op tool
   that a ``fleetbus worker`` process serves, answering after a second
   model call. Two such fleets run at once, one traced (every process an
   SDK provider, the default parent-based sampler: every reply traced), one
   not; replies are asked one at a time, in blocks taking turns. Reported:
   the median reply time of each and their ratio, and the CPU the agent and
   worker processes spent a reply. Target: traced / untraced <= 1.10.
2. **Tool traffic, sampled** (``tool_calls_in_flight_64``): a client process
   making no-op tool calls with 64 in flight (each under a client span, as
   an agent's tool call is) to a worker process, uvloop in both. Modes, each
   its own client and worker, all up at once, their runs taking turns:

   - ``off``: no provider;
   - ``sampled``: an SDK provider in both processes with
     ``OTEL_TRACES_SAMPLER=parentbased_traceidratio`` and
     ``OTEL_TRACES_SAMPLER_ARG=0.1``, as docs/observability.md recommends
     for tool traffic, each call a trace of its own (a root to decide);
   - ``sampled_8_per_trace``: the same, each 8 calls of a caller in one
     root span, as an agent reply's tool calls are;
   - ``none_sampled``: the same sampler at 0: what a trace not sampled costs;
   - ``all``: every call traced (the default sampler): what sampling saves;
   - ``header``: no provider, every call carrying a fixed, unsampled
     ``traceparent``: what the header alone costs the bus;
   - ``disabled``: no provider and fleetbus's tracing hooks replaced by
     functions that return at once: the request path without its tracing
     code, which ``off`` is measured against.

   Reported: each mode's median calls per second, CPU per call of the
   client, the worker and the server, the spans exported, and the ratios
   to ``off``. Targets: sampled / off >= 0.90; off / disabled: nothing
   measurable (within the runs' noise).

3. **Tool traffic that does work, sampled** (``real_tools_in_flight_64``):
   the same client and worker, 64 in flight, calling a tool that does
   about 1 ms of CPU a call (``cpu_1ms``: JSON round trips and a hash, a
   sync tool, run in a thread as fleetbus runs one) or one that awaits
   5 ms (``io_5ms``, a tool waiting on I/O), each ``off`` and ``sampled``
   (``parentbased_traceidratio`` at 0.1), their runs taking turns.
   Reported as for the no-op tool; target: sampled / off >= 0.90.

Every traced process exports through the SDK's batch span processor to an
exporter that encodes the spans as OTLP and drops them (``bench/_traced.py``).
Prints one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import IO, Any

from fleetbus.bus import Bus, EmbeddedServer, ToolClient
from fleetbus.errors import FleetbusError
from fleetbus.protocol import FinalAnswer, UserRequest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SAMPLED = {"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.1"}
TOOL_MODES: dict[str, dict[str, str]] = {
    "off": {"BENCH_TRACE": "off"},
    "sampled": {"BENCH_TRACE": "on", **SAMPLED},
    "sampled_8_per_trace": {"BENCH_TRACE": "on", "BENCH_CALLS_PER_TRACE": "8", **SAMPLED},
    "all": {"BENCH_TRACE": "on"},
    "header": {"BENCH_TRACE": "header"},
    "none_sampled": {
        "BENCH_TRACE": "on",
        "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
        "OTEL_TRACES_SAMPLER_ARG": "0",
    },
    "disabled": {"BENCH_TRACE": "disabled"},
}

REAL_MODES: dict[str, dict[str, str]] = {
    "off": {"BENCH_TRACE": "off"},
    "sampled": {"BENCH_TRACE": "on", **SAMPLED},
}
"""The modes a tool that does work is measured in."""

REAL_TOOLS = {"cpu_1ms": "work", "io_5ms": "wait"}
"""Tools that do work (``bench/_traced_tools.py``): ~1 ms of CPU (JSON and
a hash, a sync tool), and an await of 5 ms (a tool waiting on I/O)."""


SPANS_FILE = Path(os.environ.get("TMPDIR", "/tmp")) / f"bench-tracing-{os.getpid()}.spans"
"""Where the traced processes write how many spans they exported, at their exit."""


def _env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env["BENCH_SPANS_FILE"] = str(SPANS_FILE)
    return {**env, "PYTHONPATH": str(ROOT), "FLEETBUS_UVLOOP": "1", **extra}


def exported_spans() -> dict[str, int]:
    """Spans exported by each mode's processes since the last call."""
    counts: dict[str, int] = {}
    if SPANS_FILE.exists():
        for line in SPANS_FILE.read_text().splitlines():
            service, count = line.rsplit(" ", 1)
            mode = service.removeprefix("bench-")
            counts[mode] = counts.get(mode, 0) + int(count)
        SPANS_FILE.unlink()
    return counts


@contextmanager
def process(
    command: list[str], env: dict[str, str], *, stdin: bool = False
) -> Iterator[subprocess.Popen[str]]:
    """A child process, stopped (SIGTERM, then SIGKILL) when the block ends."""
    proc = subprocess.Popen(
        command,
        cwd=ROOT,
        env=_env(env),
        stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        yield proc
    finally:
        if proc.stdin is not None:  # a client: its input ends, it exits
            proc.stdin.close()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                pass
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


def cpu_seconds(pid: int) -> float:
    """CPU time (user and system) process ``pid`` has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def worker(url: str, prefix: str, tools: str, in_flight: int) -> list[str]:
    command = [sys.executable, "-m", "fleetbus", "worker", tools, "--nats", url]
    return [*command, "--prefix", prefix, "--concurrency", str(in_flight)]


async def wait_for_tool(bus: Bus, timeout: float = 60.0) -> None:
    client = ToolClient(bus)
    deadline = time.monotonic() + timeout
    while "noop" not in await client.discover(timeout=0.3):
        if time.monotonic() > deadline:
            raise RuntimeError(f"no noop worker on {bus.prefix} within {timeout}s")


async def ask(bus: Bus, session_id: str, timeout: float = 30.0) -> FinalAnswer:
    answer = await bus.request(
        bus.subjects.agent_inbox("replier"),
        UserRequest(content="go", session_id=session_id),
        timeout=timeout,
    )
    if not isinstance(answer, FinalAnswer):
        raise RuntimeError(f"not an answer: {answer!r}")
    return answer


async def wait_for_agent(bus: Bus, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            await ask(bus, f"warm-{uuid.uuid4().hex}", timeout=5.0)
            return
        except (FleetbusError, RuntimeError):
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)


async def measure_reply(url: str, replies: int, block: int, delay: float) -> dict[str, Any]:
    """Replies on a model of ``delay`` seconds a call, traced and not."""
    modes = {"off": {"BENCH_TRACE": "off"}, "on": {"BENCH_TRACE": "on"}}
    buses: dict[str, Bus] = {}
    pids: dict[str, list[int]] = {}
    with ExitStack() as stack:
        for mode, env in modes.items():
            prefix = f"benchreply{mode}"
            env = {**env, "BENCH_MODEL_DELAY": str(delay), "OTEL_SERVICE_NAME": f"bench-{mode}"}
            buses[mode] = await Bus.connect(url, prefix=prefix)
            tools = stack.enter_context(
                process(worker(url, prefix, "bench._traced_tools", 64), env)
            )
            await wait_for_tool(buses[mode])
            agent_cmd = [sys.executable, "-m", "fleetbus", "agent", "bench._traced_agent:agents"]
            agent_cmd += ["--nats", url, "--prefix", prefix]
            agent = stack.enter_context(process(agent_cmd, env))
            pids[mode] = [tools.pid, agent.pid]
        try:
            for bus in buses.values():
                await wait_for_agent(bus)
            times: dict[str, list[float]] = {mode: [] for mode in modes}
            cpu: dict[str, float] = dict.fromkeys(modes, 0.0)
            for _ in range(max(1, replies // block)):
                for mode, bus in buses.items():
                    before = sum(cpu_seconds(pid) for pid in pids[mode])
                    for _ in range(block):
                        started = time.perf_counter()
                        await ask(bus, uuid.uuid4().hex)
                        times[mode].append(time.perf_counter() - started)
                    cpu[mode] += sum(cpu_seconds(pid) for pid in pids[mode]) - before
        finally:
            for bus in buses.values():
                await bus.close()
    spans = exported_spans().get("on", 0)
    median = {mode: statistics.median(values) for mode, values in times.items()}
    cpu_ms = {mode: 1e3 * cpu[mode] / len(times[mode]) for mode in modes}
    return {
        "model_delay_s": delay,
        "model_calls_per_reply": 2,
        "replies_each": len(times["off"]),
        "off_median_ms": round(median["off"] * 1e3, 2),
        "on_median_ms": round(median["on"] * 1e3, 2),
        "on_vs_off_time": round(median["on"] / median["off"], 4),
        "fleet_cpu_ms_per_reply": {mode: round(value, 2) for mode, value in cpu_ms.items()},
        "added_cpu_vs_reply_time": round((cpu_ms["on"] - cpu_ms["off"]) / (median["off"] * 1e3), 4),
        "traced_spans_exported": spans,
    }


def _line(stream: IO[str] | None, timeout: float = 120.0) -> str:
    assert stream is not None
    line = stream.readline()
    if not line:
        raise RuntimeError("a client process stopped")
    return line.strip()


async def measure_tools(
    url: str,
    server_pid: int,
    calls: int,
    in_flight: int,
    repeats: int,
    modes: dict[str, dict[str, str]],
    label: str = "",
) -> dict[str, Any]:
    """Tool calls with ``in_flight`` in flight in each of ``modes`` (the
    environment of its processes), their runs taking turns."""
    rates: dict[str, list[float]] = {mode: [] for mode in modes}
    server_us: dict[str, list[float]] = {mode: [] for mode in modes}
    client_us: dict[str, list[float]] = {mode: [] for mode in modes}
    worker_us: dict[str, list[float]] = {mode: [] for mode in modes}
    with ExitStack() as stack:
        clients: dict[str, subprocess.Popen[str]] = {}
        workers: dict[str, int] = {}
        for mode, env in modes.items():
            prefix = f"benchtools{label}{mode}"
            env = {**env, "OTEL_SERVICE_NAME": f"bench-{mode}"}
            served = stack.enter_context(
                process(worker(url, prefix, "bench._traced_tools", in_flight), env)
            )
            workers[mode] = served.pid
            client_cmd = [sys.executable, str(HERE / "_trace_client.py"), url, prefix]
            clients[mode] = stack.enter_context(
                process([*client_cmd, str(in_flight)], env, stdin=True)
            )
        for mode, client in clients.items():
            ready = await asyncio.to_thread(_line, client.stdout)
            if ready != "ready":
                raise RuntimeError(f"client {mode}: {ready}")
        per = (calls // in_flight) * in_flight
        for _ in range(repeats):
            for mode, client in clients.items():
                assert client.stdin is not None
                before, server_before = cpu_seconds(workers[mode]), cpu_seconds(server_pid)
                client.stdin.write(f"{calls}\n")
                client.stdin.flush()
                rate, cpu = (await asyncio.to_thread(_line, client.stdout)).split()
                worker_us[mode].append((cpu_seconds(workers[mode]) - before) * 1e6 / per)
                server_us[mode].append((cpu_seconds(server_pid) - server_before) * 1e6 / per)
                rates[mode].append(float(rate))
                client_us[mode].append(float(cpu) * 1e6 / per)
    spans = exported_spans()
    median = {mode: statistics.median(values) for mode, values in rates.items()}

    def ratios(mode: str, against: str) -> list[float]:
        return sorted(round(a / b, 3) for a, b in zip(rates[mode], rates[against], strict=True))

    def ratio(mode: str, against: str) -> float | None:
        if mode not in median or against not in median:
            return None
        return round(median[mode] / median[against], 3)

    return {
        "calls_per_run": per,
        "in_flight": in_flight,
        "runs": repeats,
        "spans_exported": {mode: spans.get(mode, 0) for mode in modes},
        "calls_per_s": {mode: round(value, 1) for mode, value in median.items()},
        "client_cpu_us_per_call": {
            mode: round(statistics.median(v), 1) for mode, v in client_us.items()
        },
        "worker_cpu_us_per_call": {
            mode: round(statistics.median(v), 1) for mode, v in worker_us.items()
        },
        "server_cpu_us_per_call": {
            mode: round(statistics.median(v), 1) for mode, v in server_us.items()
        },
        "vs_off": {mode: ratio(mode, "off") for mode in modes if mode != "off"},
        "sampled_vs_off_each_run": ratios("sampled", "off") if "sampled" in modes else None,
        "off_vs_disabled_each_run": ratios("off", "disabled") if "disabled" in modes else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--replies", type=int, default=60, help="replies of each fleet")
    parser.add_argument("--block", type=int, default=10, help="replies a turn")
    parser.add_argument("--model-delay", type=float, default=0.05, help="seconds a model call")
    parser.add_argument("--calls", type=int, default=8000, help="tool calls a run")
    parser.add_argument("--in-flight", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=7, help="tool-call runs of each mode")
    parser.add_argument("--real-calls", type=int, default=2000, help="calls a run of a real tool")
    parser.add_argument("--real-repeats", type=int, default=5, help="runs of each real tool mode")
    parser.add_argument("--parts", default="reply,tools,real", help="what to measure")
    parser.add_argument("--modes", default=",".join(TOOL_MODES), help="tool-call modes")
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    report: dict[str, Any] = {
        "bench": "tracing",
        "cpus": os.cpu_count(),
        "load": round(os.getloadavg()[0], 2),
    }
    targets: dict[str, bool] = {}
    exported_spans()  # none left from an earlier run
    with EmbeddedServer() as server:
        if "reply" in parts:
            reply = asyncio.run(
                measure_reply(server.url, args.replies, args.block, args.model_delay)
            )
            report["reply_model_50ms"] = reply
            targets["reply_traced_le_1.10x"] = reply["on_vs_off_time"] <= 1.10
        if "tools" in parts:
            assert server.pid is not None
            tools = asyncio.run(
                measure_tools(
                    server.url,
                    server.pid,
                    args.calls,
                    args.in_flight,
                    args.repeats,
                    {mode: TOOL_MODES[mode] for mode in args.modes.split(",")},
                )
            )
            report["tool_calls_in_flight_64"] = tools
            sampled = tools["vs_off"].get("sampled")
            if sampled is not None:
                targets["sampled_0.1_ge_0.90x"] = sampled >= 0.90
        if "real" in parts:
            assert server.pid is not None
            real: dict[str, Any] = {}
            for name, tool in REAL_TOOLS.items():
                real[name] = asyncio.run(
                    measure_tools(
                        server.url,
                        server.pid,
                        args.real_calls,
                        args.in_flight,
                        args.real_repeats,
                        {mode: {**env, "BENCH_TOOL": tool} for mode, env in REAL_MODES.items()},
                        label=name.replace("_", ""),
                    )
                )
                targets[f"{name}_sampled_0.1_ge_0.90x"] = real[name]["vs_off"]["sampled"] >= 0.90
            report["real_tools_in_flight_64"] = real
    report["targets_met"] = targets
    print(json.dumps(report, separators=(",", ":")))


if __name__ == "__main__":
    main()
