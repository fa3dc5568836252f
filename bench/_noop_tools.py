"""The no-op tool the benchmarks serve with ``fleetbus worker``.

With ``BENCH_TRACING=1`` the worker process records its spans, as a traced
fleet's would, in an in-memory exporter behind the SDK's batch processor (the
one ``fleetbus`` commands install), or its simple one with
``BENCH_SPANS=simple`` (``bench/tool_calls.py`` measures what tracing costs).
"""

from __future__ import annotations

import os

from fleetbus.tools_workers import Toolkit, tool

if os.environ.get("BENCH_TRACING") == "1":
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    _provider = TracerProvider()
    _processor = (
        SimpleSpanProcessor if os.environ.get("BENCH_SPANS") == "simple" else BatchSpanProcessor
    )
    _provider.add_span_processor(_processor(InMemorySpanExporter()))
    trace.set_tracer_provider(_provider)


@tool
async def noop() -> None:
    """Do nothing."""


toolkit = Toolkit([noop])
