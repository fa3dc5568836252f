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

from fleetbus._version import __version__
from fleetbus.bus import SERVICE_NAME, Bus, EndpointInfo, Handler, Lifecycle, MicroService, Request
from fleetbus.protocol import ErrorMessage, Message, ToolCall, ToolResult, error_reply
from fleetbus.tools_workers.tool import ToolOutcome
from fleetbus.tools_workers.toolkit import Toolkit, ToolLike

__all__ = ["ToolWorker"]

logger = logging.getLogger(__name__)


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
        dedup_ttl: seconds an answered result is remembered.
        drain_timeout: seconds in-flight calls get to finish on stop.
    """

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
        dedup_ttl: float = 600.0,
        drain_timeout: float = 30.0,
    ) -> None:
        if concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        self.bus = bus
        self.toolkit = toolkit
        self.worker_id = worker_id or f"worker.{socket.gethostname()}-{os.getpid()}"
        self.concurrency = concurrency
        self.default_timeout = default_timeout
        self.max_timeout = max_timeout
        self.max_request_bytes = max_request_bytes
        self.dedup_size = dedup_size
        self.dedup_ttl = dedup_ttl
        self.drain_timeout = drain_timeout
        super().__init__()
        self._answered: OrderedDict[tuple[str, str, str], tuple[float, ToolResult]] = OrderedDict()
        self._running: dict[tuple[str, str, str], asyncio.Future[ToolResult]] = {}
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

    def _endpoint(self, t: ToolLike) -> EndpointInfo:
        metadata = {
            "description": t.description,
            "schema": json.dumps(t.parameters, separators=(",", ":")),
            "concurrency_safe": str(t.concurrency_safe).lower(),
        }
        if t.timeout is not None:
            metadata["timeout"] = repr(t.timeout)
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
        limiter = asyncio.Semaphore(self.concurrency)
        names = self.toolkit.names
        loops_ready = [asyncio.Event() for _ in names]
        service_ready = asyncio.Event()
        logger.info("worker %s serving %s", self.worker_id, ", ".join(names))
        async with asyncio.TaskGroup() as tg:
            for name, ready in zip(names, loops_ready, strict=True):
                tg.create_task(
                    self.bus.serve(
                        self.bus.subjects.tool(name),
                        self._handler(self.toolkit.get(name)),
                        stop=self._stop,
                        queue=self.bus.subjects.tool_queue(name),
                        limiter=limiter,
                        drain_timeout=self.drain_timeout,
                        ready=ready,
                        component=self.worker_id,
                    )
                )
            tg.create_task(self.service.run(self._stop, ready=service_ready))
            tg.create_task(self._announce_ready(*loops_ready, service_ready))
        logger.info("worker %s stopped after %d call(s)", self.worker_id, self.executed)

    def _handler(self, served: ToolLike) -> Handler:
        async def handle(request: Request) -> Message:
            started = time.perf_counter_ns()
            reply = await self._answer(served, request)
            error = None
            if isinstance(reply, ToolResult) and reply.error_detail is not None:
                error = f"{reply.error_detail.code}: {reply.error_detail.message}"
            elif isinstance(reply, ErrorMessage):
                error = f"{reply.code}: {reply.message}"
            self.service.record(served.name, started, error)
            return reply

        return handle

    async def _answer(self, served: ToolLike, request: Request) -> Message:
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
            return self._result(
                call,
                ToolOutcome.failure(
                    "error",
                    "unknown_tool",
                    f"this subject serves {served.name!r}, not {call.tool_name!r}",
                ),
            )
        limit = self.max_request_bytes or self.bus.max_payload
        if request.size > limit:
            return self._result(
                call,
                ToolOutcome.failure(
                    "error",
                    "invalid_parameters",
                    f"the call is {request.size} bytes; this worker accepts at most {limit}",
                ),
            )
        timeout = call.timeout if call.timeout is not None else served.timeout
        timeout = self.default_timeout if timeout is None else timeout
        if not timeout > 0:
            return self._result(
                call,
                ToolOutcome.failure("error", "invalid_parameters", "timeout must be positive"),
            )
        # A call is one client's: two callers that pick the same call_id do
        # not get each other's answers.
        key = (served.name, call.sender, call.call_id)
        recorded = self._recorded(key)
        if recorded is not None:
            logger.info(
                "call %s answered before; replaying its result",
                call.call_id,
                extra={"call_id": call.call_id},
            )
            return recorded
        running = self._running.get(key)
        if running is not None:
            return await asyncio.shield(running)
        future: asyncio.Future[ToolResult] = asyncio.get_running_loop().create_future()
        self._running[key] = future
        try:
            result = await self._execute(served, call, min(timeout, self.max_timeout))
        except BaseException as exc:
            if isinstance(exc, asyncio.CancelledError):
                future.cancel()
            else:
                future.set_exception(exc)
            raise
        else:
            future.set_result(result)
            self._remember(key, result)
            return result
        finally:
            del self._running[key]

    async def _execute(self, served: ToolLike, call: ToolCall, timeout: float) -> ToolResult:
        self.executed += 1
        try:
            outcome = await served.run(call.parameters, timeout=timeout)
        except asyncio.CancelledError:
            if self._stop.is_set():
                # Draining ran out of time: answer so the caller need not wait.
                return self._result(
                    call,
                    ToolOutcome.failure("cancelled", "cancelled", "the worker is shutting down"),
                )
            raise
        return self._result(call, outcome)

    def _result(self, call: ToolCall, outcome: ToolOutcome) -> ToolResult:
        return ToolResult(
            sender=self.worker_id,
            session_id=call.session_id,
            call_id=call.call_id,
            tool_name=call.tool_name,
            status=outcome.status,
            content=outcome.content,
            error_detail=outcome.error_detail,
        )

    def _recorded(self, key: tuple[str, str, str]) -> ToolResult | None:
        entry = self._answered.get(key)
        if entry is None:
            return None
        expires, result = entry
        if expires < time.monotonic():
            del self._answered[key]
            return None
        return result

    def _remember(self, key: tuple[str, str, str], result: ToolResult) -> None:
        if result.status == "cancelled":
            return  # not an answer: a retry should run the call again
        self._answered[key] = (time.monotonic() + self.dedup_ttl, result)
        self._answered.move_to_end(key)
        while len(self._answered) > self.dedup_size:
            self._answered.popitem(last=False)
