"""The serving loop behind :meth:`fleetbus.Bus.serve`.

Each request is handled in a task of its own, owned by the loop: started
where the connection reads the request (:class:`~fleetbus.bus._seam.Client`'s
route), or, while every place is taken, from the subscription's callback once
one comes free (both cheaper than nats-py's message iterator, which starts a
task and an ``asyncio.wait`` per message); bounded by a semaphore, and
awaited — or cancelled — when the loop drains. The task keeps its own books
(drops itself, gives its place back) instead of a done callback: one loop
callback less per request.

A reply is sent once, at most once as NATS core delivers it: one the server
took just before it died is lost with it. So the loop keeps the replies it
sent last (:class:`RecentReplies`), and once its connection is back after a
loss it sends again those sent shortly before it: whoever still waits gets
the answer now instead of after its whole timeout, and a requester that has
its answer already drops the copy (fleetbus's requests do).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import msgspec
import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.subscription import Subscription
from opentelemetry import context as otel_context

from fleetbus import logs, tracing
from fleetbus.bus._replies import Reconnects
from fleetbus.bus._seam import (
    AVAILABLE,
    Client,
    Received,
    give_place,
    take_place,
    unsubscribe_ahead,
)
from fleetbus.errors import BusError, ConnectionClosedError, PayloadTooLargeError, ProtocolError
from fleetbus.protocol import (
    AnyMessage,
    ErrorCode,
    ErrorMessage,
    Message,
    decode,
    encode,
    error_reply,
)
from fleetbus.protocol.codec import clip

__all__ = ["Handler", "RecentReplies", "Request", "ServeLoop", "settle"]

logger = logging.getLogger(__name__)

_LOGGED_CHARS = 500
"""Most characters of a bad request's explanation in a log line."""


@dataclass(slots=True)
class Request:
    """One request taken by a serving loop, decoded (not frozen: a frozen
    dataclass is made three times slower, and one is made per request).

    Attributes:
        message: the decoded message.
        subject: the subject it arrived on.
        size: its encoded size in bytes.
        reply: the subject the answer goes to (``""`` for a plain publish).
    """

    message: AnyMessage
    subject: str
    size: int
    reply: str = ""


Handler = Callable[[Request], Awaitable[Message | None]]
"""Handles a request; the message it returns (if any) is the reply."""


async def settle(nc: NATS, timeout: float = 5.0) -> None:
    """Wait until the server has every subscription made so far.

    nats-py writes a flush's PING straight to the socket, ahead of commands
    still in its buffer (a SUB just made), so one round trip can end before
    the server has the subscription; the second PING follows them.

    A reconnection (the server went away: a cluster node died) drops the
    PONGs nats-py waits for, so a round trip then never ends: each is given
    :data:`_ROUND_TRIP_SLICE` seconds, and the two are tried again while
    ``timeout`` lasts (the subscriptions are made again on the new server).

    Raises:
        nats.errors.TimeoutError: no answer within ``timeout``.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        try:
            for _ in range(2):
                await _round_trip(nc, min(_ROUND_TRIP_SLICE, max(deadline - loop.time(), 0.001)))
            return
        except nats.errors.TimeoutError:
            if loop.time() >= deadline or nc.is_closed:
                raise


_UNSUBSCRIBE_WAIT = 10.0
"""Seconds a stopping serving loop waits for the server to have its UNSUB
(nats-py's own drain waits as long for its flush): a server that does not
answer leaves the requests in flight the rest of the drain timeout."""

_ROUND_TRIP_SLICE = 2.0
"""Seconds one PING of :func:`settle` is waited for before another is sent."""


_PONG_WAIT = 300.0
"""Seconds nats-py itself waits for a PONG (far past any caller's timeout)."""

_round_trips: set[asyncio.Task[None]] = set()
"""Round trips whose caller stopped waiting, until their PONG arrives."""


async def _round_trip(nc: NATS, timeout: float) -> None:
    """One PING/PONG, bounded by ``timeout``, that is never cancelled.

    nats-py 2.16 cancels the PONG's future when a flush is cancelled or times
    out, but leaves it in its queue: the late PONG then fails on it and ends
    the connection's read loop for good (nothing more arrives on that
    connection). So the flush runs in a task with a long timeout of its own,
    which outlives a caller that gives up or is cancelled, and ends when its
    PONG comes (or the connection closes).
    """
    task = asyncio.ensure_future(nc.flush(timeout=_PONG_WAIT))  # type: ignore[arg-type]
    _round_trips.add(task)
    task.add_done_callback(_forget_round_trip)
    done, _ = await asyncio.wait({task}, timeout=timeout)
    if not done:
        raise nats.errors.TimeoutError
    task.result()


def _forget_round_trip(task: asyncio.Task[None]) -> None:
    _round_trips.discard(task)
    if not task.cancelled():
        task.exception()  # retrieved: a late failure is nobody's to raise


RESEND_BEFORE_LOSS = 2.0
"""Seconds before a connection's loss whose replies are sent again once it
is back: a reply the server had taken but not yet passed on (to a client
of another cluster node, say) when it died. A killed server's connections
end at once, so the loss is found within milliseconds of it."""

RECENT_REPLIES = 1024
"""Most replies a loop keeps for sending again."""

RECENT_BYTES = 1024 * 1024
"""Most bytes of replies a loop keeps for sending again."""


class RecentReplies:
    """The replies a serving loop sent last, each with when it was sent
    (``time.monotonic()``), within :data:`RECENT_REPLIES` and
    :data:`RECENT_BYTES`: those a connection's loss may have lost."""

    __slots__ = ("_bytes", "_entries", "most_bytes")

    def __init__(self, most: int = RECENT_REPLIES, most_bytes: int = RECENT_BYTES) -> None:
        self.most_bytes = most_bytes
        # Bounded by count itself (the oldest dropped as one is added, in C):
        # a Python loop is left only for the bytes, which rarely bind.
        self._entries: deque[tuple[float, str, bytes]] = deque(maxlen=most)
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def most(self) -> int:
        """The most replies kept."""
        return self._entries.maxlen or 0

    def add(self, subject: str, payload: bytes) -> None:
        """Keep the reply ``payload`` sent to ``subject`` now, dropping the
        oldest past the limits (one larger than them all is not kept)."""
        size = len(payload)
        if size > self.most_bytes:
            return
        entries = self._entries
        if len(entries) == entries.maxlen:
            if not entries:
                return  # it keeps none
            size -= len(entries[0][2])  # the oldest, which the append drops
        entries.append((time.monotonic(), subject, payload))
        self._bytes += size
        while self._bytes > self.most_bytes:
            self._bytes -= len(entries.popleft()[2])

    def since(self, when: float) -> list[tuple[str, bytes]]:
        """The replies sent at ``when`` or later, oldest first."""
        entries = self._entries
        found: list[tuple[str, bytes]] = []
        for sent, subject, payload in reversed(entries):
            if sent < when:
                break
            found.append((subject, payload))
        found.reverse()
        return found


class ServeLoop:
    """Serves one subject until stopped; owns and awaits its handler tasks.

    Args:
        nc: the connection.
        subject: the subject to serve.
        handler: makes each reply.
        limiter: bounds the handlers running at once.
        source: ``sender``/``source_component`` of the error replies made here.
        encode: encodes a reply, checking the server's size limit.
        reconnects: the connection's losses and re-establishments; the
            replies sent just before a loss are sent again after it
            (``None``: they are not).
    """

    _loop: asyncio.AbstractEventLoop
    """The loop :meth:`run` serves in."""

    _context: contextvars.Context
    """The context :meth:`run` was started in: each handler's starts as a copy."""

    def __init__(
        self,
        nc: NATS,
        subject: str,
        handler: Handler,
        *,
        limiter: asyncio.Semaphore,
        source: str,
        encode: Callable[[Message], bytes],
        reconnects: Reconnects | None = None,
        span_name: str | None = None,
    ) -> None:
        self._nc = nc
        self._reconnects = reconnects
        self.recent = RecentReplies()
        """The replies sent last, for sending again after a connection's loss."""
        self._subject = subject
        self._handler = handler
        self._limiter = limiter
        self._source = source
        self._encode = encode
        self._tasks: dict[int, asyncio.Task[None]] = {}
        """The handlers running, by the id of the message each handles."""
        self._span_name = span_name or _span_name(subject)
        """What a request's span is called (when tracing is on)."""
        self._by_fields = False
        """Whether the limiter's places are taken and given back by its fields
        (:func:`~fleetbus.bus._seam.take_place`)."""
        self._publish_now = (
            nc.publish_now if isinstance(nc, Client) and "publish_now" in AVAILABLE else None
        )
        """Queues a reply without a coroutine, when the connection is plainly up."""

    async def run(
        self,
        *,
        stop: asyncio.Event,
        queue: str | None,
        drain_timeout: float,
        ready: asyncio.Event | None,
    ) -> None:
        """Serve until ``stop`` is set, then drain (see :meth:`Bus.serve`)."""
        # Kept: asyncio.get_running_loop() makes a getpid system call (Python
        # 3.11), on every request otherwise.
        self._loop = asyncio.get_running_loop()
        # The handlers start in the context this loop was started in, as
        # those that nats-py's subscription task starts do.
        self._context = contextvars.copy_context()
        try:
            sub = await self._nc.subscribe(self._subject, queue=queue or "", cb=self._dispatch)
            self._by_fields = "places" in AVAILABLE and isinstance(self._limiter, asyncio.Semaphore)
            if isinstance(self._nc, Client) and self._by_fields and "route" in AVAILABLE:
                self._nc.route(sub, self._take, bare=True)
            await settle(self._nc)
        except nats.errors.ConnectionClosedError as exc:
            raise ConnectionClosedError(f"cannot serve {self._subject}: connection closed") from exc
        except (nats.errors.Error, TimeoutError) as exc:
            raise BusError(f"cannot subscribe to {self._subject}: {exc}") from exc
        if ready is not None:
            ready.set()
        resending = (
            self._loop.create_task(self._resend_after_losses(self._reconnects))
            if self._reconnects is not None
            else None
        )
        try:
            await stop.wait()
            await self._drain(sub, drain_timeout)
        finally:
            if resending is not None:
                resending.cancel()
                await asyncio.wait([resending])
            # Cancelled, or the drain ran out of time: nothing outlives the loop.
            tasks = dict(self._tasks)
            for task in tasks.values():
                task.cancel()
            if tasks:
                await asyncio.gather(*tasks.values(), return_exceptions=True)
            for key, task in tasks.items():
                if self._tasks.get(key) is task:
                    # Cancelled before it started: its ``finally`` never ran.
                    del self._tasks[key]
                    self._limiter.release()

    async def _resend_after_losses(self, reconnects: Reconnects) -> None:
        """Each time the connection is back after a loss, send again the
        replies sent from :data:`RESEND_BEFORE_LOSS` seconds before it."""
        back = reconnects.next()
        while True:
            await back.wait()
            back = reconnects.next()  # armed already: a loss while sending is not missed
            lost_at = reconnects.lost_at
            if lost_at is None:
                continue  # back without a loss seen: nothing was lost
            again = self.recent.since(lost_at - RESEND_BEFORE_LOSS)
            sent = 0
            for subject, payload in again:
                try:
                    await self._nc.publish(subject, payload)
                except nats.errors.Error as exc:
                    logger.warning(
                        "replies on %s not sent again: %s", self._subject, exc or type(exc).__name__
                    )
                    break
                sent += 1
            if again:
                logger.info(
                    "sent %d of %d repl%s on %s again: the connection was lost just after",
                    sent,
                    len(again),
                    "y" if len(again) == 1 else "ies",
                    self._subject,
                )

    async def _drain(self, sub: Subscription, timeout: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        try:
            # No new requests; those already received are still dispatched.
            # The server has the UNSUB before the subscription goes: one
            # routed here before it would otherwise be dropped unanswered
            # (:func:`~fleetbus.bus._seam.unsubscribe_ahead`).
            async with asyncio.timeout(timeout):
                if not self._nc.is_closed and not self._nc.is_draining:
                    if await unsubscribe_ahead(self._nc, sub):
                        wait = min(deadline - loop.time(), _UNSUBSCRIBE_WAIT)
                        await settle(self._nc, max(wait, 0.001))
                    await sub.drain()  # type: ignore[no-untyped-call]
        except (TimeoutError, nats.errors.Error) as exc:
            logger.warning("draining %s: %s", self._subject, exc or type(exc).__name__)
            try:
                await sub.unsubscribe()
            except nats.errors.Error:
                pass  # already gone with the connection
        if self._tasks:
            remaining = max(0.0, deadline - loop.time())
            _, late = await asyncio.wait(set(self._tasks.values()), timeout=remaining)
            if late:
                logger.warning(
                    "%d request(s) on %s still running after %.3gs; cancelling them",
                    len(late),
                    self._subject,
                    timeout,
                )

    async def _dispatch(self, msg: Received) -> None:
        # nats-py awaits this from the subscription's own task, one message at
        # a time, for the requests not taken directly (:meth:`_take`). An
        # exception here would vanish into nats-py's error callback, so none
        # may escape.
        try:
            await self._limiter.acquire()
            self._start(msg)
        except Exception:
            logger.exception("cannot dispatch a request on %s", self._subject)

    def _take(self, msg: Received) -> bool:
        """Start handling ``msg`` now, from the connection's read loop
        (:class:`~fleetbus.bus._seam.Client`), if a place is free and
        nobody waits for one; else say no (nats-py queues it for
        :meth:`_dispatch`)."""
        if not take_place(self._limiter):
            return False
        try:
            self._start(msg)
        except Exception:
            self._limiter.release()
            logger.exception("cannot dispatch a request on %s", self._subject)
        return True

    def _start(self, msg: Received) -> None:
        self._tasks[id(msg)] = self._loop.create_task(
            self._handle(msg), context=self._context.copy()
        )

    async def _handle(self, msg: Received) -> None:
        try:
            try:
                message = decode(msg.data)
            except ProtocolError as exc:
                reply: Message | None = self._undecodable(msg, exc)
            else:
                logs.serving(message)  # every line this task logs carries its ids
                # The handler is awaited here, not in a coroutine of its own:
                # one frame less on every request.
                try:
                    request = Request(message, msg.subject, len(msg.data), msg.reply)
                    headers = msg.headers
                    if headers and tracing.carry_unsampled(headers):
                        # A trace not sampled: its context is this task's
                        # now, and no span is made (nor its attributes).
                        reply = await self._handler(request)
                    else:
                        parent = tracing.extract(headers) if headers else None
                        if parent is None and not tracing.enabled():
                            # Positional arguments: a quarter cheaper than keywords.
                            reply = await self._handler(request)
                        else:
                            reply = await self._traced(request, parent)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    logger.exception(
                        "handler for %s failed", msg.subject, extra={"call_id": message.call_id}
                    )
                    reply = self._error(
                        message, "internal", f"internal error: {type(exc).__name__}: {exc}"
                    )
            if reply is None:
                return
            if not msg.reply:
                logger.warning(
                    "request on %s has no reply subject; answer dropped: %s",
                    msg.subject,
                    type(reply).__name__,
                    extra={"call_id": reply.call_id},
                )
                return
            try:
                payload = self._encode(reply)
            except (PayloadTooLargeError, ProtocolError) as exc:
                logger.warning("reply on %s cannot be sent: %s", msg.subject, exc)
                payload = self._unsendable(reply, exc)
            # Kept first: a reply nats-py cannot take now (its buffer full
            # while it reconnects) goes out again once the connection is back.
            self.recent.add(msg.reply, payload)
            try:
                if self._publish_now is None or not self._publish_now(msg.reply, payload):
                    await self._nc.publish(msg.reply, payload)
            except nats.errors.Error as exc:
                logger.warning("reply on %s not sent: %s", msg.subject, exc or type(exc).__name__)
        except Exception:
            logger.exception("request handling on %s failed", self._subject)
        finally:
            # The task's own bookkeeping: cheaper than a done callback (one
            # more loop callback per request).
            self._tasks.pop(id(msg), None)
            if self._by_fields:
                give_place(self._limiter)
            else:
                self._limiter.release()

    def _undecodable(self, msg: Received, exc: ProtocolError) -> ErrorMessage:
        """The answer to a request that did not decode: its ids come from the error."""
        logger.warning(
            "bad request on %s: %s",
            msg.subject,
            clip(str(exc), _LOGGED_CHARS),
            extra={"call_id": exc.call_id},
        )
        return ErrorMessage(
            sender=self._source,
            session_id=exc.session_id,
            call_id=exc.call_id,
            code=exc.code,
            message=str(exc),
            source_component=self._source,
        )

    async def _traced(
        self, request: Request, parent: otel_context.Context | None
    ) -> Message | None:
        """The handler's reply, made in a span (a child of the trace the
        request carries, if any)."""
        message = request.message
        with tracing.span(
            self._span_name,
            kind=tracing.SpanKind.SERVER,
            parent=parent,
            attributes={
                "fleetbus.subject": request.subject,
                "fleetbus.call_id": message.call_id,
                "fleetbus.session_id": message.session_id,
                "fleetbus.sender": message.sender,
                "fleetbus.served_by": self._source,
            },
        ):
            return await self._handler(request)

    def _unsendable(self, reply: Message, exc: Exception) -> bytes:
        """The ``internal`` error that answers instead of ``reply``, which
        could not be sent. It keeps the request's ids when they fit: a
        ``call_id`` as large as the server's limit does not."""
        error = self._error(reply, "internal", f"the reply could not be sent: {exc}")
        payload = encode(error)
        if len(payload) > self._nc.max_payload:
            payload = encode(msgspec.structs.replace(error, call_id=None, session_id=None))
        return payload

    def _error(self, about: Message, code: ErrorCode, text: str) -> ErrorMessage:
        return error_reply(about, code, clip(text), source=self._source)


def _span_name(subject: str) -> str:
    """The span of a request served on ``subject``: ``fleetbus tool run`` on a
    tool subject, ``fleetbus model worker`` on a model's, ``fleetbus agent
    request`` on an agent inbox, else ``fleetbus request``."""
    tokens = subject.split(".")
    if len(tokens) >= 3 and tokens[-2] == "tool":
        return "fleetbus tool run"
    if len(tokens) >= 3 and tokens[-2] == "model":
        return "fleetbus model worker"
    if tokens[-1] == "inbox":
        return "fleetbus agent request"
    return "fleetbus request"
