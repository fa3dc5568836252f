"""The tool calls ``bench/tracing_instructions.py`` counts: one process, an
embedded nats-server (not counted: a process of its own), a ``ToolWorker``
serving the no-op tool and a ``ToolClient`` calling it, one call at a time,
each under a client span as an agent's tool call is; tracing as
``BENCH_TRACE`` says (:mod:`bench._traced`, the sampler from ``OTEL_*``).

Usage: ``_traced_calls.py N``: 100 calls to warm up, then ``N``.
"""

from __future__ import annotations

import asyncio
import importlib
import os
import sys

from fleetbus import tracing
from fleetbus.bus import Bus, EmbeddedServer, ToolClient
from fleetbus.tools_workers import Toolkit, ToolWorker

importlib.import_module("bench._traced")  # tracing as BENCH_TRACE says, before any request
_tools = importlib.import_module("bench._traced_tools")


async def main(calls: int) -> None:
    with EmbeddedServer() as server:
        worker_bus = await Bus.connect(server.url, prefix="counted")
        client_bus = await Bus.connect(server.url, prefix="counted")
        toolkit: Toolkit = _tools.toolkit
        worker = ToolWorker(worker_bus, toolkit, worker_id="counted")
        client = ToolClient(client_bus, attempts=1)
        attributes = {"fleetbus.tool": "noop", "fleetbus.call_id": "counted-1"}

        async def call() -> None:
            with tracing.span(
                "fleetbus tool call", kind=tracing.SpanKind.CLIENT, attributes=attributes
            ) as span:
                result = await client.call("noop", {})
                if span is not None:
                    span.set_attribute("fleetbus.tool_status", result.status)
            if not result.ok:
                raise RuntimeError(f"tool call failed: {result.error_detail}")

        async with asyncio.TaskGroup() as tg:
            serving = tg.create_task(worker.run())
            await worker.wait_ready()
            for _ in range(100):
                await call()
            for _ in range(calls):
                await call()
            worker.stop()
            await serving
        await worker_bus.close()
        await client_bus.close()


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1])))
    os._exit(0)  # no exporter's thread to wait for
