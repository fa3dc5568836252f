"""The tool worker: serves a toolkit over the bus.

Each tool is served on ``<prefix>.tool.<name>`` in queue group
``tool.<name>``, so every process serving a tool shares its load. The worker
registers as a NATS micro service whose endpoints carry the tools' JSON
Schemas, so clients discover tools from the bus.

Guarantees:

- a bad request (not JSON, an unknown type, a higher version, oversized
  parameters, a wrong tool name) gets an answer, and the worker keeps serving;
- a tool that raises or runs past its timeout gives a ``tool_result`` with
  status ``error`` / ``timeout`` and an ``error_detail``;
- a ``call_id`` seen before (a retry) gets the recorded result; one still
  running is joined; the tool does not run twice;
- a ``cancel`` on ``<prefix>.tool.<name>.control`` (every worker hears it)
  stops the call it names if it runs here: the call is answered, and
  recorded, as ``cancelled``; a cancel for a call not running here is
  ignored;
- a ``tool_call`` request on that control subject checks who holds the call
  (its caller has no reply yet): a worker that runs it, answered it, or has
  every slot taken sends a receipt, and no worker runs it;
- a result too large for one message goes to the fleet's object store, and
  the answer refers to it (see :class:`~fleetbus.bus.tools.ResultStore`);
- a streaming tool's chunks go, as it yields them, to the reply subject of a
  call that asked for them (``stream``), each a ``tool_result`` with
  ``final`` false, before the answer (a delta that cannot be sent is
  dropped: the answer holds the whole result);
- on stop (SIGTERM/SIGINT in the CLI) the worker takes no new calls, finishes
  those in flight, and returns.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, cast

from pydantic import BaseModel, Field

from fleetbus._version import __version__
from fleetbus.bus import (
    RESULT_HEADROOM,
    SERVICE_NAME,
    Bus,
    EndpointInfo,
    Handler,
    Lifecycle,
    MicroService,
    Request,
    ResultStore,
)
from fleetbus.errors import BusError, PayloadTooLargeError, ProtocolError, StoreError
from fleetbus.protocol import (
    Cancel,
    ErrorCode,
    ErrorMessage,
    Message,
    ToolCall,
    ToolResult,
    ToolStatus,
    error_reply,
    new_id,
)
from fleetbus.protocol.codec import clip
from fleetbus.tools_workers.settings import check_ranges
from fleetbus.tools_workers.tool import Tool, tool_failure
from fleetbus.tools_workers.toolkit import Toolkit, ToolLike

__all__ = ["ToolWorker"]


class _Limits(BaseModel):
    concurrency: int = Field(ge=1)


logger = logging.getLogger(__name__)

_Key = tuple[str, str, str]
"""A call: (tool name, caller's ``sender``, ``call_id``)."""

DEDUP_BYTES = 64 * 1024 * 1024
"""Bytes of answered results a worker remembers for replay by default: ids
and results as large as a message can make each record about 1 MiB."""

_RECORD_BYTES = 512
"""Bytes counted for a recorded result whose encoded size is not known,
besides its ids."""

_LOGGED_CHARS = 200
"""Most characters of a caller's id or reason quoted in a log line."""


@dataclass(slots=True)
class _Running:
    """A call running on this worker."""

    task: asyncio.Task[object] | None
    """The task running the tool; ``None`` once the tool has returned."""
    cancel_reason: str | None = None
    """Set when the caller cancelled the call."""
    joined: list[asyncio.Future[ToolResult]] | None = None
    """The results awaited by retries that joined the call (made only for
    them: most calls have none)."""

    async def join(self) -> ToolResult:
        """Its result, once it has one (for a retry that joins it)."""
        done: asyncio.Future[ToolResult] = asyncio.get_running_loop().create_future()
        if self.joined is None:
            self.joined = []
        self.joined.append(done)
        return await done

    def finish(self, result: ToolResult | BaseException) -> None:
        """Hand the result (or what ended the call) to the retries that joined it."""
        for done in self.joined or ():
            if done.done():  # that retry was cancelled
                continue
            if isinstance(result, asyncio.CancelledError):
                done.cancel()
            elif isinstance(result, BaseException):
                done.set_exception(result)
            else:
                done.set_result(result)


class ToolWorker(Lifecycle):
    """Serves the tools of a toolkit on the bus.

    Args:
        bus: the connection.
        toolkit: the tools to serve.
        worker_id: this worker's id (``sender`` of its results); host-pid by default.
        concurrency: calls run at once by this worker, across all its tools.
        default_timeout: seconds a call may run when neither the call nor the
            tool says.
        max_timeout: the most seconds any call may ask for.
        max_request_bytes: larger requests are refused with
            ``invalid_parameters``; the server's ``max_payload`` by default.
        dedup_size: how many answered ``call_id`` results are remembered.
        dedup_bytes: how many bytes of answered results (encoded, with the
            caller's ``sender``) are remembered; the oldest go first.
        dedup_ttl: seconds an answered result is remembered.
        drain_timeout: seconds in-flight calls get to finish on stop.
        max_result_bytes: a ``tool_result`` larger than this (encoded) is
            stored in the object store and answered by reference; the
            server's ``max_payload`` less ``RESULT_HEADROOM`` by default.
        store_timeout: seconds storing one large result may take.
    """

    _loop: asyncio.AbstractEventLoop
    """The loop :meth:`run` serves in."""

    def __init__(
        self,
        bus: Bus,
        toolkit: Toolkit,
        *,
        worker_id: str | None = None,
        concurrency: int = 64,
        default_timeout: float = 30.0,
        max_timeout: float = 3600.0,
        max_request_bytes: int | None = None,
        dedup_size: int = 10_000,
        dedup_bytes: int = DEDUP_BYTES,
        dedup_ttl: float = 600.0,
        drain_timeout: float = 30.0,
        max_result_bytes: int | None = None,
        store_timeout: float = 30.0,
    ) -> None:
        check_ranges(_Limits, "ToolWorker", ValueError, concurrency=concurrency)
        self.bus = bus
        self.toolkit = toolkit
        self.worker_id = worker_id or f"worker.{socket.gethostname()}-{os.getpid()}"
        self.concurrency = concurrency
        self.default_timeout = default_timeout
        self.max_timeout = max_timeout
        self.max_request_bytes = max_request_bytes
        self.dedup_size = dedup_size
        self.dedup_bytes = dedup_bytes
        self.dedup_ttl = dedup_ttl
        self.drain_timeout = drain_timeout
        self.max_result_bytes = max_result_bytes
        super().__init__()
        self.results = ResultStore(bus, timeout=store_timeout)
        self._answered: OrderedDict[_Key, tuple[float, ToolResult, int]] = OrderedDict()
        """Answered calls: when each record expires, the result, its bytes."""
        self._answered_bytes = 0
        self._running: dict[_Key, _Running] = {}
        self._limiter: asyncio.Semaphore | None = None
        """The places among the calls running (while :meth:`run` serves)."""
        self.service = MicroService(
            bus,
            name=SERVICE_NAME,
            version=__version__,
            description="fleetbus tool worker",
            metadata={
                "fleetbus_prefix": bus.prefix,
                "worker_id": self.worker_id,
                "concurrency": str(concurrency),
            },
            endpoints=[self._endpoint(t) for t in toolkit],
        )
        self.executed = 0
        """How many times this worker ran a tool (not counting replays)."""
        self.cancelled = 0
        """How many calls running here their callers cancelled."""

    def _endpoint(self, t: ToolLike) -> EndpointInfo:
        metadata = {
            "description": t.description,
            "schema": json.dumps(t.parameters, separators=(",", ":")),
            "concurrency_safe": str(t.concurrency_safe).lower(),
        }
        if t.timeout is not None:
            metadata["timeout"] = repr(t.timeout)
        if isinstance(t, Tool) and t.streams:
            metadata["streams"] = "true"
        return EndpointInfo(
            name=t.name,
            subject=self.bus.subjects.tool(t.name),
            queue_group=self.bus.subjects.tool_queue(t.name),
            metadata=metadata,
        )

    async def run(self) -> None:
        """Serve until :meth:`stop`; then drain in-flight calls and return.

        Raises:
            ConnectionClosedError: the bus closed.
        """
        # Kept: asyncio.get_running_loop() (and current_task() without a
        # loop) makes a getpid system call (Python 3.11), on every call otherwise.
        self._loop = asyncio.get_running_loop()
        limiter = self._limiter = asyncio.Semaphore(self.concurrency)
        names = self.toolkit.names
        loops_ready = [asyncio.Event() for _ in names]
        controls_ready = [asyncio.Event() for _ in names]
        service_ready = asyncio.Event()
        # The control loops outlive the call loops, so a cancel still reaches
        # a call that runs on during the drain.
        controls_stop = asyncio.Event()
        logger.info("worker %s serving %s", self.worker_id, ", ".join(names))
        async with asyncio.TaskGroup() as tg:
            calls = []
            for name, ready, control_ready in zip(names, loops_ready, controls_ready, strict=True):
                served = self.toolkit.get(name)
                calls.append(
                    tg.create_task(
                        self.bus.serve(
                            self.bus.subjects.tool(name),
                            self._handler(served),
                            stop=self._stop,
                            queue=self.bus.subjects.tool_queue(name),
                            limiter=limiter,
                            drain_timeout=self.drain_timeout,
                            ready=ready,
                            component=self.worker_id,
                        )
                    )
                )
                tg.create_task(
                    self.bus.serve(
                        self.bus.subjects.tool_control(name),
                        self._control(served),
                        stop=controls_stop,
                        # Its own limiter: a worker busy with calls still hears cancels.
                        limiter=asyncio.Semaphore(16),
                        drain_timeout=1.0,
                        ready=control_ready,
                        component=self.worker_id,
                    )
                )
            tg.create_task(self.service.run(self._stop, ready=service_ready))
            tg.create_task(self._announce_ready(*loops_ready, *controls_ready, service_ready))
            tg.create_task(_set_after(calls, controls_stop))
        logger.info("worker %s stopped after %d call(s)", self.worker_id, self.executed)

    def _handler(self, served: ToolLike) -> Handler:
        stats = self.service.stats[served.name]
        streams = isinstance(served, Tool) and served.streams

        async def handle(request: Request) -> Message:
            started = time.perf_counter_ns()
            reply = await self._answer(served, request, streams)
            error = None
            if type(reply) is ToolResult:
                if reply.error_detail is not None:
                    error = f"{reply.error_detail.code}: {reply.error_detail.message}"
            elif isinstance(reply, ErrorMessage):
                error = f"{reply.code}: {reply.message}"
            stats.record(time.perf_counter_ns() - started, error)
            return reply

        return handle

    def _control(self, served: ToolLike) -> Handler:
        async def handle(request: Request) -> None:
            message = request.message
            if isinstance(message, Cancel) and message.call_id:
                self._cancel(served.name, message)
            elif isinstance(message, ToolCall) and message.call_id:
                await self._answer_check(served.name, message, request.reply)
            else:
                logger.info(
                    "ignored a %s on %s: only 'cancel' with a call_id is understood",
                    type(message).__struct_config__.tag,
                    request.subject,
                    extra={"call_id": message.call_id},
                )

        return handle

    async def _answer_check(self, tool_name: str, call: ToolCall, reply: str) -> None:
        """A caller with no answer yet asks who holds ``call``: a receipt
        (an empty message) when it runs here, was answered here, or may be
        waiting here unseen (every place among the calls taken); silence
        otherwise, which tells the caller, when every worker is silent, that
        the call was lost on its way (docs/protocol.md, "Checks")."""
        assert call.call_id is not None
        key = (tool_name, call.sender, call.call_id)
        held = key in self._running or self._recorded(key) is not None
        limiter = self._limiter
        if not reply or not (held or (limiter is not None and limiter.locked())):
            return
        try:
            await self.bus.receipt(reply)
        except BusError as exc:
            logger.debug("receipt for the check of call %s not sent: %s", call.call_id, exc)

    def _cancel(self, tool_name: str, cancel: Cancel) -> None:
        """Stop the call ``cancel`` names if it runs here; else do nothing
        (another worker may run it, or it is over)."""
        assert cancel.call_id is not None
        running = self._running.get((tool_name, cancel.sender, cancel.call_id))
        if running is None or running.task is None or running.cancel_reason is not None:
            logger.debug(
                "cancel of call %s: not running here",
                clip(cancel.call_id, _LOGGED_CHARS),
                extra={"call_id": cancel.call_id},
            )
            return
        reason = clip(cancel.reason) or "no reason given"
        logger.info(
            "cancelling call %s of %s for %s: %s",
            clip(cancel.call_id, _LOGGED_CHARS),
            tool_name,
            clip(cancel.sender, _LOGGED_CHARS),
            clip(reason, _LOGGED_CHARS),
            extra={"call_id": cancel.call_id, "session_id": cancel.session_id},
        )
        running.cancel_reason = reason
        running.task.cancel()

    async def _answer(self, served: ToolLike, request: Request, streams: bool = False) -> Message:
        call = request.message
        if not isinstance(call, ToolCall):
            return error_reply(
                call,
                "malformed",
                f"expected a 'tool_call' message on {request.subject}, "
                f"got {type(call).__struct_config__.tag!r}",
                source=self.worker_id,
            )
        if not call.call_id:
            return error_reply(
                call, "malformed", "a tool_call needs a call_id", source=self.worker_id
            )
        if call.tool_name != served.name:
            return self._failure(
                call,
                "error",
                "unknown_tool",
                f"this subject serves {served.name!r}, not {call.tool_name!r}",
            )
        max_payload = self.bus.max_payload  # read once: a property of a property
        limit = self.max_request_bytes or max_payload
        if request.size > limit:
            return self._failure(
                call,
                "error",
                "invalid_parameters",
                f"the call is {request.size} bytes; this worker accepts at most {limit}",
            )
        timeout = call.timeout if call.timeout is not None else served.timeout
        timeout = self.default_timeout if timeout is None else timeout
        if not timeout > 0:
            return self._failure(call, "error", "invalid_parameters", "timeout must be positive")
        # A call is one client's: two callers that pick the same call_id do
        # not get each other's answers.
        key = (served.name, call.sender, call.call_id)
        recorded = self._recorded(key) if key in self._answered else None
        if recorded is not None:
            logger.info(
                "call %s answered before; replaying its result",
                clip(call.call_id, _LOGGED_CHARS),
                extra={"call_id": call.call_id},
            )
            return recorded
        running = self._running.get(key)
        if running is not None:
            return await running.join()
        current = _Running(asyncio.current_task(self._loop))
        self._running[key] = current
        try:
            result, record, size = await self._execute(
                served,
                call,
                min(timeout, self.max_timeout),
                current,
                max_payload,
                request.reply if streams and call.stream else "",
            )
        except BaseException as exc:
            current.finish(exc)
            raise
        else:
            if current.joined is not None:
                current.finish(result)
            if record:
                self._remember(key, result, size)
            return result
        finally:
            del self._running[key]

    async def _execute(
        self,
        served: ToolLike,
        call: ToolCall,
        timeout: float,
        running: _Running,
        max_payload: int,
        deltas_to: str = "",
    ) -> tuple[ToolResult, bool, int | None]:
        """Run the tool; the result as it can travel (by reference when too
        large for one message, ``max_payload`` the server's limit), whether
        a retry should get it, and its encoded size when known. A streaming
        tool's chunks go to ``deltas_to`` (when given) as it yields them."""
        self.executed += 1
        try:
            if deltas_to:
                ran = await cast(Tool, served).run(
                    call.parameters, timeout=timeout, on_chunk=self._deltas(call, deltas_to)
                )
            else:
                ran = await served.run(call.parameters, timeout=timeout)
        except asyncio.CancelledError:
            if running.cancel_reason is not None and _uncancel(running.task) == 0:
                # Only the caller's cancel: it is the call's answer.
                self.cancelled += 1
                return self._cancelled(call, running.cancel_reason), True, None
            if self._stop.is_set():
                # Draining ran out of time: answer so the caller need not wait,
                # but a retry on another worker should run the call.
                return (
                    self._failure(call, "cancelled", "cancelled", "the worker is shutting down"),
                    False,
                    None,
                )
            raise
        finally:
            task, running.task = running.task, None
        if running.cancel_reason is not None:
            _uncancel(task)  # the tool swallowed the cancel and returned: that is what happened
        result = self._answer_of(call, ran)
        limit = self.max_result_bytes or max_payload - RESULT_HEADROOM
        try:
            # Encoded as the serving loop sends it, which then takes this payload.
            size = len(self.bus.encode(result))
        except PayloadTooLargeError as exc:
            size = exc.size
        except ProtocolError:
            return result, True, None  # the serving loop answers what cannot be encoded
        if size <= limit or not result.ok:
            # Only content goes by reference; the serving loop refuses an
            # error result too large.
            return result, True, size
        return await self._offload(call, result, size, limit)

    def _deltas(self, call: ToolCall, reply: str) -> Callable[[Any], Awaitable[None]]:
        """Sends each chunk of ``call``'s streamed result to ``reply``."""

        async def send(chunk: Any) -> None:
            delta = ToolResult(
                id=new_id(),
                sender=self.worker_id,
                session_id=call.session_id,
                call_id=call.call_id,
                tool_name=call.tool_name,
                status="success",
                content=chunk,
                final=False,
            )
            try:
                await self.bus.publish(reply, delta)
            except (BusError, ProtocolError) as exc:  # too large, or the bus closing
                logger.debug(
                    "a delta of call %s not sent: %s",
                    clip(call.call_id or "", _LOGGED_CHARS),
                    exc,
                    extra={"call_id": call.call_id, "session_id": call.session_id},
                )

        return send

    def _cancelled(self, call: ToolCall, reason: str) -> ToolResult:
        return self._failure(call, "cancelled", "cancelled", f"cancelled by the caller: {reason}")

    async def _offload(
        self, call: ToolCall, result: ToolResult, size: int, limit: int
    ) -> tuple[ToolResult, bool, int | None]:
        """``result`` (``size`` bytes, more than ``limit``) by reference;
        whether a retry should get it; its encoded size when known."""
        try:
            stored = await self.results.offload(result, sender=call.sender)
        except (StoreError, ProtocolError) as exc:
            logger.warning(
                "result of call %s (%d bytes) not stored: %s",
                clip(call.call_id or "", _LOGGED_CHARS),
                size,
                exc,
                extra={"call_id": call.call_id, "session_id": call.session_id},
            )
            failed = self._failure(
                call,
                "error",
                "tool_error",
                f"the result is {size} bytes, more than one message carries ({limit}), "
                f"and it could not be stored: {exc}",
            )
            # Not recorded: a retry runs the call again and may store it.
            return failed, False, None
        logger.info(
            "result of call %s (%d bytes) stored by reference",
            clip(call.call_id or "", _LOGGED_CHARS),
            size,
            extra={"call_id": call.call_id, "session_id": call.session_id},
        )
        return stored, True, None

    def _answer_of(self, call: ToolCall, ran: ToolResult) -> ToolResult:
        """This worker's answer to ``call``: how the run went (``ran``'s
        status, content, error detail and time) in a message of its own, from
        this worker, with the call's ids. ``ran`` is not sent as it is: the
        tool runs without the call's ids, and a tool served on the bus
        answers with its own worker's (and its own message id)."""
        return ToolResult(
            id=new_id(),
            timestamp=ran.timestamp,
            sender=self.worker_id,
            session_id=call.session_id,
            call_id=call.call_id,
            tool_name=call.tool_name,
            status=ran.status,
            content=ran.content,
            error_detail=ran.error_detail,
        )

    def _failure(
        self, call: ToolCall, status: ToolStatus, code: ErrorCode, message: str
    ) -> ToolResult:
        """This worker's answer to ``call`` when it did not succeed."""
        return tool_failure(
            call.tool_name,
            status,
            code,
            message,
            call_id=call.call_id,
            session_id=call.session_id,
            sender=self.worker_id,
        )

    def _recorded(self, key: _Key) -> ToolResult | None:
        entry = self._answered.get(key)
        if entry is None:
            return None
        expires, result, cost = entry
        if expires < time.monotonic():
            del self._answered[key]
            self._answered_bytes -= cost
            return None
        return result

    def _remember(self, key: _Key, result: ToolResult, size: int | None) -> None:
        """Record ``result`` (``size`` bytes encoded, when known) for the
        retries of ``key``, within ``dedup_size`` and ``dedup_bytes``."""
        if size is None:  # a small result (cancelled, by reference) or one never sent
            size = _RECORD_BYTES + len(key[2]) + len(result.session_id or "")
        cost = size + len(key[1])  # the caller's sender is kept in the key
        answered = self._answered
        total = self._answered_bytes + cost
        previous = answered.pop(key, None)
        if previous is not None:
            total -= previous[2]
        answered[key] = (time.monotonic() + self.dedup_ttl, result, cost)
        most, most_bytes = self.dedup_size, self.dedup_bytes
        while len(answered) > most or total > most_bytes:
            total -= answered.popitem(last=False)[1][2]
        self._answered_bytes = total


def _uncancel(task: asyncio.Task[object] | None) -> int:
    """Withdraw one cancellation request of ``task``; how many remain."""
    return task.uncancel() if task is not None else 0


async def _set_after(tasks: list[asyncio.Task[None]], event: asyncio.Event) -> None:
    """Set ``event`` once every task in ``tasks`` is done (or this is cancelled)."""
    try:
        if tasks:
            await asyncio.wait(tasks)
    finally:
        event.set()
