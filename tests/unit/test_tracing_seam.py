"""The one seam of :mod:`fleetbus.tracing` into opentelemetry-api's private
names: what it reads is there and means what it assumes, on the installed
version; without it, fleetbus warns once and goes through the public API,
with the same results."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
from opentelemetry import propagate, trace
from opentelemetry.baggage.propagation import W3CBaggagePropagator
from opentelemetry.propagators.composite import CompositePropagator
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from fleetbus import tracing
from tests.helpers import reset_tracer_provider

TRACEPARENT = f"00-{'a' * 32}-{'b' * 16}-01"


@pytest.fixture(autouse=True)
def _no_provider_around() -> Iterator[None]:
    reset_tracer_provider()
    yield
    reset_tracer_provider()


def test_the_api_names_the_seam_reads_mean_what_it_assumes() -> None:
    assert tracing._check_seam()
    assert tracing._SEAM
    assert tracing._DIRECT
    unset: object = trace._TRACER_PROVIDER
    assert unset is None  # none set: tracing is off
    assert not tracing.enabled()
    provider = TracerProvider()
    trace.set_tracer_provider(provider)
    assert trace._TRACER_PROVIDER is provider
    assert tracing.enabled()
    parts = [TraceContextTextMapPropagator(), W3CBaggagePropagator()]
    assert list(CompositePropagator(parts)._propagators) == parts
    assert tracing._w3c_only()  # OpenTelemetry's default propagator, seen through it


def test_without_the_names_fleetbus_warns_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delattr(trace, "_TRACER_PROVIDER")
    with caplog.at_level(logging.WARNING, logger="fleetbus.tracing"):
        assert not tracing._check_seam()
    (record,) = caplog.records
    assert "going through its public API" in record.getMessage()


def test_the_public_way_gives_the_same_results(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tracing, "_SEAM", False)
    monkeypatch.setattr(tracing, "_DIRECT", False)
    monkeypatch.setattr(tracing, "_w3c_textmap", None)
    assert not tracing.enabled()
    assert tracing.inject(None) is None
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    assert tracing.enabled()
    assert not tracing._w3c_only()  # the propagator reads every header
    parent = tracing.extract({"traceparent": TRACEPARENT})
    assert parent is not None
    reference = propagate.extract({"traceparent": TRACEPARENT})
    assert (
        trace.get_current_span(parent).get_span_context()
        == trace.get_current_span(reference).get_span_context()
    )
    with tracing.span("public", parent=parent):
        pass
    (finished,) = exporter.get_finished_spans()
    assert finished.parent is not None
    assert finished.parent.span_id == int("b" * 16, 16)
