"""fleetbus's own spans for the SDK's provider (``fleetbus._spans``) export
what the SDK's spans export, follow the provider's sampler, limits and
processors, and the W3C headers fleetbus writes and reads itself are the
propagator's."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
from opentelemetry import baggage, propagate, trace
from opentelemetry import context as otel_context
from opentelemetry.propagators.composite import CompositePropagator
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import (
    ConcurrentMultiSpanProcessor,
    ReadableSpan,
    SpanLimits,
    SpanProcessor,
    TracerProvider,
)
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import (
    ALWAYS_OFF,
    Decision,
    Sampler,
    SamplingResult,
    TraceIdRatioBased,
)
from opentelemetry.trace import Link, SpanContext, StatusCode, TraceFlags, TraceState
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from fleetbus import _spans, tracing
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
    attributes = {"a": "abcdefgh", "b": ["long-one", "x"]}
    with (
        caplog.at_level(logging.WARNING, logger="fleetbus.tracing"),
        tracing.span("limited", attributes=attributes) as span,
    ):
        span.set_attribute("bad", {"a": "dict"})
        span.set_attribute("mixed", [1, "a"])
        span.set_attribute("c", 1)
        span.set_attribute("d", 2)  # the fourth: over the limit
        span.set_attribute("a", "replaced")  # a known key is still set
        span.add_event("first")
        span.add_event("second")  # over the limit of events
    (finished,) = exporter.get_finished_spans()
    assert dict(finished.attributes or {}) == {"a": "repl", "b": ("long", "x"), "c": 1}
    assert [e.name for e in finished.events] == ["first"]
    assert "Invalid type dict for attribute 'bad'" in caplog.text
    assert "'mixed'" in caplog.text


def test_an_ended_span_takes_nothing_more_and_ends_once(caplog: pytest.LogCaptureFixture) -> None:
    exporter = install()
    span = tracing.begin("once", attributes={"k": "v"})
    assert span is not None
    assert span.is_recording()
    span.end()
    assert not span.is_recording()
    with caplog.at_level(logging.WARNING, logger="fleetbus.tracing"):
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
            {"sampled.by": "tagging"},
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


class Hooked(SpanProcessor):
    """Records which of its hooks a span calls, in order."""

    def __init__(self, calls: list[str], name: str) -> None:
        self.calls = calls
        self.name = name

    def on_start(self, span: Any, parent_context: otel_context.Context | None = None) -> None:
        self.calls.append(f"{self.name} start {span.name}")

    def _on_ending(self, span: Any) -> None:
        self.calls.append(f"{self.name} ending {span.name} {span.end_time}")

    def on_end(self, span: ReadableSpan) -> None:
        self.calls.append(f"{self.name} end {span.name} {span.end_time is not None}")


def test_every_processor_hook_is_called_in_order_and_one_added_later_too() -> None:
    reset_tracer_provider()
    calls: list[str] = []
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(Hooked(calls, "a"))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    with tracing.span("first"):
        pass
    provider.add_span_processor(Hooked(calls, "b"))  # after fleetbus read the processors
    with tracing.span("second"):
        pass
    assert calls == [
        "a start first",
        "a ending first None",
        "a end first True",
        "a start second",
        "b start second",
        "a ending second None",
        "b ending second None",
        "a end second True",
        "b end second True",
    ]
    assert [s.name for s in exporter.get_finished_spans()] == ["first", "second"]


def test_a_concurrent_multi_processor_is_called_itself() -> None:
    reset_tracer_provider()
    calls: list[str] = []
    multi = ConcurrentMultiSpanProcessor(num_threads=2)
    multi.add_span_processor(Hooked(calls, "c"))
    trace.set_tracer_provider(TracerProvider(active_span_processor=multi, shutdown_on_exit=False))
    with tracing.span("parallel"):
        pass
    assert calls == ["c start parallel", "c ending parallel None", "c end parallel True"]
    multi.shutdown()


def test_the_span_processors_are_given_does_not_change_after_its_end(
    caplog: pytest.LogCaptureFixture,
) -> None:
    exporter = install()
    with tracing.span("kept", attributes={"k": "v"}) as span:
        span.add_event("e")
    (finished,) = exporter.get_finished_spans()
    with caplog.at_level(logging.WARNING, logger="fleetbus.tracing"):
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


def test_the_sdk_pipeline_is_read_from_the_tracer() -> None:
    install()
    tracer, pipeline = tracing._tracer()
    assert isinstance(pipeline, _spans.Pipeline)
    assert pipeline.tracer is tracer


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
