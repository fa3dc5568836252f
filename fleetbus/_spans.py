"""fleetbus's spans for an OpenTelemetry SDK tracer provider, at a third of
the SDK's cost.

The SDK's ``Tracer.start_span`` and ``Span.end`` took 56 us for a span with
three attributes on a 2-core machine, most of it checking each attribute
through a lock-guarded bounded mapping and building what fleetbus's spans
never use; a tool call records two spans (the caller's, the worker's), and
tracing cost 58-63 % of tool-call throughput. A :class:`Span` here takes 18
us for the same work. It is an SDK ``ReadableSpan`` too, handed to the
provider's span processors as the SDK's spans are, so the provider's
exporters, batching, resource, limits, sampler and id generator apply
unchanged; at its end the span itself is handed over, not a copy (a tenth
of a span's cost).

Used only when the global provider is the SDK's; any other provider gets its
own spans from its own tracer (see :mod:`fleetbus.tracing`).
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Callable, Mapping, Sequence
from time import time_ns
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.trace import (
    Event,
    ReadableSpan,
    SpanLimits,
    SpanProcessor,
    SynchronousMultiSpanProcessor,
)
from opentelemetry.sdk.trace import Tracer as SdkTracer
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
from opentelemetry.sdk.trace.sampling import Decision
from opentelemetry.trace import Link, SpanContext, Status, StatusCode, TraceFlags

__all__ = ["Pipeline", "Span"]

logger = logging.getLogger("fleetbus.tracing")

_RANDOM = getattr(TraceFlags, "RANDOM_TRACE_ID", 0)
_SAMPLED_FLAG = TraceFlags.SAMPLED
_FLAGS = {bits: TraceFlags(bits) for bits in (0, _SAMPLED_FLAG, _RANDOM, _SAMPLED_FLAG | _RANDOM)}
_UNSET = Status(StatusCode.UNSET)
_DEFAULT_SAMPLER = (
    "ParentBased{root:AlwaysOnSampler,remoteParentSampled:AlwaysOnSampler,"
    "remoteParentNotSampled:AlwaysOffSampler,localParentSampled:AlwaysOnSampler,"
    "localParentNotSampled:AlwaysOffSampler}"
)
_PRIMITIVES = (str, bool, int, float)
_SAMPLED = (Decision.RECORD_AND_SAMPLE,)
_RECORDED = (Decision.RECORD_ONLY, Decision.RECORD_AND_SAMPLE)
_DO_NOTHING = frozenset(
    {
        SpanProcessor.on_start,
        SpanProcessor._on_ending,
        BatchSpanProcessor.on_start,
        BatchSpanProcessor._on_ending,
        SimpleSpanProcessor.on_start,
        SimpleSpanProcessor._on_ending,
    }
)
"""The hooks of the SDK's own processors that do nothing (``pass``): not called."""

_Hook = Callable[..., None]
_NOT_READ = object()


class Pipeline:
    """What fleetbus's spans of one SDK tracer go through: the tracer's
    sampler, id generator, limits, resource, scope and span processor, read
    once."""

    __slots__ = (
        "_default",
        "_hooks",
        "_is_enabled",
        "ids",
        "limits",
        "max_length",
        "most",
        "on_ending",
        "processor",
        "random_ids",
        "resource",
        "sample_all",
        "sampler",
        "scope",
        "tracer",
    )

    def __init__(self, tracer: SdkTracer) -> None:
        self.tracer = tracer
        self.sampler = tracer.sampler
        description = self.sampler.get_description()
        # The SDK's default sampler, and AlwaysOn, are not asked (their
        # answer is known: a root or a sampled parent's child is sampled),
        # which was a sixth of an SDK span.
        self.sample_all = description == "AlwaysOnSampler"
        self._default = description == _DEFAULT_SAMPLER
        self.ids = tracer.id_generator
        is_random = getattr(self.ids, "is_trace_id_random", None)
        self.random_ids = bool(is_random()) if is_random is not None else False
        self.limits: SpanLimits = getattr(tracer, "_span_limits", None) or SpanLimits()
        self.most: int | None = self.limits.max_span_attributes
        self.max_length: int | None = getattr(self.limits, "max_span_attribute_length", None)
        self.resource = tracer.resource
        self.scope = getattr(tracer, "_instrumentation_scope", None)
        self.processor = tracer.span_processor
        self.on_ending = getattr(self.processor, "_on_ending", None)
        self._is_enabled: Callable[[], bool] | None = getattr(tracer, "_is_enabled", None)
        self._hooks: tuple[object, tuple[_Hook, ...], tuple[_Hook, ...], tuple[_Hook, ...]] = (
            _NOT_READ,
            (),
            (),
            (),
        )

    def enabled(self) -> bool:
        """Whether the tracer records (an SDK tracer configurator can turn it off)."""
        return self._is_enabled() if self._is_enabled is not None else True

    def hooks(self) -> tuple[tuple[_Hook, ...], tuple[_Hook, ...], tuple[_Hook, ...]]:
        """What a span's start, ending and end call: ``on_start``,
        ``_on_ending`` and ``on_end`` of each of the provider's processors,
        as its (synchronous) multi-processor calls them, less those of the
        SDK's own processors that do nothing; read again when a processor is
        added. Any other kind of multi-processor is called itself."""
        multi = self.processor
        processors = getattr(multi, "_span_processors", None)  # no API lists them
        hooks = self._hooks
        if hooks[0] is processors and processors is not None:
            return hooks[1], hooks[2], hooks[3]
        if type(multi) is SynchronousMultiSpanProcessor and isinstance(processors, tuple):
            starts = tuple(p.on_start for p in processors if type(p).on_start not in _DO_NOTHING)
            endings = tuple(
                p._on_ending for p in processors if type(p)._on_ending not in _DO_NOTHING
            )
            ends = tuple(p.on_end for p in processors)
        else:
            starts, ends = (multi.on_start,), (multi.on_end,)
            endings = (self.on_ending,) if self.on_ending is not None else ()
            processors = None  # asked again each time: nothing says when it changes
        self._hooks = (processors, starts, endings, ends)
        return starts, endings, ends

    def start(
        self,
        name: str,
        parent: otel_context.Context | None,
        kind: trace.SpanKind,
        attributes: Mapping[str, Any] | None,
    ) -> trace.Span:
        """A started span, a child of the span current in ``parent`` (else in
        the current context); a non-recording one when it is not sampled."""
        parent_ctx = trace.get_current_span(parent).get_span_context()
        if not parent_ctx.is_valid:
            parent_span: SpanContext | None = None
            trace_id = self.ids.generate_trace_id()
            random = self.random_ids
        else:
            parent_span = parent_ctx
            trace_id = parent_ctx.trace_id
            random = bool(parent_ctx.trace_flags & _RANDOM)
        most = self.most
        clean = _clean(attributes, most, self.max_length)
        if self.sample_all or (
            self._default and (parent_span is None or parent_ctx.trace_flags.sampled)
        ):
            sampled = recording = True
            trace_state = parent_ctx.trace_state if parent_span is not None else None
        elif self._default:
            sampled = recording = False
            trace_state = parent_ctx.trace_state
        else:
            result = self.sampler.should_sample(parent, trace_id, name, kind, clean, ())
            sampled = result.decision in _SAMPLED
            recording = result.decision in _RECORDED
            trace_state = result.trace_state
            if result.attributes:
                clean = _clean({**clean, **result.attributes}, most, self.max_length)
        flags = _FLAGS[(_SAMPLED_FLAG if sampled else 0) | (_RANDOM if random else 0)]
        context = SpanContext(trace_id, self.ids.generate_span_id(), False, flags, trace_state)
        if not recording:
            return trace.NonRecordingSpan(context)
        span = Span(self, name, context, parent_span, kind, clean)
        # The processors are given it as the SDK gives them its own spans.
        for on_start in self.hooks()[0]:
            on_start(span, parent_context=parent)
        return span


class Span(trace.Span, ReadableSpan):
    """A recording span of a :class:`Pipeline`: the OpenTelemetry API's span
    and the SDK's ``ReadableSpan`` at once, as the SDK's own spans are. It
    is handed to the pipeline's span processors itself when it ends (the SDK
    hands them a copy, which took a tenth of a span's cost): once ended,
    nothing changes it."""

    __slots__ = (
        "_attributes",
        "_context",
        "_end_time",
        "_events",
        "_instrumentation_info",
        "_instrumentation_scope",
        "_kind",
        "_links",
        "_name",
        "_parent",
        "_pipeline",
        "_resource",
        "_start_time",
        "_status",
    )

    def __init__(
        self,
        pipeline: Pipeline,
        name: str,
        context: SpanContext,
        parent: SpanContext | None,
        kind: trace.SpanKind,
        attributes: dict[str, Any],
    ) -> None:
        # What ReadableSpan.__init__ sets, without its keyword arguments.
        self._pipeline = pipeline
        self._name = name
        self._context = context
        self._parent = parent
        self._kind = kind
        self._attributes: dict[str, Any] = attributes
        self._events: Sequence[Event] = ()
        self._links: Sequence[Link] = ()
        self._status = _UNSET
        self._resource = pipeline.resource
        self._instrumentation_scope = pipeline.scope
        self._instrumentation_info = None
        self._end_time: int | None = None
        self._start_time: int | None = time_ns()

    def get_span_context(self) -> SpanContext:
        return self._context  # type: ignore[return-value]  # (always set: ReadableSpan allows None)

    def is_recording(self) -> bool:
        return self._end_time is None

    def set_attribute(self, key: str, value: Any) -> None:
        if self._end_time is not None:
            logger.warning("Setting attribute on ended span.")
            return
        pipeline = self._pipeline
        attributes = self._attributes
        most = pipeline.most
        if most is not None and key not in attributes and len(attributes) >= most:
            return  # the SDK drops what exceeds the limit, too
        if type(value) in _PRIMITIVES and (pipeline.max_length is None or type(value) is not str):
            attributes[key] = value  # what _clean keeps as it is, without a dict to clean
            return
        attributes.update(_clean({key: value}, None, pipeline.max_length))

    def set_attributes(self, attributes: Mapping[str, Any]) -> None:
        for key, value in attributes.items():
            self.set_attribute(key, value)

    def add_event(
        self, name: str, attributes: Mapping[str, Any] | None = None, timestamp: int | None = None
    ) -> None:
        if self._end_time is not None:
            logger.warning("Calling add_event on an ended span.")
            return
        limits = self._pipeline.limits
        events = self._events
        if type(events) is not list:
            events = self._events = []
        if limits.max_events is not None and len(events) >= limits.max_events:
            return
        clean = _clean(attributes, limits.max_event_attributes, self._pipeline.max_length)
        events.append(Event(name, clean, timestamp if timestamp is not None else time_ns()))

    def add_link(self, context: SpanContext, attributes: Mapping[str, Any] | None = None) -> None:
        if self._end_time is not None or context is None or not context.is_valid:
            return
        limits = self._pipeline.limits
        links = self._links
        if type(links) is not list:
            links = self._links = []
        if limits.max_links is not None and len(links) >= limits.max_links:
            return
        clean = _clean(attributes, limits.max_link_attributes, self._pipeline.max_length)
        links.append(Link(context, clean))

    def update_name(self, name: str) -> None:
        if self._end_time is None:
            self._name = name

    def set_status(self, status: Status | StatusCode, description: str | None = None) -> None:
        # As the SDK: OK is final, UNSET is ignored; and an ended span, which
        # its processors hold, stays as it ended.
        if self._status.status_code is StatusCode.OK or self._end_time is not None:
            return
        if isinstance(status, Status):
            if status.status_code is not StatusCode.UNSET:
                self._status = status
        elif status is not StatusCode.UNSET:
            self._status = Status(status, description)

    def record_exception(
        self,
        exception: BaseException,
        attributes: Mapping[str, Any] | None = None,
        timestamp: int | None = None,
        escaped: bool = False,
    ) -> None:
        module = type(exception).__module__
        qualname = type(exception).__qualname__
        recorded: dict[str, Any] = {
            "exception.type": f"{module}.{qualname}"
            if module and module != "builtins"
            else qualname,
            "exception.message": str(exception),
            "exception.stacktrace": "".join(traceback.format_exception(exception)),
            "exception.escaped": str(escaped),
        }
        if attributes:
            recorded.update(attributes)
        self.add_event("exception", recorded, timestamp)

    def end(self, end_time: int | None = None) -> None:
        if self._end_time is not None:
            logger.warning("Calling end() on an ended span.")
            return
        _, endings, ends = self._pipeline.hooks()
        for on_ending in endings:
            on_ending(self)
        self._end_time = end_time if end_time is not None else time_ns()
        if self._events:
            self._events = tuple(self._events)
        if self._links:
            self._links = tuple(self._links)
        for on_end in ends:
            on_end(self)

    def __repr__(self) -> str:
        return f'{type(self).__name__}(name="{self._name}", context={self._context})'


def _clean(
    attributes: Mapping[str, Any] | None, most: int | None, max_length: int | None
) -> dict[str, Any]:
    """``attributes`` as OpenTelemetry keeps them: ``None`` left out, a value
    of another type than str, bool, int, float or a sequence of one of them
    dropped with a warning, sequences made tuples, strings cut at the
    length limit, at most ``most`` of them."""
    clean: dict[str, Any] = {}
    if not attributes:
        return clean
    for key, value in attributes.items():
        if value is None:
            continue
        if most is not None and len(clean) >= most:
            break
        if type(value) in _PRIMITIVES:
            if max_length is not None and type(value) is str and len(value) > max_length:
                value = value[:max_length]
            clean[key] = value
            continue
        value = _sequence(key, value, max_length)
        if value is not None:
            clean[key] = value
    return clean


def _sequence(key: str, value: Any, max_length: int | None) -> tuple[Any, ...] | None:
    if isinstance(value, _PRIMITIVES):  # a subclass: an enum member of str, say
        return value  # type: ignore[return-value]
    if not isinstance(value, Sequence) or isinstance(value, (bytes, bytearray)):
        logger.warning(
            "Invalid type %s for attribute '%s' value: not a str, bool, int, float or a "
            "sequence of one of them",
            type(value).__name__,
            key,
        )
        return None
    kinds = {type(item) for item in value if item is not None}
    if len(kinds) > 1 or not kinds <= set(_PRIMITIVES):
        logger.warning("Invalid sequence for attribute '%s': mixed or unsupported types", key)
        return None
    if max_length is not None and kinds == {str}:
        return tuple(v if v is None else v[:max_length] for v in value)
    return tuple(value)
