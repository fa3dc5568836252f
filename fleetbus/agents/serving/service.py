"""An agent served on the bus: its inbox, its sessions, its events.

:class:`AgentService` binds one :class:`~fleetbus.agents.Agent` definition to
the bus. It serves ``<prefix>.agent.<name>.inbox`` in queue group
``agent.<name>``, so replicas share the work:

- ``user_request`` (or ``agent_message`` with ``reply=True``): run a reply in
  the message's session and answer ``final_answer``; every event of the reply
  is published on ``<prefix>.events.<agent>.<session_id>``, the final answer
  too. A message's ``output_schema`` reaches the agent with the message (the
  agent reads it, see ``Agent.reply``) and is saved with the reply it starts,
  so a take-over, which resumes without the message, keeps asking for it;
- ``agent_message`` with ``reply=False``: add it to the session's memory and
  answer an ``event`` named ``observed``;
- ``confirm_result`` / ``external_result``: resume the session's paused reply;
- ``tool_call``: the agent used as a tool (``{"request": "..."}``), answered
  with a ``tool_result``;
- ``cancel``: interrupt the session's reply (also on the control subject,
  which every replica hears).

Sessions live in JetStream (:class:`SessionStore`), written ahead of every
side effect under a lease: the request when it is taken, the input before any
work, a step's tool calls before they are sent, each result as it arrives,
and the end — status and final answer — before the answer is sent and the
lease released. A replica that dies leaves a lease that goes silent;
:class:`~fleetbus.agents.serving.sessions.Recovery` in any replica finds it
without scanning the store, and that replica takes the session over from its
last write, finishes it, stores and publishes the final answer, and answers
the original request. A replica that loses its session stops quietly: only
the owner answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import socket
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from fleetbus._retry import Retry
from fleetbus.agents.agent import Agent
from fleetbus.agents.serving.sessions import Lease, SessionStatus, SessionStore
from fleetbus.agents.state import AgentState
from fleetbus.bus import Bus, Lifecycle, Request
from fleetbus.bus.subjects import check_name
from fleetbus.errors import (
    BusError,
    InvalidSubjectError,
    ProtocolError,
    SessionBusyError,
    SessionLost,
    StoreError,
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
    decode,
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
        recover_interval: seconds between checks of the running sessions' lease
            timers (no store scan: see :class:`Recovery`).
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
        self._runs: dict[str, _Run] = {}
        self._takeovers: asyncio.TaskGroup | None = None
        self._taking_over: set[str] = set()
        self._takeover_deadlines: set[asyncio.Timeout] = set()
        self._limiter = asyncio.Semaphore(concurrency)
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
        recovery = self.store.recovery(self.name, self._take_over, interval=self.recover_interval)
        await recovery.start()
        subjects = self.bus.subjects
        limiter = asyncio.Semaphore(self.concurrency)
        self._limiter = limiter
        ready = [asyncio.Event() for _ in range(2 + len(self.topics))]
        try:
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
                tg.create_task(recovery.run(self._stop))
                tg.create_task(self._cut_take_overs())
                self._takeovers = tg
        finally:
            self._takeovers = None
            await recovery.close()  # never leave its subscription behind

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
    ) -> Message | None:
        """Serve a message that wants a reply. ``None`` (no answer from this
        replica) when the session was lost meanwhile: its new owner answers."""
        session = session_id or new_id()
        try:
            check_name(session, what="session id")
        except InvalidSubjectError as exc:
            return self._error(message, "malformed", str(exc))
        assert self.store is not None
        run = self._runs.setdefault(session, _Run())
        run.users += 1
        try:
            async with self._session_lock(session):
                reply_to = (request.reply or None) if request is not None else None
                lease = await self._acquire(message, session, reply_to)
                if isinstance(lease, ErrorMessage):
                    return lease
                final = await self._run_reply(lease, message, session, run, answer_to=reply_to)
                # Answered by _run_reply once its end was stored (or by the
                # session's new owner): nothing more to send from here.
                return None if reply_to else final
        finally:
            run.users -= 1
            if not run.users:
                self._runs.pop(session, None)

    async def _acquire(
        self, message: AnyMessage, session: str, reply_to: str | None
    ) -> Lease | ErrorMessage:
        """The session's lease with ``message`` recorded, or the error to answer."""
        assert self.store is not None
        try:
            return await self.store.acquire(
                self.name,
                session,
                fresh=self.agent.clone().state,
                reply_to=reply_to,
                pending_input=to_builtins(message),
                wait=self.busy_wait,
            )
        except SessionBusyError as exc:
            return self._error(message, "overloaded", str(exc))
        except StoreError as exc:
            return self._error(message, "internal", f"the session store failed: {exc}")

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

    async def _run_reply(
        self,
        lease: Lease,
        inputs: AnyMessage | None,
        session: str,
        run: _Run,
        *,
        answer_to: str | None = None,
    ) -> FinalAnswer | None:
        """Serve ``inputs`` (``None``: a take-over) holding ``lease``: first what
        a dead owner left — an answer it stored but may not have sent, the
        reply it was running, the request it had not recorded — then
        ``inputs``, whose answer goes to ``answer_to``.

        The end of each reply is written before it is sent and the lease is
        released after: the status and the final answer in one write, then
        the answer, then the lease. A replica that dies in between leaves a
        lease that lapses, and whoever takes over sends the stored answer
        again (a duplicate at worst, never a loss). ``None`` if the session
        was lost meanwhile (one log line: the new owner answers)."""
        record = lease.record
        if inputs is None:  # a take-over: the request being served is in the head
            orphan, orphan_to = record.pending_input, record.reply_to
            if lease.previous != "running" and record.final is not None:
                # Its owner died after storing the answer: send it, release.
                return await self._deliver(lease, record.final, record.reply_to, lease.previous)
        else:
            orphan, orphan_to = lease.orphan_input, lease.orphan_reply_to
            stored = _decode_final(lease.orphan_final)
            if stored is not None and orphan_to:  # a dead owner's answer, maybe unsent
                await self._publish(orphan_to, stored)
                orphan_to = None

        async def checkpoint(state: AgentState) -> None:
            if state.reply is None or state.paused:
                return  # the end of a reply: written below with its answer and status
            await self._save(lease, self.lease_ttl, state=state, input_recorded=run.recording)

        agent = self.agent.clone(state=record.state, checkpoint=checkpoint)
        # (input, who waits for its answer, whether it is the pending input)
        phases: list[tuple[Any, str | None, bool]] = []
        orphan_message = _decode_input(orphan)
        if agent.state.reply is not None and not agent.state.paused:
            phases.append((None, orphan_to if orphan_message is None else None, False))
        if orphan_message is not None:
            phases.append((orphan_message, orphan_to, inputs is None))
        if inputs is not None:
            phases.append((inputs, answer_to, True))
        self._running[session] = agent
        final: FinalAnswer | None = None
        lost = False
        try:
            async with asyncio.TaskGroup() as tg:
                # Renewed until released: the end is written, sent and released
                # under the lease, so nobody takes a session that is ending.
                renewing = tg.create_task(self._renew(lease))
                try:
                    final = await self._serve_phases(agent, phases, session, run, lease)
                finally:
                    renewing.cancel()
        except* SessionLost:
            lost = True
        finally:
            self._running.pop(session, None)
            run.cancelled = False  # a cancel ends the reply it found, not later ones
        if lost:
            logger.warning(
                "%s: session %s was lost to another replica; stopping", self.name, session
            )
            return None
        return final

    async def _serve_phases(
        self,
        agent: Agent,
        phases: list[tuple[Any, str | None, bool]],
        session: str,
        run: _Run,
        lease: Lease,
    ) -> FinalAnswer | None:
        """Run each phase; write the end, send the last answer, release."""
        events = self.bus.subjects.events(self.name, session)
        final: FinalAnswer | None = None
        last_to: str | None = None
        for index, (phase_input, phase_to, pending) in enumerate(phases):
            run.recording = pending
            if isinstance(phase_input, AgentMessage) and not phase_input.reply:
                await agent.observe(phase_input)
                continue
            final = await self._stream(agent, phase_input, session, events, run)
            if index == len(phases) - 1:
                last_to = phase_to  # answered once its end is written
            elif phase_to and final is not None:
                await self._publish(phase_to, final)
        if final is None:
            status: SessionStatus = "paused" if agent.state.paused else "idle"
        else:
            status = _STATUS.get(final.finished_reason, "done")
        await self._save(
            lease,
            self.lease_ttl,
            state=agent.state,
            status=status,
            final=to_builtins(final) if final is not None else None,
            input_recorded=True,
        )
        if last_to and final is not None:
            await self._publish(last_to, final)
        assert self.store is not None
        await self.store.release(lease)
        return final

    async def _deliver(
        self, lease: Lease, final: dict[str, Any], reply_to: str | None, status: SessionStatus
    ) -> FinalAnswer | None:
        """Send an answer a dead owner stored, and put the session back as it was."""
        answer = _decode_final(final)
        try:
            await self._save(lease, self.lease_ttl, status=status, input_recorded=True)
            if reply_to and answer is not None:
                await self._publish(reply_to, answer)
            assert self.store is not None
            await self.store.release(lease)
        except SessionLost:
            logger.warning(
                "%s: session %s was lost while re-sending its answer",
                self.name,
                lease.record.session_id,
            )
            return None
        return answer

    async def _save(self, lease: Lease, deadline: float, **what: Any) -> None:
        """Save, retrying a failing store for up to ``deadline`` seconds; past
        that this replica cannot vouch for the session any more: it stops."""
        store = self.store
        assert store is not None
        record = lease.record

        async def save() -> None:
            try:
                await store.save(lease, **what)
            except StoreError as exc:
                logger.warning(
                    "%s: saving session %s failed: %s", self.name, record.session_id, exc
                )
                raise

        retry = Retry(on=StoreError, attempts=None, backoff=0.05, max_backoff=1.0, timeout=deadline)
        try:
            await retry.call(save)
        except StoreError as exc:
            raise SessionLost(
                f"session {record.session_id} could not be saved for {deadline:g} s: {exc}",
                agent=record.agent,
                session_id=record.session_id,
            ) from exc

    async def _stream(
        self, agent: Agent, inputs: Any, session: str, events: str, run: _Run
    ) -> FinalAnswer | None:
        final: FinalAnswer | None = None
        stream = agent.reply_stream(inputs, session_id=session)
        try:
            async for item in stream:
                if run.cancelled:
                    agent.interrupt()  # a cancel that came before the reply ran (idempotent)
                if isinstance(item, FinalAnswer):
                    final = item
                await self._publish(events, item)
        finally:
            await stream.aclose()
        return final

    async def _renew(self, lease: Lease) -> None:
        assert self.store is not None
        while True:
            await asyncio.sleep(self.lease_ttl / 3)
            try:
                await self.store.renew(lease)
            except StoreError as exc:
                if time.monotonic() - lease.renewed_at >= self.lease_ttl:
                    record = lease.record
                    raise SessionLost(
                        f"the lease of session {record.session_id} could not be renewed: {exc}",
                        agent=record.agent,
                        session_id=record.session_id,
                    ) from exc
                logger.warning("%s: lease renewal failed, retrying: %s", self.name, exc)

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
            while True:
                lease = await self._acquire(message, session, None)
                if isinstance(lease, ErrorMessage):
                    return lease
                state = lease.record.state
                stored = _decode_final(lease.orphan_final)
                if stored is not None and lease.orphan_reply_to:
                    await self._publish(lease.orphan_reply_to, stored)  # a dead owner's answer
                if lease.orphan_input is None and (state.reply is None or state.paused):
                    break
                # A dead owner left work in this session: finish it, then observe.
                lease.record = lease.record.model_copy(
                    update={
                        "pending_input": lease.orphan_input,
                        "reply_to": lease.orphan_reply_to,
                    }
                )
                if await self._run_reply(lease, None, session, _Run()) is None:
                    return self._error(message, "internal", f"session {session} was lost")
            agent = self.agent.clone(state=lease.record.state)
            await agent.observe(message)
            previous = lease.previous
            status: SessionStatus = (
                "paused" if agent.state.paused else "idle" if previous == "running" else previous
            )
            try:
                await self._save(
                    lease, self.lease_ttl, state=agent.state, status=status, release=True
                )
            except SessionLost as exc:
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

    async def _as_tool(self, call: ToolCall) -> Message | None:
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
        if answer is None:  # lost to another replica: the caller's retry finds its answer
            return None
        assert isinstance(answer, ErrorMessage)
        return _tool_result(call, self.replica_id, "error", None, "tool_error", answer.message)

    async def _control(self, request: Request) -> Message | None:
        message = request.message
        if isinstance(message, Cancel) and message.session_id:
            run = self._runs.get(message.session_id)
            if run is not None:
                run.cancelled = True
            agent = self._running.get(message.session_id)
            if agent is not None:
                logger.info("%s: cancelling session %s", self.name, message.session_id)
                agent.interrupt()
        return None

    # -- taking sessions over ---------------------------------------------------------

    async def _take_over(self, session: str, lease_revision: int) -> None:
        """Recovery found ``session`` left running by a dead owner: serve it in
        a task of its own, so that recovery goes on checking the others."""
        if self._takeovers is None or session in self._taking_over:
            return
        self._taking_over.add(session)
        self._takeovers.create_task(self._serve_take_over(session, lease_revision))

    async def _serve_take_over(self, session: str, lease_revision: int) -> None:
        try:
            async with asyncio.timeout(None) as deadline:
                self._takeover_deadlines.add(deadline)
                try:
                    await self._resume_session(session, lease_revision)
                finally:
                    self._takeover_deadlines.discard(deadline)
        except TimeoutError:
            logger.warning(
                "%s: stopping before the take-over of session %s ended; its lease will lapse",
                self.name,
                session,
            )
        finally:
            self._taking_over.discard(session)

    async def _cut_take_overs(self) -> None:
        """On stop, running take-overs get ``drain_timeout`` seconds to end."""
        await self._stop.wait()
        when = asyncio.get_running_loop().time() + self.drain_timeout
        for deadline in list(self._takeover_deadlines):
            deadline.reschedule(when)

    async def _resume_session(self, session: str, lease_revision: int) -> None:
        assert self.store is not None
        async with self._session_lock(session):
            try:
                lease = await self.store.acquire(
                    self.name, session, take_over=True, lease_revision=lease_revision
                )
            except SessionBusyError:
                return  # another replica was faster, or it ended meanwhile
            logger.warning(
                "%s: taking over session %s from %s at step %d",
                self.name,
                session,
                lease.previous_owner or "a replica that died",
                lease.record.step,
            )
            run = self._runs.setdefault(session, _Run())
            run.users += 1
            try:
                async with self._limiter:
                    await self._run_reply(lease, None, session, run)
            finally:
                run.users -= 1
                if not run.users:
                    self._runs.pop(session, None)

    def _error(self, about: AnyMessage, code: ErrorCode, text: str) -> ErrorMessage:
        return error_reply(about, code, text, source=self.replica_id)


@dataclass
class _Run:
    """The requests of one session in this replica, and whether a cancel came."""

    users: int = 0
    cancelled: bool = False
    recording: bool = False
    """The phase running serves the request recorded with the lease."""


def _decode_input(data: dict[str, Any] | None) -> AnyMessage | None:
    if data is None:
        return None
    try:
        return decode(orjson.dumps(data))
    except ProtocolError as exc:
        logger.warning("a recorded request is unreadable, dropped: %s", exc)
        return None


def _decode_final(data: dict[str, Any] | None) -> FinalAnswer | None:
    message = _decode_input(data)
    return message if isinstance(message, FinalAnswer) else None


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
