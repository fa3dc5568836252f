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
``fleetbus[otel]`` extra is installed (those fleetbus reads itself are
:class:`TracingSettings`).
Without a provider, every helper here returns at once: tracing costs nothing
measurable when it is off. Spans are made by the provider's own tracer,
through the OpenTelemetry API only; in a trace that the provider's
parent-based sampler does not sample, no span is made at all (the parent's
context is carried on), so sampling at the root saves the spans' cost in
every process (docs/observability.md has the figures). A serve loop
decides it once per request, from the sampled bit of the ``traceparent``
flags (:func:`carry_unsampled`), and makes no span block at all.

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
import re
from collections.abc import Mapping
from importlib import metadata
from types import TracebackType
from typing import Any

from opentelemetry import baggage, propagate, trace
from opentelemetry import context as otel_context
from opentelemetry.baggage.propagation import W3CBaggagePropagator
from opentelemetry.propagators.composite import CompositePropagator
from opentelemetry.trace import SpanContext, Status, StatusCode, TraceFlags
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from pydantic import field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from fleetbus import _version

__all__ = [
    "SpanKind",
    "TracingSettings",
    "begin",
    "carry_unsampled",
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


class TracingSettings(BaseSettings):
    """The standard OpenTelemetry variables fleetbus reads itself (an empty
    variable is as if unset); the SDK and its exporter read the others
    (``OTEL_EXPORTER_OTLP_HEADERS``, ``OTEL_TRACES_SAMPLER`` …)."""

    model_config = SettingsConfigDict(
        env_prefix="OTEL_", env_ignore_empty=True, extra="ignore", frozen=True
    )

    traces_exporter: str = ""
    """``OTEL_TRACES_EXPORTER``: ``otlp``, ``console`` or ``none`` (any case);
    unset: ``otlp`` when an OTLP endpoint is set, else no traces."""
    exporter_otlp_traces_endpoint: str = ""
    """``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``: where the OTLP exporter sends spans."""
    exporter_otlp_endpoint: str = ""
    """``OTEL_EXPORTER_OTLP_ENDPOINT``: the OTLP endpoint of every signal."""
    sdk_disabled: bool = False
    """``OTEL_SDK_DISABLED``: ``true`` (any case) turns :func:`setup_from_env`
    off; any other value leaves it on, as the specification says."""
    service_name: str = "fleetbus"
    """``OTEL_SERVICE_NAME``: the process's ``service.name``."""
    python_tracer_provider: str | None = None
    """``OTEL_PYTHON_TRACER_PROVIDER``: a tracer provider the API loads by
    entry point on first use (fleetbus then asks the API for it, read at
    import)."""

    @field_validator("traces_exporter", mode="before")
    @classmethod
    def _lower(cls, value: Any) -> Any:
        return value.strip().lower() if isinstance(value, str) else value

    @field_validator("sdk_disabled", mode="before")
    @classmethod
    def _true(cls, value: Any) -> Any:
        return value.strip().lower() == "true" if isinstance(value, str) else value


# The one seam into opentelemetry-api's private names, written for
# opentelemetry-api 1.25 to 1.45 (tests/unit/test_tracing_seam.py checks
# what it reads, against the installed version). It reads two:
# - ``opentelemetry.trace._TRACER_PROVIDER``, the global provider (None
#   until one is set): "off" in one global read. The public
#   ``get_tracer_provider()`` asks ``os.environ`` on every call while none
#   is set (nine times the global read), and a request asks twice.
# - ``CompositePropagator._propagators``, what the global propagator is made
#   of: when it is OpenTelemetry's default, a plain ``traceparent`` is read
#   here, in half the propagator's time a request received, and written
#   here too.
# Checked once, at import: when either is missing, one warning, and fleetbus
# goes through the public API.


def _check_seam() -> bool:
    """Whether the private names the seam reads are there (else warn once)."""
    provider_there = hasattr(trace, "_TRACER_PROVIDER")
    parts = getattr(CompositePropagator([]), "_propagators", None)
    if provider_there and isinstance(parts, list | tuple):
        return True
    try:
        version = metadata.version("opentelemetry-api")
    except metadata.PackageNotFoundError:
        version = "unknown"
    logger.warning(
        "opentelemetry-api %s lacks what fleetbus's tracing reads to be cheap "
        "(written for 1.25 to 1.45): going through its public API",
        version,
    )
    return False


_SEAM = _check_seam()
_DIRECT = _SEAM and TracingSettings().python_tracer_provider is None
"""Whether the global provider is read directly (a provider named in the
environment is loaded by the API's ``get_tracer_provider()`` on first use:
then only that asks)."""


def _provider() -> trace.TracerProvider | None:
    """The global tracer provider (``None``, or the API's proxy, until one is set)."""
    return trace._TRACER_PROVIDER if _DIRECT else trace.get_tracer_provider()


def _propagator_parts(textmap: object) -> list[object] | None:
    """The propagators a composite propagator is made of (``None``: not known)."""
    parts = getattr(textmap, "_propagators", None) if _SEAM else None
    return list(parts) if isinstance(parts, list | tuple) else None


_UNKNOWN = object()


def enabled() -> bool:
    """Whether spans are recorded (a tracer provider is installed)."""
    # Asked several times on every request: telling the API's proxy from a
    # provider is an ABC's isinstance, so the answer is kept for the
    # provider it was found for.
    global _enabled_for
    provider = trace._TRACER_PROVIDER if _DIRECT else trace.get_tracer_provider()
    if provider is None:  # never set: off, at the cost of one global read
        return False
    cached = _enabled_for
    if cached[0] is provider:
        return cached[1]
    on = not isinstance(provider, trace.ProxyTracerProvider)
    _enabled_for = (provider, on)
    return on


_enabled_for: tuple[object, bool] = (_UNKNOWN, False)
"""The last provider :func:`enabled` saw, and its answer."""


def inject(headers: dict[str, str] | None = None) -> dict[str, str] | None:
    """``headers`` with the current span's ``traceparent`` (and
    ``tracestate``) added, when tracing is on and a span is current; else
    ``headers`` as given."""
    # The first test alone when tracing is off: a function call less on
    # every request.
    if (_DIRECT and trace._TRACER_PROVIDER is None) or not enabled():
        return headers
    context = otel_context.get_current()  # read once, for the span and the baggage
    span = trace.get_current_span(context)
    traceparent: str | None
    if type(span) is _CarriedSpan:
        # A request's, in a trace not sampled: its header goes on as it came.
        traceparent = span.traceparent
    else:
        current = span.get_span_context()
        if not current.is_valid:
            return headers
        traceparent = None if current.trace_state else _traceparent(current)
    if traceparent is not None and _w3c_only() and not baggage.get_all(context):
        # What the default propagator writes (a traceparent alone), without
        # asking the context for the span again and the baggage propagator
        # for none.
        if headers is None:
            return {_TRACEPARENT: traceparent}
        carrier = dict(headers)
        carrier[_TRACEPARENT] = traceparent
        return carrier
    carrier = dict(headers or {})
    propagate.inject(carrier, context)
    return carrier


def _traceparent(context: SpanContext) -> str:
    """The ``traceparent`` of ``context``, written once for the span context
    it was last written for (the calls made in one span, and a request
    carried on in a trace not sampled, all write the same)."""
    global _last_written
    last = _last_written
    if last[0] is context:
        return last[1]
    flags = context.trace_flags
    # The ids as bytes in hex: a third of what formatting the ints takes.
    trace_id, span_id = context.trace_id.to_bytes(16).hex(), context.span_id.to_bytes(8).hex()
    written = f"00-{trace_id}-{span_id}-{_FLAGS_HEX[flags] if flags < 256 else f'{flags:02x}'}"
    _last_written = (context, written)
    return written


_FLAGS_HEX = [f"{flags:02x}" for flags in range(256)]
"""Trace flags as the ``traceparent`` writes them."""


_last_written: tuple[object, str] = (_UNKNOWN, "")
"""The span context :func:`_traceparent` wrote last, and what it wrote."""


def carry_unsampled(headers: Mapping[str, str]) -> bool:
    """Whether ``headers`` carry a trace that is not sampled, read from the
    sampled bit of a plain ``traceparent``'s flags, under a provider whose
    sampler follows the parent (the default, and every ``parentbased_*``):
    then no span is to be made for the request, and its trace's context is
    made current here, for good: call this only from a task of the request's
    own, whose context ends with it (a serve loop's). The requests sent from
    there carry the same ``traceparent`` on (flags and all), and log lines
    carry its trace id. ``False``, with nothing changed, in any other case
    (tracing off, no ``traceparent``, a sampled one, a ``tracestate`` or
    baggage to read, another sampler or propagator): :func:`extract` and
    :func:`span` read those."""
    if (_DIRECT and trace._TRACER_PROVIDER is None) or not enabled():
        return False
    traceparent = headers.get(_TRACEPARENT)
    if (
        traceparent is None
        or traceparent[-1:] not in _UNSAMPLED_LAST_DIGITS  # sampled: read as it was
        or _TRACESTATE in headers
        or _BAGGAGE in headers
        or not _w3c_only()
        or not _follows_parent()
    ):
        return False
    global _last_carried
    last = _last_carried
    if last[0] == traceparent:
        carried = last[1]
    else:
        if _UNSAMPLED_TRACEPARENT.fullmatch(traceparent) is None:
            return False
        carried = _CarriedSpan(traceparent)
        _last_carried = (traceparent, carried)
    # Made current as a span started here would be (on the current context);
    # never detached: the context is the request's task's own.
    otel_context.attach(trace.set_span_in_context(carried))
    return True


class _CarriedSpan(trace.NonRecordingSpan):
    """The span of a trace not sampled, carried on from a request: a
    ``NonRecordingSpan`` whose context is read from the ``traceparent`` only
    when it is asked for (a request that logs nothing and makes none reads
    nothing more: a third of what reading it costs)."""

    def __init__(self, traceparent: str) -> None:  # the base's context is never read
        self.traceparent = traceparent
        """The ``traceparent`` it came in (plain: as the propagator writes it)."""
        self._read: SpanContext | None = None

    def get_span_context(self) -> SpanContext:
        read = self._read
        if read is None:
            carried = self.traceparent
            flags = TraceFlags(int(carried[53:55], 16))
            read = SpanContext(int(carried[3:35], 16), int(carried[36:52], 16), True, flags)
            self._read = read
        return read

    def __repr__(self) -> str:
        return f"NonRecordingSpan({self.get_span_context()!r})"


_UNSAMPLED_TRACEPARENT = re.compile(
    "00-(?!0{32})[0-9a-f]{32}-(?!0{16})[0-9a-f]{16}-[0-9a-f][02468ace]"
)
"""A valid version-00 ``traceparent`` (no all-zero id) with nothing around it,
of a trace not sampled (the low bit of its flags, the sampled flag, clear)."""

_UNSAMPLED_LAST_DIGITS = frozenset("02468ace")
"""The last hex digit of the flags of a trace not sampled."""

_last_carried: tuple[str, trace.Span] = ("", trace.INVALID_SPAN)
"""The ``traceparent`` :func:`carry_unsampled` read last, and the span it
carries on (the requests of one span in the caller all carry the same)."""


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
    itself."""
    global _w3c_textmap
    textmap = propagate.get_global_textmap()
    cached = _w3c_textmap
    if cached is not None and cached[0] is textmap:
        return cached[1]
    parts = _propagator_parts(textmap)
    kinds = [type(part) for part in parts] if parts is not None else []
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
        parent = self._parent
        here = otel_context.get_current()  # read once: for the parent, and to add the span to
        unsampled = _unsampled_parent(here if parent is None else parent)
        if unsampled is not None:
            # No span: the parent's span stays current (made current, if it
            # came from a request, as a started span is), and the block gets
            # a span that records nothing.
            self._span = unsampled
            self._token = (
                otel_context.attach(trace.set_span_in_context(unsampled, here))
                if parent is not None
                else None
            )
            return unsampled
        clean = _clean(self._attributes)
        started = _tracer().start_span(
            self._name, here if parent is None else parent, self._kind, clean
        )
        self._span = started
        self._token = otel_context.attach(trace.set_span_in_context(started, here))
        return started

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        started = self._span
        token = self._token
        if token is not None:
            otel_context.detach(token)
        if isinstance(started, trace.NonRecordingSpan):
            return
        # What start_as_current_span does: an escaping exception recorded with
        # an error status, made current no more, ended.
        if exc is not None and started.is_recording():
            started.record_exception(exc)
            started.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
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
    block is recorded on the span, which ends with an error status.

    In a trace that is not sampled, under a parent-based sampler (the SDK's
    default, and ``parentbased_traceidratio``), no span is made: the block
    gets a span that records nothing, and the parent's context stays the
    current one, so the requests made in the block carry it on."""
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
    unsampled = _unsampled_parent(None)
    if unsampled is not None:
        return unsampled
    return _tracer().start_span(name, None, kind, _clean(attributes))


def current(span: trace.Span | None) -> contextlib.AbstractContextManager[Any]:
    """``span`` as the current span in the block (tasks created there keep it
    as their parent); nothing for ``None``."""
    if span is None:
        return contextlib.nullcontext()
    return trace.use_span(span, end_on_exit=False)


def _clean(attributes: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    """``attributes`` without those that are ``None`` (OpenTelemetry warns of
    them): as given when none is (the SDK copies what a span keeps)."""
    if not attributes:
        return None
    if None not in attributes.values():
        return attributes
    return {k: v for k, v in attributes.items() if v is not None}


_PARENT_DECIDES = (
    ",remoteParentSampled:AlwaysOnSampler,remoteParentNotSampled:AlwaysOffSampler,"
    "localParentSampled:AlwaysOnSampler,localParentNotSampled:AlwaysOffSampler}"
)
"""How the SDK describes a parent-based sampler that follows the parent's
decision (whatever it decides for a root): the default one, and those
``OTEL_TRACES_SAMPLER=parentbased_*`` configures."""


def _unsampled_parent(parent: otel_context.Context | None) -> trace.Span | None:
    """A span that records nothing, in the context of the span current in
    ``parent`` (else in the current context), when that span is of a trace
    not sampled and the provider's sampler follows the parent: its child
    would not be sampled either, and the SDK would make a span that records
    nothing. ``None`` otherwise."""
    current = trace.get_current_span(parent)
    if type(current) is _CarriedSpan:  # a request's, not sampled (nothing to read)
        return current if _follows_parent() else None
    context = current.get_span_context()
    if context.trace_flags.sampled or not context.is_valid or not _follows_parent():
        return None
    return (
        current if isinstance(current, trace.NonRecordingSpan) else trace.NonRecordingSpan(context)
    )


_follows_parent_for: tuple[object, bool] = (_UNKNOWN, False)
"""The provider :func:`_follows_parent` last answered for, and its answer."""


def _follows_parent() -> bool:
    """Whether the provider's sampler is the SDK's parent-based one, never
    sampling a child of a parent not sampled (read through the SDK's public
    ``TracerProvider.sampler`` and the sampler's description)."""
    global _follows_parent_for
    provider = _provider()
    cached = _follows_parent_for
    if cached[0] is provider:
        return cached[1]
    sampler = getattr(provider, "sampler", None)
    follows = False
    if sampler is not None:
        try:
            from opentelemetry.sdk.trace.sampling import ParentBased
        except ImportError:  # a sampler that is not the SDK's: asked for every span
            pass
        else:
            if isinstance(sampler, ParentBased):
                description: str = sampler.get_description()  # type: ignore[no-untyped-call]
                follows = description.endswith(_PARENT_DECIDES)
    _follows_parent_for = (provider, follows)
    return follows


_cached_tracer: tuple[object, trace.Tracer] | None = None
"""The tracer of the provider it was made from."""


def _tracer() -> trace.Tracer:
    """fleetbus's tracer of the global provider, made once per provider (an SDK
    provider makes a new tracer at every ``get_tracer``)."""
    global _cached_tracer
    provider = _provider() or trace.get_tracer_provider()
    cached = _cached_tracer
    if cached is not None and cached[0] is provider:
        return cached[1]
    tracer = provider.get_tracer("fleetbus", _version.__version__)
    _cached_tracer = (provider, tracer)
    return tracer


def setup_from_env() -> bool:
    """Install an SDK tracer provider exporting spans as the standard ``OTEL_*``
    variables say, when they ask for it and ``fleetbus[otel]`` is installed;
    whether tracing is on afterwards. A provider installed already is kept.

    The variables are :class:`TracingSettings`; the exporter reads its own
    too (the OTLP endpoint, headers, timeout).
    """
    if enabled():
        return True
    settings = TracingSettings()
    exporter_name = settings.traces_exporter
    endpoint = settings.exporter_otlp_traces_endpoint or settings.exporter_otlp_endpoint
    if settings.sdk_disabled:
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
    provider = TracerProvider(resource=Resource.create({"service.name": settings.service_name}))
    provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    return True
