"""Tracing as a benchmark's child process has it, from ``BENCH_TRACE``.

- ``off`` (or unset): no tracer provider, as a fleet without tracing runs;
- ``on``: an OpenTelemetry SDK provider (the sampler from the standard
  ``OTEL_TRACES_SAMPLER``/``OTEL_TRACES_SAMPLER_ARG``, the default
  parent-based always-on one otherwise) with the SDK's batch span processor,
  as ``fleetbus`` commands install it, in front of an exporter that encodes
  every batch as the OTLP exporter does and drops the bytes (the export's
  CPU is spent, no collector needed; with ``BENCH_SPANS_FILE`` set, the
  process appends its service name and the number of spans it exported to
  that file at its exit);
- ``header``: no provider, and every request carries a fixed, unsampled
  ``traceparent``: what the header alone costs the bus;
- ``disabled``: no provider, and fleetbus's tracing hooks that a request
  passes replaced by functions that return at once: the request path
  without its tracing code, the floor that ``off`` is measured against.
"""

from __future__ import annotations

import atexit
import os
from collections.abc import Sequence
from typing import Any

MODE = os.environ.get("BENCH_TRACE", "off")


def _install() -> None:
    from opentelemetry import trace
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
    from opentelemetry.sdk.trace.export import (
        BatchSpanProcessor,
        SpanExporter,
        SpanExportResult,
    )

    class Encoding(SpanExporter):
        """Encodes spans as OTLP protobuf, as the OTLP exporter does, and drops them."""

        def __init__(self) -> None:
            self.spans = 0
            self.bytes = 0

        def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
            self.spans += len(spans)
            self.bytes += len(encode_spans(spans).SerializePartialToString())
            return SpanExportResult.SUCCESS

        def shutdown(self) -> None:
            pass

    service = os.environ.get("OTEL_SERVICE_NAME", "bench")
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    exporter = Encoding()
    provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    counts = os.environ.get("BENCH_SPANS_FILE")
    if counts:

        def count() -> None:
            provider.force_flush()
            with open(counts, "a", encoding="utf-8") as out:
                out.write(f"{service} {exporter.spans}\n")

        atexit.register(count)


def _disable() -> None:
    from fleetbus import tracing

    def inject(headers: dict[str, str] | None = None) -> dict[str, str] | None:
        return headers

    def extract(headers: Any) -> None:
        return None

    def enabled() -> bool:
        return False

    tracing.inject = inject
    tracing.extract = extract
    tracing.enabled = enabled


def _header_only() -> None:
    from fleetbus import tracing

    fixed = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00"}

    def inject(headers: dict[str, str] | None = None) -> dict[str, str] | None:
        return fixed

    tracing.inject = inject


if MODE == "on":
    _install()
elif MODE == "disabled":
    _disable()
elif MODE == "header":
    _header_only()
elif MODE != "off":
    raise SystemExit(f"BENCH_TRACE={MODE!r}: off, on, header or disabled")
