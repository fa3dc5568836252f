"""What the dashboard knows of a fleet, read from the bus only, and bounded.

:class:`FleetView` follows five sources and merges them into one picture:

- the session store (:meth:`SessionStore.records
  <fleetbus.agents.serving.sessions.SessionStore.records>`), polled: every
  session's status, step, owner and pending calls (a failure that may pass,
  a cluster electing the store's new leader, is waited out for up to
  ``store_wait`` seconds, with one warning, before the page shows an error);
- the event streams (``<prefix>.events.>``, each
  ``<prefix>.events.<agent>.<session>.<owner>``): replies as they happen,
  whoever asked for them, which also reveal the agents that publish them;
- the session journals as they are appended to (``<prefix>.session.>``): a
  request taken, and the end of each reply with its final answer (published
  nowhere else);
- the lease writes the server repeats (``<prefix>.kv.session_leases.>``): the
  sessions running and their replicas, as they take them (a session its last
  owner released writes no fact before its reply's first);
- ``$SRV.STATS.fleetbus``, polled: the tool workers of the fleet and their
  counters.

NATS does not show a queue group's subscribers to clients, so an agent that
has never had a session, and a replica that has not run one while the view
watched, are not known: the snapshot says where each fact came from.

Everything kept is bounded: sessions (the most recently updated), events per
session and in all, the size of each event, agents, replicas and workers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict, deque
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Final, Protocol

import orjson

from fleetbus.agents.permissions import suggest_rules
from fleetbus.agents.serving.sessions import SessionRecord, SessionStore, lease_owner, read_fact
from fleetbus.bus import SERVICE_NAME, Bus, Listener, check_name
from fleetbus.bus.store import STORE_WAIT, wait_for_store
from fleetbus.bus.subjects import ANY_OWNER
from fleetbus.dashboard._confirm import (
    ConfirmOutcome,
    confirmation,
    external,
    send_answer,
)
from fleetbus.dashboard._micro import collect_stats
from fleetbus.errors import ConfigError, FleetbusError, ProtocolError, StoreError
from fleetbus.protocol import (
    ConfirmResult,
    Event,
    ExternalResult,
    FinalAnswer,
    decode,
    to_builtins,
    utc_now,
)

__all__ = ["FleetView", "Limits"]

logger = logging.getLogger(__name__)

_LEASES: Final = "session_leases"
"""The lease bucket of the agent sessions (docs/fleet.md, "Sessions")."""
_KEEPALIVE: Final = 15.0
_FOLLOW_TICK: Final = 1.0
_CONNECTION_TICK: Final = 0.5
_GONE_AFTER: Final = 60.0
"""Seconds a session missing from the store is kept while its events are fresh."""
_PARAMETERS_CHARS: Final = 4000
"""The most characters of a pending call's parameters shown (and offered to edit)."""


@dataclass(frozen=True, slots=True)
class Limits:
    """How much the view keeps in memory, at most."""

    sessions: int = 500
    """Sessions listed: the most recently updated."""
    events_per_session: int = 200
    events: int = 20_000
    """Events kept over all sessions (the least recently updated lose theirs first)."""
    event_bytes: int = 4096
    """Size of one kept event (JSON); a larger one keeps a clipped preview."""
    text_chars: int = 300
    """Characters of an answer shown in the session list."""
    agents: int = 1_000
    replicas_per_agent: int = 32
    workers: int = 500


@dataclass(slots=True)
class _Session:
    agent: str
    session_id: str
    status: str = "unknown"
    step: int = 0
    owner: str | None = None
    updated_at: datetime | None = None
    event_at: datetime | None = None
    """Timestamp of the last event seen (the store's answer wins only when newer)."""
    heard: float = 0.0
    """``time.monotonic()`` of the last event seen."""
    pending: list[dict[str, Any]] = field(default_factory=list)
    last_event: str | None = None
    last_answer: str | None = None
    in_store: bool = False
    events: deque[dict[str, Any]] = field(default_factory=deque)

    def summary(self) -> dict[str, Any]:
        return {
            "agent": self.agent,
            "session": self.session_id,
            "status": self.status,
            "step": self.step,
            "owner": self.owner,
            "updated_at": _iso(self.updated_at or self.event_at),
            "pending": self.pending,
            "last_event": self.last_event,
            "last_answer": self.last_answer,
            "in_store": self.in_store,
            "events": len(self.events),
        }


@dataclass(slots=True)
class _Agent:
    name: str
    sources: set[str] = field(default_factory=set)
    replicas: OrderedDict[str, float] = field(default_factory=OrderedDict)
    """Replica id → wall-clock time it was last seen holding a session."""
    seen: float = 0.0


class _Msg(Protocol):
    subject: str
    data: bytes


class FleetView:
    """A bounded, live picture of one fleet, from the bus alone.

    Run it with :meth:`run`; read it with :meth:`snapshot`, :meth:`events`
    and :meth:`follow`; answer a paused session with :meth:`confirm`.

    Args:
        bus: the connection (its prefix is the fleet shown).
        limits: what is kept in memory at most.
        session_poll: seconds between readings of the session store.
        stats_poll: seconds between ``$SRV.STATS`` rounds.
        stats_wait: seconds one round collects answers.
        reply_timeout: seconds a confirmed reply is followed (as ``fleetbus
            confirm --timeout``).
        drain_timeout: seconds :meth:`run` lets confirmed replies finish once
            stopped, before leaving them (which interrupts them, as Ctrl-C on
            ``fleetbus confirm`` does).
        store_wait: seconds a reading of the session store waits out a
            failure that may pass (as ``fleetbus sessions --store-wait``).
    """

    def __init__(
        self,
        bus: Bus,
        *,
        limits: Limits | None = None,
        session_poll: float = 2.0,
        stats_poll: float = 2.0,
        stats_wait: float = 0.5,
        reply_timeout: float = 600.0,
        drain_timeout: float = 5.0,
        store_wait: float = STORE_WAIT,
    ) -> None:
        self.bus = bus
        self.limits = limits or Limits()
        self.session_poll = session_poll
        self.stats_poll = stats_poll
        self.stats_wait = stats_wait
        self.reply_timeout = reply_timeout
        self.drain_timeout = drain_timeout
        self.store_wait = store_wait
        self.version = 0
        """Bumped at every change of the picture."""
        self.stopping = asyncio.Event()
        self.ready = asyncio.Event()
        """Set once the subscriptions are live."""
        self._changed = asyncio.Event()
        self._sessions: OrderedDict[tuple[str, str], _Session] = OrderedDict()
        self._agents: OrderedDict[str, _Agent] = OrderedDict()
        self._workers: list[dict[str, Any]] = []
        self._errors: dict[str, str] = {}
        self._event_count = 0
        self._skipped = 0
        self._connected = bus.is_connected
        self._store: SessionStore | None = None
        self._confirms: set[asyncio.Task[ConfirmOutcome]] = set()
        self._tg: asyncio.TaskGroup | None = None
        self._events_stem = bus.subjects.all_events().removesuffix(">")
        self._leases_stem = bus.subjects.kv_writes(_LEASES, "")
        self._journals_stem = f"{bus.prefix}.session."

    # -- running ---------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        """Follow the fleet until ``stop`` is set (or :meth:`close`).

        Raises:
            ConnectionClosedError: the bus is closed.
        """
        subs = [
            await self.bus.listen(self.bus.subjects.all_events()),
            await self.bus.listen(self.bus.subjects.kv_writes(_LEASES)),
            await self.bus.listen(self._journals_stem + ">"),
        ]
        try:
            async with asyncio.TaskGroup() as tg:
                self._tg = tg
                tasks = [
                    tg.create_task(self._consume(subs[0], self._on_event)),
                    tg.create_task(self._consume(subs[1], self._on_lease)),
                    tg.create_task(self._consume(subs[2], self._on_fact)),
                    tg.create_task(self._every(self.session_poll, self._poll_sessions)),
                    tg.create_task(self._every(self.stats_poll, self._poll_workers)),
                    tg.create_task(self._every(_CONNECTION_TICK, self._check_connection)),
                ]
                with contextlib.suppress(FleetbusError, TimeoutError):
                    await self.bus.flush(5.0)
                self.ready.set()
                await _first(stop.wait(), self.stopping.wait())
                self.close()
                await self._drain_confirms()
                for task in tasks:
                    task.cancel()
        finally:
            self._tg = None
            self.close()
            for sub in subs:
                await sub.unsubscribe()

    def close(self) -> None:
        """Stop: :meth:`run` returns, and streams from :meth:`follow` end."""
        self.stopping.set()
        self._bump()

    async def _drain_confirms(self) -> None:
        if self._confirms:
            await asyncio.wait(list(self._confirms), timeout=self.drain_timeout)
            for task in self._confirms:
                task.cancel()

    async def _consume(self, listener: Listener, handle: Callable[[_Msg], None]) -> None:
        async for msg in listener:
            try:
                handle(msg)
            except Exception:  # one odd message must not stop the view
                logger.exception("dashboard: could not read a message on %s", msg.subject)

    async def _every(self, interval: float, poll: Callable[[], Any]) -> None:
        while not self.stopping.is_set():
            await poll()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stopping.wait(), interval)

    def _bump(self) -> None:
        self.version += 1
        self._changed.set()
        self._changed = asyncio.Event()

    async def changed(self, version: int, timeout: float) -> bool:
        """Wait until the picture is newer than ``version``; ``False`` after
        ``timeout`` seconds without a change."""
        if self.version != version or self.stopping.is_set():
            return True
        try:
            await asyncio.wait_for(self._changed.wait(), timeout)
        except TimeoutError:
            return False
        return True

    def _error(self, source: str, text: str | None) -> None:
        if self._errors.get(source) == text:
            return
        if text is None:
            self._errors.pop(source, None)
        else:
            self._errors[source] = text
        self._bump()

    # -- the connection --------------------------------------------------------------

    async def _check_connection(self) -> None:
        connected = self.bus.is_connected
        if connected != self._connected:
            self._connected = connected
            self._bump()

    # -- sessions and agents ---------------------------------------------------------

    def _session(self, agent: str, session_id: str) -> _Session:
        key = (agent, session_id)
        view = self._sessions.get(key)
        if view is None:
            view = self._sessions[key] = _Session(agent, session_id)
        self._sessions.move_to_end(key)
        while len(self._sessions) > self.limits.sessions:
            _, dropped = self._sessions.popitem(last=False)
            self._event_count -= len(dropped.events)
        return view

    def _agent(self, name: str, source: str, replica: str | None = None) -> None:
        agent = self._agents.get(name)
        if agent is None:
            agent = self._agents[name] = _Agent(name)
        self._agents.move_to_end(name)
        agent.sources.add(source)
        agent.seen = time.time()
        if replica:
            agent.replicas[replica] = agent.seen
            agent.replicas.move_to_end(replica)
            while len(agent.replicas) > self.limits.replicas_per_agent:
                agent.replicas.popitem(last=False)
        while len(self._agents) > self.limits.agents:
            self._agents.popitem(last=False)

    async def _poll_sessions(self) -> None:
        def waiting(exc: StoreError) -> None:
            logger.warning("waiting for the session store: %s (up to %g s)", exc, self.store_wait)

        try:
            records = await wait_for_store(self._records, timeout=self.store_wait, waiting=waiting)
        except (FleetbusError, TimeoutError) as exc:
            self._error("sessions", f"the session store cannot be read: {exc or 'timed out'}")
            return
        self._error("sessions", None)
        self._merge(records[: self.limits.sessions])

    async def _records(self) -> list[SessionRecord]:
        if self._store is None:
            self._store = await SessionStore.open(self.bus, owner="dashboard")
        return await asyncio.wait_for(self._store.records(), 30.0)

    def _merge(self, records: list[SessionRecord]) -> None:
        listed = set()
        # Oldest first, so the most recently updated end up last (kept longest).
        for record in reversed(records):
            listed.add((record.agent, record.session_id))
            view = self._session(record.agent, record.session_id)
            view.in_store = True
            view.owner = record.owner
            self._agent(record.agent, "store", record.owner)
            if view.event_at is not None and record.updated_at < view.event_at:
                continue  # events seen since that write say more
            view.updated_at = record.updated_at
            view.status = _stored_status(record.status, record.final)
            view.step = record.step
            reply = record.state.reply
            view.pending = [_pending(p.model_dump()) for p in reply.pending] if reply else []
            final = record.final or {}
            if final.get("content") is not None:
                view.last_answer = _text(final["content"], self.limits.text_chars)
        now = time.monotonic()
        for key, view in list(self._sessions.items()):
            if key not in listed and view.in_store and now - view.heard > _GONE_AFTER:
                del self._sessions[key]  # deleted from the store
                self._event_count -= len(view.events)
        self._bump()

    def _on_lease(self, msg: _Msg) -> None:
        tokens = msg.subject.removeprefix(self._leases_stem).split(".")
        if not msg.subject.startswith(self._leases_stem) or len(tokens) != 2:
            return
        agent, session_id = tokens
        owner = lease_owner(msg.data)
        self._agent(agent, "leases", owner)
        # A lease taken: the session runs (a clean take writes no fact
        # before the reply's first).
        view = (
            self._session(agent, session_id) if owner else self._sessions.get((agent, session_id))
        )
        if view is not None:
            view.owner = owner
            if owner and view.status != "running":  # (newer than the store's last write)
                view.status, view.pending, view.event_at = "running", [], utc_now()
        self._bump()

    def _on_fact(self, msg: _Msg) -> None:
        """A fact appended to a session's journal: the request taken, or the
        end of a reply with its answer (published nowhere else)."""
        tokens = msg.subject.removeprefix(self._journals_stem).split(".")
        if len(tokens) != 2:
            return
        try:
            fact = read_fact(msg.data)
        except StoreError as exc:
            self._skipped += 1
            logger.debug("dashboard skipped a fact on %s: %s", msg.subject, exc)
            return
        if fact.kind not in ("taken", "end"):
            return
        agent, session_id = tokens
        view = self._session(agent, session_id)
        view.heard = time.monotonic()
        if fact.status is not None:
            view.status = _stored_status(fact.status, fact.final)
        if fact.kind == "taken":
            view.pending = []
        final = fact.final
        if final is not None:
            view.last_answer = _text(final.get("content"), self.limits.text_chars)
            view.event_at = utc_now()
            view.events.append(self.kept(final))
            self._event_count += 1
            if len(view.events) > self.limits.events_per_session:
                view.events.popleft()
                self._event_count -= 1
            self._trim_events()
        self._bump()

    def _on_event(self, msg: _Msg) -> None:
        tokens = msg.subject.removeprefix(self._events_stem).split(".")
        if not msg.subject.startswith(self._events_stem) or len(tokens) != 3:
            return
        try:
            message = decode(msg.data)
        except ProtocolError as exc:
            self._skipped += 1
            logger.debug("dashboard skipped a message on %s: %s", msg.subject, exc)
            return
        agent, session_id, _owner = tokens
        view = self._session(agent, session_id)
        self._agent(agent, "events")
        view.heard = time.monotonic()
        view.event_at = message.timestamp
        view.events.append(self.kept(to_builtins(message)))
        self._event_count += 1
        if len(view.events) > self.limits.events_per_session:
            view.events.popleft()
            self._event_count -= 1
        self._trim_events()
        if isinstance(message, Event):
            self._apply_event(view, message)
            if message.event == "reply_end":
                _answer_last(view.events)
        elif isinstance(message, FinalAnswer):
            view.last_answer = _text(message.content, self.limits.text_chars)
            if message.finished_reason != "paused":
                view.status = _ended(message.finished_reason)
                view.pending = []
        self._bump()

    def _apply_event(self, view: _Session, event: Event) -> None:
        view.last_event = event.event
        data = event.data
        match event.event:
            case "reply_start":
                view.status, view.pending = "running", []
            case "model_call_start" if isinstance(data.get("iteration"), int):
                view.step = data["iteration"]
            case "require_user_confirm" | "require_external_execution":
                calls = data.get("calls")
                view.status = "paused"
                view.pending = (
                    [_pending(c) for c in calls if isinstance(c, dict)][:50]
                    if isinstance(calls, list)
                    else []
                )
            case "reply_end":
                reason = data.get("finished_reason")
                if reason == "paused":
                    view.status = "paused"
                else:
                    view.status = _ended(reason)
                    view.pending = []

    def _trim_events(self) -> None:
        for view in self._sessions.values():  # least recently updated first
            if self._event_count <= self.limits.events:
                return
            while view.events and self._event_count > self.limits.events:
                view.events.popleft()
                self._event_count -= 1

    def kept(self, item: dict[str, Any]) -> dict[str, Any]:
        """``item`` (a message as JSON) as it is kept: within ``event_bytes``."""
        size = len(orjson.dumps(item, default=str))
        if size <= self.limits.event_bytes:
            return item
        brief = {k: v for k, v in item.items() if isinstance(v, str | int | bool) or v is None}
        for key in ("data", "content", "structured"):
            if key in item:
                text = orjson.dumps(item[key], default=str).decode()
                brief[key] = _clip(text, self.limits.event_bytes // 2)
        brief["clipped"] = size
        return brief

    # -- tool workers ----------------------------------------------------------------

    async def _poll_workers(self) -> None:
        try:
            docs = await collect_stats(
                self.bus, SERVICE_NAME, timeout=self.stats_wait, limit=self.limits.workers
            )
        except FleetbusError as exc:
            self._error("workers", f"$SRV.STATS failed: {exc}")
            return
        self._error("workers", None)
        workers = [_worker(doc) for doc in docs if _prefix_of(doc) == self.bus.prefix]
        workers.sort(key=lambda w: str(w["worker_id"]))
        if workers != self._workers:
            self._workers = workers
            self._bump()

    # -- reading ---------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """The whole picture as JSON-ready data (sessions newest first)."""
        sessions = [v.summary() for v in reversed(self._sessions.values())]
        counts: dict[str, dict[str, int]] = {}
        for view in self._sessions.values():
            per = counts.setdefault(view.agent, {"sessions": 0, "running": 0, "paused": 0})
            per["sessions"] += 1
            if view.status in ("running", "paused"):
                per[view.status] += 1
        agents = [
            {
                "name": a.name,
                "sources": sorted(a.sources),
                "replicas": [
                    {"replica": r, "seen": _iso(datetime.fromtimestamp(t, UTC))}
                    for r, t in reversed(a.replicas.items())
                ],
                **counts.get(a.name, {"sessions": 0, "running": 0, "paused": 0}),
            }
            for a in sorted(self._agents.values(), key=lambda a: a.name)
        ]
        return {
            "prefix": self.bus.prefix,
            "bus": {"connected": self._connected, "url": self.bus.connected_url},
            "version": self.version,
            "agents": agents,
            "sessions": sessions,
            "workers": self._workers,
            "errors": dict(self._errors),
            "skipped": self._skipped,
            "limits": {
                "sessions": self.limits.sessions,
                "events_per_session": self.limits.events_per_session,
            },
        }

    def events(self, agent: str, session_id: str) -> list[dict[str, Any]]:
        """The events kept of one session, oldest first."""
        view = self._sessions.get((agent, session_id))
        return list(view.events) if view is not None else []

    async def follow(
        self, agent: str, session_id: str
    ) -> AsyncGenerator[dict[str, Any] | None, None]:
        """The events of one session: those kept, then each one published on
        ``<prefix>.events.<agent>.<session>.<owner>`` (whoever asked) as it
        comes, and each final answer as the session's journal is given it;
        ``None`` every 15 s of silence (a keep-alive). Ends when the view stops.

        Raises:
            ConfigError: ``agent`` or ``session_id`` is not a subject token.
        """
        events = self.bus.subjects.events(agent, session_id, ANY_OWNER)  # (checks the names)
        journal = f"{self._journals_stem}{agent}.{session_id}"
        arrived: asyncio.Queue[tuple[bool, bytes]] = asyncio.Queue()

        async def on_message(msg: _Msg) -> None:
            arrived.put_nowait((msg.subject == journal, msg.data))

        # The events and the journal, into one queue: each subscription hands
        # its messages over in the order they were published.
        subs = [await self.bus.listen(events, callback=on_message)]
        try:
            subs.append(await self.bus.listen(journal, callback=on_message))
            with contextlib.suppress(FleetbusError, TimeoutError):
                await self.bus.flush(5.0)
            sent: deque[str] = deque(maxlen=self.limits.events_per_session)
            for item in self.events(agent, session_id):
                sent.append(str(item.get("id")))
                yield item
            quiet = 0.0
            while not self.stopping.is_set():
                try:
                    async with asyncio.timeout(_FOLLOW_TICK):
                        is_fact, data = await arrived.get()
                except TimeoutError:
                    quiet += _FOLLOW_TICK
                    if quiet >= _KEEPALIVE:
                        quiet = 0.0
                        yield None
                    continue
                quiet = 0.0
                try:
                    if is_fact:
                        final = read_fact(data).final
                        if final is None:
                            continue
                        item = self.kept(final)
                    else:
                        item = self.kept(to_builtins(decode(data)))
                except (ProtocolError, StoreError):
                    continue
                if str(item.get("id")) in sent:
                    continue  # already sent from what was kept
                sent.append(str(item.get("id")))
                yield item
        finally:
            for one in subs:
                await one.unsubscribe()

    # -- confirming ------------------------------------------------------------------

    async def confirm(
        self,
        agent: str,
        session_id: str,
        *,
        allow: list[str],
        deny: list[str],
        always: bool = False,
        edits: Sequence[tuple[str, dict[str, Any]]] = (),
        accept_rules: Sequence[str] = (),
        accept_timeout: float = 5.0,
    ) -> ConfirmOutcome:
        """Allow and deny paused calls of a session, as ``fleetbus confirm`` does:
        an edited call (``edits``: its call id and the input it runs with
        instead of the model's) is allowed; ``accept_rules`` are allow rules
        the agent keeps for this and its later sessions.

        The resumed reply is followed in the background (its events reach
        the view like any other); this returns once the agent answered the
        first time, or after ``accept_timeout`` seconds.

        Raises:
            ConfigError: no call named, a call both allowed and denied, a
                rule that does not parse, a name that is not a subject token,
                or the view is not running.
        """
        message = confirmation(
            session_id,
            allow=allow,
            deny=deny,
            always=always,
            edits=edits,
            accept_rules=accept_rules,
        )
        return await self._answer(agent, session_id, message, accept_timeout)

    async def resume(
        self,
        agent: str,
        session_id: str,
        *,
        results: Sequence[tuple[str, Any]] = (),
        errors: Sequence[tuple[str, str]] = (),
        accept_timeout: float = 5.0,
    ) -> ConfirmOutcome:
        """Give a paused session the results of calls run outside the agent,
        as ``fleetbus resume`` does: ``results`` (call id, output as any JSON
        value), ``errors`` (call id, the message of a call that failed).
        Followed as :meth:`confirm` follows a confirmation.

        Raises:
            ConfigError: no call named, a call named twice, a name that is not
                a subject token, or the view is not running.
        """
        message = external(session_id, results=results, errors=errors)
        return await self._answer(agent, session_id, message, accept_timeout)

    async def _answer(
        self,
        agent: str,
        session_id: str,
        message: ConfirmResult | ExternalResult,
        accept_timeout: float,
    ) -> ConfirmOutcome:
        check_name(agent, what="agent name")
        check_name(session_id, what="session id")
        if self._tg is None or self.stopping.is_set():
            raise ConfigError("the dashboard is not following the fleet")
        first = asyncio.Event()
        task = self._tg.create_task(
            send_answer(
                self.bus,
                agent,
                session_id,
                message,
                timeout=self.reply_timeout,
                answered=first,
            )
        )
        self._confirms.add(task)
        task.add_done_callback(self._confirms.discard)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(first.wait(), accept_timeout)
        if task.done():
            return task.result()
        return ConfirmOutcome(accepted=True, state="resumed", message="the reply resumed")


def _answer_last(events: deque[dict[str, Any]]) -> None:
    """Put the final answers of the reply that just ended after its events,
    where they were published: heard from the journal (another subscription),
    they may come in ahead of the reply's last events."""
    items = list(events)
    start = max((i for i, e in enumerate(items) if e.get("event") == "reply_start"), default=0)
    answers = [e for e in items[start:] if e.get("type") == "final_answer"]
    if answers:
        rest = [e for e in items[start:] if e.get("type") != "final_answer"]
        events.clear()
        events.extend([*items[:start], *rest, *answers])


async def _first(*waits: Any) -> None:
    tasks = [asyncio.ensure_future(w) for w in waits]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _iso(value: datetime | None) -> str | None:
    return None if value is None else value.isoformat().replace("+00:00", "Z")


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else f"{text[:limit]}… ({len(text) - limit} more)"


def _text(content: Any, limit: int) -> str:
    if isinstance(content, str):
        return _clip(content, limit)
    if isinstance(content, list):
        parts = []
        for block in content:
            text = getattr(block, "text", None)
            if text is None and isinstance(block, dict):
                text = block.get("text")
            if isinstance(text, str):
                parts.append(text)
        return _clip("".join(parts), limit)
    return _clip(orjson.dumps(content, default=str).decode(), limit)


def _pending(call: dict[str, Any]) -> dict[str, Any]:
    """A pending call as shown: its parameters as clipped JSON text (``clipped``
    when cut: the page then offers no edit of them), and for a call to
    confirm the allow rules a person may accept (as ``fleetbus sessions``
    lists them)."""
    given = call.get("parameters", {})
    parameters = orjson.dumps(given, default=str).decode()
    kind = str(call.get("kind", "confirm"))
    tool_name = str(call.get("tool_name", ""))
    rules: list[str] = []
    if kind == "confirm":
        found = call.get("suggested_rules")
        if isinstance(found, list):
            rules = [str(r) for r in found]
        elif isinstance(given, dict):
            rules = suggest_rules(tool_name, given)
    return {
        "call_id": str(call.get("call_id", "")),
        "tool_name": tool_name,
        "kind": kind,
        "rule": None if call.get("rule") is None else str(call.get("rule")),
        "parameters": _clip(parameters, _PARAMETERS_CHARS),
        "clipped": len(parameters) > _PARAMETERS_CHARS,
        "suggested_rules": [_clip(r, 300) for r in rules[:5]],
    }


def _prefix_of(doc: dict[str, Any]) -> str | None:
    metadata = doc.get("metadata")
    return metadata.get("fleetbus_prefix") if isinstance(metadata, dict) else None


def _worker(doc: dict[str, Any]) -> dict[str, Any]:
    """A ``$SRV.STATS`` document as shown: averages in milliseconds."""
    found = doc.get("metadata")
    metadata: dict[str, Any] = found if isinstance(found, dict) else {}
    endpoints = []
    for e in doc.get("endpoints") or []:
        if not isinstance(e, dict):
            continue
        average = e.get("average_processing_time")
        endpoints.append(
            {
                "name": str(e.get("name", "")),
                "num_requests": int(e.get("num_requests") or 0),
                "num_errors": int(e.get("num_errors") or 0),
                "average_ms": round(average / 1e6, 3) if isinstance(average, int | float) else None,
                "last_error": _clip(str(e.get("last_error") or ""), 300),
            }
        )
    return {
        "worker_id": str(metadata.get("worker_id") or doc.get("id", "")),
        "service_id": str(doc.get("id", "")),
        "version": str(doc.get("version", "")),
        "started": str(doc.get("started", "")),
        "concurrency": metadata.get("concurrency"),
        "endpoints": endpoints,
    }


def _ended(finished_reason: object) -> str:
    """A session's status once a reply ended so: ``handed_off`` (the
    conversation went on with another agent), ``error``, or ``done``."""
    if finished_reason in ("error", "handed_off"):
        return str(finished_reason)
    return "done"


def _stored_status(status: str, final: dict[str, Any] | None) -> str:
    """A session's status as the store has it, but ``handed_off`` for one
    whose last reply handed the conversation over (stored ``done``)."""
    if status == "done" and final and final.get("finished_reason") == "handed_off":
        return "handed_off"
    return status
