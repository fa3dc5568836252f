"""A serve loop given a request in a trace that is not sampled makes no span
for it, and the handler still has the trace: it carries it on to the
requests it sends, and its log lines carry the trace id."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

from fleetbus import logs, tracing
from fleetbus.bus import Bus
from fleetbus.bus._serve import Request
from fleetbus.protocol import Message, ToolCall, ToolResult


@pytest.fixture
def blocks(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the spans asked of :func:`fleetbus.tracing.span`."""
    asked: list[str] = []
    real = tracing.span

    def counted(name: str, **kwargs: Any) -> contextlib.AbstractContextManager[Any]:
        asked.append(name)
        return real(name, **kwargs)

    monkeypatch.setattr(tracing, "span", counted)
    return asked


async def served_once(bus: Bus, flags: TraceFlags) -> tuple[ToolResult, dict[str, Any]]:
    """One request sent in a trace with ``flags``; what its handler saw."""
    seen: dict[str, Any] = {}

    async def handler(request: Request) -> Message:
        seen["headers"] = tracing.inject(None)
        seen["log_ids"] = dict(logs._trace_ids())
        return ToolResult(call_id=request.message.call_id, tool_name="t", status="success")

    remote = SpanContext(0x4BF92F3577B34DA6A3CE929D0E0E4736, 0x00F067AA0BA902B7, False, flags)
    stop, ready = asyncio.Event(), asyncio.Event()
    async with asyncio.TaskGroup() as tg:
        tg.create_task(bus.serve("traced", handler, stop=stop, ready=ready))
        await asyncio.wait_for(ready.wait(), 30)
        with trace.use_span(NonRecordingSpan(remote)):
            reply = await bus.request("traced", ToolCall(tool_name="t", call_id="c1"), timeout=30)
        stop.set()
    assert isinstance(reply, ToolResult)
    return reply, seen


async def test_an_unsampled_request_is_served_without_a_span_and_keeps_its_trace(
    bus: Bus, spans: InMemorySpanExporter, blocks: list[str]
) -> None:
    reply, seen = await served_once(bus, TraceFlags(0))
    assert reply.status == "success"
    sent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00"
    assert seen["headers"] == {"traceparent": sent}
    assert seen["log_ids"] == {"trace_id": sent[3:35], "span_id": sent[36:52]}
    assert blocks == []  # decided from the header: no span block at all
    assert spans.get_finished_spans() == ()


async def test_a_sampled_request_is_served_in_a_span_of_its_trace(
    bus: Bus, spans: InMemorySpanExporter, blocks: list[str]
) -> None:
    _, seen = await served_once(bus, TraceFlags(TraceFlags.SAMPLED))
    (served,) = spans.get_finished_spans()
    assert blocks == [served.name]
    assert served.context is not None
    assert served.parent is not None
    assert served.context.trace_id == 0x4BF92F3577B34DA6A3CE929D0E0E4736
    assert served.parent.span_id == 0x00F067AA0BA902B7
    assert seen["headers"] == {
        "traceparent": f"00-{served.context.trace_id:032x}-{served.context.span_id:016x}-01"
    }
