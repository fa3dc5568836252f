"""Messages lost with a server that dies (a cluster node) cost their caller
moments, not its whole timeout:

- a reply lost with the responder's connection is sent again once the
  connection is back;
- a request routed to a serving loop as it stops is answered, not dropped:
  the loop stops once the server has its UNSUB (waiting a bounded time for
  it, so that a server that never answers costs the calls in flight none of
  their drain time);
- a tool call lost on its way to the worker is found unheld by the worker
  check its caller makes after a while, and sent again at once; a call that
  a worker holds (running it) is not.

The worker reaches the real nats-server through a TCP link the test
controls (:class:`tests.integration.link.Link`): it swallows what passes one
way (lost as with a dying server), then cuts the connection, and nats-py
reconnects through it; or it holds what the worker writes from its UNSUB on.
"""

from __future__ import annotations

import asyncio
import logging

import nats
import pytest
from nats.aio.msg import Msg

from fleetbus.bus import Bus, EmbeddedServer, Request, ToolClient, _serve
from fleetbus.bus._serve import RecentReplies
from fleetbus.errors import ConfigError, NoRespondersError
from fleetbus.protocol import Message, ToolCall, ToolResult, decode
from fleetbus.tools_workers import Toolkit, ToolWorker, tool
from tests.helpers import worker_running
from tests.integration.link import Link


async def test_a_reply_lost_with_the_responders_connection_is_sent_again_once_it_is_back(
    nats_server: EmbeddedServer, bus: Bus, prefix: str
) -> None:
    link = await Link(int(nats_server.url.rsplit(":", 1)[1])).start()
    responder = await Bus.connect(link.url, prefix=prefix, name="lossy-worker")
    calls: list[str] = []

    async def answer_then_lose_the_link(request: Request) -> Message:
        message = request.message
        assert isinstance(message, ToolCall)
        calls.append(message.call_id or "")
        link.swallow = True  # what the responder writes from now on is lost
        return ToolResult(call_id=message.call_id, tool_name="t", status="success", content="ok")

    stop = asyncio.Event()
    ready = asyncio.Event()
    try:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(
                responder.serve(
                    f"{prefix}.lossy", answer_then_lose_the_link, stop=stop, ready=ready
                )
            )
            await ready.wait()
            asking = tg.create_task(
                bus.request(
                    f"{prefix}.lossy", ToolCall(tool_name="t", call_id="c-lost"), timeout=20
                )
            )
            while link.swallowed == 0:  # noqa: ASYNC110 - the reply went into the link
                await asyncio.sleep(0.01)
            link.swallow = False
            link.cut()  # the connection dies with the reply in it
            reply = await asyncio.wait_for(asking, 15)  # not the 20 s of the request
            stop.set()
    finally:
        await responder.close()
        await link.close()
    assert isinstance(reply, ToolResult)
    assert reply.call_id == "c-lost"
    assert reply.content == "ok"
    assert calls == ["c-lost"]  # sent again by the responder, not asked again


async def test_a_serving_loop_stops_only_once_the_server_routes_it_nothing_more(
    nats_server: EmbeddedServer, bus: Bus, prefix: str
) -> None:
    # nats-py's drain ends a subscription once a PING it writes ahead of the
    # UNSUB comes back: a request the server routes to it meanwhile (to a
    # queue group member being stopped) would be dropped, unanswered. The
    # link holds the responder's UNSUB: while it is held the server routes
    # here, so the loop must still be serving.
    link = await Link(int(nats_server.url.rsplit(":", 1)[1])).start()
    responder = await Bus.connect(link.url, prefix=prefix, name="stopping-worker")
    subject = f"{prefix}.stopping"

    asked = asyncio.Event()

    async def answer(request: Request) -> Message:
        message = request.message
        assert isinstance(message, ToolCall)
        asked.set()
        return ToolResult(call_id=message.call_id, tool_name="t", status="success", content="ok")

    stop = asyncio.Event()
    ready = asyncio.Event()
    serving = asyncio.create_task(responder.serve(subject, answer, stop=stop, ready=ready))
    try:
        await ready.wait()
        link.hold_from(b"UNSUB")
        stop.set()
        await link.held.wait()
        # Time for a loop that does not wait for the server to stop (it
        # stops within a round trip); one that waits cannot stop here.
        await asyncio.wait({serving}, timeout=1.0)
        assert not serving.done()
        asking = asyncio.create_task(
            bus.request(subject, ToolCall(tool_name="t", call_id="c-routed"), timeout=10)
        )
        await asked.wait()  # routed here, and handled; its reply waits behind the UNSUB
        link.release()
        reply = await asking
        assert isinstance(reply, ToolResult)
        assert reply.call_id == "c-routed"
        await asyncio.wait_for(serving, 10)
        with pytest.raises(NoRespondersError):  # the server has the UNSUB: nobody is asked
            await bus.request(subject, ToolCall(tool_name="t", call_id="c-after"), timeout=10)
    finally:
        stop.set()
        link.release()
        await asyncio.gather(serving, return_exceptions=True)
        await responder.close()
        await link.close()


async def test_a_server_that_never_has_the_unsubscribe_costs_the_calls_in_flight_no_drain_time(
    nats_server: EmbeddedServer, bus: Bus, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The wait for the server to have the UNSUB is bounded: a server that
    # never answers leaves a call in flight the rest of the drain timeout
    # (unbounded, the wait took all of it and the call was cancelled).
    monkeypatch.setattr(_serve, "_UNSUBSCRIBE_WAIT", 0.2)
    link = await Link(int(nats_server.url.rsplit(":", 1)[1])).start()
    responder = await Bus.connect(link.url, prefix=prefix, name="unheard-worker")
    subject = f"{prefix}.unheard"
    running, go_on, finished = asyncio.Event(), asyncio.Event(), asyncio.Event()

    async def slow(request: Request) -> Message:
        message = request.message
        assert isinstance(message, ToolCall)
        running.set()
        await go_on.wait()
        await asyncio.sleep(0.5)  # the call's last moments, within its drain time
        finished.set()
        return ToolResult(call_id=message.call_id, tool_name="t", status="success", content="ok")

    gave_up = asyncio.Event()

    class GaveUp(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.getMessage().startswith(f"draining {subject}"):
                gave_up.set()

    watcher = GaveUp()
    logging.getLogger("fleetbus.bus._serve").addHandler(watcher)
    stop = asyncio.Event()
    ready = asyncio.Event()
    serving = asyncio.create_task(
        responder.serve(subject, slow, stop=stop, ready=ready, drain_timeout=5)
    )
    asking = None
    try:
        await ready.wait()
        asking = asyncio.create_task(
            bus.request(subject, ToolCall(tool_name="t", call_id="c-slow"), timeout=10)
        )
        await running.wait()
        link.hold_from(b"UNSUB")  # the server never has it
        stop.set()
        await gave_up.wait()
        go_on.set()
        await asyncio.wait_for(serving, 10)
        assert finished.is_set()  # run to its end, not cancelled
    finally:
        logging.getLogger("fleetbus.bus._serve").removeHandler(watcher)
        stop.set()
        go_on.set()
        if asking is not None:
            asking.cancel()
            await asyncio.gather(asking, return_exceptions=True)
        await asyncio.gather(serving, return_exceptions=True)
        link.release()
        await responder.close()
        await link.close()


def test_recent_replies_keep_the_newest_within_their_limits() -> None:
    recent = RecentReplies(most=3, most_bytes=10)
    for n in range(5):
        recent.add(f"r.{n}", b"ab")
    assert [subject for subject, _ in recent.since(0.0)] == ["r.2", "r.3", "r.4"]
    recent.add("big", b"x" * 11)  # larger than all of them: not kept
    assert len(recent) == 3
    recent.add("r.5", b"x" * 8)  # 2 + 8 bytes: only the newest fit with it
    assert [subject for subject, _ in recent.since(0.0)] == ["r.4", "r.5"]
    assert recent.since(float("inf")) == []
    recent.add("r.6", b"a")  # 11 bytes: r.4 goes
    recent.add("r.7", b"a")  # 3 of them, 10 bytes
    recent.add("r.8", b"a")  # the count drops r.5, and its 8 bytes with it
    recent.add("r.9", b"x" * 7)  # the count drops r.6: 1 + 1 + 7 bytes fit
    assert [subject for subject, _ in recent.since(0.0)] == ["r.7", "r.8", "r.9"]
    none = RecentReplies(most=0)
    none.add("r", b"ab")
    assert len(none) == 0
    assert none.since(0.0) == []


@tool
async def slow(seconds: float) -> str:
    """Take a while.

    Args:
        seconds: how long.
    """
    await asyncio.sleep(seconds)
    return "slow done"


@tool
def quick() -> str:
    """Answer at once."""
    return "quick done"


async def test_a_call_lost_on_its_way_to_the_worker_is_sent_again_once_no_worker_holds_it(
    nats_server: EmbeddedServer, bus: Bus, prefix: str
) -> None:
    link = await Link(int(nats_server.url.rsplit(":", 1)[1])).start()
    worker_bus = await Bus.connect(link.url, prefix=prefix, name="far-worker")
    worker = ToolWorker(worker_bus, Toolkit([quick]), worker_id="far-worker")
    client = ToolClient(bus, timeout=20.0, check_after=0.5, check_timeout=0.5)
    try:
        async with worker_running(worker):
            link.swallow_incoming = True  # the call dies with the server that has it
            asking = asyncio.create_task(client.call("quick", call_id="c-gone"))
            while link.swallowed == 0:  # noqa: ASYNC110 - the call went into the link
                await asyncio.sleep(0.01)
            link.swallow_incoming = False
            link.cut()
            result = await asyncio.wait_for(asking, 15)  # not the 21 s of its attempt
    finally:
        await worker_bus.close()
        await link.close()
    assert result.ok, result
    assert result.content == "quick done"
    assert result.call_id == "c-gone"
    assert worker.executed == 1  # the copy sent again; the first never arrived


async def test_a_call_a_worker_holds_is_checked_but_not_sent_again(
    nats_server: EmbeddedServer, bus: Bus, prefix: str
) -> None:
    worker = ToolWorker(bus, Toolkit([slow]), worker_id="busy-worker")
    watcher = await nats.connect(nats_server.url)
    checks: list[ToolCall] = []
    sendings: list[ToolCall] = []

    async def seen(msg: Msg) -> None:
        message = decode(msg.data)
        if isinstance(message, ToolCall):
            (checks if msg.subject.endswith(".control") else sendings).append(message)

    await watcher.subscribe(bus.subjects.tool_control("slow"), cb=seen)
    await watcher.subscribe(bus.subjects.tool("slow"), cb=seen)
    await watcher.flush()
    caller = await Bus.connect(nats_server.url, prefix=prefix, name="patient")
    client = ToolClient(caller, timeout=20.0, check_after=0.2, check_timeout=0.5)
    try:
        async with worker_running(worker):
            result = await client.call("slow", {"seconds": 1.5}, call_id="c-held")
    finally:
        await caller.close()
        await watcher.close()
    assert result.ok, result
    assert result.content == "slow done"
    assert checks, "the call was never checked"
    assert {check.call_id for check in checks} == {"c-held"}
    assert [call.attempt for call in sendings] == [1]  # held, so never sent again
    assert worker.executed == 1


async def test_check_settings_out_of_range_are_refused(bus: Bus) -> None:
    with pytest.raises(ConfigError, match="check_after must be positive or None"):
        ToolClient(bus, check_after=0)
    with pytest.raises(ConfigError, match="check_timeout must be positive"):
        ToolClient(bus, check_timeout=-1)
    assert ToolClient(bus, check_after=None).check_after is None
