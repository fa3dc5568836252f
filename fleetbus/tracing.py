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
when it is off. With the SDK's provider, fleetbus makes its spans itself, at
a third of the SDK's cost, and hands them to the provider's processors as
the SDK's spans are (:mod:`fleetbus._spans`); any other provider makes its
own.

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
import re
from collections.abc import Mapping
from types import TracebackType
from typing import TYPE_CHECKING, Any

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.baggage.propagation import W3CBaggagePropagator
from opentelemetry.propagators.composite import CompositePropagator
from opentelemetry.trace import SpanContext, Status, StatusCode, TraceFlags
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from fleetbus import _version

if TYPE_CHECKING:
    from fleetbus._spans import Pipeline

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
_TRACESTATE = "tracestate"
_BAGGAGE = "baggage"


_UNKNOWN = object()


def enabled() -> bool:
    """Whether spans are recorded (a tracer provider is installed)."""
    # Asked several times on every request: the API's own lookup
    # (get_tracer_provider) took 0.8 us, and telling its proxy from a provider
    # (an ABC's isinstance) 0.5 us; the answer kept for the provider it was
    # found for, 0.1 us.
    global _enabled_for
    provider = _provider()
    if provider is None:  # never set: off, at the cost of one global read
        return False
    cached = _enabled_for
    if cached[0] is provider:
        return cached[1]
    on = provider is not None and not isinstance(provider, trace.ProxyTracerProvider)
    _enabled_for = (provider, on)
    return on


_enabled_for: tuple[object, bool] = (_UNKNOWN, False)
"""The last provider :func:`enabled` saw, and its answer."""


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
    if _w3c_only() and _TRACESTATE not in headers and _BAGGAGE not in headers:
        match = _PLAIN_TRACEPARENT.fullmatch(headers[_TRACEPARENT])
        if match is not None:  # what the propagator reads from it, in half the time
            trace_id, span_id = int(match[1], 16), int(match[2], 16)
            if not trace_id or not span_id:
                return otel_context.Context()
            remote = SpanContext(trace_id, span_id, True, TraceFlags(int(match[3], 16)))
            return trace.set_span_in_context(trace.NonRecordingSpan(remote), otel_context.Context())
    return propagate.extract(dict(headers))


_PLAIN_TRACEPARENT = re.compile("00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")
"""A version-00 ``traceparent`` with nothing around it (anything else is the
propagator's to read)."""

_w3c_textmap: tuple[object, bool] | None = None


def _w3c_only() -> bool:
    """Whether the global propagator is OpenTelemetry's default (W3C trace
    context and baggage): then :func:`extract` reads a plain ``traceparent``
    itself. (:func:`inject` always writes through the propagator: doing it
    by hand saved 0.4 of 7.7 us.)"""
    global _w3c_textmap
    textmap = propagate.get_global_textmap()
    cached = _w3c_textmap
    if cached is not None and cached[0] is textmap:
        return cached[1]
    parts = getattr(textmap, "_propagators", None)  # no API says what a composite holds
    kinds = [type(part) for part in parts] if isinstance(parts, (list, tuple)) else []
    plain = isinstance(textmap, CompositePropagator) and TraceContextTextMapPropagator in kinds
    plain = plain and all(k in (TraceContextTextMapPropagator, W3CBaggagePropagator) for k in kinds)
    _w3c_textmap = (textmap, plain)
    return plain


class _Block:
    """The context manager of :func:`span` when tracing is on: a class, not a
    generator, as it runs around every traced request."""

    __slots__ = ("_attributes", "_kind", "_name", "_parent", "_span", "_token")

    def __init__(
        self,
        name: str,
        kind: trace.SpanKind,
        parent: otel_context.Context | None,
        attributes: Mapping[str, Any] | None,
    ) -> None:
        self._name = name
        self._kind = kind
        self._parent = parent
        self._attributes = attributes

    def __enter__(self) -> trace.Span:
        started = _start(self._name, self._kind, self._parent, self._attributes)
        self._span = started
        self._token = otel_context.attach(trace.set_span_in_context(started))
        return started

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        started = self._span
        # What start_as_current_span does: an escaping exception recorded with
        # an error status, made current no more, ended.
        if exc is not None and started.is_recording():
            started.record_exception(exc)
            started.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
        otel_context.detach(self._token)
        started.end()


_OFF = contextlib.nullcontext()


def span(
    name: str,
    *,
    kind: trace.SpanKind = trace.SpanKind.INTERNAL,
    parent: otel_context.Context | None = None,
    attributes: Mapping[str, Any] | None = None,
) -> contextlib.AbstractContextManager[Any]:
    """A span named ``name`` around the block (a child of ``parent``, a context
    from :func:`extract`, else of the current span); yields the span to add
    attributes to, or ``None`` when tracing is off. An exception escaping the
    block is recorded on the span, which ends with an error status."""
    if not enabled():
        return _OFF
    return _Block(name, kind, parent, attributes)


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
    return _start(name, kind, None, attributes)


def current(span: trace.Span | None) -> contextlib.AbstractContextManager[Any]:
    """``span`` as the current span in the block (tasks created there keep it
    as their parent); nothing for ``None``."""
    if span is None:
        return contextlib.nullcontext()
    return trace.use_span(span, end_on_exit=False)


def _start(
    name: str,
    kind: trace.SpanKind,
    parent: otel_context.Context | None,
    attributes: Mapping[str, Any] | None,
) -> trace.Span:
    """A span started through the global provider: fleetbus's own spans for
    the SDK's provider (a third of the SDK's cost, the same spans exported:
    :mod:`fleetbus._spans`), the provider's tracer's for any other."""
    tracer, pipeline = _tracer()
    if pipeline is not None:
        if pipeline.enabled():
            return pipeline.start(name, parent, kind, attributes)
        return trace.NonRecordingSpan(trace.get_current_span(parent).get_span_context())
    clean = {k: v for k, v in (attributes or {}).items() if v is not None}
    return tracer.start_span(name, context=parent, kind=kind, attributes=clean)


_cached_tracer: tuple[object, trace.Tracer, Pipeline | None] | None = None
"""The tracer of the provider it was made from, with its pipeline when it is
the SDK's."""


def _tracer() -> tuple[trace.Tracer, Pipeline | None]:
    """fleetbus's tracer of the global provider, made once per provider (an SDK
    provider makes a new tracer at every ``get_tracer``), and the pipeline
    fleetbus's spans go through when the provider is the SDK's."""
    global _cached_tracer
    provider = _provider() or trace.get_tracer_provider()
    cached = _cached_tracer
    if cached is not None and cached[0] is provider:
        return cached[1], cached[2]
    tracer = provider.get_tracer("fleetbus", _version.__version__)
    pipeline = None
    if type(tracer).__module__.startswith("opentelemetry.sdk."):
        from fleetbus._spans import Pipeline

        try:
            pipeline = Pipeline(tracer)  # type: ignore[arg-type]
        except AttributeError as exc:  # an SDK this does not know: its own spans
            logger.debug("fleetbus spans go through the SDK's tracer: %s", exc)
    _cached_tracer = (provider, tracer, pipeline)
    return tracer, pipeline


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
