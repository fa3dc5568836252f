"""``Client.publish_now`` with headers (a traced request's ``traceparent``):
the bytes it queues are those nats-py's ``publish`` sends, and a header that
is not plain is left to ``publish``; a traced request goes out without
``publish``."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from fleetbus import tracing
from fleetbus.bus import Bus
from fleetbus.bus._seam import Client
from fleetbus.protocol import ToolCall, ToolResult

LINE_PARSER = callable(getattr(NATS, "_parse_header_lines", None))
"""Whether the installed nats-py parses headers line by line (2.15+)."""

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00"


@pytest.mark.parametrize(
    "headers",
    [
        {"traceparent": TRACEPARENT},
        {"traceparent": TRACEPARENT, "tracestate": "k=v,o=w", "baggage": "a=1"},
        {"Nats-Msg-Id": "m-1", "empty": ""},
        {"name": "vålue"},
    ],
)
async def test_plain_headers_are_queued_as_publish_writes_them(
    bus: Bus, headers: dict[str, str]
) -> None:
    nc = bus._nc
    assert isinstance(nc, Client)
    got: asyncio.Queue[Msg] = asyncio.Queue()

    async def keep(msg: Msg) -> None:
        await got.put(msg)

    await nc.subscribe("hnow.>", cb=keep)
    await nc.flush()
    captured: list[bytes] = []
    real = nc._send_command

    async def capture(cmd: bytes, priority: bool = False) -> None:
        captured.append(bytes(cmd))
        await real(cmd, priority)

    nc._send_command = capture  # type: ignore[method-assign]
    try:
        await nc.publish("hnow.a", b"body", reply="r.1", headers=headers)
    finally:
        del nc._send_command
    before = len(nc._pending)
    assert nc.publish_now("hnow.a", b"body", "r.1", headers)
    queued = nc._pending[before] if len(nc._pending) > before else None
    assert queued == captured[0]
    first = await asyncio.wait_for(got.get(), 30)
    second = await asyncio.wait_for(got.get(), 30)
    # nats-py before 2.15 parses headers with email.parser, which loses the
    # whole block when a value is not ASCII: the same for both copies.
    readable = LINE_PARSER or all(value.isascii() for value in headers.values())
    assert first.headers == second.headers == (headers if readable else None)
    assert second.data == b"body"
    assert second.reply == "r.1"


@pytest.mark.parametrize(
    "headers",
    [
        {"bad name": "v"},
        {"": "v"},
        {"name:colon": "v"},
        {"k": "line\r\nbreak"},
        {"k": " padded "},
    ],
)
async def test_a_header_that_is_not_plain_is_left_to_publish(
    bus: Bus, headers: dict[str, str]
) -> None:
    nc = bus._nc
    assert isinstance(nc, Client)
    pending = nc._pending_data_size
    assert not nc.publish_now("hnow.b", b"x", "", headers)
    assert nc._pending_data_size == pending  # nothing queued


async def test_a_traced_request_is_sent_without_publish(
    bus: Bus, spans: InMemorySpanExporter, monkeypatch: pytest.MonkeyPatch
) -> None:
    nc = bus._nc
    assert isinstance(nc, Client)
    published: list[Any] = []
    real = nc.publish

    async def counted(*args: Any, **kwargs: Any) -> None:
        published.append(kwargs.get("headers"))
        await real(*args, **kwargs)

    async def handler(request: Any) -> ToolResult:
        return ToolResult(call_id=request.message.call_id, tool_name="t", status="success")

    stop, ready = asyncio.Event(), asyncio.Event()
    async with asyncio.TaskGroup() as tg:
        tg.create_task(bus.serve("traced.now", handler, stop=stop, ready=ready))
        await asyncio.wait_for(ready.wait(), 30)
        monkeypatch.setattr(nc, "publish", counted)
        with tracing.span("caller"):
            reply = await bus.request(
                "traced.now", ToolCall(tool_name="t", call_id="c"), timeout=30
            )
        monkeypatch.undo()
        stop.set()
    assert isinstance(reply, ToolResult)
    assert reply.status == "success"
    assert published == []
    names = sorted(span.name for span in spans.get_finished_spans())
    assert names == ["caller", "fleetbus request"]  # the header reached the server


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"traceparent": TRACEPARENT},
        {"a": "1", "b": " two ", "c": "", "Nats-Msg-Id": "x"},
    ],
)
async def test_a_route_reads_headers_as_nats_py_does(bus: Bus, headers: dict[str, str]) -> None:
    nc = bus._nc
    assert isinstance(nc, Client)
    routed: asyncio.Queue[dict[str, str] | None] = asyncio.Queue()
    plain: asyncio.Queue[dict[str, str] | None] = asyncio.Queue()

    def take(msg: Any) -> bool:
        routed.put_nowait(msg.headers)
        return True

    async def keep(msg: Msg) -> None:
        await plain.put(msg.headers)

    sub = await nc.subscribe("hread.a", cb=keep)
    nc.route(sub, take, bare=True)
    await nc.subscribe("hread.a", cb=keep)  # nats-py's own way
    await nc.flush()
    await nc.publish("hread.a", b"x", headers=headers)
    ours = await asyncio.wait_for(routed.get(), 30)
    theirs = await asyncio.wait_for(plain.get(), 30)
    assert ours == theirs
