"""The NATS transport: connect, request/reply with retries, publish, observe,
and serving loops.

This is the only module (with its siblings in ``fleetbus.bus``) that imports
``nats``; nats-py errors become fleetbus errors here, most specific first.

Requests wait for their replies on an inbox of fleetbus's own rather than
through nats-py's ``request``, which makes each request's token with system
calls and wakes its caller through three loop callbacks: on a tool call's
client that is more CPU than the rest of the call, and the client's CPU
bounds a fleet's tool-call throughput (:class:`Replies` says what is done
instead; ``bench/tool_calls.py`` measures it).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import socket
from collections.abc import AsyncIterator, Callable, Sequence
from types import TracebackType
from typing import Any, Self

import msgspec
import nats
import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from fleetbus import tracing
from fleetbus._retry import Retry
from fleetbus.bus._replies import (
    RESEND_AFTER,
    Denials,
    Interruption,
    Reconnects,
    Replies,
    permission_denied,
)
from fleetbus.bus._seam import Client, Received, server_info
from fleetbus.bus._serve import Handler, Request, ServeLoop, settle
from fleetbus.bus._server_version import check_server_version, unsupported_server
from fleetbus.bus.listen import Callback, Listener
from fleetbus.bus.settings import ConnectOptions
from fleetbus.bus.subjects import Subjects
from fleetbus.errors import (
    BusError,
    CallTimeoutError,
    ConfigError,
    ConnectError,
    ConnectionClosedError,
    FleetbusError,
    NoRespondersError,
    PayloadTooLargeError,
    ProtocolError,
)
from fleetbus.protocol import AnyMessage, Asking, Message, ToolCall, decode, encode

__all__ = ["Bus", "Handler", "Observation", "Request"]

logger = logging.getLogger(__name__)

_UNANSWERED = (nats.errors.NoRespondersError, nats.errors.TimeoutError)
"""What :meth:`Bus.request` retries: nobody serves the subject (yet), or
nobody answered in time."""

_REFUSED = ("authorization violation", "authentication", "user credentials")
"""How the server (or nats-py) says it refused who we are, lower-cased."""


class Bus:
    """A connection to a NATS server (or cluster) for one fleet.

    Make one with :meth:`connect`; close it with :meth:`close` or ``async with``.

    Args:
        nc: a connected nats-py client.
        subjects: the fleet's subject names.
        client_name: the ``sender`` of messages this bus makes up itself
            (error replies).
        drain_timeout: seconds :meth:`close` waits for pending work.
        js_replicas: copies of each JetStream asset fleetbus creates;
            ``None`` follows the server (see ``ConnectOptions.js_replicas``).
    """

    def __init__(
        self,
        nc: NATS,
        *,
        subjects: Subjects,
        client_name: str,
        drain_timeout: float = 5.0,
        js_replicas: int | None = None,
        reconnects: Reconnects | None = None,
        denials: Denials | None = None,
    ) -> None:
        self._nc = nc
        self.denials = denials or Denials()
        self._last_encoded: tuple[Message, bytes] | None = None
        """The last message :meth:`encode` encoded, and its payload."""
        """The permission violations the server reported on this connection."""
        self.reconnects = reconnects or Reconnects()
        """Signals each re-established connection (requests in flight resend)."""
        self.subjects = subjects
        self.client_name = client_name
        self._drain_timeout = drain_timeout
        self.js_replicas = js_replicas
        """Copies of each KV bucket and object store; ``None``: the server's default."""
        self._replies = Replies(nc)
        # nats-py's own requests (JetStream's API, its KV and object stores)
        # go through the bus's inbox too: a refused publish fails them at
        # once, instead of after their timeout, and they cost less CPU.
        nc.request = self._nats_request  # type: ignore[method-assign]

    @classmethod
    async def connect(
        cls,
        servers: str | Sequence[str] | None = None,
        *,
        prefix: str | None = None,
        name: str | None = None,
        options: ConnectOptions | None = None,
        timeout: float | None = None,
    ) -> Bus:
        """Connect to NATS.

        Args:
            servers: URL(s); else ``FLEETBUS_NATS_URL``; else the local default.
            prefix: subject prefix; else ``FLEETBUS_PREFIX``; else ``fleet``.
            name: this client's name, used as ``sender`` of messages the bus
                makes; a host-pid name by default.
            options: full settings; ``servers``/``prefix``/``name`` override them.
            timeout: seconds to keep trying before giving up on the first
                connection; ``options.initial_connect_timeout`` (10 s, or
                ``FLEETBUS_CONNECT_TIMEOUT``) by default. Later disconnects
                are retried for ever. Refused credentials end the first
                connection at once.

        The server must be nats-server
        :data:`~fleetbus.bus.MIN_SERVER_VERSION` or later: an older one is
        refused once connected, before anything is asked of it (a server
        met on a later reconnection is only warned about).

        Raises:
            ConnectError: no server reachable in time, credentials refused, or
                the server is older than ``MIN_SERVER_VERSION`` (the message
                names both versions).
            ConfigError: invalid settings (a credentials, NKEY or TLS file
                missing or malformed among them).
        """
        if options is None:
            options = ConnectOptions.from_env(servers, prefix=prefix, name=name)
        else:
            updates: dict[str, object] = {}
            if servers is not None:
                updates["servers"] = [servers] if isinstance(servers, str) else list(servers)
            if prefix is not None:
                updates["prefix"] = prefix
            if name is not None:
                updates["name"] = name
            if updates:
                options = ConnectOptions.model_validate({**options.model_dump(), **updates})
        client_name = options.name or f"{socket.gethostname()}-{os.getpid()}"
        kwargs = options.nats_kwargs()
        kwargs.setdefault("name", client_name)
        nc = Client()
        last_error: list[BaseException] = []
        reconnects = Reconnects()
        denials = Denials()
        replies: list[Replies] = []  # the bus's, once it is made
        connecting = True
        credentials = any(
            (options.user, options.password, options.token, options.creds_file, options.nkey_file)
        )

        async def error_cb(exc: Exception) -> None:
            denial = permission_denied(exc)
            if denial is not None:
                denials.add(denial)
                if not (replies and replies[0].deny(denial)):
                    logger.warning("%s", denial)
                return
            if credentials and isinstance(exc, ConnectionResetError):
                # A server that refuses credentials writes its -ERR and closes;
                # the close can reach this client before the -ERR does.
                exc = _RefusedError(f"the server closed the connection on the credentials: {exc}")
            last_error[:] = [exc]
            logger.debug("nats: %s", exc or type(exc).__name__)
            if connecting and _refused(exc):
                # Retrying the same credentials until the deadline only hides
                # why. Raised out of nats-py's connect (it calls back from
                # its retry loop), which leaves the socket to close().
                raise _RefusedError(str(exc)) from exc

        async def disconnected_cb() -> None:
            if nc.is_connected or nc.is_closed or nc.is_draining:
                return
            reconnects.lost()
            if replies:
                replies[0].lost()
            logger.warning("disconnected from NATS; reconnecting")

        async def reconnected_cb() -> None:
            logger.warning("reconnected to NATS at %s", _url(nc))
            reason = unsupported_server(_server_version(nc), _url(nc) or "?")
            if reason is not None:  # a cluster part-way through a downgrade
                logger.warning("%s", reason)
            reconnects.happened()
            if replies:  # answers published while away are lost: ask again
                replies[0].reconnected()

        try:
            await asyncio.wait_for(
                nc.connect(
                    error_cb=error_cb,
                    disconnected_cb=disconnected_cb,
                    reconnected_cb=reconnected_cb,
                    **kwargs,
                ),
                options.initial_connect_timeout if timeout is None else timeout,
            )
        except (TimeoutError, OSError, nats.errors.Error, _RefusedError) as exc:
            connecting = False  # the close below calls back too: nothing to raise then
            await _close_quietly(nc)
            cause = last_error[0] if last_error else exc
            where = ", ".join(options.servers)
            if _refused(cause):
                raise ConnectError(f"NATS at {where} refused the credentials") from cause
            detail = str(cause) or type(cause).__name__
            raise ConnectError(f"cannot connect to NATS at {where}: {detail}") from exc
        finally:
            connecting = False
        try:
            check_server_version(_server_version(nc), _url(nc) or ", ".join(options.servers))
        except ConnectError:
            await _close_quietly(nc)
            raise
        logger.debug("connected to NATS at %s", _url(nc))
        bus = cls(
            nc,
            subjects=Subjects(options.prefix),
            client_name=client_name,
            drain_timeout=options.drain_timeout,
            js_replicas=options.js_replicas,
            reconnects=reconnects,
            denials=denials,
        )
        replies.append(bus._replies)
        return bus

    async def _nats_request(
        self,
        subject: str,
        payload: bytes = b"",
        timeout: float = 0.5,
        old_style: bool = False,
        headers: dict[str, Any] | None = None,
    ) -> Msg:
        """nats-py's ``Client.request``, on the bus's reply inbox (``old_style``
        is ignored: every request shares the inbox); the reply as nats-py's
        ``Msg``, which its JetStream code reads (``Msg.header``)."""
        reply = await self._replies.request(subject, payload, timeout, headers)
        if isinstance(reply, Msg):
            return reply
        return Msg(
            self._nc,
            subject=reply.subject,
            reply=reply.reply,
            data=reply.data,
            headers=reply.headers,
        )

    async def _await_reply(
        self,
        subject: str,
        data: bytes,
        timeout: float,
        headers: dict[str, str] | None = None,
        watch: Callable[[Interruption], None] | None = None,
        stream: Callable[[Received], bool] | None = None,
    ) -> Received:
        """One request; a reconnection while it waits ends it as unanswered.

        A reply published while this client was away is lost, and waiting out
        the whole timeout for it (a tool call's 30 s) would stall every call
        in flight across a server's fail-over: the retry, with the same
        ``call_id``, goes out as soon as the connection is back. ``watch``
        is handed the wait's :class:`Interruption`, which can end it so too.
        """
        # The caller's task waits, and a reconnection cancels it (as
        # asyncio.timeout would): a task for the request, another for the
        # event and an asyncio.wait cost more client CPU than the rest of a
        # tool call (bench/tool_calls.py).
        task = asyncio.current_task()
        assert task is not None  # always inside a task under asyncio
        cancelling = task.cancelling()
        interruption = self.reconnects.interrupt(task)
        if watch is not None:
            watch(interruption)
        try:
            return await self._replies.request(
                subject, data, timeout, headers=headers, stream=stream
            )
        except asyncio.CancelledError:
            if interruption.interrupted:
                interruption.interrupted = False
                # Ours, unless someone else cancelled the task too.
                if task.uncancel() <= cancelling:
                    raise nats.errors.TimeoutError from None
            raise
        finally:
            interruption.ended = True
            self.reconnects.forget(interruption)
            if interruption.interrupted:  # the reply came first and the cancel was swallowed
                task.uncancel()

    @property
    def nc(self) -> NATS:
        """The underlying nats-py client: an escape hatch for tests and for
        what fleetbus does not wrap. Nothing in fleetbus outside
        ``fleetbus.bus`` uses it (``tests/unit/test_private_names.py``)."""
        return self._nc

    @property
    def is_closed(self) -> bool:
        """Whether the bus is closed or closing (draining)."""
        return bool(self._nc.is_closed or self._nc.is_draining)

    def new_inbox(self) -> str:
        """A new unique subject under this client's :attr:`inbox_prefix`, for
        the answers to one request (:meth:`listen` to it, then
        :meth:`publish_bytes` the request with it as ``reply``)."""
        return self._nc.new_inbox()

    async def listen(self, subject: str, *, callback: Callback | None = None) -> Listener:
        """Listen to every message on ``subject`` (wildcards allowed): read
        them from the :class:`~fleetbus.bus.listen.Listener`, or have each
        handed to ``callback`` (which must not raise). For watchers; serve
        requests with :meth:`serve`.

        Raises:
            ConnectionClosedError: the bus is closed.
            BusError: the subscription was refused (a bad subject among reasons).
        """
        self._check_open()
        try:
            if callback is None:
                sub = await self._nc.subscribe(subject)
            else:
                sub = await self._nc.subscribe(subject, cb=callback)
        except (nats.errors.Error, OSError) as exc:
            raise _translate(exc, f"listening on {subject}") from exc
        return Listener(sub, subject)

    async def publish_bytes(
        self,
        subject: str,
        payload: bytes,
        *,
        reply: str = "",
        headers: dict[str, str] | None = None,
    ) -> None:
        """Publish ``payload`` as it is (not a fleetbus message: an empty
        ``$SRV`` request, a prompt encoded already), with ``reply`` and
        ``headers`` if given.

        Raises:
            PayloadTooLargeError: ``payload`` exceeds the server's limit.
            ConnectionClosedError: the bus is closed.
            BusError: it could not be sent (a bad subject among reasons).
        """
        self._check_open()
        try:
            await self._nc.publish(subject, payload, reply=reply, headers=headers)
        except nats.errors.MaxPayloadError as exc:
            raise PayloadTooLargeError(
                f"{len(payload)} bytes to {subject}: the server accepts at most {self.max_payload}",
                size=len(payload),
                limit=self.max_payload,
            ) from exc
        except (nats.errors.Error, OSError) as exc:
            raise _translate(exc, f"publish to {subject}") from exc

    @property
    def prefix(self) -> str:
        """The fleet's subject prefix."""
        return self.subjects.prefix

    @property
    def inbox_prefix(self) -> str:
        """Where replies to this client travel: ``_INBOX_<fleet>.<identity>``
        (nats-py adds a unique token per inbox; see
        :func:`~fleetbus.bus.inbox_prefix`)."""
        # What nats-py's new inboxes start with (it has no accessor for it).
        return self._nc.new_inbox().rpartition(".")[0]

    @property
    def max_payload(self) -> int:
        """The largest message the server accepts, in bytes."""
        return int(self._nc.max_payload)

    @property
    def server_info(self) -> dict[str, object]:
        """The INFO the connected server sent (``server_name``, ``cluster``,
        ``connect_urls``, ``jetstream``…), as of the last (re)connection."""
        return server_info(self._nc)

    @property
    def server_version(self) -> str:
        """The nats-server version the connected server announced
        (``2.12.1``), as of the last (re)connection; ``0.0.0-unknown`` when
        it announced none, ``unknown`` when it is not a version."""
        return _server_version(self._nc)

    @property
    def is_connected(self) -> bool:
        """Whether the connection is up (not closed, not reconnecting)."""
        return bool(self._nc.is_connected)

    @property
    def connected_url(self) -> str | None:
        """The URL of the server currently connected to."""
        return _url(self._nc)

    def _check_open(self) -> None:
        if self._nc.is_closed or self._nc.is_draining:
            raise ConnectionClosedError("the bus connection is closed")

    async def publish(self, subject: str, message: Message) -> None:
        """Publish a message (fire and forget; broadcast to every observer).

        A publish the server's permissions refuse is reported later (nothing
        waits for the server here): logged as a warning, and raised by the
        next :meth:`flush`.

        Raises:
            PayloadTooLargeError: the message exceeds the server's limit.
            ConnectionClosedError: the bus is closed.
        """
        self._check_open()
        payload = self._encode(message)
        try:
            await self._nc.publish(subject, payload)
        except nats.errors.ConnectionClosedError as exc:
            raise ConnectionClosedError("the bus connection is closed") from exc
        except nats.errors.Error as exc:
            raise BusError(f"publish to {subject} failed: {exc}") from exc

    async def receipt(self, reply_to: str) -> None:
        """Send a receipt to ``reply_to``: an empty message (no body, no
        headers), which says a request is held (an agent's host took it, a
        tool worker holds the call a check asks about) and is not its answer.

        Raises:
            ConnectionClosedError: the bus is closed.
            BusError: it could not be sent.
        """
        self._check_open()
        try:
            await self._nc.publish(reply_to, b"")
        except nats.errors.ConnectionClosedError as exc:
            raise ConnectionClosedError("the bus connection is closed") from exc
        except (nats.errors.Error, OSError) as exc:
            raise BusError(f"receipt to {reply_to} not sent: {exc}") from exc

    async def request(
        self,
        subject: str,
        message: Message,
        *,
        timeout: float,
        attempts: int = 1,
        retry_backoff: float = 0.05,
        resend: float | None = None,
        watch: Callable[[Interruption], None] | None = None,
        stream: Callable[[Received], bool] | None = None,
    ) -> AnyMessage:
        """Send a request and wait for its reply, retrying what went unanswered.

        A retry resends the same message (same ``id`` and ``call_id``), so a
        responder that already handled it can answer from its record; a
        ``tool_call`` carries its ``attempt`` number. Timeouts and "no
        responders" are retried, after a jittered exponential backoff (a
        worker may be restarting; callers that failed together do not come
        back together); anything else is not.

        Args:
            subject: where to send it.
            message: the request.
            timeout: seconds to wait for each attempt's reply.
            attempts: how many times to send it, at least 1.
            retry_backoff: seconds before the first retry (plus jitter),
                doubling after each, up to 5 s.
            resend: for a message that asks for a receipt
                (:class:`~fleetbus.protocol.Asking`, ``receipt=True``), with
                one attempt: seconds until it is sent again, the same message
                to the same reply subject, when no receipt came; twice as
                long before each next sending, up to 30 s, within
                ``timeout``. An agent's host sends the receipt once the
                request is in its session's lease: a replica that dies with
                a request it had not taken yet loses nothing. After a
                reconnection it is sent again at once, receipt or not, and
                again until a receipt comes again (3 s on at most, then
                doubling): an answer published while the connection was away
                is lost, and the host answers the same request again from
                where it is.
            watch: handed, as each attempt but the last starts waiting, an
                :class:`Interruption` whose ``fire`` ends that attempt as
                unanswered: the next goes out at once (what a reconnection
                does; :class:`ToolClient` fires it for a call no worker holds).
            stream: handed every message that comes to an attempt's reply
                subject before it is taken as the reply; one it returns
                ``True`` for is not the reply (a delta of a streamed tool
                result). Called from the connection's read loop: it must
                neither block nor raise.

        Returns:
            The decoded reply, which may be an ``error`` message.

        Raises:
            CallTimeoutError: no reply to any attempt.
            NoRespondersError: nobody served the subject, on the last attempt.
            PermissionDeniedError: the server refused the publish, or the
                subscription of the reply inbox (at once, not retried).
            PayloadTooLargeError: the message exceeds the server's limit.
            ProtocolError: the reply could not be decoded.
            ConnectionClosedError: the bus is closed.
            ConfigError: both ``resend`` and more than one attempt, or
                ``resend`` for a message that does not ask for a receipt
                (``receipt=True``) or has no ``call_id``: no receipt would
                come, and every copy sent again would be a new attempt.
        """
        self._check_open()
        if resend is not None and attempts > 1:
            raise ConfigError("a request is sent again either on its receipt or on attempts")
        if resend is not None and not (
            isinstance(message, Asking) and message.receipt and message.call_id
        ):
            raise ConfigError(
                "resend needs a request that asks for a receipt (receipt=True) and has a "
                f"call_id, which a receipt and its copies are known by; this "
                f"{type(message).__struct_config__.tag} "
                f"has receipt={getattr(message, 'receipt', None)}, call_id={message.call_id!r}"
            )
        payload = self._encode(message)
        attempts = max(1, attempts)
        sent = 0
        headers = tracing.inject(None)  # the trace goes along (None when off)

        async def send() -> Received:
            nonlocal sent
            sent += 1
            data = payload
            if sent > 1 and isinstance(message, ToolCall):
                data = encode(msgspec.structs.replace(message, attempt=sent))
            try:
                if sent < attempts:  # an attempt is left to resend with
                    return await self._await_reply(subject, data, timeout, headers, watch, stream)
                return await self._replies.request(
                    subject, data, timeout, headers=headers, resend=resend, stream=stream
                )
            except _UNANSWERED as exc:
                _log_unanswered(exc, subject, timeout, message, sent, attempts)
                raise

        try:
            if attempts == 1:
                # send() without its frame, on every request of one attempt.
                sent = 1
                try:
                    reply = await self._replies.request(
                        subject, payload, timeout, headers=headers, resend=resend, stream=stream
                    )
                except _UNANSWERED as exc:
                    _log_unanswered(exc, subject, timeout, message, 1, 1)
                    raise
            else:
                # Retry makes its first attempt without stamina (tenacity),
                # which was half of a tool call's client CPU
                # (bench/tool_calls.py): only a call unanswered pays for it.
                reply = await _request_retry(attempts, max(0.0, retry_backoff)).call(send)
        except nats.errors.Error as exc:
            raise self._failed(exc, subject, message, timeout, sent, len(payload)) from exc
        return decode(reply.data)

    def _failed(
        self,
        exc: nats.errors.Error,
        subject: str,
        message: Message,
        timeout: float,
        sent: int,
        size: int,
        waited: str = "reply",
    ) -> FleetbusError:
        """What a request to ``subject`` that failed with ``exc`` raises."""
        after = f" after {sent} attempt(s)"
        if isinstance(exc, nats.errors.NoRespondersError):
            return NoRespondersError(
                f"{self.subjects.nobody_serves(subject)}; no responders on {subject}{after}",
                subject=subject,
                call_id=message.call_id,
            )
        if isinstance(exc, nats.errors.TimeoutError):
            return CallTimeoutError(
                f"no {waited} on {subject} within {timeout:g}s{after}",
                subject=subject,
                call_id=message.call_id,
                attempts=sent,
            )
        if isinstance(exc, nats.errors.ConnectionClosedError):
            return ConnectionClosedError("the bus connection is closed")
        if isinstance(exc, nats.errors.MaxPayloadError):
            return PayloadTooLargeError(str(exc), size=size, limit=self.max_payload)
        return BusError(f"request to {subject} failed: {exc}")

    async def deliver(
        self, subject: str, message: Asking, *, timeout: float, resend: float = RESEND_AFTER
    ) -> None:
        """Send a request whose answer goes elsewhere (the message names
        where), and wait until a responder holds it: its receipt. Until the
        receipt comes, the same message is sent again ``resend`` seconds
        after the first sending, then twice as long each time (see
        :meth:`request`): a responder that dies before holding it loses
        nothing.

        Raises:
            CallTimeoutError: no receipt within ``timeout``.
            NoRespondersError: nobody serves ``subject``.
            PermissionDeniedError: the server refused the publish.
            PayloadTooLargeError: the message exceeds the server's limit.
            ConnectionClosedError: the bus is closed.
            ConfigError: the message does not ask for a receipt, or has no ``call_id``.
        """
        self._check_open()
        if not (message.receipt and message.call_id):
            raise ConfigError("deliver needs a request with receipt=True and a call_id")
        payload = self._encode(message)
        try:
            await self._replies.request(
                subject,
                payload,
                timeout,
                headers=tracing.inject(None),
                resend=resend,
                until_receipt=True,
            )
        except nats.errors.Error as exc:
            raise self._failed(exc, subject, message, timeout, 1, len(payload), "receipt") from exc

    async def observe(
        self, subject: str, *, queue: str | None = None, timeout: float = 5.0
    ) -> Observation:
        """Subscribe to a subject (by default without a queue group: every
        observer gets every message).

        Use as ``async with await bus.observe(s) as obs: async for m in obs``.
        A payload that does not decode is logged and skipped.

        Args:
            subject: what to subscribe to.
            queue: a queue group.
            timeout: seconds the server gets to confirm the subscription
                (a confirmation lost to a reconnection is asked for again).

        Raises:
            ConnectionClosedError: the bus is closed.
            PermissionDeniedError: the server refused the subscription.
            CallTimeoutError: the server did not confirm it in time.
        """
        self._check_open()
        mark = self.denials.count
        observation = Observation()
        try:
            observation._sub = await self._nc.subscribe(
                subject, queue=queue or "", cb=observation._take
            )
        except nats.errors.Error as exc:
            raise _translate(exc, f"subscribe to {subject}") from exc
        try:
            # A refusal comes back before the answer to the PING that follows.
            await settle(self._nc, timeout)
        except nats.errors.TimeoutError as exc:
            await observation.close()
            raise CallTimeoutError(f"subscribe to {subject}: timed out", subject=subject) from exc
        except nats.errors.Error as exc:
            await observation.close()
            raise _translate(exc, f"subscribe to {subject}") from exc
        denial = self.denials.since(mark, "subscription", subject)
        if denial is not None:
            await observation.close()
            raise denial
        return observation

    async def serve(
        self,
        subject: str,
        handler: Handler,
        *,
        stop: asyncio.Event,
        queue: str | None = None,
        limiter: asyncio.Semaphore | None = None,
        drain_timeout: float = 30.0,
        ready: asyncio.Event | None = None,
        component: str | None = None,
        span_name: str | None = None,
    ) -> None:
        """Serve requests on a subject until ``stop`` is set, then drain.

        Each request is decoded and handed to ``handler`` in its own task;
        at most as many run at once as ``limiter`` allows. A payload that does
        not decode, or a handler that raises, is answered with an ``error``
        message: the loop never dies of a bad request. When ``stop`` is set
        the subscription is drained — no new requests, those already
        received are handled — and in-flight handlers get ``drain_timeout``
        seconds to finish before they are cancelled.

        Args:
            subject: the subject to serve.
            handler: makes the reply of each request.
            stop: set it to stop serving.
            queue: queue group, so several processes share the subject.
            limiter: bounds the concurrent handlers (shared between loops to
                bound a whole worker).
            drain_timeout: seconds to wait for in-flight handlers on stop.
            ready: set once the subscription is live on the server.
            component: ``sender`` and ``source_component`` of the error
                replies made here; the bus's client name by default.
            span_name: what a request's span is called when tracing is on;
                by default from the subject (``fleetbus tool run`` on a tool
                subject, ``fleetbus model worker`` on a model's…).

        Raises:
            ConnectionClosedError: the bus is closed.
            PermissionDeniedError: the server refused the subscription.
        """
        self._check_open()
        loop = ServeLoop(
            self._nc,
            subject,
            handler,
            limiter=limiter or asyncio.Semaphore(64),
            source=component or self.client_name,
            encode=self._encode,
            reconnects=self.reconnects,
            span_name=span_name,
        )
        mark = self.denials.count
        subscribed = asyncio.Event()
        halt = asyncio.Event()
        # Owned here and awaited on every path: the loop runs in a task only
        # so that a refused subscription can end it before ``ready`` is set.
        serving: asyncio.Future[object] = asyncio.ensure_future(
            loop.run(stop=halt, queue=queue, drain_timeout=drain_timeout, ready=subscribed)
        )
        try:
            # The loop settles its subscription before it says so: a
            # refusal has come back by then.
            await _until(subscribed, serving)
            denial = self.denials.since(mark, "subscription", subject)
            if denial is None and not serving.done():
                if ready is not None:
                    ready.set()
                await _until(stop, serving)
        except BaseException:
            serving.cancel()
            await asyncio.wait([serving])
            raise
        halt.set()
        await serving
        if denial is not None:
            raise denial

    def encode(self, message: Message) -> bytes:
        """``message`` as this bus sends it, checked against the server's limit.

        The last message encoded is remembered (by identity), so a serving
        loop's handler that measures its reply before returning it does not
        have it encoded twice.

        Raises:
            PayloadTooLargeError: it is larger than the server's ``max_payload``.
            ProtocolError: it cannot be encoded.
        """
        payload = self._encode(message)
        self._last_encoded = (message, payload)
        return payload

    def _encode(self, message: Message) -> bytes:
        last = self._last_encoded
        if last is not None and last[0] is message:
            return last[1]
        payload = encode(message)
        if len(payload) > self._nc.max_payload:  # on every message: not through the property
            limit = self.max_payload
            raise PayloadTooLargeError(
                f"{type(message).__name__} of {len(payload)} bytes exceeds the server's "
                f"max_payload of {limit} bytes",
                size=len(payload),
                limit=limit,
            )
        return payload

    async def flush(self, timeout: float = 5.0) -> None:
        """Wait until the server has processed everything sent so far.

        Raises:
            CallTimeoutError: the server did not answer in time.
            ConnectionClosedError: the bus is closed.
            PermissionDeniedError: the server refused a publish or a
                subscription meanwhile (the last one refused is raised).
        """
        self._check_open()
        mark = self.denials.count
        try:
            await settle(self._nc, timeout)
        except nats.errors.TimeoutError as exc:
            raise CallTimeoutError("flush timed out", subject="") from exc
        except nats.errors.Error as exc:
            raise _translate(exc, "flush") from exc
        denial = self.denials.since(mark)
        if denial is not None:
            raise denial

    async def close(self) -> None:
        """Drain (deliver what is pending, within the drain timeout) and close.

        Safe to call twice.
        """
        if self._nc.is_closed:
            return
        try:
            if not self._nc.is_draining:
                await asyncio.wait_for(self._nc.drain(), self._drain_timeout + 1.0)
        except (TimeoutError, nats.errors.Error, OSError, RuntimeError) as exc:
            # RuntimeError: uvloop's, when the connection closed under the
            # drain before nats-py noticed (the server went away just then).
            logger.debug("drain failed (%s); closing", exc)
        await _close_quietly(self._nc)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()


_OBSERVED_KEPT = 65_536
"""Messages an observation holds unread at most (then it drops, and says so)."""


class Observation:
    """Messages arriving on an observed subject, decoded, as an async iterator.

    The subscription hands each message over as it is read from the
    connection (a callback, no task in between): once the server has
    answered a round trip, every message it sent before is here, and
    :meth:`received` hands out what is not read yet.
    """

    def __init__(self) -> None:
        self._sub: Subscription | None = None
        self._queue: asyncio.Queue[AnyMessage] = asyncio.Queue()
        self.skipped = 0
        """How many payloads could not be decoded (or found the queue full) and were skipped."""

    async def _take(self, msg: Msg) -> None:
        try:
            message = decode(msg.data)
        except ProtocolError as exc:
            self.skipped += 1
            logger.warning("skipped a bad message on %s: %s", msg.subject, exc)
            return
        if self._queue.qsize() >= _OBSERVED_KEPT:
            self.skipped += 1
            logger.warning("an observer of %s is too slow: a message was dropped", msg.subject)
            return
        self._queue.put_nowait(message)

    def __aiter__(self) -> AsyncIterator[AnyMessage]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[AnyMessage]:
        while True:
            yield await self._queue.get()

    async def received(self) -> list[AnyMessage]:
        """The messages already received and not yet read, without waiting
        for more."""
        while self._sub is not None and self._sub.pending_msgs > 0:  # noqa: ASYNC110
            await asyncio.sleep(0)  # the callback takes each over as it is read
        got: list[AnyMessage] = []
        while not self._queue.empty():
            got.append(self._queue.get_nowait())
        return got

    async def close(self) -> None:
        """Stop observing (pending messages are discarded)."""
        sub, self._sub = self._sub, None  # (its callback is ours: no cycle left)
        if sub is None:
            return
        try:
            await sub.unsubscribe()
        except nats.errors.Error:
            pass  # already unsubscribed, or the connection is gone

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()


@functools.lru_cache(maxsize=32)
def _request_retry(attempts: int, backoff: float) -> Retry:
    """The policy of a request sent up to ``attempts`` times (made once for
    each setting: a tool call is such a request)."""
    return Retry(on=_UNANSWERED, attempts=attempts, backoff=backoff)


def _log_unanswered(
    exc: BaseException, subject: str, timeout: float, message: Message, sent: int, attempts: int
) -> None:
    if isinstance(exc, nats.errors.TimeoutError):
        logger.debug(
            "no reply on %s within %.3gs (attempt %d/%d)",
            subject,
            timeout,
            sent,
            attempts,
            extra={"call_id": message.call_id},
        )


class _RefusedError(Exception):
    """The server refused the credentials while connecting: stop retrying."""


def _refused(exc: BaseException) -> bool:
    """Whether ``exc`` says the server refused our credentials."""
    if isinstance(exc, nats.errors.AuthorizationError | _RefusedError):
        return True
    text = str(exc).lower()
    return any(words in text for words in _REFUSED)


async def _until(event: asyncio.Event, task: asyncio.Future[object]) -> None:
    """Wait until ``event`` is set or ``task`` ends."""
    waiter: asyncio.Future[object] = asyncio.ensure_future(event.wait())
    either: list[asyncio.Future[object]] = [waiter, task]
    try:
        await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()
        await asyncio.wait([waiter])


def _server_version(nc: NATS) -> str:
    """The version the connected server announced, through nats-py's public
    ``connected_server_version`` (``0.0.0-unknown`` when it announced none)."""
    announced = nc.connected_server_version
    try:
        version = f"{announced.major}.{announced.minor}.{announced.patch}"
        prerelease, build = announced.prerelease, announced.build
    except ValueError:  # announced, but not a semantic version
        return "unknown"
    if prerelease:
        version += f"-{prerelease}"
    if build:
        version += f"+{build}"
    return str(version)


def _url(nc: NATS) -> str | None:
    url = nc.connected_url
    if url is None:
        return None
    return f"{url.scheme}://{url.hostname}:{url.port}"


def _translate(exc: BaseException, what: str) -> BusError:
    if isinstance(exc, nats.errors.ConnectionClosedError | nats.errors.ConnectionDrainingError):
        return ConnectionClosedError(f"{what}: the bus connection is closed")
    if isinstance(exc, TimeoutError):
        return CallTimeoutError(f"{what}: timed out", subject="")
    return BusError(f"{what} failed: {exc}")


async def _close_quietly(nc: NATS) -> None:
    try:
        await nc.close()
    # AttributeError: nats-py before 2.15 cannot close a TCP transport whose
    # first connection never opened (it calls close on a writer that is None).
    except (nats.errors.Error, OSError, RuntimeError, AttributeError) as exc:
        logger.debug("close: %s", exc)
