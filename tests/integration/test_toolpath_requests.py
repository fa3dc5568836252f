"""Requests on the tool-call path against a real server: each reply reaches
its own request (a late one reaches nobody), a retry still waits its jittered
backoff, a reconnection resends a request but a caller's cancel stays a
cancel."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest
from stamina.instrumentation import RetryDetails, set_on_retry_hooks

from fleetbus.bus import Bus, Request
from fleetbus.errors import CallTimeoutError, NoRespondersError
from fleetbus.protocol import Message, ToolCall, ToolResult


async def echo(request: Request) -> Message:
    call = request.message
    assert isinstance(call, ToolCall)
    if call.parameters.get("delay"):
        await asyncio.sleep(call.parameters["delay"])
    return ToolResult(
        call_id=call.call_id, tool_name=call.tool_name, status="success", content=call.parameters
    )


@pytest.fixture
def waits() -> Iterator[list[float]]:
    """The waits stamina schedules before each retry."""
    seen: list[float] = []

    def record(details: RetryDetails) -> None:
        seen.append(details.wait_for)

    set_on_retry_hooks([record])
    try:
        yield seen
    finally:
        set_on_retry_hooks(None)


async def test_many_first_requests_each_get_their_own_reply(bus: Bus) -> None:
    stop = asyncio.Event()
    ready = asyncio.Event()
    async with asyncio.TaskGroup() as tg:
        tg.create_task(bus.serve("echo", echo, stop=stop, ready=ready))
        await ready.wait()
        replies = await asyncio.gather(
            *(
                bus.request(
                    "echo", ToolCall(tool_name="e", call_id=f"c{i}", parameters={"i": i}), timeout=5
                )
                for i in range(40)
            )
        )
        stop.set()
    assert [(r.call_id, r.content) for r in replies if isinstance(r, ToolResult)] == [
        (f"c{i}", {"i": i}) for i in range(40)
    ]


async def test_a_reply_after_the_timeout_reaches_nobody(bus: Bus) -> None:
    stop = asyncio.Event()
    ready = asyncio.Event()
    async with asyncio.TaskGroup() as tg:
        tg.create_task(bus.serve("slow", echo, stop=stop, ready=ready))
        await ready.wait()
        with pytest.raises(CallTimeoutError, match="after 1 attempt"):
            await bus.request(
                "slow",
                ToolCall(tool_name="s", call_id="late", parameters={"delay": 0.2}),
                timeout=0.05,
            )
        # The late reply arrives while this request waits: it is not taken for this one's.
        reply = await bus.request(
            "slow", ToolCall(tool_name="s", call_id="next", parameters={"delay": 0.3}), timeout=5
        )
        stop.set()
    assert isinstance(reply, ToolResult)
    assert reply.call_id == "next"


async def test_a_cancelled_request_does_not_take_a_later_reply(bus: Bus) -> None:
    stop = asyncio.Event()
    ready = asyncio.Event()
    async with asyncio.TaskGroup() as tg:
        tg.create_task(bus.serve("slow", echo, stop=stop, ready=ready))
        await ready.wait()
        asking = tg.create_task(
            bus.request(
                "slow",
                ToolCall(tool_name="s", call_id="gone", parameters={"delay": 0.1}),
                timeout=5,
            )
        )
        await asyncio.sleep(0.02)
        asking.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asking
        reply = await bus.request("slow", ToolCall(tool_name="s", call_id="kept"), timeout=5)
        await asyncio.sleep(0.15)  # the cancelled request's reply comes and goes
        again = await bus.request("slow", ToolCall(tool_name="s", call_id="again"), timeout=5)
        stop.set()
    assert isinstance(reply, ToolResult)
    assert reply.call_id == "kept"
    assert isinstance(again, ToolResult)
    assert again.call_id == "again"


async def test_retries_keep_their_jittered_backoff(bus: Bus, waits: list[float]) -> None:
    with pytest.raises(NoRespondersError, match="after 3 attempt"):
        await bus.request(
            "nobody.here",
            ToolCall(tool_name="x", call_id="c"),
            timeout=1,
            attempts=3,
            retry_backoff=0.02,
        )
    assert len(waits) == 2  # one wait before each of the two retries
    assert 0.02 <= waits[0] <= 0.04  # the backoff, plus up to as much jitter


async def test_a_reconnection_does_not_turn_a_callers_cancel_into_a_retry(bus: Bus) -> None:
    seen: list[int] = []
    stop = asyncio.Event()
    ready = asyncio.Event()

    async def silent(request: Request) -> None:
        assert isinstance(request.message, ToolCall)
        seen.append(request.message.attempt)

    async with asyncio.TaskGroup() as tg:
        tg.create_task(bus.serve("silent", silent, stop=stop, ready=ready))
        await ready.wait()
        asking = tg.create_task(
            bus.request("silent", ToolCall(tool_name="s", call_id="c"), timeout=30, attempts=3)
        )
        while not seen:  # noqa: ASYNC110 - the handler records the first attempt
            await asyncio.sleep(0.01)
        asking.cancel()
        bus.reconnects.happened()  # at the same moment
        with pytest.raises(asyncio.CancelledError):
            await asking
        await asyncio.sleep(0.1)
        stop.set()
    assert seen == [1]


async def test_each_request_times_out_after_its_own_timeout(bus: Bus) -> None:
    """Deadlines share one timer: a short one sent after long ones still ends on time."""
    stop = asyncio.Event()
    ready = asyncio.Event()

    async def silent(request: Request) -> None:
        return None

    async def timed(timeout: float) -> float:
        started = time.monotonic()
        with pytest.raises(CallTimeoutError):
            await bus.request(
                "silent", ToolCall(tool_name="s", call_id=f"t{timeout}"), timeout=timeout
            )
        return time.monotonic() - started

    async with asyncio.TaskGroup() as tg:
        tg.create_task(bus.serve("silent", silent, stop=stop, ready=ready))
        await ready.wait()
        long = tg.create_task(timed(1.0))
        await asyncio.sleep(0.01)
        short = await timed(0.1)
        medium = await timed(0.2)
        took = await long
        stop.set()
    # Each request has its own deadline (loose upper bounds: a shared machine).
    assert 0.1 <= short < 0.9
    assert 0.2 <= medium < 0.95
    assert 1.0 <= took < 3


async def test_answered_requests_do_not_pile_up_deadlines(bus: Bus) -> None:
    stop = asyncio.Event()
    ready = asyncio.Event()
    async with asyncio.TaskGroup() as tg:
        tg.create_task(bus.serve("echo", echo, stop=stop, ready=ready))
        await ready.wait()
        for i in range(500):
            await bus.request("echo", ToolCall(tool_name="e", call_id=f"c{i}"), timeout=30)
        stop.set()
    assert len(bus._replies._deadlines) <= 64 + 2  # not one per request answered
