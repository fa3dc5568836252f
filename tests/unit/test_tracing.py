"""Spans of a reply in one process, the W3C headers, and tracing switched
on by the standard environment."""

from __future__ import annotations

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from fleetbus import tracing
from fleetbus.agents import Agent
from fleetbus.protocol import UserRequest
from fleetbus.testing import ScriptedModel
from fleetbus.tools_workers import Toolkit, tool
from tests.helpers import reset_tracer_provider


@tool
def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first.
        b: the second.
    """
    return a + b


def by_name(finished: tuple[ReadableSpan, ...]) -> dict[str, list[ReadableSpan]]:
    named: dict[str, list[ReadableSpan]] = {}
    for span in finished:
        named.setdefault(span.name, []).append(span)
    return named


async def test_a_reply_is_one_tree_of_steps_model_calls_and_tool_calls(
    spans: InMemorySpanExporter,
) -> None:
    model = ScriptedModel(
        [ScriptedModel.call("add", {"a": 2, "b": 3}, call_id="c1"), ScriptedModel.text("5")]
    )
    agent = Agent("adder", "", model, toolkit=Toolkit([add]))
    final = await agent.reply(UserRequest(content="2+3?", call_id="r-1", session_id="s-1"))
    assert final.content == "5"
    named = by_name(spans.get_finished_spans())
    (reply,) = named["fleetbus reply"]
    assert reply.attributes is not None
    assert reply.attributes["fleetbus.agent"] == "adder"
    assert reply.attributes["fleetbus.call_id"] == "r-1"
    assert reply.attributes["fleetbus.session_id"] == "s-1"
    assert reply.attributes["fleetbus.finished_reason"] == "completed"
    steps = named["fleetbus step"]
    assert len(steps) == 2
    assert all(s.parent is not None and s.parent.span_id == reply.context.span_id for s in steps)
    models = named["fleetbus model call"]
    assert len(models) == 2
    step_ids = {s.context.span_id for s in steps}
    assert all(m.parent is not None and m.parent.span_id in step_ids for m in models)
    (call,) = named["fleetbus tool call"]
    assert call.attributes is not None
    # The call_id as it travels to a worker: the reply's id and the model's.
    sent = f"{reply.attributes['fleetbus.reply_id']!s}.c1"
    assert (call.attributes["fleetbus.tool"], call.attributes["fleetbus.call_id"]) == ("add", sent)
    assert call.parent is not None
    assert call.parent.span_id == steps[0].context.span_id
    assert {s.context.trace_id for s in spans.get_finished_spans()} == {reply.context.trace_id}


def test_headers_carry_the_current_trace_and_bring_it_back(
    spans: InMemorySpanExporter,
) -> None:
    assert tracing.inject({"a": "1"}) == {"a": "1"}  # no span current: nothing added
    with tracing.span("outer") as outer:
        assert outer is not None
        headers = tracing.inject({"a": "1"})
    assert headers is not None
    assert headers["a"] == "1"
    trace_id = f"{outer.get_span_context().trace_id:032x}"
    assert headers["traceparent"].split("-")[1] == trace_id
    parent = tracing.extract(headers)
    with tracing.span("inner", parent=parent) as inner:
        assert inner is not None
    assert inner.get_span_context().trace_id == outer.get_span_context().trace_id
    assert tracing.extract({"a": "1"}) is None
    assert tracing.extract(None) is None


def test_off_without_a_provider_everything_returns_at_once() -> None:
    reset_tracer_provider()
    assert not tracing.enabled()
    assert tracing.inject({"a": "1"}) == {"a": "1"}
    assert tracing.inject(None) is None
    assert tracing.extract({"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"}) is None
    with tracing.span("nothing") as span:
        assert span is None


def test_the_environment_switches_tracing_on(monkeypatch: pytest.MonkeyPatch) -> None:
    reset_tracer_provider()
    try:
        monkeypatch.delenv("OTEL_TRACES_EXPORTER", raising=False)
        monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
        monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", raising=False)
        assert not tracing.setup_from_env()
        monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
        assert not tracing.setup_from_env()
        monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")
        assert tracing.setup_from_env()
        assert tracing.enabled()
    finally:
        provider = trace.get_tracer_provider()
        if isinstance(provider, TracerProvider):
            provider.shutdown()
        reset_tracer_provider()


def test_the_otel_variables_read_as_the_specification_says(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in ("TRACES_EXPORTER", "SDK_DISABLED", "SERVICE_NAME"):
        monkeypatch.delenv(f"OTEL_{name}", raising=False)
    assert tracing.TracingSettings().service_name == "fleetbus"
    assert not tracing.TracingSettings().sdk_disabled
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", " Console ")
    monkeypatch.setenv("OTEL_SDK_DISABLED", " TRUE ")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "")
    settings = tracing.TracingSettings()
    assert (settings.traces_exporter, settings.sdk_disabled) == ("console", True)
    assert settings.service_name == "fleetbus"  # empty: as if unset
    reset_tracer_provider()
    assert not tracing.setup_from_env()  # an exporter named, but the SDK is off
    assert not tracing.enabled()
    monkeypatch.setenv("OTEL_SDK_DISABLED", "1")  # only "true" turns it off
    assert not tracing.TracingSettings().sdk_disabled


def test_a_span_is_current_in_its_block_and_records_what_escapes_it(
    spans: InMemorySpanExporter,
) -> None:
    with tracing.span("outer", attributes={"fleetbus.call_id": "c-1", "fleetbus.none": None}):
        seen: list[object] = []

        def fail() -> None:
            with tracing.span("inner") as inner:
                seen.extend([inner, trace.get_current_span()])
                raise ValueError("bad")

        with pytest.raises(ValueError, match="bad"):
            fail()
        assert seen[0] is seen[1]  # current in its block
        assert trace.get_current_span().get_span_context().is_valid  # back to outer
    assert not trace.get_current_span().get_span_context().is_valid
    named = by_name(spans.get_finished_spans())
    (outer,) = named["outer"]
    (failed,) = named["inner"]
    assert outer.attributes is not None
    assert dict(outer.attributes) == {"fleetbus.call_id": "c-1"}  # None values left out
    assert outer.status.status_code is trace.StatusCode.UNSET
    assert failed.parent is not None
    assert failed.parent.span_id == outer.context.span_id
    assert failed.status.status_code is trace.StatusCode.ERROR
    assert failed.status.description == "ValueError: bad"
    assert [e.name for e in failed.events] == ["exception"]


def test_the_tracer_follows_a_new_provider(spans: InMemorySpanExporter) -> None:
    with tracing.span("first"):
        pass
    other = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(other))
    reset_tracer_provider()
    trace.set_tracer_provider(provider)
    with tracing.span("second"):
        pass
    assert [s.name for s in spans.get_finished_spans()] == ["first"]
    assert [s.name for s in other.get_finished_spans()] == ["second"]
