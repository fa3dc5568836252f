"""Agents served on the bus: their inboxes, their sessions, their events.

:class:`AgentHost` serves any number of agents from one process. Given a
``group``, it takes every agent's inbox with one wildcard subscription
(``<prefix>.agent.*.inbox`` in queue group ``host.<group>``, control
``<prefix>.agent.*.control``), so its subscriptions do not grow with the
agents, and the host replicas started with the same group share the load.
Without a group it subscribes each agent's own subjects (queue group
``agent.<name>``), like one :class:`~fleetbus.agents.serving.AgentService`
per agent. An agent is only a name until a message comes for it: its
definition is built then (``AgentSource.agent(name)``, a bounded cache keeps
recent ones) and its session is read from the store, so an idle agent holds
nothing in memory.

What an agent's inbox takes:

- ``user_request`` (or ``agent_message`` with ``reply=True``): run a reply in
  the message's session and answer ``final_answer``; every event of the reply
  is published on ``<prefix>.events.<agent>.<session_id>``, the final answer
  too. A message's ``output_schema`` reaches the agent with the message (the
  agent reads it, see ``Agent.reply``) and is saved with the reply it starts,
  so a take-over, which resumes without the message, keeps asking for it;
- ``agent_message`` with ``reply=False``: add it to the session's memory
  (session ``main`` when it names none) and answer an ``event`` named
  ``observed``;
- ``confirm_result`` / ``external_result``: resume the session's paused reply;
- ``tool_call``: the agent used as a tool (``{"request": "..."}``), answered
  with a ``tool_result``;
- ``cancel``: interrupt the session's reply (also on the control subject,
  which every replica hears).

A broadcast on a topic the host observes is recorded by one replica in the
memory of every agent it serves, in the session the sender names, else in
the session named after the topic. A durable topic is kept in a JetStream
stream, read through one durable consumer per host group: a host that was
down catches up on what it missed.

Sessions live in JetStream (:class:`SessionStore`), written ahead of every
side effect under a lease: the request when it is taken, the input before any
work, a step's tool calls before they are sent, each result as it arrives,
and the end — status and final answer — before the answer is sent and the
lease released. A replica that dies leaves a lease that goes silent;
:class:`~fleetbus.agents.serving.sessions.Recovery` in any replica finds it
without scanning the store, and that replica takes the session over from its
last write, finishes it, stores and publishes the final answer, and answers
the original request. A replica that loses its session stops quietly: only
the owner answers. It stops waiting for the tool calls of its reply without
cancelling them on the workers (:class:`~fleetbus.bus.CallScope`): the new
owner sends them again with the same ``call_id`` and gets their results; so
does a host that stops with replies still running, whose sessions are taken
over. Only a ``cancel`` (the session's reply interrupted) cancels them.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import socket
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

import orjson

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
from fleetbus.bus import Bus, CallScope, Lifecycle, Request
from fleetbus.bus.store import wait_for_store
from fleetbus.bus.subjects import Subjects, check_name
from fleetbus.bus.topics import DurableTopic
from fleetbus.errors import (
    BusError,
    ConfigError,
    InvalidSubjectError,
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
from fleetbus.protocol.codec import clip

__all__ = ["AgentHost", "AgentSource"]

logger = logging.getLogger(__name__)

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
}


@runtime_checkable
class AgentSource(Protocol):
    """Where a host finds the agents it serves: any number, built on demand.

    ``name in source`` must be cheap (it is asked for every message of a
    wildcard subscription); ``source.agent(name)`` builds that agent's
    definition and may be called again for the same name. To observe topics
    with a group, the source must also be iterable (the names it serves).
    A :class:`fleetbus.sim.Population` is one.
    """

    def __contains__(self, name: object) -> bool: ...

    def agent(self, name: str) -> Agent: ...


class _Named:
    """A fixed set of agent definitions as an :class:`AgentSource`."""

    def __init__(self, agents: Iterable[Agent]) -> None:
        self.agents: dict[str, Agent] = {}
        for agent in agents:
            check_name(agent.name, what="agent name")
            if agent.name in self.agents:
                raise ConfigError(f"two agents are named {agent.name!r}")
            self.agents[agent.name] = agent

    def __contains__(self, name: object) -> bool:
        return name in self.agents

    def __iter__(self) -> Iterator[str]:
        return iter(self.agents)

    def agent(self, name: str) -> Agent:
        return self.agents[name]


class AgentHost(Lifecycle):
    """Serves many agents on the bus from one process.

    Args:
        bus: the connection.
        agents: the agents: a sequence or mapping of definitions, or an
            :class:`AgentSource` that builds them on demand (a population).
            Each session runs on a clone of its agent's definition holding
            that session's state.
        group: serve with wildcard subscriptions in queue group
            ``host.<group>``, shared by every replica started with this
            group: a constant number of subscriptions whatever the number of
            agents. Every replica of a group must serve the same agents.
            Without it, each agent's own subjects are subscribed (queue group
            ``agent.<name>``), which needs a finite set of agents.
        replica_id: this replica's id (the lease owner); host-pid by default.
        topics: broadcast topics to observe (one replica records each message).
        durable_topics: keep the topics in JetStream streams, read through a
            durable consumer, so a host that was down catches up.
        lease_ttl: seconds a session lease lasts unrenewed; a replica that
            dies holding one delays its session this long.
        concurrency: sessions run at once by this replica.
        busy_wait: seconds a message waits for its session to be free.
        store_wait: seconds a message waits for the session store when it
            fails (a JetStream stream electing a new leader after a cluster
            node died takes a few seconds) before it is answered an error.
        recover_interval: seconds between checks of the running sessions' lease
            timers (no store scan: see :class:`Recovery`).
        drain_timeout: seconds running replies get to finish on stop.
        cache_size: agent definitions kept built (an :class:`AgentSource`'s).
        checkpoints: ``"step"`` (the default) writes ahead of every side
            effect, so a take-over resumes where the reply was; ``"reply"``
            writes only when a request is taken and when its reply ends, so a
            take-over runs the reply again from its input (its tool calls
            too, under new call ids): half the writes, for agents whose
            replies are short and whose tools may run twice (simulations).
        events: what of each reply is published on its events subject:
            ``"all"`` (the default: every event, for watchers and streaming
            clients), or ``"final"`` / ``"none"``: no event (for
            populations); the final answer is never published there — it is
            the end fact of the session's journal, which watchers follow, and
            the requester's reply.

    Raises:
        ConfigError: no agents, no group with agents that cannot be listed,
            two agents with one name, or topics with a group whose agents
            cannot be listed.
    """

    def __init__(
        self,
        bus: Bus,
        agents: AgentSource | Mapping[str, Agent] | Iterable[Agent],
        *,
        group: str | None = None,
        replica_id: str | None = None,
        topics: Sequence[str] = (),
        durable_topics: bool = False,
        lease_ttl: float = 10.0,
        concurrency: int = 64,
        busy_wait: float = 60.0,
        store_wait: float = 30.0,
        recover_interval: float = 2.0,
        drain_timeout: float = 30.0,
        cache_size: int = 64,
        checkpoints: Literal["step", "reply"] = "step",
        events: Literal["all", "final", "none"] = "all",
    ) -> None:
        if checkpoints not in ("step", "reply"):
            raise ConfigError(f"checkpoints is 'step' or 'reply', not {checkpoints!r}")
        if events not in ("all", "final", "none"):
            raise ConfigError(f"events is 'all', 'final' or 'none', not {events!r}")
        self.checkpoints = checkpoints
        self.events = events
        if isinstance(agents, Mapping):
            agents = _Named(agents.values())
        elif not isinstance(agents, AgentSource):
            agents = _Named(agents)
        self.source: AgentSource = agents
        self.group = check_name(group, what="host group") if group is not None else None
        self._names: list[str] | None = None
        if isinstance(agents, _Named):
            self._names = list(agents)
        elif isinstance(agents, Iterable) and (self.group is None or topics):
            self._names = list(agents)  # per-name subjects, or the observers of topics
        elif self.group is None or topics:
            raise ConfigError(
                "an agent source that cannot list its agents needs a group, and no topics"
            )
        if self._names is not None and not self._names:
            raise ConfigError("a host needs at least one agent to serve")
        for topic in topics:
            check_name(topic, what="topic")
        self.bus = bus
        label = self.group or (self._names[0] if self._names and len(self._names) == 1 else "host")
        self.replica_id = replica_id or f"{label}@{socket.gethostname()}-{os.getpid()}"
        self.topics = list(topics)
        self.durable_topics = durable_topics
        self.lease_ttl = lease_ttl
        self.concurrency = concurrency
        self.busy_wait = busy_wait
        self.store_wait = store_wait
        self.recover_interval = recover_interval
        self.drain_timeout = drain_timeout
        self.store: SessionStore | None = None
        super().__init__()
        self._definitions: OrderedDict[str, Agent] = OrderedDict()
        self._cache_size = max(1, cache_size)
        # Keyed by session key (<agent>.<session>): only what runs is here.
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

    def serves(self, name: str) -> bool:
        """Whether this host serves the agent ``name``."""
        return name in self.source

    def definition(self, name: str) -> Agent:
        """The definition of agent ``name`` (built by the source, cached)."""
        if isinstance(self.source, _Named):
            return self.source.agent(name)
        agent = self._definitions.get(name)
        if agent is None:
            agent = self.source.agent(name)
            if agent.name != name:
                raise ConfigError(f"the agent source built {agent.name!r} for {name!r}")
            self._definitions[name] = agent
            if len(self._definitions) > self._cache_size:
                self._definitions.popitem(last=False)
        else:
            self._definitions.move_to_end(name)
        return agent

    async def run(self) -> None:
        """Serve until :meth:`stop`.

        Raises:
            StoreError: JetStream is not available for the sessions.
            ConnectionClosedError: the bus closed.
        """
        self.store = await SessionStore.open(
            self.bus, owner=self.replica_id, lease_ttl=self.lease_ttl
        )
        grouped = self.group is not None
        recovery = self.store.recovery(
            None if grouped else (self._names or []),
            self._take_over,
            serves=self.serves if grouped else None,
            interval=self.recover_interval,
        )
        await recovery.start()
        limiter = asyncio.Semaphore(self.concurrency)
        self._limiter = limiter
        try:
            async with asyncio.TaskGroup() as tg:
                ready = self._subscribe(tg, limiter)
                for event in ready:
                    await event.wait()
                self._ready.set()
                logger.info("%s serving as %s", self._describe(), self.replica_id)
                tg.create_task(recovery.run(self._stop))
                tg.create_task(self._cut_take_overs())
                self._takeovers = tg
        finally:
            self._takeovers = None
            await recovery.close()  # never leave its subscription behind

    def _describe(self) -> str:
        if self._names is not None and len(self._names) <= 3:
            return "agent " + ", ".join(self._names)
        return f"host {self.group or ''} ({len(self._names) if self._names else 'any'} agents)"

    def _subscribe(self, tg: asyncio.TaskGroup, limiter: asyncio.Semaphore) -> list[asyncio.Event]:
        """Start every serving loop; their readiness events."""
        subjects = self.bus.subjects
        ready: list[asyncio.Event] = []

        def serve(subject: str, handler: Any, queue: str | None, limited: bool) -> None:
            event = asyncio.Event()
            ready.append(event)
            tg.create_task(
                self.bus.serve(
                    subject,
                    handler,
                    stop=self._stop,
                    queue=queue,
                    limiter=limiter if limited else None,
                    drain_timeout=self.drain_timeout,
                    ready=event,
                    component=self.replica_id,
                )
            )

        if self.group is not None:
            serve(subjects.all_agent_inboxes(), self._handle, subjects.host_queue(self.group), True)
            serve(subjects.all_agent_controls(), self._control, None, False)
            topic_queue = subjects.host_topic_queue(self.group)
            for topic in self.topics:
                self._observe_on(tg, ready, topic, topic_queue, self._names or [])
        else:
            for name in self._names or []:
                serve(subjects.agent_inbox(name), self._handle, subjects.agent_queue(name), True)
                serve(subjects.agent_control(name), self._control, None, False)
                for topic in self.topics:
                    self._observe_on(tg, ready, topic, subjects.topic_queue(name), [name])
        return ready

    def _observe_on(
        self,
        tg: asyncio.TaskGroup,
        ready: list[asyncio.Event],
        topic: str,
        queue: str,
        names: list[str],
    ) -> None:
        """Record the broadcasts of ``topic`` in the memory of ``names``."""
        event = asyncio.Event()
        ready.append(event)

        async def observe(request: Request) -> None:
            await self._observe_topic(topic, request.message, names)
            return None

        if self.durable_topics:
            reader = DurableTopic(self.bus, topic, consumer=queue.replace(".", "-"))
            tg.create_task(reader.run(observe, stop=self._stop, ready=event))
            return
        tg.create_task(
            self.bus.serve(
                self.bus.subjects.topic(topic),
                observe,
                stop=self._stop,
                queue=queue,
                limiter=self._limiter,
                drain_timeout=self.drain_timeout,
                ready=event,
                component=self.replica_id,
            )
        )

    # -- the inbox -------------------------------------------------------------------

    async def _handle(self, request: Request) -> Message | None:
        name = Subjects.agent_of(request.subject)
        if self.group is not None and not self.serves(name):
            return None  # another host group's agent (or nobody's): they answer
        message = request.message
        if isinstance(message, UserRequest | ConfirmResult | ExternalResult):
            return await self._converse(name, message, message.session_id, request)
        if isinstance(message, AgentMessage):
            if message.reply:
                return await self._converse(name, message, message.session_id, request)
            return await self._observe(name, message)
        if isinstance(message, ToolCall):
            return await self._as_tool(name, message)
        if isinstance(message, Cancel):
            return await self._control(request)
        return self._error(
            message,
            "malformed",
            f"an agent inbox takes user_request, agent_message, confirm_result, "
            f"external_result, tool_call or cancel, not {type(message).__name__}",
        )

    async def _converse(
        self, name: str, message: AnyMessage, session_id: str | None, request: Request | None
    ) -> Message | None:
        """Serve a message that wants a reply. ``None`` (no answer from this
        replica) when the session was lost meanwhile: its new owner answers."""
        session = session_id or new_id()
        try:
            check_name(session, what="session id")
        except InvalidSubjectError as exc:
            return self._error(message, "malformed", str(exc))
        assert self.store is not None
        key = session_key(name, session)
        reply_to = (request.reply or None) if request is not None else None
        receipt = (
            (message.call_id, reply_to)
            if isinstance(message, Asking) and message.receipt and message.call_id and reply_to
            else None
        )
        run = self._runs.setdefault(key, _Run())
        if receipt is not None:
            if receipt in run.receipts:
                # Sent again (no receipt came yet) while this replica holds
                # it: its answer goes to the same reply subject, once.
                return None
            run.receipts.add(receipt)
        run.users += 1
        try:
            async with self._session_lock(key):
                lease = await self._acquire(name, message, session, reply_to, receipt)
                if lease is None or isinstance(lease, ErrorMessage | FinalAnswer):
                    return lease
                if receipt is not None and reply_to is not None:
                    await self._receipt(reply_to)
                final = await self._run_reply(lease, message, run, answer_to=reply_to)
                # Answered by _run_reply once its end was stored (or by the
                # session's new owner): nothing more to send from here.
                return None if reply_to else final
        finally:
            run.users -= 1
            if receipt is not None:
                run.receipts.discard(receipt)
            if not run.users:
                self._runs.pop(key, None)

    async def _receipt(self, reply_to: str) -> None:
        """Tell the requester its request is taken (in the session's lease):
        an empty message. Best effort: without it the requester sends the
        request again, and that is answered once too."""
        try:
            await self.bus.receipt(reply_to)
        except BusError as exc:
            logger.warning("%s: the receipt to %s was not sent: %s", self.replica_id, reply_to, exc)

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

    @contextlib.asynccontextmanager
    async def _session_lock(self, key: str) -> AsyncIterator[None]:
        """One reply (or observation) at a time per session in this replica;
        the lease does the same across replicas."""
        lock = self._session_locks.setdefault(key, asyncio.Lock())
        self._lock_users[key] = self._lock_users.get(key, 0) + 1
        try:
            async with lock:
                yield
        finally:
            self._lock_users[key] -= 1
            if not self._lock_users[key]:
                del self._lock_users[key]
                del self._session_locks[key]

    async def _run_reply(
        self,
        lease: Lease,
        inputs: AnyMessage | None,
        run: _Run,
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
            if _redoable(state, run.recording):
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
        orphan_message = _decode_input(orphan)
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
                    renewing = tg.create_task(self._renew(lease, calls))
                    try:
                        final = await self._serve_phases(agent, phases, run, lease)
                    finally:
                        renewing.cancel()
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
        run: _Run,
        lease: Lease,
    ) -> FinalAnswer | None:
        """Run each phase; write the end, send the last answer, release."""
        session = lease.record.session_id
        events = self.bus.subjects.events(lease.record.agent, session)
        final: FinalAnswer | None = None
        last_to: list[str | None] = []
        for index, phase in enumerate(phases):
            run.recording = phase.pending
            if isinstance(phase.input, AgentMessage) and not phase.input.reply:
                await agent.observe(phase.input)
                continue
            final = await self._stream(agent, phase.input, session, events, run)
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
        )
        if final is not None:
            for to in dict.fromkeys(last_to):
                if to:
                    await self._publish(to, final)
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
        # Events that are not published are not made (but for the middleware
        # watching them): only "all" publishes them.
        stream = agent.reply_stream(inputs, session_id=session, events=self.events == "all")
        try:
            async for item in stream:
                if run.cancelled:
                    agent.interrupt(pending=True)  # a cancel that came before (idempotent)
                if isinstance(item, FinalAnswer):
                    final = item  # stored in the journal, sent to the requester
                elif self.events == "all":
                    await self._publish(events, item)
        finally:
            await stream.aclose()
        return final

    async def _renew(self, lease: Lease, calls: CallScope) -> None:
        """Renew ``lease`` until cancelled. Raises ``SessionLost`` when it was
        taken over or could not be renewed for its TTL, after abandoning
        ``calls`` (the reply's tool calls are left to the next owner)."""
        assert self.store is not None
        try:
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
                    logger.warning(
                        "%s: lease renewal failed, retrying: %s", lease.record.agent, exc
                    )
        except SessionLost:
            calls.abandon()
            raise

    async def _publish(self, subject: str, message: Message) -> None:
        try:
            await self.bus.publish(subject, message)
        except BusError as exc:  # events are best effort; the session holds the truth
            logger.warning("%s: event not published on %s: %s", self.replica_id, subject, exc)

    async def _observe(self, name: str, message: AgentMessage, session: str = "main") -> Message:
        session = message.session_id or session
        try:
            check_name(session, what="session id")
        except InvalidSubjectError as exc:
            return self._error(message, "malformed", str(exc))
        assert self.store is not None
        async with self._session_lock(session_key(name, session)):
            while True:
                lease = await self._acquire(name, message, session, None)
                if isinstance(lease, ErrorMessage | FinalAnswer):
                    return lease
                assert lease is not None  # (None only for a copy of a request with a receipt)
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
                # (an observation does not always hold a place of the limiter)
                if await self._run_reply(lease, None, _Run(), holds_slot=False) is None:
                    return self._error(message, "internal", f"session {session} was lost")
            agent = self.definition(name).clone(state=lease.record.state)
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
            data={"agent": name},
        )

    async def _observe_topic(self, topic: str, message: AnyMessage, names: list[str]) -> None:
        """Record a broadcast in the memory of each of ``names`` (not its
        sender's), in the session it names or the topic's; ``concurrency``
        at a time."""
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
            logger.info("%s: topic message %s not observed", topic, type(message).__name__)
            return
        pending = iter([name for name in names if name != observed.name])

        async def record() -> None:
            for name in pending:
                answer = await self._observe(name, observed, topic)
                if isinstance(answer, ErrorMessage):
                    logger.warning(
                        "%s: broadcast on %s not recorded: %s", name, topic, answer.message
                    )

        async with asyncio.TaskGroup() as tg:
            for _ in range(min(self.concurrency, len(names))):
                tg.create_task(record())

    async def _as_tool(self, name: str, call: ToolCall) -> Message | None:
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
        record = await self.store.get(name, session)
        if record is not None and record.final is not None and call.session_id is None:
            final: Any = record.final
            return _tool_result(call, self.replica_id, "success", final.get("content"), None, None)
        answer = await self._converse(
            name, UserRequest(sender=call.sender, session_id=session, content=text), session, None
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
            name = Subjects.agent_of(request.subject)
            key = session_key(name, message.session_id)
            run = self._runs.get(key)
            if run is not None:
                run.cancelled = True
            agent = self._running.get(key)
            if agent is not None:
                logger.info("%s: cancelling session %s", name, message.session_id)
                agent.interrupt(pending=True)  # its reply may not have started yet
        return None

    # -- taking sessions over ---------------------------------------------------------

    async def _take_over(self, name: str, session: str, lease_revision: int) -> None:
        """Recovery found ``session`` left running by a dead owner: serve it in
        a task of its own, so that recovery goes on checking the others."""
        key = session_key(name, session)
        if self._takeovers is None or key in self._taking_over or not self.serves(name):
            return
        self._taking_over.add(key)
        self._takeovers.create_task(self._serve_take_over(name, session, lease_revision))

    async def _serve_take_over(self, name: str, session: str, lease_revision: int) -> None:
        key = session_key(name, session)
        try:
            async with asyncio.timeout(None) as deadline:
                self._takeover_deadlines.add(deadline)
                try:
                    await self._resume_session(name, session, lease_revision)
                finally:
                    self._takeover_deadlines.discard(deadline)
        except TimeoutError:
            logger.warning(
                "%s: stopping before the take-over of session %s ended; its lease will lapse",
                name,
                session,
            )
        finally:
            self._taking_over.discard(key)

    async def _cut_take_overs(self) -> None:
        """On stop, running take-overs get ``drain_timeout`` seconds to end."""
        await self._stop.wait()
        when = asyncio.get_running_loop().time() + self.drain_timeout
        for deadline in list(self._takeover_deadlines):
            deadline.reschedule(when)

    async def _resume_session(self, name: str, session: str, lease_revision: int) -> None:
        assert self.store is not None
        key = session_key(name, session)
        async with self._session_lock(key):
            try:
                lease = await self.store.acquire(
                    name,
                    session,
                    fresh=lambda: self.definition(name).initial_state(),
                    take_over=True,
                    lease_revision=lease_revision,
                )
            except SessionBusyError:
                return  # another replica was faster, or it ended meanwhile
            logger.warning(
                "%s: taking over session %s from %s at step %d",
                name,
                session,
                lease.previous_owner or "a replica that died",
                lease.record.step,
            )
            run = self._runs.setdefault(key, _Run())
            run.users += 1
            try:
                async with self._limiter:
                    await self._run_reply(lease, None, run)
            finally:
                run.users -= 1
                if not run.users:
                    self._runs.pop(key, None)

    def _error(self, about: AnyMessage, code: ErrorCode, text: str) -> ErrorMessage:
        # The text may quote what the message carried (a session id, say).
        return error_reply(about, code, clip(text), source=self.replica_id)


@dataclass
class _Run:
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
    return _decode_final(final)


def _redoable(state: AgentState, recording: bool) -> bool:
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
