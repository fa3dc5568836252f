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
  is published on ``<prefix>.events.<agent>.<session_id>.<owner>`` (the final answer
  is written in the session's journal). A message's ``output_schema``
  reaches the agent with the message (the agent reads it, see
  ``Agent.reply``) and is saved with the reply it starts, so a take-over,
  which resumes without the message, keeps asking for it;
- ``agent_message`` with ``reply=False``: add it to the session's memory
  (session ``main`` when it names none) and answer an ``event`` named
  ``observed``;
- ``confirm_result`` / ``external_result``: resume the session's paused reply;
- ``tool_call``: the agent used as a tool (``{"request": "..."}``), answered
  with a ``tool_result``;
- ``cancel``: interrupt the session's reply (also on the control subject,
  which every replica hears).

A broadcast on a topic the host observes is recorded in the memory of every
agent it serves (:mod:`._observing`).

Each replica registers the NATS micro service ``fleetbus-agents``: its INFO
lists the agents the host was given, with their descriptions and tools, and
its STATS counts each agent's inbox requests (:mod:`.directory`).

Sessions are journals written ahead of every side effect under a lease
(:mod:`.sessions`); replies run as :mod:`._replies` says. A replica that dies
leaves a lease that goes silent: :class:`~fleetbus.agents.serving.sessions.Recovery`
in any replica finds it without scanning the store, and that replica takes
the session over from its last fact, finishes it, and answers the original
request.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import socket
import time
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping, Sequence, Sized
from typing import Any, Literal, Protocol, runtime_checkable

from fleetbus.agents.agent import Agent
from fleetbus.agents.serving._observing import Observing
from fleetbus.agents.serving._replies import Run, SessionLocks
from fleetbus.agents.serving.directory import agent_service
from fleetbus.agents.serving.sessions import (
    Recovery,
    SessionStore,
    session_key,
)
from fleetbus.bus import Bus, Lifecycle, Request
from fleetbus.bus.store import wait_for_store
from fleetbus.bus.subjects import Subjects, check_name
from fleetbus.errors import (
    BusError,
    ConfigError,
    InvalidSubjectError,
    SessionBusyError,
    StoreError,
)
from fleetbus.protocol import (
    AgentMessage,
    AnyMessage,
    Asking,
    Cancel,
    ConfirmResult,
    ErrorDetail,
    ErrorMessage,
    ExternalResult,
    FinalAnswer,
    Message,
    ToolCall,
    ToolResult,
    UserRequest,
    new_id,
)

__all__ = ["AgentHost", "AgentSource"]

logger = logging.getLogger(__name__)


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


class AgentHost(Observing, Lifecycle):
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
            node died takes a few seconds) before it is answered an error;
            and that the host, starting, waits for the store's streams.
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
        """The agents, for their own subjects (named agents, or no group)."""
        self._observers: Iterable[str] = ()
        """Who records a topic's broadcasts: a group's source is listed when
        one comes, not kept (a million names would be some 70 MB)."""
        if isinstance(agents, _Named) or (isinstance(agents, Iterable) and self.group is None):
            self._names = list(agents)
            self._observers = self._names
            if not self._names:
                raise ConfigError("a host needs at least one agent to serve")
        elif isinstance(agents, Iterable) and topics:
            if next(iter(agents), None) is None:
                raise ConfigError("a host needs at least one agent to serve")
            self._observers = agents
        elif self.group is None or topics:
            raise ConfigError(
                "an agent source that cannot list its agents needs a group, and no topics"
            )
        for topic in topics:
            check_name(topic, what="topic")
        self.bus = bus
        label = self.group or (self._names[0] if self._names and len(self._names) == 1 else "host")
        self.replica_id = replica_id or f"{label}@{socket.gethostname()}-{os.getpid()}"
        self.service = agent_service(
            bus,
            list(agents.agents.values()) if isinstance(agents, _Named) else None,
            replica_id=self.replica_id,
            group=self.group,
        )
        """This replica in the agents' directory: the ``fleetbus-agents`` micro
        service, listing the agents given as definitions (a population's: none)."""
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
        self._runs: dict[str, Run] = {}
        self._takeovers: asyncio.TaskGroup | None = None
        self._recovery: Recovery | None = None
        self._taking_over: set[str] = set()
        self._takeover_deadlines: set[asyncio.Timeout] = set()
        self._limiter = asyncio.Semaphore(concurrency)
        self._session_lock = SessionLocks()

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

        def waiting(exc: StoreError) -> None:
            logger.warning(
                "%s: waiting for the session store (up to %g s): %s",
                self._describe(),
                self.store_wait,
                exc,
            )

        # Making the store's streams is a Raft proposal on a cluster: a busy
        # cluster, or one electing a leader, may answer it late.
        self.store = await wait_for_store(
            lambda: SessionStore.open(self.bus, owner=self.replica_id, lease_ttl=self.lease_ttl),
            timeout=self.store_wait,
            waiting=waiting,
        )
        grouped = self.group is not None
        recovery = self._recovery = self.store.recovery(
            None if grouped else (self._names or []),
            self._take_over,
            serves=self.serves if grouped else None,
            interval=self.recover_interval,
        )
        try:
            await wait_for_store(recovery.start, timeout=self.store_wait, waiting=waiting)
        except BaseException:
            await recovery.close()
            raise
        limiter = asyncio.Semaphore(self.concurrency)
        self._limiter = limiter
        try:
            async with asyncio.TaskGroup() as tg:
                ready = self._subscribe(tg, limiter)
                ready.append(asyncio.Event())
                tg.create_task(self.service.run(self._stop, ready=ready[-1]))
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
        source = self.source
        count = f"{len(source):,}" if isinstance(source, Sized) else "any"
        return f"host {self.group or ''} ({count} agents)"

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
                self._observe_on(tg, ready, topic, topic_queue, self._observers)
        else:
            for name in self._names or []:
                serve(subjects.agent_inbox(name), self._handle, subjects.agent_queue(name), True)
                serve(subjects.agent_control(name), self._control, None, False)
                for topic in self.topics:
                    self._observe_on(tg, ready, topic, subjects.topic_queue(name), [name])
        return ready

    # -- the inbox -------------------------------------------------------------------

    async def _handle(self, request: Request) -> Message | None:
        name = Subjects.agent_of(request.subject)
        if self.group is not None and not self.serves(name):
            return None  # another host group's agent (or nobody's): they answer
        stats = self.service.stats.get(name)
        if stats is None:  # a population's agent: not in the directory
            return await self._answer(name, request)
        started = time.perf_counter_ns()
        answer = await self._answer(name, request)
        error = None
        if isinstance(answer, ErrorMessage):
            error = f"{answer.code}: {answer.message}"
        elif isinstance(answer, ToolResult) and answer.error_detail is not None:
            error = f"{answer.error_detail.code}: {answer.error_detail.message}"
        stats.record(time.perf_counter_ns() - started, error)
        return answer

    async def _answer(self, name: str, request: Request) -> Message | None:
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
        receipt_to = reply_to
        if isinstance(message, UserRequest) and message.handoff and message.handoff.reply_to:
            reply_to = message.handoff.reply_to  # handed over: its receipt only comes back
        receipt = (
            (message.call_id, reply_to)
            if isinstance(message, Asking)
            and message.receipt
            and message.call_id
            and receipt_to
            and reply_to
            else None
        )
        run = self._runs.setdefault(key, Run())
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
                    if receipt_to == reply_to or receipt_to is None:
                        return lease
                    # Handed over: the answer goes to the requester, and the
                    # agent that handed it over learns it is held.
                    if lease is not None and reply_to is not None:
                        await self._publish(reply_to, lease)
                    await self._receipt(receipt_to)
                    return None
                # (A request passed on gets its receipt from its new holder.)
                if (
                    receipt is not None
                    and receipt_to is not None
                    and self.passes_on(lease, message) is None
                ):
                    await self._receipt(receipt_to)
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
            except StoreError as exc:
                # A store that does not answer (a cluster node cut off): the
                # lease is left to lapse; recovery watches it again.
                logger.warning(
                    "%s: taking over session %s failed, tried again once its lease is "
                    "silent a TTL more: %s",
                    name,
                    session,
                    exc,
                )
                if self._recovery is not None:
                    self._recovery.watch_again(key, lease_revision)
                return
            logger.warning(
                "%s: taking over session %s from %s at step %d",
                name,
                session,
                lease.previous_owner or "a replica that died",
                lease.record.step,
            )
            run = self._runs.setdefault(key, Run())
            run.users += 1
            try:
                async with self._limiter:
                    await self._run_reply(lease, None, run)
            finally:
                run.users -= 1
                if not run.users:
                    self._runs.pop(key, None)


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
