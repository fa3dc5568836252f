"""An agent served on the bus: its inbox, its sessions, its events.

:class:`AgentService` binds one :class:`~fleetbus.agents.Agent` definition to
the bus. It serves ``<prefix>.agent.<name>.inbox`` in queue group
``agent.<name>``, so replicas share the work:

- ``user_request`` (or ``agent_message`` with ``reply=True``): run a reply in
  the message's session and answer ``final_answer``; every event of the reply
  is published on ``<prefix>.events.<agent>.<session_id>``, the final answer
  too;
- ``agent_message`` with ``reply=False``: add it to the session's memory and
  answer an ``event`` named ``observed``;
- ``confirm_result`` / ``external_result``: resume the session's paused reply;
- ``tool_call``: the agent used as a tool (``{"request": "..."}``), answered
  with a ``tool_result``;
- ``cancel``: interrupt the session's reply (also on the control subject,
  which every replica hears).

Sessions live in JetStream KV (:class:`SessionStore`), saved after every step
with compare-and-set under a lease. A replica that dies mid-reply leaves a
lease that expires; any replica — or the restarted process — takes the
session over from its last saved step, finishes it, stores and publishes the
final answer, and answers the original request if its requester still waits.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import socket
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fleetbus.agents.agent import Agent
from fleetbus.agents.serving.sessions import Lease, SessionStatus, SessionStore
from fleetbus.agents.state import AgentState
from fleetbus.bus import Bus, Lifecycle, Request
from fleetbus.bus.subjects import check_name
from fleetbus.errors import (
    BusError,
    FleetbusError,
    InvalidSubjectError,
    SessionBusyError,
    SessionLostError,
)
from fleetbus.protocol import (
    AgentMessage,
    AnyMessage,
    Cancel,
    ConfirmResult,
    ErrorCode,
    ErrorDetail,
    ErrorMessage,
    Event,
    ExternalResult,
    FinalAnswer,
    Message,
    ToolCall,
    ToolResult,
    UserRequest,
    error_reply,
    new_id,
    to_builtins,
)

__all__ = ["AgentService"]

logger = logging.getLogger(__name__)


_STATUS: dict[str, SessionStatus] = {
    "completed": "done",
    "exceed_max_iters": "done",
    "repeated_action": "done",
    "interrupted": "idle",
    "paused": "paused",
    "error": "error",
}


class AgentService(Lifecycle):
    """Serves one agent on the bus.

    Args:
        bus: the connection.
        agent: the agent's definition; each session runs on a clone of it
            holding that session's state.
        replica_id: this replica's id (the lease owner); host-pid by default.
        topics: broadcast topics to observe (one replica records each message).
        lease_ttl: seconds a session lease lasts unrenewed; a replica that
            dies holding one delays its session this long.
        concurrency: sessions run at once by this replica.
        busy_wait: seconds a message waits for its session to be free.
        recover_interval: seconds between scans for sessions to take over.
        drain_timeout: seconds running replies get to finish on stop.
    """

    def __init__(
        self,
        bus: Bus,
        agent: Agent,
        *,
        replica_id: str | None = None,
        topics: Sequence[str] = (),
        lease_ttl: float = 10.0,
        concurrency: int = 16,
        busy_wait: float = 60.0,
        recover_interval: float = 2.0,
        drain_timeout: float = 30.0,
    ) -> None:
        check_name(agent.name, what="agent name")
        self.bus = bus
        self.agent = agent
        self.name = agent.name
        self.replica_id = replica_id or f"{agent.name}@{socket.gethostname()}-{os.getpid()}"
        self.topics = list(topics)
        self.lease_ttl = lease_ttl
        self.concurrency = concurrency
        self.busy_wait = busy_wait
        self.recover_interval = recover_interval
        self.drain_timeout = drain_timeout
        self.store: SessionStore | None = None
        super().__init__()
        self._running: dict[str, Agent] = {}
        # One reply at a time per session in this replica; the lease does the
        # same across replicas.
        self._session_locks: dict[str, asyncio.Lock] = {}
        self._lock_users: dict[str, int] = {}

    async def run(self) -> None:
        """Serve until :meth:`stop`.

        Raises:
            StoreError: JetStream is not available for the sessions.
            ConnectionClosedError: the bus closed.
        """
        self.store = await SessionStore.open(
            self.bus, owner=self.replica_id, lease_ttl=self.lease_ttl
        )
        subjects = self.bus.subjects
        limiter = asyncio.Semaphore(self.concurrency)
        ready = [asyncio.Event() for _ in range(2 + len(self.topics))]
        async with asyncio.TaskGroup() as tg:
            tg.create_task(
                self.bus.serve(
                    subjects.agent_inbox(self.name),
                    self._handle,
                    stop=self._stop,
                    queue=subjects.agent_queue(self.name),
                    limiter=limiter,
                    drain_timeout=self.drain_timeout,
                    ready=ready[0],
                    component=self.replica_id,
                )
            )
            tg.create_task(
                self.bus.serve(
                    subjects.agent_control(self.name),
                    self._control,
                    stop=self._stop,
                    ready=ready[1],
                    component=self.replica_id,
                )
            )
            for topic, event in zip(self.topics, ready[2:], strict=True):
                tg.create_task(
                    self.bus.serve(
                        subjects.topic(topic),
                        self._observe_topic,
                        stop=self._stop,
                        queue=subjects.topic_queue(self.name),
                        limiter=limiter,
                        ready=event,
                        component=self.replica_id,
                    )
                )
            for event in ready:
                await event.wait()
            self._ready.set()
            logger.info("agent %s serving as %s", self.name, self.replica_id)
            tg.create_task(self._recover_forever(limiter))

    # -- the inbox -------------------------------------------------------------------

    async def _handle(self, request: Request) -> Message | None:
        message = request.message
        if isinstance(message, UserRequest | ConfirmResult | ExternalResult):
            return await self._converse(message, message.session_id, request)
        if isinstance(message, AgentMessage):
            if message.reply:
                return await self._converse(message, message.session_id, request)
            return await self._observe(message)
        if isinstance(message, ToolCall):
            return await self._as_tool(message)
        if isinstance(message, Cancel):
            return await self._control(request)
        return self._error(
            message,
            "malformed",
            f"an agent inbox takes user_request, agent_message, confirm_result, "
            f"external_result, tool_call or cancel, not {type(message).__name__}",
        )

    async def _converse(
        self, message: AnyMessage, session_id: str | None, request: Request | None
    ) -> Message:
        session = session_id or new_id()
        try:
            check_name(session, what="session id")
        except InvalidSubjectError as exc:
            return self._error(message, "malformed", str(exc))
        assert self.store is not None
        async with self._session_lock(session):
            try:
                lease = await self.store.acquire(
                    self.name,
                    session,
                    fresh=self.agent.clone().state,
                    reply_to=request.reply if request is not None else None,
                    wait=self.busy_wait,
                )
            except SessionBusyError as exc:
                return self._error(message, "overloaded", str(exc))
            final = await self._run_reply(lease, message, session)
        if final is None:
            return self._error(
                message, "internal", f"session {session} was taken over by another replica"
            )
        return final

    @contextlib.asynccontextmanager
    async def _session_lock(self, session: str) -> AsyncIterator[None]:
        """One reply (or observation) at a time per session in this replica;
        the lease does the same across replicas."""
        lock = self._session_locks.setdefault(session, asyncio.Lock())
        self._lock_users[session] = self._lock_users.get(session, 0) + 1
        try:
            async with lock:
                yield
        finally:
            self._lock_users[session] -= 1
            if not self._lock_users[session]:
                del self._lock_users[session]
                del self._session_locks[session]

    async def _run_reply(self, lease: Lease, inputs: Any, session: str) -> FinalAnswer | None:
        """Run (or continue, with ``inputs=None``) a reply holding ``lease``;
        store and publish its end. ``None`` if the session was lost."""
        assert self.store is not None
        store = self.store

        async def checkpoint(state: AgentState) -> None:
            await store.save(lease, state=state, status="running")

        agent = self.agent.clone(state=lease.record.state, checkpoint=checkpoint)
        events = self.bus.subjects.events(self.name, session)
        self._running[session] = agent
        final: FinalAnswer | None = None
        lost = False
        unfinished = inputs is not None and agent.state.reply is not None and not agent.state.paused
        try:
            async with asyncio.TaskGroup() as tg:
                renewing = tg.create_task(self._renew(lease))
                try:
                    if unfinished:
                        # A reply cut short by a crash: finish it before the new input.
                        earlier = await self._stream(agent, None, session, events)
                        if lease.record.reply_to and earlier is not None:
                            await self._publish(lease.record.reply_to, earlier)
                    final = await self._stream(agent, inputs, session, events)
                finally:
                    renewing.cancel()
        except* SessionLostError:
            logger.warning("%s: session %s was taken over; stopping", self.name, session)
            lost = True
        finally:
            self._running.pop(session, None)
        if lost or final is None:
            return None
        status = _STATUS.get(final.finished_reason, "done")
        try:
            await store.save(
                lease, state=agent.state, status=status, final=to_builtins(final), release=True
            )
        except SessionLostError:
            logger.warning("%s: session %s was taken over at its end", self.name, session)
            return None
        return final

    async def _stream(
        self, agent: Agent, inputs: Any, session: str, events: str
    ) -> FinalAnswer | None:
        final: FinalAnswer | None = None
        async for item in agent.reply_stream(inputs, session_id=session):
            if isinstance(item, FinalAnswer):
                final = item
            await self._publish(events, item)
        return final

    async def _renew(self, lease: Lease) -> None:
        assert self.store is not None
        while True:
            await asyncio.sleep(self.lease_ttl / 3)
            await self.store.renew(lease)

    async def _publish(self, subject: str, message: Message) -> None:
        try:
            await self.bus.publish(subject, message)
        except BusError as exc:  # events are best effort; the session holds the truth
            logger.warning("%s: event not published on %s: %s", self.name, subject, exc)

    async def _observe(self, message: AgentMessage) -> Message:
        session = message.session_id or "main"
        try:
            check_name(session, what="session id")
        except InvalidSubjectError as exc:
            return self._error(message, "malformed", str(exc))
        assert self.store is not None
        async with self._session_lock(session):
            try:
                lease = await self.store.acquire(
                    self.name, session, fresh=self.agent.clone().state, wait=self.busy_wait
                )
            except SessionBusyError as exc:
                return self._error(message, "overloaded", str(exc))
            agent = self.agent.clone(state=lease.record.state)
            await agent.observe(message)
            previous = lease.previous
            status: SessionStatus = (
                "paused" if agent.state.paused else "idle" if previous == "running" else previous
            )
            try:
                await self.store.save(lease, state=agent.state, status=status, release=True)
            except SessionLostError as exc:
                return self._error(message, "internal", str(exc))
        return Event(
            sender=self.replica_id,
            session_id=session,
            call_id=message.call_id,
            event="observed",
            data={"agent": self.name},
        )

    async def _observe_topic(self, request: Request) -> None:
        message = request.message
        if isinstance(message, AgentMessage):
            observed = message
        elif isinstance(message, UserRequest | FinalAnswer):
            content = message.content
            observed = AgentMessage(
                sender=message.sender,
                session_id=message.session_id,
                name=message.sender,
                content=content if isinstance(content, list) else _text_blocks(content),
                reply=False,
            )
        else:
            logger.info("%s: topic message %s not observed", self.name, type(message).__name__)
            return None
        await self._observe(observed)
        return None

    async def _as_tool(self, call: ToolCall) -> Message:
        text = call.parameters.get("request")
        if not isinstance(text, str) or not text.strip():
            return _tool_result(
                call,
                self.replica_id,
                "error",
                None,
                "invalid_parameters",
                "'request' must be a non-empty string",
            )
        # One session per call: a retry of the call finds it (and its answer).
        digest = hashlib.sha256(f"{call.sender}|{call.call_id}".encode()).hexdigest()[:24]
        session = call.session_id or f"tool-{digest}"
        assert self.store is not None
        record = await self.store.get(self.name, session)
        if record is not None and record.final is not None and call.session_id is None:
            final: Any = record.final
            return _tool_result(call, self.replica_id, "success", final.get("content"), None, None)
        answer = await self._converse(
            UserRequest(sender=call.sender, session_id=session, content=text), session, None
        )
        if isinstance(answer, FinalAnswer):
            ok = answer.finished_reason in ("completed", "exceed_max_iters")
            return _tool_result(
                call,
                self.replica_id,
                "success" if ok else "error",
                answer.content if ok else None,
                None if ok else "tool_error",
                None if ok else f"{answer.finished_reason}: {answer.content}",
            )
        assert isinstance(answer, ErrorMessage)
        return _tool_result(call, self.replica_id, "error", None, "tool_error", answer.message)

    async def _control(self, request: Request) -> Message | None:
        message = request.message
        if isinstance(message, Cancel) and message.session_id:
            agent = self._running.get(message.session_id)
            if agent is not None:
                logger.info("%s: cancelling session %s", self.name, message.session_id)
                agent.interrupt()
        return None

    # -- taking sessions over ---------------------------------------------------------

    async def _recover_forever(self, limiter: asyncio.Semaphore) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.recover_interval):
                    await self._stop.wait()
            if self._stop.is_set():
                return
            try:
                await self._recover_once(limiter)
            except FleetbusError as exc:
                logger.warning("%s: recovery scan failed: %s", self.name, exc)

    async def _recover_once(self, limiter: asyncio.Semaphore) -> None:
        assert self.store is not None
        for record in await self.store.stale(self.name):
            try:
                lease = await self.store.acquire(self.name, record.session_id, take_over=True)
            except SessionBusyError:
                continue  # another replica was faster
            logger.warning(
                "%s: taking over session %s from %s at step %d",
                self.name,
                record.session_id,
                record.owner,
                record.step,
            )
            async with limiter:
                reply_to = record.reply_to
                final = await self._run_reply(lease, None, record.session_id)
            if final is not None and reply_to:
                # The original requester may still wait on its inbox.
                await self._publish(reply_to, final)

    def _error(self, about: AnyMessage, code: ErrorCode, text: str) -> ErrorMessage:
        return error_reply(about, code, text, source=self.replica_id)


def _text_blocks(text: str) -> list[Any]:
    from fleetbus.protocol import TextBlock

    return [TextBlock(text=text)]


def _tool_result(
    call: ToolCall,
    sender: str,
    status: Any,
    content: Any,
    code: str | None,
    message: str | None,
) -> ToolResult:
    return ToolResult(
        sender=sender,
        session_id=call.session_id,
        call_id=call.call_id,
        tool_name=call.tool_name,
        status=status,
        content=content,
        error_detail=ErrorDetail(code=code, message=message or "") if code else None,
    )
