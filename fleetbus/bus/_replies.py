"""The bus's own machinery for requests: the reply inbox every request of a
connection shares, the connection's re-establishments as events, and the
permission violations the server reports.

Kept apart from :mod:`fleetbus.bus.connection`, which uses them.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import math
import re
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import nats.errors
from nats.aio.client import NO_RESPONDERS_STATUS
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js.api import Header

from fleetbus.bus._seam import Client, Delivered, Received
from fleetbus.errors import PermissionDeniedError

__all__ = [
    "RESEND_AFTER",
    "RESEND_MAX",
    "Denials",
    "Interruption",
    "Reconnects",
    "Replies",
    "permission_denied",
]

logger = logging.getLogger(__name__)

_VIOLATION = re.compile(r'permissions violation for (publish|subscription) to "([^"]*)"')


def permission_denied(error: BaseException) -> PermissionDeniedError | None:
    """The permission violation the server reported in ``error`` (what
    nats-py hands its ``error_cb``: ``nats: permissions violation for publish
    to "<subject>"``, lower-cased), or ``None`` for any other error."""
    found = _VIOLATION.search(str(error).lower())
    if found is None:
        return None
    operation, subject = found.groups()
    return PermissionDeniedError(
        f"permission denied: {operation} to {subject}", operation=operation, subject=subject
    )


RESEND_AFTER = 3.0
"""Seconds a request that asked for a receipt waits for it before it is sent
again, by default (:class:`~fleetbus.agents.serving.RemoteAgent`, agents
asking each other)."""

RESEND_MAX = 30.0
"""Seconds at most between two sendings of a request awaiting its receipt."""


_BACK = Delivered(subject="", reply="", data=b"")
"""What wakes a request waiting for its answer when the connection is back
(:meth:`Replies.reconnected`)."""


def _no_responders(msg: Received) -> bool:
    headers = msg.headers
    return headers is not None and headers.get(Header.STATUS) == NO_RESPONDERS_STATUS


class Denials:
    """The permission violations the server reported on a connection, newest
    last, numbered, so a caller can ask for those that came after a mark."""

    def __init__(self, keep: int = 64) -> None:
        self.count = 0
        """How many were reported (the mark of the next is ``count``)."""
        self._recent: deque[tuple[int, PermissionDeniedError]] = deque(maxlen=keep)

    def add(self, denial: PermissionDeniedError) -> None:
        """Record one."""
        self.count += 1
        self._recent.append((self.count, denial))

    def since(
        self, mark: int, operation: str | None = None, subject: str | None = None
    ) -> PermissionDeniedError | None:
        """The last violation reported after ``mark`` (a :attr:`count`), of
        ``operation`` on ``subject`` if given, with ``subject`` written as
        the caller wrote it (the server's text is lower-cased)."""
        for number, denial in reversed(self._recent):
            if number <= mark:
                break
            if operation is not None and denial.operation != operation:
                continue
            if subject is not None:
                if denial.subject != subject.lower():
                    continue
                return PermissionDeniedError(
                    f"permission denied: {denial.operation} to {subject}",
                    operation=denial.operation,
                    subject=subject,
                )
            return denial
        return None


class Replies:
    """Requests, and their replies on one wildcard inbox subscription: what
    nats-py's ``request`` does, for less.

    nats-py makes each request's token with its NUID (a loop in Python) and
    two random bytes (a ``getrandom`` system call), its future with
    ``asyncio.Future()`` (a ``getpid`` system call, Python 3.11), and waits
    with ``asyncio.wait_for``: a reply then takes three loop callbacks to
    reach the caller. Here a token is a counter, and a reply wakes the
    caller directly: a request costs the client about two thirds of the CPU
    nats-py's ``request`` takes (against a trivial responder, 64 requests in
    flight), and the client's CPU is what bounds the throughput of
    ``bench/tool_calls.py``.

    Deadlines share one loop timer, armed for the earliest: a timer armed
    and cancelled per request costs ten times what a heap entry does
    (asyncio and uvloop alike). Entries of requests already over are dropped
    when they come first, or all at once when they outnumber the rest.

    Replies to a request given up on (timed out, cancelled) are dropped, as
    nats-py does; nats-py subscribes the inbox again after a reconnection,
    and a request that asked for a receipt is then sent again
    (:meth:`reconnected`): its answer may have come while the connection was
    away.

    A permission violation the server reports (:meth:`deny`) fails at once
    the requests it stops: those published to the subject refused, or all of
    them when the inbox's subscription is refused. Each request keeps its
    subject for that, in a tuple with its future (no measurable cost).
    """

    _loop: asyncio.AbstractEventLoop
    """The loop of the first request (nats-py's client serves one loop)."""

    def __init__(self, nc: NATS) -> None:
        self._nc = nc
        self._waiting: dict[str, tuple[asyncio.Future[Received | None], str]] = {}
        """Pending requests by token: the future of the reply, the subject."""
        self._inbox = ""
        """``<inbox prefix>.<unique>.``; a request's reply subject adds its token."""
        self._sent = 0
        self._opening = asyncio.Lock()
        self._deadlines: list[tuple[float, str]] = []
        """A heap of (deadline, token), some of requests already over."""
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = math.inf
        self._receipts: dict[str, bool] = {}
        """Requests that asked for a receipt, by token: whether it came."""
        self._sent_at: dict[str, float] = {}
        """Requests that asked for a receipt, by token: when last sent (loop time)."""
        self._overtaken_before = -math.inf
        """Requests last sent before this (loop time) and still without a
        receipt are presumed lost (see :meth:`_due`)."""
        self._passed_before = -math.inf
        """Requests last sent before this (loop time) were passed: a request
        sent after them has had its receipt (see :meth:`_due`)."""
        self._receipt_at = -math.inf
        """When the last receipt came (loop time)."""
        self._newest_sent = -math.inf
        """When the last request that asked for a receipt was sent (loop time)."""
        self._losses = 0
        """How many times the connection was lost (see :meth:`lost`)."""
        self._until_receipt: set[str] = set()
        """Requests whose receipt is what they wait for, by token."""
        self._streams: dict[str, Callable[[Received], bool]] = {}
        """Requests that take messages before their reply, by token: what
        takes each (``True``: it was not the reply)."""

    async def request(
        self,
        subject: str,
        payload: bytes,
        timeout: float,
        headers: dict[str, str] | None = None,
        resend: float | None = None,
        stream: Callable[[Received], bool] | None = None,
        until_receipt: bool = False,
    ) -> Received:
        """Publish ``payload`` (with ``headers``) on ``subject`` and wait
        ``timeout`` seconds for the reply.

        With ``until_receipt`` (and ``resend``), the receipt is what is
        waited for and returned: the answer goes elsewhere.

        With ``stream``, every message that comes to the request's reply
        subject is handed to it first, as it comes (from the connection's
        read loop: it must not block nor raise); one it returns ``True`` for
        is not the reply (a delta of a streamed tool result), and the wait
        goes on.

        With ``resend``, the request asked for a receipt (an empty message on
        its reply subject once the responder has durably taken it): until one
        comes, it is published again, the same payload to the same reply
        subject, ``resend`` seconds after the first sending, then after twice as
        long each time (up to :data:`RESEND_MAX`), or sooner, once requests sent
        well after it have had their receipts, or once receipts stopped after
        later requests had theirs, or after it was sent last (:meth:`_due`). A
        receipt is not the reply: the wait goes on for the reply. "No
        responders" to a request sent again, or sent before the connection was
        lost, is not the reply either (its only responder may be restarting, or
        subscribing again): it is sent again within :data:`RESEND_AFTER`, until
        ``timeout``. When the connection is back it is sent again at once,
        receipt or not, and until a receipt comes again (:meth:`reconnected`).

        Raises:
            nats.errors.TimeoutError: no reply in time.
            nats.errors.NoRespondersError: nobody serves ``subject`` (when it
                is first sent).
            nats.errors.Error: what publishing raises.
            PermissionDeniedError: the server refused the publish, or the
                subscription of the inbox.
        """
        if not self._inbox:
            await self._open()
        self._sent += 1
        token = str(self._sent)
        loop = self._loop
        reply: asyncio.Future[Received | None] = loop.create_future()
        self._waiting[token] = (reply, subject)
        self._expect(loop.time() + timeout, token)
        if resend is not None:
            self._receipts[token] = False  # (before it is sent: the receipt may come at once)
            self._sent_at[token] = self._newest_sent = loop.time()
            if until_receipt:
                self._until_receipt.add(token)
        if stream is not None:
            self._streams[token] = stream
        try:
            nc = self._nc
            if not isinstance(nc, Client) or not nc.publish_now(
                subject, payload, self._inbox + token, headers
            ):
                await nc.publish(subject, payload, reply=self._inbox + token, headers=headers)
            if resend is None:
                msg = await reply
            else:
                # (sent on a connection lost since, or not up: buffered)
                losses = self._losses if nc.is_connected else -1
                msg = await self._until_answered(
                    token, reply, subject, payload, headers, resend, losses
                )
        finally:
            del self._waiting[token]
            if resend is not None:
                del self._receipts[token]
                del self._sent_at[token]
                self._until_receipt.discard(token)
            if stream is not None:
                del self._streams[token]
        if msg is None:
            raise nats.errors.TimeoutError
        if _no_responders(msg):
            raise nats.errors.NoRespondersError
        return msg

    async def _until_answered(
        self,
        token: str,
        reply: asyncio.Future[Received | None],
        subject: str,
        payload: bytes,
        headers: dict[str, str] | None,
        resend: float,
        losses: int,
    ) -> Received | None:
        """The reply to the request ``token``, sending it again while no
        receipt came (see :meth:`request`), and at once when the connection
        is back (:meth:`reconnected`). "No responders" is the reply only to
        its first sending, before any receipt, on a connection not lost since
        (``losses``: :attr:`_losses` when it was sent)."""
        loop = self._loop
        interval = max(resend, 0.001)
        sent = 1
        while True:
            timeout = None
            if not self._receipts.get(token):
                # Due ``interval`` after it was sent, or sooner (see _due):
                # looked at every RESEND_AFTER at most.
                due = self._sent_at[token] + interval - loop.time()
                timeout = max(0.0, min(due, RESEND_AFTER))
            await asyncio.wait((reply,), timeout=timeout)
            back = False
            if reply.done():
                msg = reply.result()
                back = msg is _BACK
                if not back:
                    if msg is None or not _no_responders(msg):
                        return msg
                    if sent == 1 and losses == self._losses and not self._receipts.get(token):
                        return msg  # nobody serves it
                # Nobody serves it now (a replica may be starting, or
                # subscribing again after a reconnection), or the connection
                # is back and its answer may have come while it was away:
                # soon again, until a receipt comes.
                reply = self._loop.create_future()
                self._waiting[token] = (reply, subject)
                interval = min(interval, RESEND_AFTER)
                if not back:
                    continue
            elif self._receipts.get(token) or not self._due(token, interval, sent == 1):
                continue
            sent += 1
            logger.debug(
                "%s: sending the request on %s again (#%d)",
                "the connection is back" if back else "no receipt",
                subject,
                sent,
            )
            self._sent_at[token] = self._newest_sent = loop.time()
            await self._nc.publish(subject, payload, reply=self._inbox + token, headers=headers)
            if not back:
                interval = min(interval * 2, RESEND_MAX)

    async def _open(self) -> None:
        async with self._opening:
            if self._inbox:
                return
            inbox = f"{self._nc.new_inbox()}."
            sub = await self._nc.subscribe(f"{inbox}*", cb=self._deliver)
            if isinstance(self._nc, Client):
                self._nc.route(sub, self._take, bare=True)
            # Kept: asyncio.get_running_loop() makes a getpid system call
            # (Python 3.11), on every request otherwise.
            self._loop = asyncio.get_running_loop()
            self._inbox = inbox

    async def _deliver(self, msg: Msg) -> None:
        self._take(msg)

    def _take(self, msg: Received) -> bool:
        """Wake the request ``msg`` answers (or note its receipt): straight
        from the connection's read loop
        (:class:`~fleetbus.bus._seam.Client`), or from the subscription's
        callback. Always taken."""
        token = msg.subject[len(self._inbox) :]
        if not msg.data and token in self._receipts and not msg.headers:
            if not self._receipts[token]:
                self._overtake(token)
            self._receipts[token] = True  # a receipt, not the reply
            if token in self._until_receipt:  # ...but what is waited for
                entry = self._waiting.get(token)
                if entry is not None and not entry[0].done():
                    entry[0].set_result(msg)
            return True
        if self._streams:
            take = self._streams.get(token)
            if take is not None and take(msg):
                return True  # taken before the reply (a delta)
        entry = self._waiting.get(token)
        if entry is not None and not entry[0].done():
            entry[0].set_result(msg)
        return True

    def _overtake(self, token: str) -> None:
        """The receipt of ``token`` came (now: receipts still come): the
        requests sent before it and still without one were passed, and those
        sent well before it (by more than :data:`RESEND_AFTER`, and than its
        wait) are presumed lost (see :meth:`_due`)."""
        sent = self._sent_at[token]
        now = self._receipt_at = self._loop.time()
        self._overtaken_before = max(self._overtaken_before, sent - max(RESEND_AFTER, now - sent))
        self._passed_before = max(self._passed_before, sent)

    def _due(self, token: str, interval: float, first: bool) -> bool:
        """Whether ``token``, still without a receipt, is sent again now:
        ``interval`` passed since it was last sent; or it was overtaken — a
        request sent after it (later by more than :data:`RESEND_AFTER`, and
        than that request's whole wait) has had its receipt; or no receipt at
        all came for :data:`RESEND_AFTER`, and it was passed — a request sent
        after it has had its receipt — or it is the last request sent, sent
        once (``first``), :data:`RESEND_AFTER` ago.

        The responder that holds an overtaken request queued is likely gone with
        it (a host replica killed with requests it had not taken yet, which a
        simulation's runner would otherwise wait a quarter of its round's
        deadline to send again). A responder takes requests in the order they
        come, so a request queued behind replies that take minutes is not
        overtaken for waiting its turn there. Several responders' queues do not
        drain in step: one waiting in a longer queue may be overtaken, and its
        copy may go to a shorter one (200 requests of 1 s replies on two hosts
        of two places each, 20 in flight: 24 to 63 copies in seven runs);
        whichever copy comes second finds the request taken, or answered, and
        costs a lease read. The order is the connection's, over every subject: a
        request to a slow responder may be overtaken by one to a fast responder,
        and copied the same way (the requesters that wait long between sendings,
        a simulation's runner, ask one host group). At a round's end nothing is
        sent later to overtake the requests a dead responder held; the other
        responders then take their last requests and their receipts stop: the
        requests passed, the dead one's, are sent again then (one queued behind
        minutes-long replies on a live responder may be copied too, once per
        stall: its copy is answered once as well). The last request sent, which
        nothing passes, is sent again then too, once: where replies are so slow
        that no receipt comes for that long, most requests get a copy this way
        (12 requests of 4-s replies on one responder of one place, 6 in flight:
        8 copies, each answered once)."""
        sent = self._sent_at[token]
        now = self._loop.time()
        if now - sent >= interval or sent < self._overtaken_before:
            return True
        if now - self._receipt_at < RESEND_AFTER:
            return False  # receipts still come
        return sent < self._passed_before or (
            first and sent >= self._newest_sent and now - sent >= RESEND_AFTER
        )

    def lost(self) -> None:
        """The connection is lost: a "no responders" to a request sent
        before is no longer the sign that nobody serves it (the responders
        may be subscribing again, as this client is)."""
        self._losses += 1

    def reconnected(self) -> None:
        """The connection is back: an answer published while it was away is
        lost. Each request that asked for a receipt and still waits is sent
        again at once (the same message to the same reply subject), its
        receipt come or not, and again as ``resend`` says (from
        :data:`RESEND_AFTER` at most) until a receipt comes again: its
        responder answers it from where it is (the reply still running takes
        it as the same request, one answered already sends its answer
        again), and a copy may find the responders not subscribed again yet
        (a server restarted)."""
        if not self._receipts:
            return
        logger.info(
            "the connection is back: %d request(s) awaiting an answer sent again",
            len(self._receipts),
        )
        for token in self._receipts:
            self._receipts[token] = False
            reply = self._waiting[token][0]
            if not reply.done():
                reply.set_result(_BACK)

    def deny(self, denial: PermissionDeniedError) -> bool:
        """Fail the requests ``denial`` stops (see the class); whether any.

        The server's text is lower-cased: subjects are compared so, and each
        error names the subject as the request wrote it.
        """
        if denial.operation == "subscription":
            if not self._inbox or denial.subject != f"{self._inbox}*".lower():
                return False
            refused = f"{self._inbox}*"
            self._inbox = ""  # the next request subscribes again (and learns the same)
            stopped = [(entry[0], refused) for entry in self._waiting.values()]
        else:
            stopped = [
                entry for entry in self._waiting.values() if entry[1].lower() == denial.subject
            ]
        for future, subject in stopped:
            if not future.done():
                future.set_exception(
                    PermissionDeniedError(
                        f"permission denied: {denial.operation} to {subject}",
                        operation=denial.operation,
                        subject=subject,
                    )
                )
        return bool(stopped)

    def _expect(self, deadline: float, token: str) -> None:
        """Give up on the request ``token`` at ``deadline`` (loop time)."""
        deadlines = self._deadlines
        heapq.heappush(deadlines, (deadline, token))
        if len(deadlines) > 2 * len(self._waiting) + 64:
            # Mostly requests already over: keep those still waiting.
            waiting = self._waiting
            deadlines[:] = [entry for entry in deadlines if entry[1] in waiting]
            heapq.heapify(deadlines)
        if deadline < self._timer_at:
            self._arm(deadline)

    def _arm(self, when: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self._loop.call_at(when, self._expire)
        self._timer_at = when

    def _expire(self) -> None:
        """Answer ``None`` to the requests whose deadline has come (their
        waiters raise the timeout; a result, not an exception, as nobody may
        be there to take it), and arm the timer for the next one."""
        self._timer = None
        self._timer_at = math.inf
        now = self._loop.time()
        deadlines = self._deadlines
        while deadlines:
            deadline, token = deadlines[0]
            entry = self._waiting.get(token)
            reply = None if entry is None else entry[0]
            if reply is not None and not reply.done():
                if deadline > now:
                    # uvloop keeps time in whole milliseconds and may fire up
                    # to half of one early: not again before the next one.
                    self._arm(max(deadline, now + 0.001))
                    return
                reply.set_result(None)
            heapq.heappop(deadlines)


class Reconnects:
    """The connection's re-establishments, as events to wait on, or as
    cancellations of the tasks that asked to be interrupted."""

    def __init__(self) -> None:
        self._next = asyncio.Event()
        self._interrupting: set[Interruption] = set()
        self.count = 0
        self.lost_at: float | None = None
        """When (``time.monotonic()``) the connection was last found lost;
        ``None`` until it first is."""

    def lost(self) -> None:
        """The connection is found lost (nats-py reconnects): note when."""
        self.lost_at = time.monotonic()

    def next(self) -> asyncio.Event:
        """Set when the connection is next re-established."""
        return self._next

    def interrupt(self, task: asyncio.Task[Any]) -> Interruption:
        """Cancel ``task`` when the connection is next re-established (once);
        hand the result to :meth:`forget` when that no longer matters."""
        interruption = Interruption(task)
        self._interrupting.add(interruption)
        return interruption

    def forget(self, interruption: Interruption) -> None:
        """Do not interrupt that task (any more)."""
        self._interrupting.discard(interruption)

    def happened(self) -> None:
        """The connection is back: wake who waits, interrupt who asked, and
        arm the next event."""
        self.count += 1
        event, self._next = self._next, asyncio.Event()
        interrupting, self._interrupting = self._interrupting, set()
        event.set()
        for interruption in interrupting:
            interruption.fire("the connection was re-established")


class Interruption:
    """A task to cancel on the next reconnection (see :meth:`Reconnects.interrupt`)."""

    __slots__ = ("ended", "interrupted", "task")

    def __init__(self, task: asyncio.Task[Any]) -> None:
        self.task = task
        self.interrupted = False
        """Set when the task was cancelled for it."""
        self.ended = False
        """Set when the wait it interrupts is over, however it ended."""

    def fire(self, why: str) -> None:
        """End the wait now, as unanswered (once; nothing once it is over)."""
        if self.interrupted or self.ended:
            return
        self.interrupted = True
        self.task.cancel(why)
