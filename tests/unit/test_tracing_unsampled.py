"""A request in a trace that is not sampled, read from its ``traceparent``'s
flags once (:func:`fleetbus.tracing.carry_unsampled`): no span, its context
current for the rest of the request's task, carried on as it came, and its
trace id on the log lines."""

from __future__ import annotations

import contextvars
import logging
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from opentelemetry import baggage, propagate, trace
from opentelemetry import context as otel_context
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_ON, ParentBased, Sampler, TraceIdRatioBased

from fleetbus import tracing
from fleetbus.logs import ContextFilter
from tests.helpers import reset_tracer_provider

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
SPAN_ID = "00f067aa0ba902b7"


def traceparent(flags: str) -> str:
    return f"00-{TRACE_ID}-{SPAN_ID}-{flags}"


def install(sampler: Sampler | None = None) -> InMemorySpanExporter:
    reset_tracer_provider()
    exporter = InMemorySpanExporter()
    provider = TracerProvider() if sampler is None else TracerProvider(sampler=sampler)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    return exporter


@pytest.fixture(autouse=True)
def _no_provider_after() -> Iterator[None]:
    yield
    reset_tracer_provider()


def in_own_task(work: Callable[[], Any]) -> Any:
    """``work`` run in a context of its own, as a serve loop's request task is."""
    return contextvars.copy_context().run(work)


@pytest.mark.parametrize("flags", ["00", "02"])  # 02: the random-trace-id flag, not sampled
def test_an_unsampled_request_carries_its_trace_on_without_a_span(flags: str) -> None:
    exporter = install()  # parent-based, always on at a root
    sent = traceparent(flags)

    def request() -> tuple[bool, Any, Any, Any]:
        carried = tracing.carry_unsampled({"traceparent": sent, "other": "x"})
        with tracing.span("fleetbus reply") as inner:  # no span of its own either
            onward = tracing.inject(None)
            recording = inner.is_recording()
        return carried, onward, recording, trace.get_current_span().get_span_context()

    carried, onward, recording, context = in_own_task(request)
    assert carried
    assert onward == {"traceparent": sent}  # as it came, flags and all
    assert not recording
    assert f"{context.trace_id:032x}" == TRACE_ID
    assert f"{context.span_id:016x}" == SPAN_ID
    assert context.is_remote
    assert f"{int(context.trace_flags):02x}" == flags
    assert exporter.get_finished_spans() == ()
    # Nothing left behind in the caller's own context.
    assert not trace.get_current_span().get_span_context().is_valid


def test_what_is_carried_on_is_what_the_propagator_writes() -> None:
    install()

    def request() -> tuple[Any, dict[str, str], Any]:
        tracing.carry_unsampled({"traceparent": traceparent("00")})
        written: dict[str, str] = {}
        propagate.inject(written)
        return tracing.inject(None), written, tracing.inject({"k": "v"})

    ours, propagators, with_headers = in_own_task(request)
    assert ours == propagators
    assert with_headers == {"k": "v", **propagators}


def test_log_lines_carry_the_unsampled_trace() -> None:
    install()

    def request() -> logging.LogRecord:
        tracing.carry_unsampled({"traceparent": traceparent("00")})
        record = logging.LogRecord("t", logging.INFO, __file__, 1, "line", None, None)
        ContextFilter().filter(record)
        return record

    record = in_own_task(request)
    assert record.__dict__["trace_id"] == TRACE_ID
    assert record.__dict__["span_id"] == SPAN_ID


@pytest.mark.parametrize(
    "headers",
    [
        {"traceparent": traceparent("01")},  # sampled: a span to make
        {"traceparent": traceparent("03")},
        {"traceparent": traceparent("00"), "tracestate": "k=v"},  # for the propagator
        {"traceparent": traceparent("00"), "baggage": "k=v"},
        {"traceparent": f"00-{'0' * 32}-{SPAN_ID}-00"},  # not valid
        {"traceparent": f"00-{TRACE_ID}-{'0' * 16}-00"},
        {"traceparent": f"00-{TRACE_ID.upper()}-{SPAN_ID}-00"},
        {"traceparent": f"01-{TRACE_ID}-{SPAN_ID}-00"},
        {"traceparent": traceparent("00") + "-more"},
        {"other": "x"},
    ],
)
def test_anything_else_is_left_to_the_propagator_and_the_sampler(headers: dict[str, str]) -> None:
    install()

    def request() -> tuple[bool, bool]:
        carried = tracing.carry_unsampled(headers)
        return carried, trace.get_current_span().get_span_context().is_valid

    assert in_own_task(request) == (False, False)


def test_a_sampler_not_following_the_parent_decides_for_itself() -> None:
    install(sampler=ALWAYS_ON)
    assert not in_own_task(lambda: tracing.carry_unsampled({"traceparent": traceparent("00")}))


def test_off_nothing_is_carried() -> None:
    reset_tracer_provider()
    assert not tracing.carry_unsampled({"traceparent": traceparent("00")})


def test_a_ratio_sampler_at_its_root_follows_the_parent_below() -> None:
    exporter = install(sampler=ParentBased(TraceIdRatioBased(1.0)))

    def request() -> tuple[bool, Any]:
        carried = tracing.carry_unsampled({"traceparent": traceparent("00")})
        with tracing.span("child"):
            return carried, tracing.inject(None)

    assert in_own_task(request) == (True, {"traceparent": traceparent("00")})
    assert exporter.get_finished_spans() == ()


def test_the_carried_context_is_read_only_when_asked_for() -> None:
    install()

    fresh = f"00-{'7' * 32}-{'8' * 16}-00"  # no request before carried it

    def request() -> tuple[bool, bool]:
        tracing.carry_unsampled({"traceparent": fresh})
        span = trace.get_current_span()
        with tracing.span("child"):
            tracing.inject(None)
        # A span and a request made in it read nothing more of the header.
        unread = span._read is None  # type: ignore[attr-defined]
        span.get_span_context()
        return unread, span._read is not None  # type: ignore[attr-defined]

    assert in_own_task(request) == (True, True)


def test_baggage_set_in_the_request_goes_through_the_propagator() -> None:
    install()

    def request() -> dict[str, str] | None:
        tracing.carry_unsampled({"traceparent": traceparent("00")})
        token = otel_context.attach(baggage.set_baggage("k", "v"))
        try:
            return tracing.inject(None)
        finally:
            otel_context.detach(token)

    assert in_own_task(request) == {"traceparent": traceparent("00"), "baggage": "k=v"}
