"""Tracing across processes with OpenTelemetry.

One reply is one trace: the W3C ``traceparent`` (and ``tracestate``) travel in
the NATS headers of the messages a reply sends — its tool calls, its model
calls, a request to another agent — so the spans that the tool worker, the
model worker and the other agent make join it. The JSON body and the protocol
version do not change: a client that knows nothing of tracing sends no
headers and gets its answers all the same.

Only ``opentelemetry-api`` is a dependency of fleetbus. Spans are recorded
once an OpenTelemetry SDK tracer provider is installed: by the application,
or by :func:`setup_from_env`, which every ``fleetbus`` command calls and
which follows the standard ``OTEL_*`` environment variables when the
``fleetbus[otel]`` extra is installed (``OTEL_TRACES_EXPORTER``, else
``OTEL_EXPORTER_OTLP_ENDPOINT``/``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``).
Without a provider, every helper here returns at once: tracing costs nothing
when it is off.

Spans (all named ``fleetbus …``), with their attributes:

- ``fleetbus reply`` (agent side): ``fleetbus.agent``, ``fleetbus.session_id``,
  ``fleetbus.call_id`` (the request's), ``fleetbus.reply_id``;
- ``fleetbus step`` for each reasoning step (``fleetbus.step``);
- ``fleetbus model call`` (``fleetbus.model``, ``gen_ai.usage.input_tokens``,
  ``gen_ai.usage.output_tokens``);
- ``fleetbus tool call`` on the agent's side and ``fleetbus tool run`` on the
  worker's (``fleetbus.tool``, ``fleetbus.call_id``, ``fleetbus.worker``);
- ``fleetbus model worker`` on the model worker;
- ``fleetbus session save`` and ``fleetbus session take-over``.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Mapping
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.trace import Status, StatusCode

__all__ = [
    "SpanKind",
    "begin",
    "current",
    "enabled",
    "extract",
    "inject",
    "setup_from_env",
    "span",
]

logger = logging.getLogger(__name__)

SpanKind = trace.SpanKind

_TRACEPARENT = "traceparent"


_UNKNOWN = object()


def enabled() -> bool:
    """Whether spans are recorded (a tracer provider is installed)."""
    # Asked on every request: the API's own lookup (get_tracer_provider) took
    # 0.8 us; its global, read directly when the API still keeps it there,
    # 0.05 us.
    provider = _provider()
    return provider is not None and not isinstance(provider, trace.ProxyTracerProvider)


def _provider() -> trace.TracerProvider | None:
    """The global tracer provider (``None``, or the API's proxy, until one is set)."""
    provider = getattr(trace, "_TRACER_PROVIDER", _UNKNOWN)
    if provider is _UNKNOWN:
        provider = trace.get_tracer_provider()
    return provider  # type: ignore[return-value]


def inject(headers: dict[str, str] | None = None) -> dict[str, str] | None:
    """``headers`` with the current span's ``traceparent`` (and
    ``tracestate``) added, when tracing is on and a span is current; else
    ``headers`` as given."""
    if not enabled():
        return headers
    current = trace.get_current_span().get_span_context()
    if not current.is_valid:
        return headers
    carrier: dict[str, str] = dict(headers or {})
    propagate.inject(carrier)
    return carrier


def extract(headers: Mapping[str, str] | None) -> otel_context.Context | None:
    """The trace context a received message carries in its headers (``None``:
    none, or tracing is off)."""
    if not headers or _TRACEPARENT not in headers or not enabled():
        return None
    return propagate.extract(dict(headers))


@contextlib.contextmanager
def span(
    name: str,
    *,
    kind: trace.SpanKind = trace.SpanKind.INTERNAL,
    parent: otel_context.Context | None = None,
    attributes: Mapping[str, Any] | None = None,
) -> Iterator[trace.Span | None]:
    """A span named ``name`` around the block (a child of ``parent``, a context
    from :func:`extract`, else of the current span); yields the span to add
    attributes to, or ``None`` when tracing is off. An exception escaping the
    block is recorded on the span, which ends with an error status."""
    if not enabled():
        yield None
        return
    clean = {k: v for k, v in (attributes or {}).items() if v is not None}
    started = _tracer().start_span(name, context=parent, kind=kind, attributes=clean)
    # What start_as_current_span does, without its three nested context
    # managers: made current, an escaping exception recorded with an error
    # status, ended.
    token = otel_context.attach(trace.set_span_in_context(started))
    try:
        yield started
    except BaseException as exc:
        if started.is_recording():
            started.record_exception(exc)
            started.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
        raise
    finally:
        otel_context.detach(token)
        started.end()


_cached_tracer: tuple[object, trace.Tracer] | None = None
"""The tracer of the provider it was made from."""


def _tracer() -> trace.Tracer:
    """fleetbus's tracer of the global provider, made once per provider: an SDK
    provider makes a new tracer at every ``get_tracer`` (a quarter of what a
    span cost)."""
    global _cached_tracer
    provider = _provider() or trace.get_tracer_provider()
    cached = _cached_tracer
    if cached is not None and cached[0] is provider:
        return cached[1]
    tracer = provider.get_tracer("fleetbus")
    _cached_tracer = (provider, tracer)
    return tracer


def begin(
    name: str,
    *,
    kind: trace.SpanKind = trace.SpanKind.INTERNAL,
    attributes: Mapping[str, Any] | None = None,
) -> trace.Span | None:
    """A span started now and ended by the caller (``span.end()``), for work
    that outlives a ``with`` block; ``None`` when tracing is off. Make it the
    parent of what a block starts with :func:`current`."""
    if not enabled():
        return None
    clean = {k: v for k, v in (attributes or {}).items() if v is not None}
    return _tracer().start_span(name, kind=kind, attributes=clean)


def current(span: trace.Span | None) -> contextlib.AbstractContextManager[Any]:
    """``span`` as the current span in the block (tasks created there keep it
    as their parent); nothing for ``None``."""
    if span is None:
        return contextlib.nullcontext()
    return trace.use_span(span, end_on_exit=False)


def setup_from_env() -> bool:
    """Install an SDK tracer provider exporting spans as the standard ``OTEL_*``
    variables say, when they ask for it and ``fleetbus[otel]`` is installed;
    whether tracing is on afterwards. A provider installed already is kept.

    ``OTEL_TRACES_EXPORTER``: ``otlp`` (the default when an OTLP endpoint is
    set), ``console``, or ``none``. ``OTEL_SERVICE_NAME`` names the process
    (default: ``fleetbus``); the exporter reads its own variables
    (``OTEL_EXPORTER_OTLP_ENDPOINT``, headers, timeout).
    """
    if enabled():
        return True
    exporter_name = os.environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    endpoint = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get(
        "OTEL_EXPORTER_OTLP_ENDPOINT"
    )
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    if not exporter_name:
        if not endpoint:
            return False
        exporter_name = "otlp"
    if exporter_name == "none":
        return False
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
    except ImportError:
        logger.warning(
            "OTEL_* asks for traces but the OpenTelemetry SDK is not installed: "
            "pip install 'fleetbus[otel]'"
        )
        return False
    exporter: Any
    if exporter_name == "console":
        exporter = ConsoleSpanExporter()
    elif exporter_name == "otlp":
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError:
            logger.warning(
                "OTEL_TRACES_EXPORTER=otlp needs the OTLP exporter: pip install 'fleetbus[otel]'"
            )
            return False
        exporter = OTLPSpanExporter()
    else:
        logger.warning(
            "OTEL_TRACES_EXPORTER=%s is not one fleetbus knows: no traces", exporter_name
        )
        return False
    service = os.environ.get("OTEL_SERVICE_NAME") or "fleetbus"
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    return True
