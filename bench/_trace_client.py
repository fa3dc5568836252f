"""A tool-calling client process of ``bench/tracing.py``, tracing as
``BENCH_TRACE`` says (:mod:`bench._traced`).

Usage: ``_trace_client.py URL PREFIX IN_FLIGHT``. It prints ``ready`` once
the tool answers (``BENCH_TOOL``, else the no-op tool), then for each line
``N`` read from its input makes ``N`` calls with ``IN_FLIGHT`` in flight,
each under a client span as an agent's tool call is, and prints the calls
per second and its CPU seconds.
With ``BENCH_CALLS_PER_TRACE=K``, each ``K`` calls of a caller are made in
one root span, as the tool calls of an agent's reply are; else each call is
a trace of its own.
"""

from __future__ import annotations

import asyncio
import importlib
import os
import sys
import time

import uvloop

from fleetbus import tracing
from fleetbus.bus import Bus, ToolClient

importlib.import_module("bench._traced")  # tracing as BENCH_TRACE says, before any request


TOOL = os.environ.get("BENCH_TOOL", "noop")
"""The tool called (one of ``bench/_traced_tools.py``'s)."""


async def main(url: str, prefix: str, in_flight: int) -> None:
    bus = await Bus.connect(url, prefix=prefix)
    client = ToolClient(bus, attempts=1)
    count = 0

    async def call() -> None:
        nonlocal count
        count += 1
        attributes = {"fleetbus.tool": TOOL, "fleetbus.call_id": f"bench-{count}"}
        with tracing.span(
            "fleetbus tool call", kind=tracing.SpanKind.CLIENT, attributes=attributes
        ) as span:
            result = await client.call(TOOL, {})
            if span is not None:
                span.set_attribute("fleetbus.tool_status", result.status)
        if not result.ok:
            raise RuntimeError(f"tool call failed: {result.error_detail}")

    per_trace = int(os.environ.get("BENCH_CALLS_PER_TRACE", "1"))

    async def caller(count: int) -> None:
        if per_trace <= 1:  # each call a trace of its own
            for _ in range(count):
                await call()
            return
        for start in range(0, count, per_trace):  # a reply's calls: one trace
            with tracing.span("fleetbus reply"):
                for _ in range(min(per_trace, count - start)):
                    await call()

    deadline = time.monotonic() + 60
    while TOOL not in await client.discover(timeout=0.3):
        if time.monotonic() > deadline:
            raise SystemExit(f"no {TOOL} tool")
    await asyncio.gather(*(caller(20) for _ in range(in_flight)))  # warm up
    print("ready", flush=True)
    loop = asyncio.get_running_loop()
    try:
        while line := await loop.run_in_executor(None, sys.stdin.readline):
            per = max(1, int(line) // in_flight)
            cpu, started = time.process_time(), time.perf_counter()
            await asyncio.gather(*(caller(per) for _ in range(in_flight)))
            rate = per * in_flight / (time.perf_counter() - started)
            print(f"{rate:.1f} {time.process_time() - cpu:.4f}", flush=True)
    finally:
        await bus.close()


if __name__ == "__main__":
    uvloop.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
