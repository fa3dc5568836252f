"""The one module of fleetbus that reads or overrides private names of other
libraries: nats-py's client and subscription, and ``asyncio.Semaphore``.

Written for nats-py 2.12 to 2.16 and Python 3.11 to 3.13 (the range
``pyproject.toml`` allows and ``scripts/test-versions.sh`` tests). Checked once,
at import (:data:`AVAILABLE`): a path whose internals are missing, or that
``FLEETBUS_PRIVATE_OFF`` turns off, is not taken, and fleetbus goes through the
public API instead; missing internals log one warning naming them.
``tests/unit/test_private_names.py`` keeps every other module of fleetbus off
other libraries' private names.

The paths, and what each buys (``bench/seam.py``: the private path against
the public one in the same run, alternating; ratios of the public path's
figure to the private path's, so above 1 the private path is faster):

================  ===============  ===============  ==========
path left off     no-op tool,      1 ms tool,       no-op tool,
                  throughput       throughput       p50 latency
================  ===============  ===============  ==========
all (public API)  1.58x            1.23x            1.19x
``route``         1.47x            1.05x            0.92x
``publish_now``   1.37x            1.02x            1.04x
``places``        1.35x            0.93x            0.84x
``headers``       1.15x            0.93x            0.99x
================  ===============  ===============  ==========

Measured with nats-py 2.16 on Python 3.11, 64 calls in flight, five rounds,
on a shared two-core machine (other work running: single figures move by
about a tenth, so only the throughput figures of the no-op tool, and all
paths together on the 1 ms tool, stand clear of the noise). ``places`` is
what lets a serving loop take the direct route, so leaving it off costs what
``route`` does. Tool calls carry no headers: ``headers`` was measured on what
it is for, the seven headers a lease write comes back with, parsed 2.3 to
3.8 times faster than by nats-py (``timeit``, same run). Every path is kept.

``route`` — nats-py delivers each message of a subscription to its callback
through an ``asyncio.Queue`` and a task that takes from it: a put, a get, a
``task_done`` and a wake-up per message. The bus's receivers (a serving loop
starting a request's handler, the reply inbox waking a caller) only start or
wake a task and never wait, so :meth:`Client._process_msg` hands them the
message where nats-py parses it, as a :class:`Delivered` when they ask for it
bare (with its header block unparsed, for one that reads a header or two of
it: :func:`header_value`). A receiver may decline (a serving loop with every
place taken): that message, and those after it while any wait, go through
nats-py's queue, so their order, the pending limits, slow-consumer errors
and ``drain`` are nats-py's. Reads ``_process_msg``, ``_remove_sub``,
``_process_headers``, ``_build_message``, ``_subs`` and a subscription's
``_id``, ``_pending_queue`` and ``_received``.

``publish_now`` — :meth:`Client.publish_now` queues a publish into nats-py's
pending buffer for its flusher, as ``publish`` does on a connection that is
up, without ``publish``'s coroutines. Reads ``_status``, ``_pending``,
``_pending_data_size``, ``_max_payload``, ``_max_pending_size``,
``_flush_queue`` and ``_flusher_task``.

``headers`` — :meth:`Client._parse_header_lines` parses a message's headers
without nats-py's per-character checks, with the same result (a journal
read comes back with six). Every lease write comes back to every host with
seven headers, of which its follower reads two (:func:`header_value`).
nats-py has the method from 2.15; before, it parses headers with
``email.parser`` inside ``_process_headers``, and this path is not taken
(and not warned about).

``places`` — a serving loop takes and gives back a place of its
``asyncio.Semaphore`` from the read loop, where it cannot await ``acquire``
(:func:`take_place`, :func:`give_place`): reads ``_value`` and ``_waiters``.
Without it a serving loop takes no direct route.

``unsubscribe`` — nats-py's ``Subscription.drain`` queues its UNSUB for the
flusher, then writes a PING straight to the socket, ahead of it, and removes
the subscription once the PONG is back: the server may not have the UNSUB
yet, and a request it routes to the subscription meanwhile (a queue group
member being stopped) is dropped here, unanswered. :func:`unsubscribe_ahead`
sends the UNSUB and keeps the subscription, so a serving loop waits until the
server has it (:func:`~fleetbus.bus._serve.settle`) before nats-py's drain.
Calls ``_send_unsubscribe`` and reads a subscription's ``_id``. Without it a
request sent in that moment waits out its timeout.

``server_info`` — the INFO the connected server sent (whether it is in a
cluster: how many replicas a KV bucket gets), which nats-py keeps in
``_server_info`` with no public accessor. Without it fleetbus assumes a single
server.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import re
import sys
from collections.abc import Callable
from importlib import metadata
from typing import Literal

import msgspec
import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from fleetbus.bus.settings import BusSettings

__all__ = [
    "AVAILABLE",
    "PATHS",
    "Client",
    "Delivered",
    "Path",
    "Received",
    "Route",
    "check",
    "give_place",
    "server_info",
    "take_place",
    "unsubscribe_ahead",
]

logger = logging.getLogger(__name__)

Path = Literal["route", "publish_now", "headers", "places", "unsubscribe", "server_info"]
"""A private path of this module (see the module's docstring)."""

PATHS: tuple[Path, ...] = (
    "route",
    "publish_now",
    "headers",
    "places",
    "unsubscribe",
    "server_info",
)

_CLIENT_METHODS: dict[Path, tuple[str, ...]] = {
    "route": ("_process_msg", "_remove_sub", "_process_headers", "_build_message"),
    "headers": ("_parse_header_lines",),
    "unsubscribe": ("_send_unsubscribe",),
}
"""nats-py ``Client`` methods each path overrides or calls."""

_CLIENT_FIELDS: dict[Path, tuple[str, ...]] = {
    "route": ("_subs",),
    "publish_now": (
        "_status",
        "_pending",
        "_pending_data_size",
        "_max_payload",
        "_max_pending_size",
        "_flush_queue",
        "_flusher_task",
    ),
    "server_info": ("_server_info",),
}
"""Fields of a new nats-py ``Client`` each path reads or writes."""

_SINCE: dict[Path, tuple[int, int]] = {"headers": (2, 15)}
"""The nats-py version a path's internals came with, where that is later than
the lowest version fleetbus allows: before it the path is not taken, without
a warning (nothing is missing that should be there)."""

_SUBSCRIPTION_FIELDS = ("_id", "_pending_queue", "_received")
"""Fields of a nats-py ``Subscription`` the route reads or writes."""

_PROCESS_MSG_PARAMETERS = ["self", "sid", "subject", "reply", "data", "headers"]


def _missing(path: Path) -> list[str]:
    """The internals ``path`` needs that the installed libraries lack."""
    missing: list[str] = []
    if path == "places":
        limiter = asyncio.Semaphore(1)
        if not isinstance(getattr(limiter, "_value", None), int):
            missing.append("asyncio.Semaphore._value")
        if not hasattr(limiter, "_waiters"):
            missing.append("asyncio.Semaphore._waiters")
        return missing
    for name in _CLIENT_METHODS.get(path, ()):
        if not callable(getattr(NATS, name, None)):
            missing.append(f"nats Client.{name}")
    client = NATS()
    for name in _CLIENT_FIELDS.get(path, ()):
        if not hasattr(client, name):
            missing.append(f"nats Client.{name}")
    if path == "unsubscribe" and not hasattr(Subscription(client, id=1, subject="x"), "_id"):
        missing.append("nats Subscription._id")
    if path == "route":
        process = getattr(NATS, "_process_msg", None)
        if process is not None and (
            not inspect.iscoroutinefunction(process)
            or list(inspect.signature(process).parameters) != _PROCESS_MSG_PARAMETERS
        ):
            missing.append("nats Client._process_msg(sid, subject, reply, data, headers)")
        subscription = Subscription(client, id=1, subject="x")
        for name in _SUBSCRIPTION_FIELDS:
            if not hasattr(subscription, name):
                missing.append(f"nats Subscription.{name}")
    if path == "publish_now" and not isinstance(getattr(NATS, "CONNECTED", None), int):
        missing.append("nats Client.CONNECTED")
    return missing


def check(settings: BusSettings | None = None) -> frozenset[Path]:
    """The private paths to take: those whose internals are there and that
    ``FLEETBUS_PRIVATE_OFF`` does not turn off. Logs one warning naming what
    is missing, if anything is."""
    settings = settings or BusSettings()
    off = settings.private_paths_off()
    unknown = off - {*PATHS, "all"}
    if unknown:
        logger.warning("FLEETBUS_PRIVATE_OFF names no path: %s", ", ".join(sorted(unknown)))
    wanted = [] if "all" in off else [path for path in PATHS if path not in off]
    nats_py = _release(_version("nats-py"))
    if nats_py is not None:
        wanted = [path for path in wanted if nats_py >= _SINCE.get(path, nats_py)]
    taken: set[Path] = set()
    missing: list[str] = []
    for path in wanted:
        try:
            lacking = _missing(path)
        except Exception as exc:  # whatever a changed constructor raises
            lacking = [f"{path} ({type(exc).__name__}: {exc})"]
        if lacking:
            missing.extend(lacking)
        else:
            taken.add(path)
    if missing:
        logger.warning(
            "nats-py %s on Python %s lacks what fleetbus reads to be cheaper (%s; written "
            "for nats-py 2.12 to 2.16, Python 3.11 to 3.13): using the public API instead",
            _version("nats-py"),
            f"{sys.version_info[0]}.{sys.version_info[1]}",
            ", ".join(missing),
        )
    return frozenset(taken)


def _version(distribution: str) -> str:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "unknown"


def _release(version: str) -> tuple[int, int] | None:
    """The major and minor numbers of ``version`` (``None``: not known)."""
    match = re.match(r"(\d+)\.(\d+)", version)
    return None if match is None else (int(match[1]), int(match[2]))


AVAILABLE: frozenset[Path] = check()
"""The private paths taken in this process (checked once, at import)."""


def take_place(limiter: asyncio.Semaphore) -> bool:
    """Take a place of ``limiter`` if one is free and nobody waits for one
    (what ``acquire`` does at once then); whether it did. Only with the
    ``places`` path (the caller checks :data:`AVAILABLE`): ``locked()`` and
    ``acquire()`` each look at the waiters through a generator, and
    ``acquire`` must be awaited, which the read loop cannot."""
    if limiter._value > 0 and not limiter._waiters:
        limiter._value -= 1
        return True
    return False


def give_place(limiter: asyncio.Semaphore) -> None:
    """Give back a place of ``limiter``: by its field when nobody waits (what
    ``release`` does then, without its two calls), else ``release``."""
    if "places" in AVAILABLE and not limiter._waiters:
        limiter._value += 1
    else:
        limiter.release()


async def unsubscribe_ahead(nc: NATS, sub: Subscription) -> bool:
    """Send ``sub``'s UNSUB to the server and keep the subscription here,
    its messages still delivered to it; whether it was sent (not without the
    ``unsubscribe`` path, nor to what is not a nats-py client, nor on a
    connection that is not plainly up: nats-py sends none while it
    reconnects). Once the server has it (a round trip behind it:
    :func:`~fleetbus.bus._serve.settle`), nothing more comes, and
    ``sub.drain()`` ends the subscription without dropping what was routed
    to it (its own UNSUB is then one the server ignores)."""
    if (
        "unsubscribe" not in AVAILABLE
        or not isinstance(nc, NATS)
        or not nc.is_connected
        or nc.is_draining
    ):
        return False
    await nc._send_unsubscribe(sub._id)
    return True


def server_info(nc: NATS) -> dict[str, object]:
    """The INFO the connected server sent, as of the last (re)connection
    (``{}`` without the ``server_info`` path)."""
    if "server_info" not in AVAILABLE:
        return {}
    info = getattr(nc, "_server_info", None)
    return dict(info) if isinstance(info, dict) else {}


_UNSAFE = re.compile(r"[ \t\r\n]")
"""What a subject may not hold (a CR LF would end the command; nats-py 2.16
refuses the same, earlier versions send it)."""

_HEADER_SPACE = " \t\n\r\x0b\x0c"
"""What ``bytes.strip`` strips: around a header's name and value."""


_HEADER_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
"""A header name ``publish`` writes as it is (an RFC 9110 token)."""

_TOKEN_NAMES: set[str] = set()
"""Header names found tokens (a few hundred at most are kept): a connection
writes the same few names again and again."""


def _header_block(headers: dict[str, str]) -> bytes | None:
    """The header block ``publish`` writes for ``headers`` (``NATS/1.0``, a
    ``name: value`` line each, an empty line), when each is plain: a token
    for a name, a value without a line break or whitespace around it (what
    ``publish`` would change or refuse). ``None`` otherwise."""
    lines = ["NATS/1.0\r\n"]
    for name, value in headers.items():
        if name not in _TOKEN_NAMES:
            if _HEADER_NAME.fullmatch(name) is None:
                return None
            if len(_TOKEN_NAMES) < 256:
                _TOKEN_NAMES.add(name)
        if "\r" in value or "\n" in value or value != value.strip():
            return None
        lines.append(f"{name}: {value}\r\n")
    lines.append("\r\n")
    return "".join(lines).encode()


def header_value(block: bytes, name: str) -> str | None:
    """The value of header ``name`` in a header block as it came (``NATS/1.0``
    and a ``Name: value`` line each), as nats-py's parse gives it for a name
    written once, as the server writes its own: ``None`` when it is not
    there. Reading two headers of seven this way costs a third of parsing
    them all (``timeit``: 1.1 against 2.9 µs)."""
    mark = f"\r\n{name}:".encode()
    start = block.find(mark)
    if start < 0:
        return None
    start += len(mark)
    end = block.find(b"\r\n", start)
    return (
        block[start : end if end >= 0 else len(block)]
        .decode("utf-8", "replace")
        .strip(_HEADER_SPACE)
    )


class Delivered(msgspec.Struct, gc=False):
    """A message as a route that asks for it bare takes it: the four
    fields of nats-py's ``Msg`` that a serving loop and the reply inbox
    read, and the header block for a route that reads it itself (a ``Msg``
    is a dataclass of eight fields made by keyword, several times slower to
    make). Not for what nats-py's own code reads (JetStream's replies read
    ``Msg.header``, its metadata, its acks)."""

    subject: str
    reply: str
    data: bytes
    headers: dict[str, str] | None = None
    block: bytes = b""
    """The header block as it came (``NATS/1.0`` and a ``Name: value`` line
    each), for a route that reads it itself (``unparsed``): ``headers`` is
    ``None`` then."""


Received = Msg | Delivered
"""A message a route takes, or nats-py's queue hands its subscription's callback."""

Route = Callable[[Received], bool]
"""A subscription's receiver: takes a message now, or says it does not
(``False``: nats-py's queue takes it); must not raise."""


class Client(NATS):
    """nats-py's client, with direct routes, :meth:`publish_now` and a faster
    header parser (see the module), and a :meth:`publish` that refuses a
    subject no nats-py version should send.

    The header parser's result is nats-py's: lines without a colon, and
    names that are not ASCII or hold whitespace, are left out; invalid UTF-8
    in a value becomes U+FFFD."""

    def __init__(self) -> None:
        super().__init__()
        self._routes: dict[int, tuple[Route, bool, bool]] = {}

    def route(
        self, sub: Subscription, take: Route, *, bare: bool = False, unparsed: bool = False
    ) -> None:
        """Hand ``sub``'s messages to ``take`` as they are parsed, while none
        waits in nats-py's queue; those it declines go there (the
        subscription still needs its callback, for them). ``bare``: as
        :class:`Delivered`, not nats-py's ``Msg``; ``unparsed``: bare, with
        the header block as it came (``Delivered.block``), for a receiver
        that reads one or two headers of it. Without the ``route`` path, all
        of them go there."""
        if "route" in AVAILABLE:
            self._routes[sub._id] = (take, bare or unparsed, unparsed)

    def _remove_sub(self, sid: int, max_msgs: int = 0) -> None:
        if self._routes:
            self._routes.pop(sid, None)
        super()._remove_sub(sid, max_msgs)

    async def _process_msg(
        self, sid: int, subject: bytes, reply: bytes, data: bytes, headers: bytes
    ) -> None:
        route = self._routes.get(sid)
        if route is not None:
            sub = self._subs.get(sid)
            if sub is not None and sub._pending_queue.empty():
                take, bare, unparsed = route
                if unparsed:
                    msg: Received = Delivered(
                        subject.decode(), reply.decode(), data, None, headers or b""
                    )
                else:
                    hdr = await self._process_headers(headers) if headers else None
                    if bare:
                        msg = Delivered(subject.decode(), reply.decode(), data, hdr)
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

    async def publish(
        self,
        subject: str,
        payload: bytes = b"",
        reply: str = "",
        headers: dict[str, str] | None = None,
    ) -> None:
        """nats-py's ``publish``, refusing an empty subject, or a subject or
        reply subject with whitespace, whatever the nats-py version (before
        2.16 it sends them: a space splits the command, a CR LF ends it).

        Raises:
            nats.errors.BadSubjectError: the subject or the reply subject.
        """
        if not subject or _UNSAFE.search(subject) is not None:
            raise nats.errors.BadSubjectError
        if reply and _UNSAFE.search(reply) is not None:
            raise nats.errors.BadSubjectError
        await super().publish(subject, payload, reply, headers)

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
        future it makes to wake the flusher. Whether it did: ``False``
        without the ``publish_now`` path, when the connection is not plainly up (connecting,
        reconnecting, draining, closed), the payload is larger than the
        server takes, the pending buffer would pass its limit, the subject is
        empty or has whitespace, or a header is not plain (a name that is not
        a token, a value with a line break or whitespace around it): then
        ``publish`` does what it does (buffers, waits, raises, or cleans the
        header). Headers are written as ``publish`` writes plain ones: a
        traced request (its ``traceparent``) is queued here too.
        """
        if "publish_now" not in AVAILABLE:
            return False
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
        if "headers" not in AVAILABLE:
            return NATS._parse_header_lines(raw)
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
