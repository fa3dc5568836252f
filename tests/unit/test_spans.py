"""fleetbus's spans are the provider's own (made through the OpenTelemetry
API only): what fleetbus's blocks record is what the SDK's
``start_as_current_span`` records; the provider's sampler, limits and
processors apply; no span is made in a trace that a parent-based sampler
does not sample; and the W3C headers fleetbus reads itself are read as the
propagator reads them."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
from opentelemetry import baggage, propagate, trace
from opentelemetry import context as otel_context
from opentelemetry.propagators.composite import CompositePropagator
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanLimits, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace import Span as SdkSpan
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import (
    ALWAYS_OFF,
    Decision,
    ParentBased,
    Sampler,
    SamplingResult,
    TraceIdRatioBased,
)
from opentelemetry.trace import Link, SpanContext, StatusCode, TraceFlags, TraceState
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from fleetbus import tracing
from tests.helpers import reset_tracer_provider


def install(**provider_args: Any) -> InMemorySpanExporter:
    reset_tracer_provider()
    exporter = InMemorySpanExporter()
    provider = TracerProvider(**provider_args)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    return exporter


@pytest.fixture(autouse=True)
def _no_provider_after() -> Iterator[None]:
    yield
    reset_tracer_provider()


def scenario(start: Any) -> None:
    """The same spans made through ``start(name, attributes)`` (a context
    manager making the span current): attributes of every kind, an event,
    a link, a status, a renamed span, an exception escaping a child."""
    link = SpanContext(0xABC, 0xDEF, is_remote=True, trace_flags=TraceFlags(1))
    with start("outer", {"s": "x", "i": 3, "f": 0.5, "b": True, "l": ["a", "b"]}) as outer:
        outer.set_attribute("later", 7)
        outer.set_attributes({"n": [1, 2]})
        outer.add_event("checkpoint", {"k": "v"}, timestamp=123)
        outer.add_link(link, {"why": "because"})
        outer.set_status(StatusCode.OK)
        outer.set_status(StatusCode.ERROR, "ignored: OK is final")
        outer.update_name("outer renamed")

        def fail() -> None:
            with start("inner", {"call": "c-1"}) as inner:
                inner.record_exception(ValueError("noted"), {"extra": 1}, timestamp=456)
                raise KeyError("gone")

        with pytest.raises(KeyError):
            fail()


def comparable(span: ReadableSpan) -> dict[str, Any]:
    events = [
        (e.name, {k: v for k, v in (e.attributes or {}).items() if k != "exception.stacktrace"})
        for e in span.events
    ]
    return {
        "name": span.name,
        "kind": span.kind,
        "attributes": dict(span.attributes or {}),
        "events": events,
        "links": [(link.context, dict(link.attributes or {})) for link in span.links],
        "status": (span.status.status_code, span.status.description),
        "has_parent": span.parent is not None,
        "sampled": span.context.trace_flags.sampled,
        "resource": dict(span.resource.attributes),
        "scope": span.instrumentation_scope.name if span.instrumentation_scope else None,
        "ended_after_start": (span.end_time or 0) >= (span.start_time or 0) > 0,
    }


def test_fleetbus_spans_export_what_the_sdk_spans_export() -> None:
    resource = Resource.create({"service.name": "spans-test"})
    exporter = install(resource=resource)
    assert tracing.enabled()

    def ours(name: str, attributes: dict[str, Any]) -> Any:
        return tracing.span(name, attributes=attributes)

    scenario(ours)
    theirs_tracer = trace.get_tracer_provider().get_tracer("fleetbus", "0.1.0")

    def theirs(name: str, attributes: dict[str, Any]) -> Any:
        return theirs_tracer.start_as_current_span(name, attributes=attributes)

    scenario(theirs)
    finished = exporter.get_finished_spans()
    assert len(finished) == 4
    ours_inner, ours_outer, sdk_inner, sdk_outer = finished
    for mine, reference in ((ours_outer, sdk_outer), (ours_inner, sdk_inner)):
        assert comparable(mine) == comparable(reference)
    assert ours_inner.parent is not None
    assert ours_inner.parent.span_id == ours_outer.context.span_id
    assert ours_inner.context.trace_id == ours_outer.context.trace_id
    assert ours_inner.status.description == "KeyError: 'gone'"
    stack = ours_inner.events[-1].attributes
    assert stack is not None
    assert "KeyError" in str(stack["exception.stacktrace"])


def test_attributes_follow_the_providers_limits_and_types(caplog: pytest.LogCaptureFixture) -> None:
    limits = SpanLimits(max_span_attributes=3, max_span_attribute_length=4, max_events=1)
    exporter = install(span_limits=limits)
    sdk_tracer = trace.get_tracer_provider().get_tracer("fleetbus", "0.1.0")

    def fill(span: Any) -> None:
        span.set_attribute("bad", {"a": "dict"})
        span.set_attribute("mixed", [1, "a"])
        span.set_attribute("c", 1)
        span.set_attribute("d", 2)  # the fourth: over the limit
        span.set_attribute("a", "replaced")
        span.add_event("first")
        span.add_event("second")  # over the limit of events

    attributes = {"a": "abcdefgh", "b": ["long-one", "x"], "none": None}
    with caplog.at_level(logging.WARNING), tracing.span("limited", attributes=attributes) as ours:
        fill(ours)
    del attributes["none"]  # fleetbus leaves None out, which the SDK warns of
    with sdk_tracer.start_as_current_span("limited", attributes=attributes) as theirs:
        fill(theirs)
    mine, reference = exporter.get_finished_spans()
    assert dict(mine.attributes or {}) == dict(reference.attributes or {})
    assert len(mine.attributes or {}) == 3
    assert (mine.attributes or {})["a"] == "repl"
    assert [e.name for e in mine.events] == [e.name for e in reference.events]
    assert len(mine.events) == 1
    assert "bad" not in (mine.attributes or {})
    assert "None" not in caplog.text


def test_an_ended_span_takes_nothing_more_and_ends_once(caplog: pytest.LogCaptureFixture) -> None:
    exporter = install()
    span = tracing.begin("once", attributes={"k": "v"})
    assert span is not None
    assert span.is_recording()
    span.end()
    assert not span.is_recording()
    with caplog.at_level(logging.WARNING):
        span.set_attribute("late", 1)
        span.end()
    (finished,) = exporter.get_finished_spans()
    assert dict(finished.attributes or {}) == {"k": "v"}
    assert "Calling end() on an ended span." in caplog.text


def test_an_unsampling_sampler_records_nothing_and_still_propagates() -> None:
    exporter = install(sampler=ALWAYS_OFF)
    with tracing.span("dropped") as span:
        assert span is not None
        assert not span.is_recording()
        headers = tracing.inject(None)
    assert exporter.get_finished_spans() == ()
    assert headers is not None
    assert not int(headers["traceparent"][-2:], 16) & TraceFlags.SAMPLED


def test_a_remote_parent_decides_under_the_default_sampler() -> None:
    exporter = install()
    unsampled = {"traceparent": f"00-{'1' * 32}-{'2' * 16}-00"}
    sampled = {"traceparent": f"00-{'3' * 32}-{'4' * 16}-01"}
    with tracing.span("child of unsampled", parent=tracing.extract(unsampled)) as span:
        assert span is not None
        assert not span.is_recording()
    with tracing.span("child of sampled", parent=tracing.extract(sampled)):
        pass
    (finished,) = exporter.get_finished_spans()
    assert finished.name == "child of sampled"
    assert finished.parent is not None
    assert finished.parent.is_remote
    assert (finished.context.trace_id, finished.parent.span_id) == (
        int("3" * 32, 16),
        int("4" * 16, 16),
    )


class Tagging(Sampler):
    """Samples the spans named ``keep …``, adding an attribute and a trace state."""

    def should_sample(
        self,
        parent_context: otel_context.Context | None,
        trace_id: int,
        name: str,
        kind: trace.SpanKind | None = None,
        attributes: Any = None,
        links: Sequence[Link] | None = None,
        trace_state: TraceState | None = None,
    ) -> SamplingResult:
        if not name.startswith("keep"):
            return SamplingResult(Decision.DROP)
        return SamplingResult(
            Decision.RECORD_AND_SAMPLE,
            {**(attributes or {}), "sampled.by": "tagging"},  # what the span keeps
            TraceState([("vendor", "v1")]),
        )

    def get_description(self) -> str:
        return "Tagging"


def test_any_other_sampler_is_asked_and_its_answer_kept() -> None:
    exporter = install(sampler=Tagging())
    with tracing.span("keep me", attributes={"mine": 1}):
        headers = tracing.inject(None)
    with tracing.span("drop me"):
        pass
    (finished,) = exporter.get_finished_spans()
    assert dict(finished.attributes or {}) == {"mine": 1, "sampled.by": "tagging"}
    assert finished.context.trace_state == TraceState([("vendor", "v1")])
    assert headers is not None
    assert headers["tracestate"] == "vendor=v1"
    install(sampler=TraceIdRatioBased(0.0))
    with tracing.span("never") as span:
        assert span is not None
        assert not span.is_recording()


class Enriching(SpanProcessor):
    """Adds an attribute when a span starts, as span processors may, from
    what it reads of the span."""

    def __init__(self) -> None:
        self.seen: list[tuple[Any, ...]] = []

    def on_start(self, span: Any, parent_context: otel_context.Context | None = None) -> None:
        self.seen.append(
            (span.name, span.context.trace_id, span.parent, span.kind, span.start_time > 0)
        )
        self.seen.append((span.end_time, span.status.status_code, span.events, span.links))
        self.seen.append((span.resource is not None, span.instrumentation_scope.name))
        span.set_attribute("enriched", True)


def test_the_providers_processors_see_the_span_start() -> None:
    reset_tracer_provider()
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    enriching = Enriching()
    provider.add_span_processor(enriching)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    with tracing.span("seen", kind=trace.SpanKind.SERVER):
        pass
    (finished,) = exporter.get_finished_spans()
    assert dict(finished.attributes or {}) == {"enriched": True}
    assert enriching.seen == [
        ("seen", finished.context.trace_id, None, trace.SpanKind.SERVER, True),
        (None, StatusCode.UNSET, (), ()),
        (True, "fleetbus"),
    ]


def test_the_span_processors_are_given_does_not_change_after_its_end(
    caplog: pytest.LogCaptureFixture,
) -> None:
    exporter = install()
    with tracing.span("kept", attributes={"k": "v"}) as span:
        span.add_event("e")
    (finished,) = exporter.get_finished_spans()
    with caplog.at_level(logging.WARNING):
        span.set_status(StatusCode.ERROR, "too late")
        span.set_attribute("late", 1)
        span.add_event("late")
        span.add_link(SpanContext(1, 2, is_remote=True))
        span.update_name("renamed")
    assert finished.status.status_code is StatusCode.UNSET
    assert dict(finished.attributes or {}) == {"k": "v"}
    assert [e.name for e in finished.events] == ["e"]
    assert finished.links == ()
    assert finished.name == "kept"
    assert isinstance(finished, ReadableSpan)


class Recording(trace.TracerProvider):
    """A provider that is not the SDK's: fleetbus asks its tracer for spans."""

    def __init__(self) -> None:
        self.names: list[str] = []

    def get_tracer(self, *args: Any, **kwargs: Any) -> trace.Tracer:
        provider = self

        class Named(trace.NoOpTracer):
            def start_span(self, name: str, *a: Any, **k: Any) -> trace.Span:
                provider.names.append(name)
                return trace.NonRecordingSpan(trace.INVALID_SPAN_CONTEXT)

        return Named()


def test_any_other_provider_makes_its_own_spans() -> None:
    reset_tracer_provider()
    provider = Recording()
    trace.set_tracer_provider(provider)
    with tracing.span("elsewhere"):
        pass
    assert provider.names == ["elsewhere"]


@pytest.mark.parametrize(
    "traceparent",
    [
        f"00-{'a' * 32}-{'b' * 16}-01",
        f"00-{'a' * 32}-{'b' * 16}-03",
        f"00-{'A' * 32}-{'b' * 16}-01",  # upper case: not valid
        f"00-{'0' * 32}-{'b' * 16}-01",  # a zero trace id
        f"00-{'a' * 32}-{'0' * 16}-01",  # a zero span id
        f"ff-{'a' * 32}-{'b' * 16}-01",  # the forbidden version
        f"01-{'a' * 32}-{'b' * 16}-01-more",  # a future version
        f"00-{'a' * 32}-{'b' * 16}-01-more",  # version 00 with more
        f" 00-{'a' * 32}-{'b' * 16}-01\t",  # spaces around
        "garbage",
    ],
)
def test_a_traceparent_is_read_as_the_propagator_reads_it(traceparent: str) -> None:
    install()
    headers = {"traceparent": traceparent}
    ours = tracing.extract(headers)
    reference = propagate.extract(dict(headers))
    assert ours is not None
    assert (
        trace.get_current_span(ours).get_span_context()
        == trace.get_current_span(reference).get_span_context()
    )


def test_the_headers_written_are_the_propagators() -> None:
    install()
    with tracing.span("writing"):
        ours = tracing.inject({"other": "kept"})
        reference: dict[str, str] = {"other": "kept"}
        propagate.inject(reference)
    assert ours == reference
    token = otel_context.attach(baggage.set_baggage("tenant", "t1"))
    try:
        with tracing.span("with baggage"):
            carried = tracing.inject(None)
    finally:
        otel_context.detach(token)
    assert carried is not None
    assert carried["baggage"] == "tenant=t1"
    back = tracing.extract(carried)
    assert baggage.get_baggage("tenant", back) == "t1"


def test_another_propagator_is_used_as_configured() -> None:
    install()
    previous = propagate.get_global_textmap()

    class Prefixed(TraceContextTextMapPropagator):
        def inject(self, carrier: Any, context: Any = None, setter: Any = None) -> None:
            carrier["x-trace"] = "custom"

    propagate.set_global_textmap(CompositePropagator([Prefixed()]))
    try:
        with tracing.span("custom"):
            assert tracing.inject(None) == {"x-trace": "custom"}
    finally:
        propagate.set_global_textmap(previous)


def test_the_exporters_encode_fleetbus_spans_as_the_sdks() -> None:
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

    exporter = install(resource=Resource.create({"service.name": "spans-test"}))
    scenario(lambda name, attributes: tracing.span(name, attributes=attributes))
    tracer = trace.get_tracer_provider().get_tracer("fleetbus", "0.1.0")
    scenario(lambda name, attributes: tracer.start_as_current_span(name, attributes=attributes))
    ours, theirs = exporter.get_finished_spans()[:2], exporter.get_finished_spans()[2:]
    for mine, reference in zip(ours, theirs, strict=True):
        assert '"name": "' in mine.to_json()  # the console exporter's form
        encoded, expected = (encode_spans([s]).resource_spans[0] for s in (mine, reference))
        assert encoded.resource == expected.resource
        (scope,), (expected_scope,) = encoded.scope_spans, expected.scope_spans
        assert scope.scope == expected_scope.scope
        (span,), (expected_span,) = scope.spans, expected_scope.spans
        for field in ("trace_id", "span_id", "parent_span_id", "start_time_unix_nano"):
            expected_span.ClearField(field)
            span.ClearField(field)
        for event in (*span.events, *expected_span.events):
            event.ClearField("time_unix_nano")
            for index, attribute in enumerate(event.attributes):
                if attribute.key == "exception.stacktrace":
                    del event.attributes[index]
                    break
        span.ClearField("end_time_unix_nano")
        expected_span.ClearField("end_time_unix_nano")
        assert span == expected_span


def test_fleetbus_spans_are_the_providers_own() -> None:
    exporter = install()
    with tracing.span("own", attributes={"k": "v"}) as span:
        assert isinstance(span, SdkSpan)  # the SDK's, made through the API
        assert trace.get_current_span() is span
    began = tracing.begin("begun")
    assert isinstance(began, SdkSpan)
    began.end()
    assert [s.name for s in exporter.get_finished_spans()] == ["own", "begun"]


def test_no_span_is_made_in_a_trace_that_is_not_sampled() -> None:
    exporter = install(sampler=ParentBased(TraceIdRatioBased(0.0)))
    with tracing.span("root") as root:
        assert not root.is_recording()
        root_context = root.get_span_context()
        assert root_context.is_valid
        with tracing.span("child", attributes={"k": "v"}) as child:
            # No span of its own: the root's context stays current and travels.
            assert not child.is_recording()
            assert child.get_span_context() == root_context
            assert trace.get_current_span().get_span_context() == root_context
            headers = tracing.inject(None)
        with pytest.raises(KeyError), tracing.span("failing"):
            raise KeyError("gone")
        assert trace.get_current_span() is root
    assert tracing.begin("begun") is not None
    assert exporter.get_finished_spans() == ()
    flags = int(root_context.trace_flags)
    assert not flags & TraceFlags.SAMPLED
    assert headers == {
        "traceparent": f"00-{root_context.trace_id:032x}-{root_context.span_id:016x}-{flags:02x}"
    }


def test_a_request_in_a_trace_not_sampled_carries_its_context_on() -> None:
    exporter = install()  # the default sampler: parent-based, always on for a root
    remote = f"00-{'5' * 32}-{'6' * 16}-00"
    with tracing.span(
        "run", kind=trace.SpanKind.SERVER, parent=tracing.extract({"traceparent": remote})
    ) as run:
        assert not run.is_recording()
        assert tracing.inject(None) == {"traceparent": remote}
    assert not trace.get_current_span().get_span_context().is_valid  # detached again
    assert exporter.get_finished_spans() == ()


class RecordOnly(Sampler):
    """Records the spans named ``recorded …`` without sampling them; drops the rest."""

    def should_sample(
        self,
        parent_context: otel_context.Context | None,
        trace_id: int,
        name: str,
        kind: trace.SpanKind | None = None,
        attributes: Any = None,
        links: Sequence[Link] | None = None,
        trace_state: TraceState | None = None,
    ) -> SamplingResult:
        decision = Decision.RECORD_ONLY if name.startswith("recorded") else Decision.DROP
        return SamplingResult(decision, attributes)

    def get_description(self) -> str:
        return "RecordOnly"


def test_a_recording_parent_not_sampled_is_left_as_it_is() -> None:
    install(sampler=ParentBased(RecordOnly()))
    with tracing.span("recorded parent", attributes={"p": 1}) as parent:
        assert parent.is_recording()
        assert not parent.get_span_context().trace_flags.sampled
        with tracing.span("child") as child:
            assert child is not parent
            assert not child.is_recording()
            child.set_attribute("into", "nothing")
            assert child.get_span_context() == parent.get_span_context()
        assert parent.is_recording()  # the child's block did not end it
    assert dict(parent.attributes or {}) == {"p": 1}


def test_a_sampler_that_does_not_follow_the_parent_is_asked_for_every_span() -> None:
    exporter = install(sampler=Tagging())
    with tracing.span("dropped root") as root:
        assert not root.is_recording()
        with tracing.span("keep the child"):
            pass
    (kept,) = exporter.get_finished_spans()
    assert kept.name == "keep the child"
    assert kept.parent is not None
    assert kept.parent.span_id == root.get_span_context().span_id


def test_a_spans_attributes_are_its_own_without_those_that_are_none() -> None:
    exporter = install()
    given: dict[str, Any] = {"a": 1, "l": ["x"]}
    with tracing.span("plain", attributes=given):
        given["a"] = 2  # changed while the span runs, and after
    given["b"] = 3
    with tracing.span("with none", attributes={"a": 1, "gone": None}):
        pass
    plain, with_none = exporter.get_finished_spans()
    assert dict(plain.attributes or {}) == {"a": 1, "l": ("x",)}
    assert dict(with_none.attributes or {}) == {"a": 1}


@pytest.mark.parametrize(
    ("trace_id", "span_id", "flags"),
    [(1, 1, 0), (0xABC, 0xDEF, 1), (2**128 - 1, 2**64 - 1, 0xFF), (2**100 + 5, 7, 2)],
)
def test_a_traceparent_is_written_as_the_propagator_writes_it(
    trace_id: int, span_id: int, flags: int
) -> None:
    install()
    context = SpanContext(trace_id, span_id, False, TraceFlags(flags))
    with trace.use_span(trace.NonRecordingSpan(context)):
        ours = tracing.inject(None)
        reference: dict[str, str] = {}
        TraceContextTextMapPropagator().inject(reference)
    assert ours == reference
