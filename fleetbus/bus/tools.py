"""Calling tools over the bus, and finding out which tools the fleet serves.

This is the client side of the tool protocol; the serving side is
``fleetbus.tools_workers.ToolWorker``. Agents and programs in any language
reach tools the same way: a ``tool_call`` request on ``<prefix>.tool.<name>``.

Two things cross from the caller to the worker besides the call itself: a
``cancel`` on ``<prefix>.tool.<name>.control`` when the caller stops waiting
(not when it abandons the call to another replica: :class:`CallScope`), and
results too large for one message, which travel through the fleet's object
store (:class:`ResultStore`).
"""

from __future__ import annotations

import asyncio
import contextvars
import hashlib
import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import msgspec
import nats.errors

from fleetbus._retry import Retry
from fleetbus.bus._replies import Interruption
from fleetbus.bus._seam import Received
from fleetbus.bus.connection import Bus
from fleetbus.bus.micro import EndpointInfo, discover
from fleetbus.bus.store import ObjectStore, object_store
from fleetbus.errors import (
    BusError,
    ConfigError,
    KeyNotFoundError,
    NoRespondersError,
    ProtocolError,
    RemoteError,
    StoreError,
    UnexpectedMessageError,
)
from fleetbus.protocol import (
    Cancel,
    DataBlock,
    ErrorDetail,
    ErrorMessage,
    ToolCall,
    ToolResult,
    ToolSpec,
    by_reference,
    content_reference,
    decode,
    decode_content,
    encode_content,
    new_id,
)

__all__ = [
    "RESULTS_STORE",
    "RESULT_HEADROOM",
    "SERVICE_NAME",
    "CallScope",
    "RemoteTool",
    "ResultStore",
    "ToolClient",
]

logger = logging.getLogger(__name__)

SERVICE_NAME = "fleetbus"
"""The NATS micro service name tool workers register under."""

RESULTS_STORE = "tool_results"
"""The object store of tool results too large for one message (the bucket
is ``<prefix with _ for .>_tool_results``)."""

RESULTS_TTL = 3600.0
"""Seconds a stored large result is kept: longer than a worker replays a call
(``dedup_ttl``, 600 s by default) plus the time to read it back."""

RESULT_HEADROOM = 16 * 1024
"""Bytes a ``tool_result`` keeps free below the server's ``max_payload`` (for
headers); a larger one goes by reference."""

_CANCELLED_REASON = "the caller stopped waiting for the result"

CHECK_MAX = 30.0
"""Most seconds between two checks of a call waiting for its reply."""


@dataclass(frozen=True, slots=True)
class RemoteTool:
    """A tool served on the bus, as discovered.

    Attributes:
        name: the tool's name.
        description: what it does (from its docstring).
        parameters: JSON Schema of its arguments.
        subject: where calls go.
        workers: how many worker instances serve it.
        worker_ids: the ids of those workers.
        timeout: its default timeout in seconds, if it declares one.
    """

    name: str
    description: str
    parameters: dict[str, Any]
    subject: str
    workers: int = 1
    worker_ids: tuple[str, ...] = ()
    timeout: float | None = None
    metadata: dict[str, str] = field(default_factory=dict)
    _spec: ToolSpec = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Made once: an agent offers its tools at every step, and the same
        # spec object from step to step is what the token count it costs
        # is kept by (fleetbus.agents._model_calls).
        spec = ToolSpec(name=self.name, description=self.description, parameters=self.parameters)
        object.__setattr__(self, "_spec", spec)

    def spec(self) -> ToolSpec:
        """The tool as offered to a model."""
        return self._spec


class CallScope:
    """Tool calls made on behalf of one piece of work (an agent host's reply),
    and whether they are *abandoned*: left running when their caller stops
    waiting, instead of cancelled on the workers.

    A call whose awaiting task is cancelled normally sends a ``cancel`` to the
    tool's workers, so that a tool nobody waits for stops. That is wrong for a
    replica that lost its session: another replica takes the session over and
    sends the same calls again with the same ``call_id``, which must join the
    run or be answered from the worker's record, not find it cancelled. So a
    call in an abandoned scope only stops waiting (a debug line says so).

    A scope is abandoned once :meth:`abandon` is called (by a host whose
    session was lost), or while ``task`` — the task that serves the work, not
    the one running the calls — is being cancelled from outside: a host that
    stops cuts its replies that way, and their sessions are taken over. An
    agent interrupting its own reply (a user's ``cancel``) cancels the calls
    from inside, which still reaches the workers.

    Enter it around the work (``with CallScope(...):``): the calls made there,
    and in the tasks started there, are in it.

    Args:
        task: the task serving the work (``None``: only :meth:`abandon` counts).
    """

    __slots__ = ("_abandoned", "_task", "_token")

    def __init__(self, task: asyncio.Task[Any] | None = None) -> None:
        self._task = task
        self._abandoned = False
        self._token: contextvars.Token[CallScope | None] | None = None

    @property
    def abandoned(self) -> bool:
        """Whether a call of this scope cancelled now is left running."""
        task = self._task
        return self._abandoned or (task is not None and task.cancelling() > 0)

    def abandon(self) -> None:
        """From now on, calls of this scope whose awaiting task is cancelled
        are left running (call it before cancelling them)."""
        self._abandoned = True

    @staticmethod
    def current() -> CallScope | None:
        """The scope the calls made here are in (``None``: none entered)."""
        return _call_scope.get()

    def __enter__(self) -> CallScope:
        self._token = _call_scope.set(self)
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._token is not None:
            _call_scope.reset(self._token)
            self._token = None


_call_scope: contextvars.ContextVar[CallScope | None] = contextvars.ContextVar(
    "fleetbus_call_scope", default=None
)


class ResultStore:
    """Tool results too large for one message, in the fleet's object store.

    A worker stores the JSON of what the tool returned under a name derived
    from the call (tool, caller and ``call_id``, hashed) and answers a
    ``tool_result`` whose content is a ``data`` block referring to it
    (``content_by_reference``); the caller reads the object back. A retry of
    the call is answered with the same reference.

    Args:
        bus: the connection.
        timeout: seconds one store or read may take.
    """

    def __init__(self, bus: Bus, *, timeout: float = 30.0) -> None:
        self._bus = bus
        self.timeout = timeout
        self.bucket = bus.subjects.kv_bucket(RESULTS_STORE)
        self._store: ObjectStore | None = None

    @staticmethod
    def object_name(tool_name: str, sender: str, call_id: str) -> str:
        """The object that holds the result of ``sender``'s call ``call_id``
        of ``tool_name``: ``<tool_name>-<32 hex digits>``."""
        key = "\x00".join((tool_name, sender, call_id)).encode()
        return f"{tool_name}-{hashlib.sha256(key).hexdigest()[:32]}"

    def url(self, name: str) -> str:
        """The reference to an object of this store: ``nats-object://<bucket>/<name>``."""
        return f"nats-object://{self.bucket}/{name}"

    async def _open(self, *, create: bool) -> ObjectStore:
        if self._store is None:
            self._store = await object_store(
                self._bus, RESULTS_STORE, create=create, ttl=RESULTS_TTL
            )
        return self._store

    async def offload(self, result: ToolResult, *, sender: str) -> ToolResult:
        """Store the content of ``result`` (the answer to ``sender``'s call)
        and return the result that refers to it.

        Raises:
            StoreError: the content could not be stored in time.
            InvalidFieldError: the content is not JSON-serializable.
        """
        data = encode_content(result.content)
        name = self.object_name(result.tool_name, sender, result.call_id or "")
        try:
            async with asyncio.timeout(self.timeout):
                store = await self._open(create=True)
                summary = await store.put(name, data)
        except TimeoutError as exc:
            raise StoreError(
                f"storing {len(data)} bytes in {self.bucket} took more than {self.timeout:g}s"
            ) from exc
        reference = DataBlock(
            url=self.url(name),
            media_type="application/json",
            name=f"{result.tool_name} result",
            size=summary.size,
        )
        return by_reference(result, reference)

    async def resolve(self, result: ToolResult) -> ToolResult:
        """``result`` with the content it refers to read back (``result``
        itself when its content is inline).

        Never raises for the reference: one that cannot be read (the object
        expired or was deleted, another store, a bad block) gives an
        ``error`` result with code ``tool_error`` saying why.
        """
        try:
            reference = content_reference(result)
        except ProtocolError as exc:
            return _unreadable(result, str(exc))
        if reference is None:
            return result
        prefix = self.url("")
        if not reference.url.startswith(prefix) or reference.url == prefix:
            return _unreadable(
                result, f"the result refers to {reference.url!r}, not to an object in {prefix}"
            )
        name = reference.url.removeprefix(prefix)
        try:
            async with asyncio.timeout(self.timeout):
                store = await self._open(create=False)
                data = await store.get(name)
        except KeyNotFoundError:
            return _unreadable(
                result,
                f"the result was stored at {reference.url}, but that object is missing "
                "(expired or deleted); call the tool again with a new call_id",
            )
        except BusError as exc:
            return _unreadable(
                result, f"the result stored at {reference.url} cannot be read: {exc}"
            )
        except TimeoutError:
            return _unreadable(
                result,
                f"reading the result stored at {reference.url} took more than {self.timeout:g}s",
            )
        if reference.size is not None and len(data) != reference.size:
            return _unreadable(
                result,
                f"the object at {reference.url} is {len(data)} bytes; "
                f"the result said {reference.size}",
            )
        try:
            content = decode_content(data)
        except ProtocolError as exc:
            return _unreadable(result, f"the object at {reference.url}: {exc}")
        return msgspec.structs.replace(result, content=content, content_by_reference=False)


def _unreadable(result: ToolResult, why: str) -> ToolResult:
    logger.warning("%s: %s", result.tool_name, why, extra={"call_id": result.call_id})
    return msgspec.structs.replace(
        result,
        status="error",
        content=None,
        content_by_reference=False,
        error_detail=ErrorDetail(code="tool_error", message=f"{result.tool_name}: {why}"),
    )


class ToolClient:
    """Calls tools served by workers on the bus, with retries.

    A call that gets no reply within its deadline (the worker died, the
    network dropped it) or finds no worker is sent again with the same
    ``call_id``; a worker that already answered it returns its record instead
    of running the tool twice.

    A call whose caller is cancelled while it waits is cancelled on the
    worker too: a ``cancel`` goes to the tool's control subject (unless the
    call's :class:`CallScope` is abandoned). A result
    stored by reference (too large for one message) is read back, so the
    caller gets the whole content either way.

    Args:
        bus: the connection.
        sender: the ``sender`` of the calls (the bus's client name by default).
        timeout: seconds to wait for a reply to a call that sets no
            ``timeout`` of its own, of a tool that declares none (the worker
            then applies its default). A call of a tool that declares a
            timeout waits that one: see :meth:`declared_timeout`.
        attempts: how many times a call is sent at most.
        reply_grace: seconds added to the tool's timeout to wait for the reply
            (the worker needs a moment to answer a timeout itself).
        cancel_timeout: seconds sending a ``cancel`` may take.
        store_timeout: seconds reading a result stored by reference may take.
        worker_wait: seconds a call of a discovered tool (an agent's remote
            tool, :class:`~fleetbus.tools_workers.RemoteToolProxy`) waits for a
            worker when none serves it: its worker may be restarting. A
            direct :meth:`call` waits only if asked to.
        check_after: seconds a call waits for its reply before the tool's
            workers are asked whether one holds it (then twice as long
            before each next check, up to :data:`CHECK_MAX`); when none
            does, it was lost on its way (with a cluster node that died) and
            is sent again at once, not after its attempt's timeout. ``None``:
            never checked. Only an attempt with another after it is.
        check_timeout: seconds a check waits for a worker's receipt.
        discovery_timeout: seconds the discovery that learns a tool's
            declared timeout may take (:meth:`declared_timeout`).
    """

    def __init__(
        self,
        bus: Bus,
        *,
        sender: str | None = None,
        timeout: float = 30.0,
        attempts: int = 3,
        reply_grace: float = 1.0,
        cancel_timeout: float = 1.0,
        store_timeout: float = 30.0,
        worker_wait: float = 10.0,
        check_after: float | None = 2.0,
        check_timeout: float = 1.0,
        discovery_timeout: float = 0.5,
    ) -> None:
        if check_after is not None and not check_after > 0:
            raise ConfigError(f"check_after must be positive or None, got {check_after}")
        if not check_timeout > 0:
            raise ConfigError(f"check_timeout must be positive, got {check_timeout}")
        self._bus = bus
        self.check_after = check_after
        self.check_timeout = check_timeout
        self._unanswered: dict[int, tuple[ToolCall, Interruption, float, float]] = {}
        """Attempts that may be checked, by the id of their call: the call,
        its attempt's interruption, when it is next checked, the interval."""
        self._sweeping: asyncio.Task[None] | None = None
        self._checks: set[asyncio.Task[None]] = set()
        self.sender = sender or bus.client_name
        self.timeout = timeout
        self.attempts = attempts
        self.reply_grace = reply_grace
        self.cancel_timeout = cancel_timeout
        self.worker_wait = worker_wait
        self.results = ResultStore(bus, timeout=store_timeout)
        self.discovery_timeout = discovery_timeout
        self._declared: dict[str, float | None] = {}
        """The timeout each tool declares (``None``: none), as discovered."""
        self._learning = asyncio.Lock()

    async def call(
        self,
        tool_name: str,
        parameters: dict[str, Any] | None = None,
        *,
        call_id: str | None = None,
        session_id: str | None = None,
        timeout: float | None = None,
        attempts: int | None = None,
        agent: bool = False,
        worker_wait: float = 0.0,
        on_delta: Callable[[ToolResult], None] | None = None,
    ) -> ToolResult:
        """Call a tool and return its ``tool_result``.

        ``on_delta``: handed, in order, each delta of a streamed result (a
        ``tool_result`` with ``final`` false, one chunk the tool yielded) as
        it comes, before the final result is returned; the call then asks
        for them (``stream``). It runs in the connection's read loop: keep it
        short (put the delta in a queue); what it raises is logged. A retry
        answered from a worker's record gets the final result alone.

        With ``agent=True`` the "tool" is an agent: the call goes to its inbox
        (``<prefix>.agent.<tool_name>.inbox``) with ``{"request": "…"}``.

        ``timeout`` is how long the tool may run (sent with the call); when
        ``None`` the worker applies the tool's own timeout, or its default,
        and the reply is awaited as long as the tool may run: the timeout it
        declares (:meth:`declared_timeout`), else the client's ``timeout``;
        plus ``reply_grace`` either way.

        ``worker_wait``: seconds to wait for a worker when none serves the
        tool (its one worker restarting, say): the call is sent again, with
        growing waits, until one answers or the time is up. 0 (the default):
        ``NoRespondersError`` after the ``attempts``, as for a tool nobody
        has ever served.

        A tool that fails, times out or rejects its parameters is a result
        with that ``status``, not an exception. So is a result stored by
        reference that cannot be read back (``tool_error``).

        Cancelling the awaiting task sends a ``cancel`` for the call to the
        tool's workers (best effort, within ``cancel_timeout``; a failure is
        logged), then lets the ``CancelledError`` through. Not for
        ``agent=True``, nor in an abandoned :class:`CallScope` (a replica
        that lost its session: the call is left to its successor).

        Raises:
            CallTimeoutError: no worker answered any attempt in time.
            NoRespondersError: no worker serves the tool.
            RemoteError: the worker could not handle the call at all
                (answered an ``error`` message).
            PayloadTooLargeError: the parameters exceed the server's limit.
            ProtocolError: the reply was not a valid ``tool_result`` for this call.
            ConfigError: the timeout is not positive, or the tool name cannot
                be a subject token.
        """
        if timeout is not None and not timeout > 0:
            raise ConfigError(f"timeout must be positive, got {timeout}")
        call = ToolCall(
            id=new_id(),
            sender=self.sender,
            session_id=session_id,
            call_id=call_id or new_id(),
            tool_name=tool_name,
            parameters=parameters or {},
            timeout=timeout,
            stream=on_delta is not None,
        )
        stream = None if on_delta is None else _deltas(call, on_delta)
        subjects = self._bus.subjects
        subject = subjects.agent_inbox(tool_name) if agent else subjects.tool(tool_name)

        tries = self.attempts if attempts is None else attempts
        watch = None
        if tries > 1 and not agent and self.check_after is not None:
            watch = partial(self._watch, call)

        if timeout is None and not agent:
            declared = (
                self._declared[tool_name]
                if tool_name in self._declared
                else await self.declared_timeout(tool_name)
            )
            timeout_of_call = self.timeout if declared is None else declared
        else:
            timeout_of_call = self.timeout if timeout is None else timeout
        wait = timeout_of_call + self.reply_grace
        send = partial(
            self._bus.request,
            subject,
            call,
            timeout=wait,
            attempts=tries,
            watch=watch,
            stream=stream,
        )
        started = asyncio.get_running_loop().time()
        try:
            try:  # the first attempt: most calls find a worker
                reply = await send()
            except NoRespondersError as exc:
                if worker_wait <= 0:
                    raise
                waiting = Retry(
                    on=_nobody_serves(tool_name, worker_wait, call),
                    attempts=None,
                    backoff=0.1,
                    max_backoff=1.0,
                    timeout=worker_wait,
                )
                reply = await waiting.after(send, exc, started)
        except asyncio.CancelledError as exc:
            scope = CallScope.current()
            if scope is not None and scope.abandoned:
                logger.debug(
                    "stopped waiting for call %s of %s; it is left to run for the "
                    "session's next owner",
                    call.call_id,
                    tool_name,
                    extra={"call_id": call.call_id, "session_id": call.session_id},
                )
            elif not agent:
                await self._cancel(call, str(exc) or _CANCELLED_REASON)
            raise
        finally:
            if watch is not None:
                self._unanswered.pop(id(call), None)
        if isinstance(reply, ErrorMessage):
            raise RemoteError(
                f"{reply.source_component or 'worker'} could not handle the call: "
                f"{reply.code}: {reply.message}",
                code=reply.code,
                source_component=reply.source_component,
                call_id=reply.call_id,
            )
        if not isinstance(reply, ToolResult):
            raise UnexpectedMessageError(
                f"expected a 'tool_result' reply, got {type(reply).__name__}",
                call_id=reply.call_id,
            )
        if reply.call_id != call.call_id:
            raise UnexpectedMessageError(
                f"reply carries call_id {reply.call_id!r}, the call was {call.call_id!r}",
                call_id=call.call_id,
                message_type="tool_result",
            )
        if reply.content_by_reference:
            return await self.results.resolve(reply)
        return reply

    def _watch(self, call: ToolCall, interruption: Interruption) -> None:
        """An attempt at ``call`` waits, and ``interruption`` ends it: check it
        after :attr:`check_after` seconds."""
        assert self.check_after is not None
        self._unanswered[id(call)] = (
            call,
            interruption,
            time.monotonic() + self.check_after,
            self.check_after,
        )
        if self._sweeping is None or self._sweeping.done():  # (done: a loop since closed)
            self._sweeping = asyncio.create_task(self._sweep())

    async def _sweep(self) -> None:
        """Check each attempt waiting longer than its interval; done when none waits."""
        assert self.check_after is not None
        try:
            while self._unanswered:
                await asyncio.sleep(self.check_after / 2)
                now = time.monotonic()
                for key, (call, interruption, due, interval) in list(self._unanswered.items()):
                    if interruption.ended:
                        self._unanswered.pop(key, None)
                    elif due <= now:
                        self._unanswered[key] = (call, interruption, math.inf, interval)
                        check = asyncio.create_task(self._check(key, call, interruption, interval))
                        self._checks.add(check)
                        check.add_done_callback(self._checks.discard)
        finally:
            self._sweeping = None

    async def _check(
        self, key: int, call: ToolCall, interruption: Interruption, interval: float
    ) -> None:
        """Ask the tool's workers whether one holds ``call``: when one does,
        check again after twice ``interval``; when none does, end the
        attempt (the next goes out at once)."""
        try:
            held = await self._held(call)
        except Exception as exc:  # cannot tell: the attempt waits on
            logger.debug("check of call %s failed: %s", call.call_id, exc)
            held = True
        if interruption.ended:
            return
        if not held:
            logger.info(
                "no worker holds call %s of %s after %.3gs: sending it again",
                call.call_id,
                call.tool_name,
                interval,
                extra={"call_id": call.call_id, "session_id": call.session_id},
            )
            interruption.fire("no worker holds the call")
        elif self._unanswered.get(key, (None, None))[1] is interruption:
            later = min(interval * 2, CHECK_MAX)
            self._unanswered[key] = (call, interruption, time.monotonic() + later, later)

    async def _held(self, call: ToolCall) -> bool:
        """Whether a worker of the tool says it holds ``call`` (a receipt to
        the ``tool_call`` sent on the tool's control subject)."""
        subject = self._bus.subjects.tool_control(call.tool_name)
        try:
            await self._bus._nats_request(subject, self._bus.encode(call), self.check_timeout)
        except (nats.errors.TimeoutError, nats.errors.NoRespondersError):
            return False
        return True

    async def _cancel(self, call: ToolCall, reason: str) -> None:
        """Tell the tool's workers to stop ``call``; log, never raise, if that fails."""
        cancel = Cancel(
            sender=call.sender, session_id=call.session_id, call_id=call.call_id, reason=reason
        )
        try:
            async with asyncio.timeout(self.cancel_timeout):
                await self._bus.publish(self._bus.subjects.tool_control(call.tool_name), cancel)
                await self._bus.flush(self.cancel_timeout)
        except (BusError, TimeoutError) as exc:
            logger.warning(
                "cancel of call %s to %s not sent: %s",
                call.call_id,
                call.tool_name,
                exc or type(exc).__name__,
                extra={"call_id": call.call_id, "session_id": call.session_id},
            )
        else:
            logger.debug(
                "sent cancel of call %s to %s",
                call.call_id,
                call.tool_name,
                extra={"call_id": call.call_id, "session_id": call.session_id},
            )

    def learn(self, tool: RemoteTool) -> None:
        """Remember the timeout ``tool`` declares (as :meth:`discover` does for
        every tool it finds): calls of it that name no timeout wait that long."""
        self._declared[tool.name] = tool.timeout

    async def declared_timeout(self, tool_name: str) -> float | None:
        """The timeout ``tool_name`` declares (``None``: it declares none, or
        no worker said).

        Known from a :meth:`discover` or :meth:`learn` of this client; for a
        tool it has not seen, learned once by a discovery of at most
        ``discovery_timeout`` seconds (concurrent calls share it). A
        discovery that fails counts as one that found nothing: the call then
        waits the client's ``timeout``.
        """
        if tool_name in self._declared:
            return self._declared[tool_name]
        async with self._learning:
            if tool_name not in self._declared:
                try:
                    await self.discover(timeout=self.discovery_timeout)
                except BusError as exc:
                    logger.debug("cannot learn the timeout of %s: %s", tool_name, exc)
                self._declared.setdefault(tool_name, None)
        return self._declared[tool_name]

    async def discover(self, *, timeout: float = 0.5) -> dict[str, RemoteTool]:
        """The tools served in this fleet, by name, with their worker counts.

        Asks every fleetbus worker for its INFO (``$SRV.INFO.fleetbus``) and
        keeps those of this bus's prefix. The client remembers the timeout
        each declares (:meth:`declared_timeout`).

        Raises:
            BusError: the request could not be sent.
        """
        services = await discover(self._bus, SERVICE_NAME, timeout=timeout)
        tools: dict[str, RemoteTool] = {}
        for service in services:
            if service.metadata.get("fleetbus_prefix") != self._bus.prefix:
                continue
            worker_id = service.metadata.get("worker_id", service.id)
            for endpoint in service.endpoints:
                known = tools.get(endpoint.name)
                if known is None:
                    tools[endpoint.name] = _remote_tool(endpoint, worker_id)
                else:
                    tools[endpoint.name] = replace(
                        known,
                        workers=known.workers + 1,
                        worker_ids=(*known.worker_ids, worker_id),
                    )
        for tool in tools.values():
            self.learn(tool)
        return dict(sorted(tools.items()))


def _deltas(call: ToolCall, on_delta: Callable[[ToolResult], None]) -> Callable[[Received], bool]:
    """Takes the deltas of ``call``'s streamed result to ``on_delta``, in the
    read loop (see :meth:`Replies.request`): ``True`` for a delta."""

    def take(msg: Received) -> bool:
        try:
            delta = decode(msg.data)
        except ProtocolError:
            return False  # the reply's to answer: it is read as one
        if type(delta) is not ToolResult or delta.final or delta.call_id != call.call_id:
            return False
        try:
            on_delta(delta)
        except Exception:  # the caller's callback must not stop the read loop
            logger.exception(
                "on_delta of call %s failed",
                call.call_id,
                extra={"call_id": call.call_id, "session_id": call.session_id},
            )
        return True

    return take


def _nobody_serves(tool_name: str, wait: float, call: ToolCall) -> Callable[[Exception], bool]:
    """What a call waiting for a worker retries: no responders (said once, in the log)."""
    told = False

    def retry(exc: Exception) -> bool:
        nonlocal told
        if not isinstance(exc, NoRespondersError):
            return False
        if not told:
            told = True
            logger.info(
                "no worker serves %s; waiting up to %g s for one",
                tool_name,
                wait,
                extra={"call_id": call.call_id, "session_id": call.session_id},
            )
        return True

    return retry


def _remote_tool(endpoint: EndpointInfo, worker_id: str) -> RemoteTool:
    name, metadata = endpoint.name, endpoint.metadata
    try:
        parameters = json.loads(metadata.get("schema", "{}"))
    except ValueError:
        logger.warning("tool %s advertises an unreadable schema; using {}", name)
        parameters = {}
    try:
        timeout: float | None = float(metadata["timeout"]) if metadata.get("timeout") else None
    except ValueError:
        timeout = None
    return RemoteTool(
        name=name,
        description=metadata.get("description", ""),
        parameters=parameters if isinstance(parameters, dict) else {},
        subject=endpoint.subject,
        workers=1,
        worker_ids=(worker_id,),
        timeout=timeout,
        metadata=metadata,
    )
