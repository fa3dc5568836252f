"""The serving loop's own bookkeeping (no sockets): every request's task gives
its limiter permit back, also one cancelled before it started, and a failure
in the loop's own handling is logged, not lost."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import pytest
from nats.aio.msg import Msg

from fleetbus.bus import Request
from fleetbus.bus._serve import ServeLoop
from fleetbus.protocol import Message, ToolCall, ToolResult, encode


class _Subscription:
    async def drain(self) -> None:
        pass

    async def unsubscribe(self) -> None:
        pass


class _Connection:
    """What a ServeLoop uses of a nats-py client; publishes are recorded."""

    is_closed = False
    is_draining = False

    def __init__(self) -> None:
        self.published: list[tuple[str, bytes]] = []
        self.dispatch: Any = None

    async def subscribe(self, subject: str, queue: str = "", cb: Any = None) -> _Subscription:
        self.dispatch = cb
        return _Subscription()

    async def flush(self, timeout: float = 0) -> None:
        pass

    async def publish(self, subject: str, payload: bytes) -> None:
        self.published.append((subject, payload))


def _msg(call_id: str, reply: str = "_INBOX.r") -> Msg:
    data = encode(ToolCall(tool_name="t", call_id=call_id))
    return Msg(_client=None, subject="s", reply=reply, data=data)  # type: ignore[arg-type]


async def _serving(nc: _Connection, loop: ServeLoop, stop: asyncio.Event) -> asyncio.Task[None]:
    ready = asyncio.Event()
    task = asyncio.create_task(loop.run(stop=stop, queue=None, drain_timeout=1.0, ready=ready))
    await ready.wait()
    return task


async def test_requests_cancelled_before_they_started_give_their_permits_back() -> None:
    nc = _Connection()
    handled: list[str] = []

    async def handler(request: Request) -> Message:
        handled.append(str(request.message.call_id))
        return ToolResult(call_id=request.message.call_id, tool_name="t", status="success")

    limiter = asyncio.Semaphore(3)
    loop = ServeLoop(nc, "s", handler, limiter=limiter, source="test", encode=encode)  # type: ignore[arg-type]
    running = await _serving(nc, loop, asyncio.Event())
    running.cancel()  # the loop ends before the tasks dispatched next can start
    for i in range(3):
        await nc.dispatch(_msg(f"c{i}"))
    with contextlib.suppress(asyncio.CancelledError):
        await running
    assert handled == []
    async with asyncio.timeout(1):
        for _ in range(3):
            await limiter.acquire()


async def test_served_requests_give_their_permits_back(caplog: pytest.LogCaptureFixture) -> None:
    nc = _Connection()

    async def handler(request: Request) -> Message:
        await asyncio.sleep(0)
        return ToolResult(call_id=request.message.call_id, tool_name="t", status="success")

    def failing_encode(message: Message) -> bytes:
        if message.call_id == "bad":
            raise RuntimeError("encoder bug")
        return encode(message)

    limiter = asyncio.Semaphore(2)
    stop = asyncio.Event()
    loop = ServeLoop(nc, "s", handler, limiter=limiter, source="test", encode=failing_encode)  # type: ignore[arg-type]
    running = await _serving(nc, loop, stop)
    with caplog.at_level(logging.ERROR, logger="fleetbus.bus._serve"):
        for call_id in ("a", "bad", "b", "c", "d"):
            await nc.dispatch(_msg(call_id))
        for _ in range(10):
            await asyncio.sleep(0)
        stop.set()
        await running
    assert len(nc.published) == 4
    assert "request handling on s failed" in caplog.text
    async with asyncio.timeout(1):
        for _ in range(2):
            await limiter.acquire()
