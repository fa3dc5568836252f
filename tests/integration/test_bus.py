"""The bus against a real nats-server: request/reply with retries, observe,
serving loops that survive bad requests, and clear connection errors."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import pytest

from fleetbus.bus import Bus, EmbeddedServer, Request, _replies
from fleetbus.errors import (
    CallTimeoutError,
    ConfigError,
    ConnectError,
    ConnectionClosedError,
    NoRespondersError,
    PayloadTooLargeError,
)
from fleetbus.protocol import (
    ErrorMessage,
    Event,
    Message,
    TextBlock,
    ToolCall,
    ToolResult,
    UserRequest,
    decode,
    encode,
)
from tests.helpers import free_port, pause


async def echo_handler(request: Request) -> Message:
    message = request.message
    assert isinstance(message, ToolCall)
    return ToolResult(
        call_id=message.call_id,
        tool_name=message.tool_name,
        status="success",
        content={"attempt": message.attempt, "parameters": message.parameters},
    )


async def test_request_reply_round_trip(bus: Bus) -> None:
    stop = asyncio.Event()
    ready = asyncio.Event()
    async with asyncio.TaskGroup() as tg:
        tg.create_task(bus.serve("x.echo", echo_handler, stop=stop, ready=ready))
        await ready.wait()
        reply = await bus.request(
            "x.echo", ToolCall(tool_name="echo", call_id="c-1", parameters={"a": 1}), timeout=2
        )
        stop.set()
    assert isinstance(reply, ToolResult)
    assert reply.call_id == "c-1"
    assert reply.content == {"attempt": 1, "parameters": {"a": 1}}


async def test_no_responders_is_retried_then_reported(bus: Bus) -> None:
    with pytest.raises(NoRespondersError, match="after 3 attempt") as caught:
        await bus.request(
            "nobody.here",
            ToolCall(tool_name="x", call_id="c-2"),
            timeout=1,
            attempts=3,
            retry_backoff=0.01,
        )
    assert caught.value.call_id == "c-2"


async def test_a_call_is_retried_until_a_responder_appears(bus: Bus) -> None:
    """The first attempts find nobody; a server that starts late still answers."""
    stop = asyncio.Event()

    async def late_server() -> None:
        await asyncio.sleep(0.15)
        await bus.serve("late.echo", echo_handler, stop=stop)

    async with asyncio.TaskGroup() as tg:
        tg.create_task(late_server())
        reply = await bus.request(
            "late.echo",
            ToolCall(tool_name="e", call_id="c-3"),
            timeout=1,
            attempts=6,
            retry_backoff=0.05,
        )
        stop.set()
    assert isinstance(reply, ToolResult)
    assert reply.call_id == "c-3"
    assert isinstance(reply.content, dict)
    assert reply.content["attempt"] > 1


async def test_unanswered_attempts_time_out_with_the_same_call_id(bus: Bus) -> None:
    seen: list[tuple[str | None, int]] = []

    async def silent(request: Request) -> None:
        assert isinstance(request.message, ToolCall)
        seen.append((request.message.call_id, request.message.attempt))
        return None

    stop = asyncio.Event()
    ready = asyncio.Event()
    async with asyncio.TaskGroup() as tg:
        tg.create_task(bus.serve("silent", silent, stop=stop, ready=ready))
        await ready.wait()
        with pytest.raises(CallTimeoutError, match="after 3 attempt") as caught:
            await bus.request(
                "silent", ToolCall(tool_name="s", call_id="c-4"), timeout=0.1, attempts=3
            )
        stop.set()
    assert caught.value.attempts == 3
    assert isinstance(caught.value, TimeoutError)
    assert seen == [("c-4", 1), ("c-4", 2), ("c-4", 3)]


async def test_a_request_without_a_receipt_is_sent_again_to_the_same_reply_subject(
    bus: Bus,
) -> None:
    """The first sending is dropped (its responder died with it), the second
    gets a receipt, and no third is sent while the reply takes its time."""
    seen: list[tuple[str, str]] = []
    answer = asyncio.Event()

    async def on_request(msg: Any) -> None:
        request = decode(msg.data)
        seen.append((str(request.id), msg.reply))
        if len(seen) == 2:
            await bus.nc.publish(msg.reply, b"")  # taken
            await answer.wait()
            reply = Event(call_id=request.call_id, event="done")
            await bus.nc.publish(msg.reply, encode(reply))

    sub = await bus.nc.subscribe("x.receipts", cb=on_request)
    await bus.flush()
    message = UserRequest(content="hi", call_id="r-1", receipt=True)
    asking = asyncio.create_task(bus.request("x.receipts", message, timeout=10, resend=0.2))
    await asyncio.sleep(1.5)  # resent after 0.2 s; after the receipt, never again
    assert not asking.done()
    answer.set()
    reply = await asking
    await sub.unsubscribe()
    assert isinstance(reply, Event)
    assert reply.call_id == "r-1"
    assert [id_ for id_, _ in seen] == [message.id, message.id]
    assert seen[0][1] == seen[1][1]  # the same reply subject


async def test_a_request_overtaken_by_later_receipts_is_sent_again_before_its_time(
    bus: Bus, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A responder died with a request queued (no receipt). Requests sent
    after it have their receipts from another responder: once one sent more
    than ``RESEND_AFTER`` later has, the request is sent again without
    waiting out its resend interval (a simulation's runner waits a quarter
    of its round's deadline: a host killed mid-round held up the round for
    150 s)."""
    monkeypatch.setattr(_replies, "RESEND_AFTER", 0.2)
    swallowed = asyncio.Event()

    async def dead(msg: Any) -> None:
        swallowed.set()  # taken to the grave: no receipt, no reply

    async def live(msg: Any) -> None:
        await bus.nc.publish(msg.reply, b"")  # taken
        reply = Event(call_id=decode(msg.data).call_id, event="done")
        await bus.nc.publish(msg.reply, encode(reply))

    async def ask(number: int) -> Event:
        message = UserRequest(content="hi", call_id=f"o-{number}", receipt=True)
        reply = await bus.request("x.overtaken", message, timeout=30, resend=3600)
        assert isinstance(reply, Event)
        return reply

    sub = await bus.nc.subscribe("x.overtaken", cb=dead)
    await bus.flush()
    async with asyncio.timeout(20):
        asking = asyncio.create_task(ask(0))
        await swallowed.wait()
        await sub.unsubscribe()
        sub = await bus.nc.subscribe("x.overtaken", cb=live)
        await bus.flush()
        number = 0
        while not asking.done():  # later requests, one after another, each taken
            number += 1
            await ask(number)
        reply = await asking
    await sub.unsubscribe()
    assert reply.call_id == "o-0"


@pytest.mark.parametrize("lost", [(0, 2, 4, 6, 8, 10), (10,)], ids=["every-other", "the-last"])
async def test_the_last_requests_a_dead_responder_held_are_sent_again_once_receipts_stop(
    bus: Bus, monkeypatch: pytest.MonkeyPatch, lost: tuple[int, ...]
) -> None:
    """A responder died holding some of the last requests sent (a round's
    last, nothing sent after them): the others had their receipts from
    another responder, and then no receipt came for ``RESEND_AFTER``. The
    requests passed (a request sent after them had its receipt) are sent
    again then, and so is the last one sent, which nothing can pass — not
    after their resend interval (a host killed in a round's last seconds
    held the round up a quarter of its deadline)."""
    monkeypatch.setattr(_replies, "RESEND_AFTER", 0.2)
    held: set[str] = set()

    async def serve(msg: Any) -> None:
        call_id = decode(msg.data).call_id
        assert call_id is not None
        if int(call_id.split("-")[1]) in lost and call_id not in held:
            held.add(call_id)  # queued on the responder that died: gone with it
            return
        await bus.nc.publish(msg.reply, b"")  # taken
        await bus.nc.publish(msg.reply, encode(Event(call_id=call_id, event="done")))

    async def ask(number: int) -> str:
        message = UserRequest(content="hi", call_id=f"t-{number}", receipt=True)
        reply = await bus.request("x.tail", message, timeout=15, resend=3600)
        assert isinstance(reply, Event)
        assert reply.call_id is not None
        return reply.call_id

    sub = await bus.nc.subscribe("x.tail", cb=serve)
    await bus.flush()
    try:
        answered = await asyncio.gather(*(ask(number) for number in range(11)))
    finally:
        await sub.unsubscribe()
    assert answered == [f"t-{number}" for number in range(11)]
    assert held == {f"t-{number}" for number in lost}


async def test_a_request_sent_again_finds_a_responder_that_was_away(bus: Bus) -> None:
    """Nobody serves the subject when the request is sent again (its only
    responder is restarting): not an error, it is sent again later."""
    got = asyncio.Event()
    seen = 0

    async def first(msg: Any) -> None:
        nonlocal seen
        seen += 1
        got.set()  # taken with it to the grave: no receipt, no reply

    sub = await bus.nc.subscribe("x.away", cb=first)
    await bus.flush()
    message = UserRequest(content="hi", call_id="r-2", receipt=True)
    asking = asyncio.create_task(bus.request("x.away", message, timeout=10, resend=0.1))
    await got.wait()
    await sub.unsubscribe()
    await asyncio.sleep(0.5)  # sent again (0.1, 0.3 s) to nobody

    async def second(msg: Any) -> None:
        reply = Event(call_id=decode(msg.data).call_id, event="done")
        await bus.nc.publish(msg.reply, encode(reply))

    sub = await bus.nc.subscribe("x.away", cb=second)
    await bus.flush()
    reply = await asking
    await sub.unsubscribe()
    assert seen == 1
    assert isinstance(reply, Event)
    assert reply.call_id == "r-2"


async def test_a_request_never_taken_times_out_and_resend_excludes_attempts(bus: Bus) -> None:
    with pytest.raises(NoRespondersError):  # nobody at all when it is first sent
        await bus.request(
            "x.nobody",
            UserRequest(content="hi", receipt=True, call_id="q-1"),
            timeout=1,
            resend=0.1,
        )
    with pytest.raises(ConfigError, match="either"):
        await bus.request("x.nobody", UserRequest(content="hi"), timeout=1, resend=1, attempts=2)
    # No receipt would come without both, and every copy would be a new attempt.
    for asking in (
        UserRequest(content="hi", receipt=True),
        UserRequest(content="hi", call_id="q-1"),
        ToolCall(tool_name="noop", call_id="q-1"),
    ):
        with pytest.raises(ConfigError, match="asks for a receipt"):
            await bus.request("x.nobody", asking, timeout=1, resend=1)

    async def mute(msg: Any) -> None:
        return None

    sub = await bus.nc.subscribe("x.mute", cb=mute)
    await bus.flush()
    with pytest.raises(CallTimeoutError):
        await bus.request(
            "x.mute",
            UserRequest(content="hi", receipt=True, call_id="q-2"),
            timeout=0.5,
            resend=0.1,
        )
    await sub.unsubscribe()


@pytest.mark.parametrize(
    ("payload", "code", "call_id"),
    [
        (b"\x00garbage", "malformed", None),
        (b'{"type": "tool_call", "tool_name": 5, "call_id": "c-5"}', "malformed", "c-5"),
        (b'{"type": "mystery", "call_id": "c-6"}', "malformed", "c-6"),
        (
            b'{"type": "tool_call", "tool_name": "x", "version": 9, "call_id": "c-7"}',
            "unsupported_version",
            "c-7",
        ),
    ],
)
async def test_bad_requests_get_an_error_reply_and_serving_goes_on(
    bus: Bus, payload: bytes, code: str, call_id: str | None
) -> None:
    stop = asyncio.Event()
    ready = asyncio.Event()
    async with asyncio.TaskGroup() as tg:
        tg.create_task(bus.serve("svc", echo_handler, stop=stop, ready=ready, component="svc-1"))
        await ready.wait()
        raw = await bus.nc.request("svc", payload, timeout=2)
        error = decode(raw.data)
        good = await bus.request("svc", ToolCall(tool_name="e", call_id="ok"), timeout=2)
        stop.set()
    assert isinstance(error, ErrorMessage)
    assert (error.code, error.call_id, error.source_component) == (code, call_id, "svc-1")
    assert isinstance(good, ToolResult)


async def test_a_handler_that_raises_gets_an_internal_error_reply(bus: Bus) -> None:
    async def broken(request: Request) -> Message:
        raise RuntimeError("handler bug")

    stop = asyncio.Event()
    ready = asyncio.Event()
    async with asyncio.TaskGroup() as tg:
        tg.create_task(bus.serve("broken", broken, stop=stop, ready=ready))
        await ready.wait()
        reply = await bus.request("broken", ToolCall(tool_name="b", call_id="c-8"), timeout=2)
        again = await bus.request("broken", ToolCall(tool_name="b", call_id="c-9"), timeout=2)
        stop.set()
    assert isinstance(reply, ErrorMessage)
    assert (reply.code, reply.call_id) == ("internal", "c-8")
    assert "handler bug" in reply.message
    assert isinstance(again, ErrorMessage)


async def test_concurrency_is_bounded_by_the_limiter(bus: Bus) -> None:
    running = 0
    peak = 0

    async def slow(request: Request) -> Message:
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        await asyncio.sleep(0.05)
        running -= 1
        return await echo_handler(request)

    stop = asyncio.Event()
    ready = asyncio.Event()
    async with asyncio.TaskGroup() as tg:
        tg.create_task(
            bus.serve("slow", slow, stop=stop, ready=ready, limiter=asyncio.Semaphore(3))
        )
        await ready.wait()
        replies = await asyncio.gather(
            *(
                bus.request("slow", ToolCall(tool_name="s", call_id=f"c{i}"), timeout=5)
                for i in range(12)
            )
        )
        stop.set()
    assert all(isinstance(r, ToolResult) for r in replies)
    assert peak == 3


async def test_stopping_drains_requests_in_flight(bus: Bus) -> None:
    stop = asyncio.Event()
    ready = asyncio.Event()
    started = asyncio.Event()

    async def slow(request: Request) -> Message:
        started.set()
        await asyncio.sleep(0.2)
        return await echo_handler(request)

    async with asyncio.TaskGroup() as tg:
        tg.create_task(bus.serve("drain", slow, stop=stop, ready=ready))
        await ready.wait()
        pending = tg.create_task(
            bus.request("drain", ToolCall(tool_name="d", call_id="c"), timeout=5)
        )
        await started.wait()
        stop.set()
        reply = await pending
    assert isinstance(reply, ToolResult)
    with pytest.raises(NoRespondersError):
        await bus.request("drain", ToolCall(tool_name="d", call_id="late"), timeout=1)


async def test_every_observer_gets_every_broadcast(bus: Bus) -> None:
    subject = bus.subjects.topic("news")
    first = await bus.observe(subject)
    second = await bus.observe(subject)
    await bus.flush()
    await bus.nc.publish(subject, b"not a message")
    for i in range(3):
        await bus.publish(subject, Event(event="tick", seq=i))

    async def take(observation: object, n: int) -> list[int]:
        got: list[int] = []
        async for message in observation:  # type: ignore[attr-defined]
            assert isinstance(message, Event)
            got.append(message.seq)
            if len(got) == n:
                break
        return got

    async with first, second:
        a, b = await asyncio.wait_for(asyncio.gather(take(first, 3), take(second, 3)), 5)
    assert a == b == [0, 1, 2]
    assert first.skipped == second.skipped == 1


async def test_oversized_messages_are_refused_before_sending(bus: Bus) -> None:
    huge = UserRequest(content=[TextBlock(text="x" * (bus.max_payload + 1))])
    with pytest.raises(PayloadTooLargeError, match="max_payload") as caught:
        await bus.publish("anywhere", huge)
    assert caught.value.size > caught.value.limit == bus.max_payload
    assert isinstance(caught.value, ValueError)


async def test_connecting_to_nothing_fails_fast_and_clearly() -> None:
    port = free_port()
    with pytest.raises(ConnectError, match=f"cannot connect to NATS at nats://127.0.0.1:{port}"):
        await Bus.connect(f"nats://127.0.0.1:{port}", timeout=1.0)


async def test_a_closed_bus_says_so(nats_server: EmbeddedServer) -> None:
    closed = await Bus.connect(nats_server.url)
    await closed.close()
    await closed.close()  # twice is fine
    with pytest.raises(ConnectionClosedError):
        await closed.publish("x", Event(event="e"))


def test_a_bus_whose_connection_closes_under_it_closes_quietly(
    nats_server: EmbeddedServer,
) -> None:
    """The server goes away just as a host stops: its connection is closed
    before nats-py notices. Under uvloop (as ``fleetbus`` runs), the drain's
    write raises ``RuntimeError``; the bus's close takes that as the
    connection gone, not as a failure of its own."""
    uvloop = pytest.importorskip("uvloop")

    async def closing() -> None:
        bus = await Bus.connect(nats_server.url, name="closing")
        observing = await bus.observe("closing.x")
        # The socket closed under the client, as when the server dies, and
        # nothing read since: nats-py still takes the connection for up. (A
        # killed server cannot make this moment happen on purpose: the read
        # loop notices first. nats-py has no public handle on its socket, so
        # the test closes it through its private transport, a test's reach.)
        bus.nc._transport._io_writer.transport.close()  # type: ignore[union-attr]
        await bus.close()
        assert bus.nc.is_closed
        await observing.close()

    uvloop.run(closing())


async def test_the_bus_survives_a_server_restart() -> None:
    """Requests work again once a restarted server is back on the same port."""
    port = free_port()
    server = EmbeddedServer(port=port).start()
    try:
        client = await Bus.connect(server.url)
        responder = await Bus.connect(server.url)
        stop = asyncio.Event()
        ready = asyncio.Event()
        async with asyncio.TaskGroup() as tg:
            tg.create_task(responder.serve("restart.echo", echo_handler, stop=stop, ready=ready))
            await ready.wait()
            server.kill()
            server = EmbeddedServer(port=port).start()
            reply = await client.request(
                "restart.echo",
                ToolCall(tool_name="e", call_id="after"),
                timeout=1,
                attempts=20,
                retry_backoff=0.05,
            )
            stop.set()
        assert isinstance(reply, ToolResult)
        assert reply.call_id == "after"
        await client.close()
        await responder.close()
    finally:
        server.stop()


async def test_a_subscription_made_while_the_server_is_away_is_confirmed_once_it_is_back() -> None:
    """The server stops answering (paused), then dies, as a cluster node
    does: the flush and the observe waiting for its PONGs are not answered,
    and nats-py drops those PONGs' futures when it reconnects. They still
    end once a server is back, instead of waiting out their timeout."""
    port = free_port()
    server = EmbeddedServer(port=port).start()
    bus = None
    try:
        bus = await Bus.connect(server.url)
        assert server.pid is not None
        await pause(server.pid)  # every thread stopped: none answers a PING
        flushing = asyncio.create_task(bus.flush(timeout=30))
        observing = asyncio.create_task(bus.observe("away.events", timeout=30))
        await asyncio.sleep(0.5)  # their PINGs are on the socket, unanswered
        server.kill()
        server = EmbeddedServer(port=port).start()
        started = time.monotonic()
        await flushing
        observation = await observing
        waited = time.monotonic() - started
        async with observation:
            await bus.publish("away.events", Event(event="back"))
            async with asyncio.timeout(10):
                got = await anext(aiter(observation))
        assert isinstance(got, Event)
        assert waited < 20, waited  # not the 30 s timeout (loose: a shared machine)
    finally:
        if bus is not None:
            await bus.close()  # (a failure leaves no socket for a later test to warn of)
        server.stop()


async def test_flushes_given_up_or_cancelled_leave_the_connection_working(bus: Bus) -> None:
    """A flush cancelled (or timed out) while its PONG is on the way must not
    break the connection: with nats-py's own flush, the late PONG ends the
    read loop and nothing more arrives."""
    for spins in range(40):
        flushing = asyncio.create_task(bus.flush())
        for _ in range(spins % 8):
            await asyncio.sleep(0)
        flushing.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await flushing
    for _ in range(5):
        with contextlib.suppress(CallTimeoutError):
            await bus.flush(timeout=0.0001)
    subject = f"{bus.prefix}.after-flushes"
    async with await bus.observe(subject) as observation:
        await bus.flush()
        await bus.publish(subject, UserRequest(content="still here"))
        async with asyncio.timeout(5):
            async for message in observation:
                assert isinstance(message, UserRequest)
                break
    await bus.flush()


async def test_a_request_in_flight_is_sent_again_as_soon_as_the_connection_is_back(
    bus: Bus,
) -> None:
    """A reply published while the client was away is lost: the retry (same
    call_id) goes out when the connection is re-established, not after the
    whole timeout; on the last attempt the request keeps waiting instead."""
    seen: list[int] = []
    stop = asyncio.Event()

    async def second_attempt_only(request: Request) -> ToolResult | None:
        message = request.message
        assert isinstance(message, ToolCall)
        seen.append(message.attempt)
        if message.attempt < 2:
            return None  # "lost": never answered
        return ToolResult(tool_name="x", call_id=message.call_id, status="success", content="ok")

    async with asyncio.TaskGroup() as tg:
        tg.create_task(bus.serve("lossy.echo", second_attempt_only, stop=stop))
        await bus.flush()
        asking = tg.create_task(
            bus.request(
                "lossy.echo", ToolCall(tool_name="x", call_id="c-9"), timeout=30, attempts=3
            )
        )
        while not seen:  # noqa: ASYNC110 - the handler records the first attempt
            await asyncio.sleep(0.01)
        started = time.monotonic()
        bus.reconnects.happened()  # as after a server's fail-over
        reply = await asyncio.wait_for(asking, 5)
        stop.set()
    assert isinstance(reply, ToolResult)
    assert reply.call_id == "c-9"
    assert seen[:2] == [1, 2]
    assert time.monotonic() - started < 5


async def test_encode_keeps_the_last_payload_for_the_serving_loop(bus: Bus) -> None:
    first = ToolResult(call_id="c-1", tool_name="t", status="success", content=[1, 2])
    payload = bus.encode(first)
    assert decode(payload) == first
    assert bus.encode(first) is payload  # measured by a handler, sent as it is
    second = ToolResult(call_id="c-2", tool_name="t", status="success", content="x")
    assert decode(bus.encode(second)) == second
    assert bus.encode(first) is not payload  # only the last one is kept
    huge = ToolResult(call_id="c-3", tool_name="t", status="success", content="x" * bus.max_payload)
    with pytest.raises(PayloadTooLargeError) as caught:
        bus.encode(huge)
    assert caught.value.size > bus.max_payload
