"""nats-py's client as the bus uses it: headers parsed in half the CPU,
messages handed to the bus's own receivers from the read loop itself, and
publishes (with a traced request's headers too) queued without nats-py's
coroutines while the connection is up (:meth:`Client.publish_now`). What each step saved, measured:
docs/performance.md, "the bus's own message path".

nats-py delivers each message of a subscription with a callback through an
``asyncio.Queue`` and a task of the subscription's that takes from it and
awaits the callback: a put, a get, a ``task_done`` and the task's wake-up for
every message. The bus's receivers — a serving loop starting the handler of
a request, the reply inbox waking a caller — only start or wake a task, and
never wait, so they can take the message where nats-py parses it. Counted
with callgrind (instructions, not seconds: the same on a busy machine), a
tool worker serving ``bench/tool_calls.py``'s no-op tool, its requests fed
to this method: 144.1k instructions a call before, 138.7k with the route
(129.3k once the serving loop also takes its place without ``locked()``).

A receiver may decline a message (a serving loop with every place taken):
that one, and those after it while any wait, go through nats-py's queue as
before, so their order, the pending limits, slow-consumer errors and
``drain`` are nats-py's.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import msgspec
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

__all__ = ["Client", "Delivered", "Received", "Route"]

_UNSAFE = re.compile(r"[ \t\r\n]")
"""What a subject may not hold (a CR LF would end the command: nats-py
refuses the same)."""

_HEADER_SPACE = " \t\n\r\x0b\x0c"
"""What ``bytes.strip`` strips: around a header's name and value."""


_HEADER_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
"""A header name ``publish`` writes as it is (an RFC 9110 token)."""

_HEADER_BREAK = re.compile(r"[\r\n]")


def _header_block(headers: dict[str, str]) -> bytes | None:
    """The header block ``publish`` writes for ``headers`` (``NATS/1.0``, a
    ``name: value`` line each, an empty line), when each is plain: a token
    for a name, a value without a line break or whitespace around it (what
    ``publish`` would change or refuse). ``None`` otherwise."""
    lines = ["NATS/1.0\r\n"]
    for name, value in headers.items():
        if (
            _HEADER_NAME.fullmatch(name) is None
            or _HEADER_BREAK.search(value) is not None
            or value != value.strip()
        ):
            return None
        lines.append(f"{name}: {value}\r\n")
    lines.append("\r\n")
    return "".join(lines).encode()


class Delivered(msgspec.Struct, gc=False):
    """A message as a route that asks for it bare takes it: the four
    fields of nats-py's ``Msg`` that a serving loop and the reply inbox
    read, made in an eighth of
    the time (43 against 347 ns; a ``Msg`` is a dataclass of eight fields
    made by keyword). Not for what nats-py's own code reads (JetStream's
    replies read ``Msg.header``, its metadata, its acks)."""

    subject: str
    reply: str
    data: bytes
    headers: dict[str, str] | None = None


Received = Msg | Delivered
"""A message a route takes, or nats-py's queue hands its subscription's callback."""

Route = Callable[[Received], bool]
"""A subscription's receiver: takes a message now, or says it does not
(``False``: nats-py's queue takes it); must not raise."""


class Client(NATS):
    """nats-py's client, with direct routes (see the module) and a faster
    header parser.

    Every lease write a host makes comes back to every host, republished with
    seven headers; nats-py's parser tests each character of each name in a
    generator (19 us for those seven on a slow machine, 10 us here). The
    result is the same: lines without a colon, and names that are not ASCII
    or hold whitespace, are left out; invalid UTF-8 in a value becomes
    U+FFFD."""

    def __init__(self) -> None:
        super().__init__()
        self._routes: dict[int, tuple[Route, bool]] = {}

    def route(self, sub: Subscription, take: Route, *, bare: bool = False) -> None:
        """Hand ``sub``'s messages to ``take`` as they are parsed, while none
        waits in nats-py's queue; those it declines go there (the
        subscription still needs its callback, for them). ``bare``: as
        :class:`Delivered`, not nats-py's ``Msg``."""
        self._routes[sub._id] = (take, bare)

    def _remove_sub(self, sid: int, max_msgs: int = 0) -> None:
        self._routes.pop(sid, None)
        super()._remove_sub(sid, max_msgs)

    async def _process_msg(
        self, sid: int, subject: bytes, reply: bytes, data: bytes, headers: bytes
    ) -> None:
        route = self._routes.get(sid)
        if route is not None:
            sub = self._subs.get(sid)
            if sub is not None and sub._pending_queue.empty():
                hdr = await self._process_headers(headers) if headers else None
                take, bare = route
                if bare:
                    msg: Received = Delivered(subject.decode(), reply.decode(), data, hdr)
                else:
                    msg = self._build_message(sid, subject, reply, data, hdr)
                if take(msg):
                    stats = self.stats
                    stats["in_msgs"] += 1
                    stats["in_bytes"] += len(data)
                    sub._received += 1
                    return
        # Declined (and made again there: only while a receiver is full).
        await super()._process_msg(sid, subject, reply, data, headers)

    def publish_now(
        self,
        subject: str,
        payload: bytes,
        reply: str = "",
        headers: dict[str, str] | None = None,
    ) -> bool:
        """Queue a publish of ``payload`` on ``subject`` (with ``headers``)
        for the flusher, as ``publish`` does on a connection that is up,
        without its three coroutines, its subject regular expression and the
        future it makes to wake the flusher: 1.7 us a publish through
        ``publish``, a fifth of a tool worker's CPU a call. Whether it did:
        ``False`` when the connection is not plainly up (connecting,
        reconnecting, draining, closed), the payload is larger than the
        server takes, the pending buffer would pass its limit, the subject is
        empty or has whitespace, or a header is not plain (a name that is not
        a token, a value with a line break or whitespace around it): then
        ``publish`` does what it does (buffers, waits, raises, or cleans the
        header). Headers are written as ``publish`` writes plain ones: a
        traced request (its ``traceparent``) is queued here too.
        """
        size = len(payload)
        pending = self._pending_data_size
        queue = self._flush_queue
        if (
            self._status != NATS.CONNECTED
            or queue is None
            or size > self._max_payload
            or not subject
            or _UNSAFE.search(subject) is not None
            or (reply and _UNSAFE.search(reply) is not None)
        ):
            return False
        if headers is None:
            command = f"PUB {subject} {reply} {size}\r\n".encode() + payload + b"\r\n"
        else:
            block = _header_block(headers)
            if block is None:
                return False
            start = f"HPUB {subject} {reply} {len(block)} {len(block) + size}\r\n".encode()
            command = start + block + payload + b"\r\n"
        pending += len(command)
        if self._max_pending_size > 0 and pending > self._max_pending_size:
            return False  # publish flushes first, and waits for it
        if queue.empty():
            flusher = self._flusher_task
            if flusher is None or flusher.done():
                return False  # publish writes it itself
            # Wakes the flusher, which writes whatever is pending by then.
            queue.put_nowait(flusher.get_loop().create_future())
        self._pending.append(command)
        self._pending_data_size = pending
        stats = self.stats
        stats["out_msgs"] += 1
        stats["out_bytes"] += size
        return True

    @staticmethod
    def _parse_header_lines(raw: bytes) -> dict[str, str]:
        out: dict[str, str] = {}
        for line in raw.decode("utf-8", "replace").split("\r\n"):
            name, colon, value = line.partition(":")
            if not colon:
                continue
            key = name.strip(_HEADER_SPACE)
            if not key.isascii() or (key and key.split() != [key]):
                continue
            out[key] = value.strip(_HEADER_SPACE)
        return out
