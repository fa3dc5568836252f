"""Requests and replies handed over where the connection reads them
(``fleetbus.bus._seam.Client``'s routes): a serving loop that has every
place taken leaves the rest to nats-py's queue, in their order, and a
subscription that ends leaves no route behind."""

from __future__ import annotations

import asyncio

import nats.js.errors
import pytest
from nats.aio.msg import Msg

from fleetbus.bus import Bus, Request
from fleetbus.bus._seam import Client
from fleetbus.protocol import Message, ToolCall, ToolResult, encode


async def test_requests_past_the_places_are_served_in_their_order(bus: Bus) -> None:
    seen: list[str] = []
    running = 0
    peak = 0

    async def one_at_a_time(request: Request) -> Message:
        nonlocal running, peak
        message = request.message
        assert isinstance(message, ToolCall)
        assert message.call_id is not None
        seen.append(message.call_id)
        running += 1
        peak = max(peak, running)
        if len(seen) % 3 == 0:
            await asyncio.sleep(0)  # some finish at once, some later
        running -= 1
        return ToolResult(call_id=message.call_id, tool_name="t", status="success")

    stop = asyncio.Event()
    ready = asyncio.Event()
    ids = [f"c{i:04d}" for i in range(400)]
    async with asyncio.TaskGroup() as tg:
        tg.create_task(
            bus.serve("one", one_at_a_time, stop=stop, ready=ready, limiter=asyncio.Semaphore(1))
        )
        await ready.wait()
        # Sent in this order (each request is published before it waits).
        replies = await asyncio.gather(
            *(bus.request("one", ToolCall(tool_name="t", call_id=c), timeout=10) for c in ids)
        )
        stop.set()
    assert [r.call_id for r in replies] == ids
    assert peak == 1
    assert seen == ids


async def test_a_subscription_that_ends_leaves_no_route(bus: Bus) -> None:
    nc = bus._nc
    assert isinstance(nc, Client)

    async def answer(request: Request) -> Message:
        message = request.message
        return ToolResult(call_id=message.call_id, tool_name="t", status="success")

    stop = asyncio.Event()
    ready = asyncio.Event()
    async with asyncio.TaskGroup() as tg:
        tg.create_task(bus.serve("brief", answer, stop=stop, ready=ready))
        await ready.wait()
        served = [sid for sid, sub in nc._subs.items() if sub.subject == "brief"]
        assert len(served) == 1
        assert served[0] in nc._routes
        reply = await bus.request("brief", ToolCall(tool_name="t", call_id="c-1"), timeout=5)
        assert isinstance(reply, ToolResult)
        stop.set()
    assert served[0] not in nc._subs
    assert served[0] not in nc._routes
    assert set(nc._routes) <= set(nc._subs)  # the reply inbox's, still in use


async def test_a_free_place_does_not_let_a_request_pass_those_queued(bus: Bus) -> None:
    """A request arriving while others wait in nats-py's queue goes behind
    them, even when a place has just come free (the queue's task has not
    taken its next request yet)."""
    nc = bus._nc
    assert isinstance(nc, Client)
    seen: list[str] = []
    gate = asyncio.Event()

    async def record(request: Request) -> Message:
        message = request.message
        assert message.call_id is not None
        seen.append(message.call_id)
        await gate.wait()
        return ToolResult(call_id=message.call_id, tool_name="t", status="success")

    stop = asyncio.Event()
    ready = asyncio.Event()
    places = asyncio.Semaphore(1)
    async with asyncio.TaskGroup() as tg:
        tg.create_task(bus.serve("queued", record, stop=stop, ready=ready, limiter=places))
        await ready.wait()
        (sid,) = [sid for sid, sub in nc._subs.items() if sub.subject == "queued"]

        async def arrive(call_id: str) -> None:
            data = encode(ToolCall(tool_name="t", call_id=call_id))
            await nc._process_msg(sid, b"queued", b"", data, b"")

        # One stretch, as the read loop runs it: nothing else runs between.
        await arrive("first")  # takes the one place
        await arrive("second")  # none free: nats-py's queue
        places.release()  # a place comes free before the queue's task runs
        await arrive("third")
        for _ in range(20):
            await asyncio.sleep(0)
        gate.set()
        stop.set()
    assert seen == ["first", "second", "third"]


async def test_jetstream_requests_on_the_bare_inbox_get_nats_py_messages(bus: Bus) -> None:
    """The reply inbox takes its replies bare; nats-py's JetStream code,
    which requests through it, still gets the ``Msg`` it reads (its API
    errors are made from ``Msg.header``)."""
    reply = await bus._nc.request("$JS.API.INFO", b"", timeout=5)
    assert isinstance(reply, Msg)
    assert reply.header is None or isinstance(reply.header, dict)
    with pytest.raises(nats.js.errors.NotFoundError):
        await bus._nc.jetstream().stream_info("no_such_stream")
