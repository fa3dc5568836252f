"""Tool-call speed: fleetbus against raw nats-py request/reply, in one run.

Both sides answer from another process over the same embedded nats-server:
raw nats-py with a trivial responder, fleetbus with a worker process serving
a no-op tool. Measured: sequential latency (p50/p99) and throughput with 64
calls in flight (the median of seven runs), for 1 and 2 responders, each
with the standard event loop and with uvloop (client and responders
alike). Both kinds of responder are up at once and the runs of the two
take turns, so the machine's changing load falls on both.

Then, with uvloop, one responder and 64 in flight: what a ``traceparent``
header alone costs (raw nats-py and fleetbus, each call with and without
one, no span made, the server's CPU per call beside), and fleetbus with
tracing off, then on (an OpenTelemetry SDK provider with an in-memory
exporter in this process and in the worker).

Prints one JSON line. Targets: fleetbus throughput >= 0.8x raw,
p50 <= 1.3x raw. (Tracing every no-op call is reported, not targeted:
``bench/tracing.py`` measures tracing against its targets.)
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
from collections.abc import Awaitable, Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import nats

from fleetbus.bus import Bus, EmbeddedServer, ToolClient
from fleetbus.protocol import ToolCall, encode

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RAW_SUBJECT = "bench.raw"


@contextmanager
def processes(commands: list[list[str]], env: dict[str, str]) -> Iterator[None]:
    procs = [
        subprocess.Popen(
            cmd,
            cwd=ROOT,
            env={**os.environ, **env, "PYTHONPATH": str(ROOT)},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for cmd in commands
    ]
    try:
        yield
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()


async def wait_until(check: Callable[[], Awaitable[bool]], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await check():
            return
        await asyncio.sleep(0.05)
    raise RuntimeError("responders did not come up in time")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def sequential(
    calls: Mapping[str, Callable[[], Awaitable[object]]], n: int, block: int = 200
) -> dict[str, dict[str, float]]:
    """Latency of one call at a time, p50 and p99 over ``n`` calls of each
    of ``calls``, made in blocks of ``block`` taking turns (so a change in
    the machine's load falls on both sides)."""
    for call in calls.values():  # warm up
        for _ in range(min(block, n)):
            await call()
    latencies: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(max(1, n // block)):
        for name, call in calls.items():
            for _ in range(block):
                started = time.perf_counter()
                await call()
                latencies[name].append(time.perf_counter() - started)
    return {
        name: {
            "p50_us": round(statistics.median(values) * 1e6, 1),
            "p99_us": round(percentile(values, 0.99) * 1e6, 1),
        }
        for name, values in latencies.items()
    }


async def throughput(
    calls: Mapping[str, Callable[[], Awaitable[object]]],
    n: int,
    in_flight: int,
    repeats: int,
    *,
    warm: bool = True,
) -> dict[str, float]:
    """Calls per second of each of ``calls`` with ``in_flight`` concurrent
    callers: the median of ``repeats`` runs of ``n`` calls, the runs of the
    calls taking turns (this machine is shared: its load moves from one
    second to the next, and falls on both sides so)."""

    async def worker(call: Callable[[], Awaitable[object]], count: int) -> None:
        for _ in range(count):
            await call()

    per = n // in_flight
    for call in calls.values() if warm else ():
        await asyncio.gather(*(worker(call, max(1, per // 10)) for _ in range(in_flight)))
    rates: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            started = time.perf_counter()
            await asyncio.gather(*(worker(call, per) for _ in range(in_flight)))
            rates[name].append(per * in_flight / (time.perf_counter() - started))
    return {name: round(statistics.median(values), 1) for name, values in rates.items()}


async def measure(
    url: str, loop_kind: str, n_seq: int, n_tp: int, in_flight: int, repeats: int
) -> dict[str, Any]:
    env = {"FLEETBUS_UVLOOP": "1" if loop_kind == "uvloop" else "0"}
    raw_cmd = [sys.executable, str(HERE / "_raw_responder.py"), url, RAW_SUBJECT]
    if loop_kind == "uvloop":
        raw_cmd.append("uvloop")
    prefix = f"bench{loop_kind}"
    worker_cmd = [
        sys.executable,
        "-m",
        "fleetbus",
        "worker",
        "bench._noop_tools",
        "--nats",
        url,
        "--prefix",
        prefix,
        "--concurrency",
        str(in_flight),
    ]
    nc = await nats.connect(url)
    bus = await Bus.connect(url, prefix=prefix)
    client = ToolClient(bus, attempts=1)
    # The raw side sends a payload of the same size as a fleetbus tool_call.
    payload = encode(ToolCall(tool_name="noop", call_id="x" * 32, sender=bus.client_name))

    async def raw_call() -> object:
        return await nc.request(RAW_SUBJECT, payload, timeout=10)

    async def fleet_call() -> object:
        result = await client.call("noop", {})
        if not result.ok:
            raise RuntimeError(f"tool call failed: {result.error_detail}")
        return result

    calls = {"raw": raw_call, "fleetbus": fleet_call}
    results: dict[str, Any] = {}
    try:
        for responders in (1, 2):
            # Both kinds of responder are up at once, the idle kind idle: the
            # runs of the two take turns.
            with processes([raw_cmd] * responders + [worker_cmd] * responders, env):

                async def up(count: int = responders) -> bool:
                    try:
                        await nc.request(RAW_SUBJECT, payload, timeout=1)
                    except nats.errors.Error:
                        return False
                    tools = await client.discover(timeout=0.3)
                    return "noop" in tools and tools["noop"].workers >= count

                await wait_until(up)
                await asyncio.sleep(0.5)  # let every raw responder subscribe
                if responders == 1:
                    seq = await sequential(calls, n_seq)
                    results["sequential"] = {
                        "raw": seq["raw"],
                        "fleetbus": seq["fleetbus"],
                        "p50_ratio": round(seq["fleetbus"]["p50_us"] / seq["raw"]["p50_us"], 3),
                        "p99_ratio": round(seq["fleetbus"]["p99_us"] / seq["raw"]["p99_us"], 3),
                    }
                rates = await throughput(calls, n_tp, in_flight, repeats)
            results[f"in_flight_{in_flight}_workers_{responders}"] = {
                "raw_calls_per_s": rates["raw"],
                "fleetbus_calls_per_s": rates["fleetbus"],
                "throughput_ratio": round(rates["fleetbus"] / rates["raw"], 3),
            }
    finally:
        await bus.close()
        await nc.close()
    return results


async def measure_tracing(
    url: str, n_tp: int, in_flight: int, repeats: int, spans: str
) -> dict[str, Any]:
    """Throughput with 64 in flight and one worker, tracing off then on (an
    SDK provider with an in-memory exporter here and in the worker, behind
    the SDK's batch span processor, as ``fleetbus`` commands install it, or
    its simple one; each call made under a span as an agent's tool call is):
    what tracing costs."""
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from fleetbus import tracing

    prefix = "benchtracing"
    worker_cmd = [sys.executable, "-m", "fleetbus", "worker", "bench._noop_tools"]
    worker_cmd += ["--nats", url, "--prefix", prefix, "--concurrency", str(in_flight)]
    bus = await Bus.connect(url, prefix=prefix)
    client = ToolClient(bus, attempts=1)

    async def call() -> object:
        with tracing.span("bench call"):
            result = await client.call("noop", {})
        if not result.ok:
            raise RuntimeError(f"tool call failed: {result.error_detail}")
        return result

    async def up() -> bool:
        tools = await client.discover(timeout=0.3)
        return "noop" in tools

    rates: dict[str, float] = {}
    exporter = InMemorySpanExporter()
    try:
        for mode in ("off", "on"):
            if mode == "on":
                provider = TracerProvider()
                processor = SimpleSpanProcessor if spans == "simple" else BatchSpanProcessor
                provider.add_span_processor(processor(exporter))
                trace.set_tracer_provider(provider)
            env = {"FLEETBUS_UVLOOP": "1", "BENCH_TRACING": "1" if mode == "on" else "0"}
            env["BENCH_SPANS"] = spans
            with processes([worker_cmd], env):
                await wait_until(up)
                rates[mode] = (await throughput({mode: call}, n_tp, in_flight, repeats))[mode]
    finally:
        await bus.close()
        if rates.get("on") is not None:
            trace.get_tracer_provider().force_flush()  # type: ignore[attr-defined]
    return {
        "span_processor": spans,
        "off_calls_per_s": rates["off"],
        "on_calls_per_s": rates["on"],
        "on_vs_off": round(rates["on"] / rates["off"], 3),
        "client_spans_recorded": len(exporter.get_finished_spans()),
    }


TRACEPARENT = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
"""The header a traced call carries (a fixed one: no span is made for it)."""


def cpu_seconds(pid: int) -> float:
    """CPU time (user and system) process ``pid`` has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def measure_header(
    url: str, server_pid: int, n_tp: int, in_flight: int, repeats: int
) -> dict[str, Any]:
    """What carrying the trace context in a NATS header costs, with no span
    anywhere: throughput with 64 in flight and one responder, each call
    sent without a header and with a fixed ``traceparent`` (the runs of the
    two alternate, in the same processes), for raw nats-py and for fleetbus
    (tracing off in both processes; ``fleetbus.tracing.inject`` replaced for
    the run by a function returning the fixed header, so every tool call
    carries it). The server's CPU per call is measured beside each: the
    header's cost that no client code can save. This is the floor under
    what tracing can cost."""
    from fleetbus import tracing

    raw_cmd = [sys.executable, str(HERE / "_raw_responder.py"), url, RAW_SUBJECT, "uvloop"]
    prefix = "benchheader"
    worker_cmd = [sys.executable, "-m", "fleetbus", "worker", "bench._noop_tools"]
    worker_cmd += ["--nats", url, "--prefix", prefix, "--concurrency", str(in_flight)]
    env = {"FLEETBUS_UVLOOP": "1", "BENCH_TRACING": "0"}
    nc = await nats.connect(url)
    bus = await Bus.connect(url, prefix=prefix)
    client = ToolClient(bus, attempts=1)
    payload = encode(ToolCall(tool_name="noop", call_id="x" * 32, sender=bus.client_name))
    injected = tracing.inject
    header: dict[str, dict[str, str] | None] = {"now": None}

    async def raw_call() -> object:
        return await nc.request(RAW_SUBJECT, payload, timeout=10, headers=header["now"])

    async def fleet_call() -> object:
        result = await client.call("noop", {})
        if not result.ok:
            raise RuntimeError(f"tool call failed: {result.error_detail}")
        return result

    async def raw_up() -> bool:
        try:
            await nc.request(RAW_SUBJECT, payload, timeout=1)
        except nats.errors.Error:
            return False
        return True

    async def fleet_up() -> bool:
        return "noop" in await client.discover(timeout=0.3)

    async def alternate(call: Callable[[], Awaitable[object]]) -> dict[str, Any]:
        rates: dict[str, list[float]] = {"plain": [], "header": []}
        server_us: dict[str, list[float]] = {"plain": [], "header": []}
        await throughput({"warm-up": call}, n_tp // 10, in_flight, 1, warm=False)
        for _ in range(repeats):
            for mode in ("plain", "header"):
                header["now"] = TRACEPARENT if mode == "header" else None
                before = cpu_seconds(server_pid)
                rate = (await throughput({mode: call}, n_tp, in_flight, 1, warm=False))[mode]
                calls = (n_tp // in_flight) * in_flight
                server_us[mode].append((cpu_seconds(server_pid) - before) * 1e6 / calls)
                rates[mode].append(rate)
        plain, with_header = statistics.median(rates["plain"]), statistics.median(rates["header"])
        return {
            "plain_calls_per_s": round(plain, 1),
            "header_calls_per_s": round(with_header, 1),
            "header_vs_plain": round(with_header / plain, 3),
            "server_cpu_us_per_call": {
                mode: round(statistics.median(values), 1) for mode, values in server_us.items()
            },
        }

    # Only the header this run sets: no span, no provider.
    tracing.inject = lambda headers=None: header["now"]
    try:
        with processes([raw_cmd], env):
            await wait_until(raw_up)
            raw = await alternate(raw_call)
        with processes([worker_cmd], env):
            await wait_until(fleet_up)
            fleet = await alternate(fleet_call)
    finally:
        tracing.inject = injected
        await bus.close()
        await nc.close()
    return {"raw_nats_py": raw, "fleetbus": fleet}


def run_loop(kind: str, url: str, args: argparse.Namespace) -> dict[str, Any]:
    coro = measure(url, kind, args.sequential, args.calls, args.in_flight, args.repeats)
    if kind == "uvloop":
        import uvloop

        return uvloop.run(coro)
    return asyncio.run(coro)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sequential", type=int, default=2000, help="sequential calls")
    parser.add_argument("--calls", type=int, default=10000, help="calls per throughput run")
    parser.add_argument("--in-flight", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=7, help="throughput runs (median)")
    parser.add_argument("--loops", default="asyncio,uvloop", help="event loops to measure")
    parser.add_argument("--no-tracing", action="store_true", help="skip the tracing run")
    parser.add_argument(
        "--spans",
        choices=("batch", "simple"),
        default="batch",
        help="the SDK span processor of the tracing run (default: batch, as fleetbus installs)",
    )
    args = parser.parse_args()
    report: dict[str, Any] = {"bench": "tool_calls", "cpus": os.cpu_count()}
    with EmbeddedServer() as server:
        for kind in args.loops.split(","):
            report[kind] = run_loop(kind, server.url, args)
        if not args.no_tracing:
            import uvloop

            assert server.pid is not None
            report["trace_header_uvloop_in_flight_64"] = uvloop.run(
                measure_header(server.url, server.pid, args.calls, args.in_flight, args.repeats)
            )
            report["tracing_uvloop_in_flight_64"] = uvloop.run(
                measure_tracing(server.url, args.calls, args.in_flight, args.repeats, args.spans)
            )
    targets = report.get("uvloop") or report["asyncio"]
    report["targets_met"] = {
        "throughput_ge_0.8x_raw": all(
            v["throughput_ratio"] >= 0.8 for k, v in targets.items() if k.startswith("in_flight")
        ),
        "p50_le_1.3x_raw": targets["sequential"]["p50_ratio"] <= 1.3,
    }
    print(json.dumps(report, separators=(",", ":")))


if __name__ == "__main__":
    main()
