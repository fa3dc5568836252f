"""Running replies under a session's lease: the part of :class:`AgentHost
<fleetbus.agents.serving.host.AgentHost>` that takes a session, serves what
it holds — what a dead owner left, then the message — writes each reply's
facts ahead of its side effects, renews the lease, writes the end, answers
and releases.

The end of each reply is written before it is sent and the lease is released
after: the status and the final answer in one fact, then the answer, then
the lease. A replica that dies in between leaves a lease that lapses, and
whoever takes over sends the stored answer again (a duplicate at worst,
never a loss). A replica that loses its session stops quietly: only the
owner answers.

A reply's events go where its answer goes: on the events subject of the
owner of the reply subject it answers
(``<prefix>.events.<agent>.<session>.<owner>``, see
:meth:`Subjects.reply_owner <fleetbus.bus.Subjects.reply_owner>`), whose
identity the server lets read them, and nobody else but the fleet's watchers.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec
import orjson

from fleetbus import tracing
from fleetbus._deadlines import later
from fleetbus._retry import Retry
from fleetbus.agents import talk
from fleetbus.agents.agent import Agent
from fleetbus.agents.serving.rules import serve_rules
from fleetbus.agents.serving.sessions import (
    Lease,
    SessionRecord,
    SessionStatus,
    SessionStore,
    session_key,
)
from fleetbus.agents.state import AgentState
from fleetbus.bus import Bus, CallScope
from fleetbus.bus.store import wait_for_store
from fleetbus.bus.subjects import NO_OWNER
from fleetbus.errors import (
    BusError,
    FleetbusError,
    NoRespondersError,
    ProtocolError,
    RequestHeldError,
    SessionBusyError,
    SessionLost,
    SessionNotFoundError,
    StoreError,
)
from fleetbus.protocol import (
    AgentMessage,
    AnyMessage,
    Asking,
    ConfirmResult,
    ErrorCode,
    ErrorMessage,
    ExternalResult,
    FinalAnswer,
    Handoff,
    Message,
    UserRequest,
    decode,
    error_reply,
    new_id,
    to_builtins,
)
from fleetbus.protocol.codec import clip

__all__ = ["ReplyRunning"]

logger = logging.getLogger(__name__)

_HANDOFF_GRACE = 5.0
"""Seconds a handoff waits for a replica of the agent it goes to (one may
be starting, or moving to another server of a cluster)."""
_HANDOFF_TIMEOUT = 60.0
"""Seconds a handoff waits for a replica of that agent to hold it."""

_MAX_INPUT_DEPTH = 128
"""Deepest nesting of arrays and objects a message an agent stores may have:
the session records hold it a few levels further down, and orjson, which
writes them, stops at 254 levels."""


_STATUS: dict[str, SessionStatus] = {
    "completed": "done",
    "exceed_max_iters": "done",
    "repeated_action": "done",
    "interrupted": "idle",
    "paused": "paused",
    "error": "error",
    "handed_off": "done",
}


class ReplyRunning:
    """Taking sessions and running their replies (mixed into ``AgentHost``,
    which sets these attributes)."""

    bus: Bus
    store: SessionStore | None
    replica_id: str
    lease_ttl: float
    busy_wait: float
    store_wait: float
    checkpoints: Literal["step", "reply"]
    events: Literal["all", "final", "none"]
    _running: dict[str, Agent]
    _runs: dict[str, Run]
    _limiter: asyncio.Semaphore
    _session_lock: SessionLocks

    def definition(self, name: str) -> Agent:
        raise NotImplementedError

    async def _acquire(
        self,
        name: str,
        message: AnyMessage,
        session: str,
        reply_to: str | None,
        receipt: tuple[str, str] | None = None,
    ) -> Lease | ErrorMessage | FinalAnswer | None:
        """The session's lease with ``message`` recorded, or what to answer
        instead (an error; a resume of a session that does not exist;
        ``None``, nothing, for a copy of the request another replica serves:
        ``receipt``, its call_id and reply subject)."""
        assert self.store is not None
        try:
            pending = to_builtins(message)
        except RecursionError:
            pending = None
        if pending is None or _nests_deeper(pending, _MAX_INPUT_DEPTH):
            return self._error(
                message,
                "malformed",
                f"the message nests arrays and objects more than {_MAX_INPUT_DEPTH} levels "
                "deep, more than an agent stores",
            )
        store = self.store

        async def acquire() -> Lease:
            return await store.acquire(
                name,
                session,
                fresh=lambda: self.definition(name).initial_state(),
                reply_to=reply_to,
                pending_input=pending,
                wait=self.busy_wait,
                # A confirmation or an external result continues a session:
                # one to a session that does not exist must not start it.
                create=not isinstance(message, ConfirmResult | ExternalResult),
                joins=receipt,
            )

        def waiting(exc: StoreError) -> None:
            logger.warning(
                "%s: the session store failed taking session %s, retrying for up to %g s: %s",
                name,
                session,
                self.store_wait,
                exc,
                extra={"session_id": session, "call_id": message.call_id},
            )

        # A JetStream fail-over (a cluster node died) leaves a stream without
        # a leader for a few seconds: the request waits for the new one.
        try:
            return await wait_for_store(acquire, timeout=self.store_wait, waiting=waiting)
        except SessionNotFoundError as exc:
            return _nothing_waits(name, message, session, str(exc))
        except RequestHeldError:
            return None  # a copy: the replica serving the request answers it
        except SessionBusyError as exc:
            return self._error(message, "overloaded", str(exc))
        except StoreError as exc:
            return self._error(message, "internal", f"the session store failed: {exc}")

    async def _run_reply(
        self,
        lease: Lease,
        inputs: AnyMessage | None,
        run: Run,
        *,
        answer_to: str | None = None,
        holds_slot: bool = True,
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
        name, session = record.agent, record.session_id
        key = session_key(name, session)
        if inputs is None:  # a take-over: the request being served is in the journal
            orphan, orphan_to = record.pending_input, record.reply_to
            if lease.previous != "running" and record.final is not None:
                # Its owner died after storing the answer: send it, release.
                return await self._deliver(lease, record.final, record.reply_to, lease.previous)
        else:
            handed = self.passes_on(lease, inputs)
            if handed is not None:  # the conversation is another agent's now: it answers
                return await self._pass_on(lease, inputs, answer_to, handed)
            orphan, orphan_to = lease.orphan_input, lease.orphan_reply_to
            stored = decode_final(lease.orphan_final)
            if stored is not None and orphan_to:  # a dead owner's answer, maybe unsent
                await self._publish(orphan_to, stored)
                orphan_to = None

        # The reply's tool calls: a replica that stops waiting for them
        # because it lost the session, or because it stops (its sessions are
        # taken over), leaves them running for the session's next owner, who
        # sends them again with the same call_id; a cancel would make that
        # re-send find them cancelled. Only an interrupt (a user's cancel)
        # cancels them on the workers.
        calls = CallScope(asyncio.current_task())

        async def checkpoint(state: AgentState) -> None:
            if state.reply is None or state.paused or self.checkpoints == "reply":
                return  # the end of a reply: written below with its answer and status
            if redoable(state, run.recording):
                return
            try:
                await self._save(lease, self.lease_ttl, state=state, input_recorded=run.recording)
            except SessionLost:
                calls.abandon()  # before it cuts the reply's other calls short
                raise

        agent = serve_rules(
            self.bus, self.definition(name).clone(state=record.state, checkpoint=checkpoint)
        )
        # (input, who waits for its answer, whether it is the pending input)
        phases: list[_Phase] = []
        orphan_message = decode_input(orphan)
        if agent.state.reply is not None and not agent.state.paused:
            phases.append(_Phase(None, [orphan_to] if orphan_message is None else [], False))
        if orphan_message is not None:
            phases.append(_Phase(orphan_message, [orphan_to], inputs is None))
        if inputs is not None:
            again = _asked_again(agent.state, phases, record, lease.previous, inputs)
            if again is None:
                phases.append(_Phase(inputs, [answer_to], True))
            elif isinstance(again, _Phase):
                # The request itself is what is left to finish: it answers both.
                again.to.append(answer_to)
                again.pending = True  # (the lease's request: recorded by this phase)
            else:  # answered already: the stored answer, again
                if not phases:
                    assert record.final is not None
                    return await self._deliver(lease, record.final, answer_to, lease.previous)
                if answer_to:
                    await self._publish(answer_to, again)
        self._running[key] = agent
        if run.cancelled:  # a cancel came before the agent was here to take it
            agent.interrupt(pending=True)
        final: FinalAnswer | None = None
        lost: BaseException | None = None
        # The reply holds a place of the limiter (taken by the serving loop,
        # or by a take-over): the talk tools give it back while they wait.
        slot = self._limiter if holds_slot else None
        speaking = talk.speaking(self.bus, name, session, slot)
        try:
            with calls:
                async with asyncio.TaskGroup() as tg:
                    # Renewed until released: the end is written, sent and released
                    # under the lease, so nobody takes a session that is ending.
                    # The renewing task starts with the first renewal: most
                    # replies end before it is due.
                    renewing: list[asyncio.Task[None]] = []
                    due = later(
                        self.lease_ttl / 3,
                        lambda: renewing.append(tg.create_task(self._renew(lease, calls))),
                    )
                    try:
                        final = await self._serve_phases(agent, phases, run, lease)
                    finally:
                        due.cancel()
                        for task in renewing:
                            task.cancel()
        except* SessionLost as group:
            lost = group.exceptions[0]
        finally:
            talk.hush(speaking)
            self._running.pop(key, None)
            run.cancelled = False  # a cancel ends the reply it found, not later ones
        if lost is not None:
            logger.warning("%s: session %s was lost, stopping: %s", name, session, lost)
            return None
        return final

    async def _serve_phases(
        self,
        agent: Agent,
        phases: list[_Phase],
        run: Run,
        lease: Lease,
    ) -> FinalAnswer | None:
        """Run each phase; write the end, send the last answer, release."""
        session = lease.record.session_id
        final: FinalAnswer | None = None
        last_to: list[str | None] = []
        for index, phase in enumerate(phases):
            run.recording = phase.pending
            if isinstance(phase.input, AgentMessage) and not phase.input.reply:
                await agent.observe(phase.input)
                continue
            final = await self._stream(agent, phase.input, session, phase.to, run)
            if index == len(phases) - 1:
                last_to = phase.to  # answered once its end is written
            elif final is not None:
                for to in dict.fromkeys(phase.to):
                    if to:
                        await self._publish(to, final)
        if final is None or agent.state.paused:  # (a refused confirmation keeps it paused)
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
            # A population's sessions are read from the store at almost every
            # reply: a small one ends as one snapshot, read in one message.
            small_rollup=self.checkpoints == "reply",
        )
        if final is not None:
            for to in dict.fromkeys(last_to):
                if to:
                    await self._publish(to, final)
            if final.handoff is not None and not any(last_to):
                await self._publish("", final)  # handed over, though nobody waits
        assert self.store is not None
        await self.store.release(lease)
        return final

    @staticmethod
    def passes_on(lease: Lease, inputs: AnyMessage) -> str | None:
        """The agent ``inputs`` goes on to, when its session handed the
        conversation over (and nothing ran since): a request starting a
        reply there is that agent's to answer. Its receipt is that agent's
        too: a copy sent again finds this lease released and goes on again."""
        record = lease.record
        if record.state.reply is not None or not _starts_a_reply(inputs):
            return None
        return _handed_to(record.final, lease.previous)

    async def _pass_on(
        self, lease: Lease, inputs: AnyMessage, reply_to: str | None, agent: str
    ) -> FinalAnswer | None:
        """Send a request of a session handed over on to the agent that holds
        the conversation now, as it is (its answer and its receipt go to
        ``reply_to``); release."""
        record = lease.record
        try:
            await self._save(lease, self.lease_ttl, status=lease.previous, input_recorded=True)
            try:
                inbox = self.bus.subjects.agent_inbox(agent)
                await self.bus.publish_bytes(inbox, self.bus.encode(inputs), reply=reply_to or "")
            except FleetbusError as exc:
                logger.warning(
                    "%s: request in session %s not passed on to %s: %s",
                    record.agent,
                    record.session_id,
                    agent,
                    exc,
                )
                if reply_to:
                    await self._publish(
                        reply_to,
                        self._error(inputs, "internal", f"not passed on to {agent}: {exc}"),
                    )
            assert self.store is not None
            await self.store.release(lease)
        except SessionLost:
            logger.warning(
                "%s: session %s was lost while passing a request on",
                record.agent,
                record.session_id,
            )
            return None
        return decode_final(record.final)

    async def _deliver(
        self, lease: Lease, final: dict[str, Any], reply_to: str | None, status: SessionStatus
    ) -> FinalAnswer | None:
        """Send an answer a dead owner stored, and put the session back as it was."""
        answer = decode_final(final)
        try:
            await self._save(lease, self.lease_ttl, status=status, input_recorded=True)
            if reply_to and answer is not None:
                await self._publish(reply_to, answer)
            assert self.store is not None
            await self.store.release(lease)
        except SessionLost:
            logger.warning(
                "%s: session %s was lost while re-sending its answer",
                lease.record.agent,
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
                    "%s: saving session %s failed: %s", record.agent, record.session_id, exc
                )
                raise

        started = asyncio.get_running_loop().time()
        try:
            try:  # the first attempt: most saves succeed
                await save()
            except StoreError as exc:
                await _save_retry(deadline).after(save, exc, started)
        except StoreError as exc:
            raise SessionLost(
                f"session {record.session_id} could not be saved for {deadline:g} s: {exc}",
                agent=record.agent,
                session_id=record.session_id,
            ) from exc

    def _events_subjects(self, name: str, session: str, to: list[str | None]) -> list[str]:
        """Where the events of a phase answering ``to`` go: the events subject
        of each owner of its reply subjects (:meth:`Subjects.reply_owner
        <fleetbus.bus.Subjects.reply_owner>`), so that only those who may read
        the answer read them; ``_`` when nobody waits for it."""
        subjects = self.bus.subjects
        owners = dict.fromkeys(subjects.reply_owner(reply_to) for reply_to in to if reply_to)
        return [subjects.events(name, session, owner) for owner in owners or [NO_OWNER]]

    async def _stream(
        self, agent: Agent, inputs: Any, session: str, to: list[str | None], run: Run
    ) -> FinalAnswer | None:
        """The reply to ``inputs``, its events published where the answer
        goes (to ``to``) when this host publishes them."""
        if self.events != "all":
            # Events that are not published are not made (but for the
            # middleware watching them): the final answer alone.
            return await agent.reply(inputs, session_id=session)
        events = self._events_subjects(agent.name, session, to)
        final: FinalAnswer | None = None
        stream = agent.reply_stream(inputs, session_id=session)
        try:
            async for item in stream:
                if run.cancelled:
                    agent.interrupt(pending=True)  # a cancel that came before (idempotent)
                if isinstance(item, FinalAnswer):
                    final = item  # stored in the journal, sent to the requester
                else:
                    for subject in events:
                        await self._publish(subject, item)
        finally:
            await stream.aclose()
        return final

    async def _renew(self, lease: Lease, calls: CallScope) -> None:
        """Renew ``lease`` now and every third of its TTL until cancelled
        (started when the first renewal is due). Raises ``SessionLost`` when it was
        taken over or could not be renewed for its TTL, after abandoning
        ``calls`` (the reply's tool calls are left to the next owner)."""
        assert self.store is not None
        try:
            while True:
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
                    logger.warning(
                        "%s: lease renewal failed, retrying: %s", lease.record.agent, exc
                    )
                await asyncio.sleep(self.lease_ttl / 3)
        except SessionLost:
            calls.abandon()
            raise

    async def _publish(self, subject: str, message: Message) -> None:
        if isinstance(message, FinalAnswer) and message.handoff is not None:
            await self._hand_over(subject, message, message.handoff)
            return
        try:
            await self.bus.publish(subject, message)
        except BusError as exc:  # events are best effort; the session holds the truth
            logger.warning("%s: event not published on %s: %s", self.replica_id, subject, exc)

    async def _hand_over(self, reply_to: str, final: FinalAnswer, handoff: Handoff) -> None:
        """Answer a reply that ended ``handed_off``: the request goes on to the
        agent that takes the conversation, carrying it, with the requester's
        call id and reply subject — that agent's answer is the requester's.

        Sent until a replica of that agent holds it (its receipt), and again
        whenever the stored answer is (a take-over, a request asked again):
        the agent it goes to takes a copy it holds or has answered as such.
        Nobody serving that agent for a few seconds: the requester gets an
        ``error`` answer saying so."""
        request = UserRequest(
            sender=f"agent.{final.sender}",
            session_id=final.session_id,
            call_id=final.call_id or new_id(),
            content="",
            handoff=msgspec.structs.replace(handoff, reply_to=reply_to or None),
            receipt=True,
        )
        with tracing.span(
            "fleetbus handoff",
            kind=tracing.SpanKind.PRODUCER,
            attributes={
                "fleetbus.agent": final.sender,
                "fleetbus.handoff.to": handoff.agent,
                "fleetbus.session_id": final.session_id or "",
            },
        ):
            try:
                inbox = self.bus.subjects.agent_inbox(handoff.agent)
                retry = Retry(
                    on=NoRespondersError, attempts=None, backoff=0.1, timeout=_HANDOFF_GRACE
                )
                await retry.call(self.bus.deliver, inbox, request, timeout=_HANDOFF_TIMEOUT)
            except FleetbusError as exc:
                logger.warning(
                    "%s: session %s not handed over to %s: %s",
                    final.sender,
                    final.session_id,
                    handoff.agent,
                    exc,
                )
                if reply_to:
                    answer = msgspec.structs.replace(
                        final,
                        content=f"The conversation could not be handed over to "
                        f"{handoff.agent}: {exc}",
                        finished_reason="error",
                        handoff=None,
                    )
                    await self._publish(reply_to, answer)
                return
        logger.info(
            "%s: session %s handed over to %s",
            final.sender,
            final.session_id,
            handoff.agent,
            extra={"call_id": final.call_id, "session_id": final.session_id},
        )

    def _error(self, about: AnyMessage, code: ErrorCode, text: str) -> ErrorMessage:
        # The text may quote what the message carried (a session id, say).
        return error_reply(about, code, clip(text), source=self.replica_id)


@functools.lru_cache(maxsize=32)
def _save_retry(deadline: float) -> Retry:
    """How a save is tried again, for up to ``deadline`` seconds (made once
    for each deadline: every reply saves)."""
    return Retry(on=StoreError, attempts=None, backoff=0.05, max_backoff=1.0, timeout=deadline)


@dataclass
class Run:
    """The requests of one session in this replica, and whether a cancel came."""

    users: int = 0
    cancelled: bool = False
    recording: bool = False
    """The phase running serves the request recorded with the lease."""
    receipts: set[tuple[str, str]] = field(default_factory=set)
    """``(call_id, reply subject)`` of the requests held here that asked for
    a receipt: the same sent again is not taken twice."""


@dataclass
class _Phase:
    """One input a lease serves, in order: ``None`` continues the reply in
    progress; its answer goes to each of ``to``."""

    input: Any
    to: list[str | None]
    pending: bool
    """It is the request recorded with the lease."""


def _asked_again(
    state: AgentState,
    phases: list[_Phase],
    record: SessionRecord,
    previous: SessionStatus,
    inputs: AnyMessage,
) -> _Phase | FinalAnswer | None:
    """Whether ``inputs``, a request that asked for a receipt, is one this
    session has already taken (sent again by a requester whose receipt had
    not come): the phase already serving it (the reply in progress for it,
    or the request a dead owner took and did not record), or the answer
    stored for it when the session's last reply answered it and ended done.
    ``None``: a request to serve. A request without a receipt asked again
    with its ``call_id`` is a new attempt (the agent drops the earlier one):
    a simulation round asked again after its runner resumed runs again
    against the environment restored."""
    if not isinstance(inputs, Asking) or not inputs.receipt or inputs.call_id is None:
        return None
    if isinstance(inputs, AgentMessage) and not inputs.reply:
        return None
    call_id = inputs.call_id
    for phase in phases:
        if phase.input is None:
            if state.reply is not None and state.reply.request_id == call_id:
                return phase
        elif isinstance(phase.input, Asking) and phase.input.call_id == call_id:
            return phase
    final = record.final
    if previous != "done" or final is None or final.get("call_id") != call_id:
        return None
    return decode_final(final)


def redoable(state: AgentState, recording: bool) -> bool:
    """Whether nothing at this write-ahead point would be lost without a
    write, because what follows writes it before any side effect: the input
    of a request the ``taken`` fact holds (a take-over serves it again from
    its start), or the last result of a step (the step's messages are
    written next; a take-over sends that one call again, with its
    ``call_id``)."""
    reply = state.reply
    assert reply is not None
    if recording and reply.iteration == 0 and not reply.answered and not reply.arrived:
        return True
    if not reply.arrived or not state.memory:
        return False
    done = set(reply.answered)
    done.update(b.id for m in reply.arrived for b in m.tool_results)
    return all(use.id in done for use in state.memory[-1].tool_uses)


def _handed_to(final: dict[str, Any] | None, status: SessionStatus) -> str | None:
    """The agent a session's last reply handed the conversation to, if it did
    (and nothing ran since)."""
    if status != "done" or not final or final.get("finished_reason") != "handed_off":
        return None
    handoff = final.get("handoff")
    agent = handoff.get("agent") if isinstance(handoff, dict) else None
    return agent if isinstance(agent, str) and agent else None


def _starts_a_reply(inputs: AnyMessage) -> bool:
    """A request for a reply of its own: not a conversation handed over, an
    observation, or the answer to a paused reply."""
    if isinstance(inputs, UserRequest):
        return inputs.handoff is None
    return isinstance(inputs, AgentMessage) and inputs.reply


def _nothing_waits(name: str, message: AnyMessage, session: str, why: str) -> FinalAnswer:
    """The answer to a confirmation or external result for a session that
    does not exist: the reply it would resume is nowhere (as for a session
    that is not paused, the reply ends ``error``)."""
    what = "a confirmation" if isinstance(message, ConfirmResult) else "an external result"
    return FinalAnswer(
        sender=name,
        session_id=session,
        call_id=message.call_id,
        content=f"Nothing is waiting for {what}: {why}.",
        finished_reason="error",
    )


def _nests_deeper(value: Any, limit: int) -> bool:
    """Whether ``value`` (JSON as Python builtins) nests arrays and objects
    more than ``limit`` levels deep. Iterative: no recursion to exhaust."""
    stack: list[tuple[Any, int]] = [(value, 1)] if isinstance(value, dict | list) else []
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            return True
        for child in item.values() if isinstance(item, dict) else item:
            if isinstance(child, dict | list):
                stack.append((child, depth + 1))
    return False


def decode_input(data: dict[str, Any] | None) -> AnyMessage | None:
    if data is None:
        return None
    try:
        return decode(orjson.dumps(data))
    except ProtocolError as exc:
        logger.warning("a recorded request is unreadable, dropped: %s", exc)
        return None


def decode_final(data: dict[str, Any] | None) -> FinalAnswer | None:
    message = decode_input(data)
    return message if isinstance(message, FinalAnswer) else None


class SessionLocks:
    """One reply (or observation) at a time per session in this replica (the
    lease does the same across replicas): ``async with locks(key):``. A
    session's lock is kept while someone holds it or waits for it."""

    def __init__(self) -> None:
        self._held: dict[str, _SessionLock] = {}

    def __call__(self, key: str) -> _SessionLock:
        lock = self._held.get(key)
        if lock is None:
            lock = self._held[key] = _SessionLock(self._held, key)
        return lock

    def __len__(self) -> int:
        return len(self._held)


class _SessionLock:
    """The lock of one session (an async context manager written out: this
    runs for every message a host serves)."""

    __slots__ = ("_all", "_key", "_lock", "_users")

    def __init__(self, held: dict[str, _SessionLock], key: str) -> None:
        self._all = held
        self._key = key
        self._lock = asyncio.Lock()
        self._users = 0

    async def __aenter__(self) -> None:
        self._users += 1
        try:
            await self._lock.acquire()
        except BaseException:
            self._leave()
            raise

    async def __aexit__(self, *exc: object) -> None:
        self._lock.release()
        self._leave()

    def _leave(self) -> None:
        self._users -= 1
        if not self._users:
            del self._all[self._key]
