"""Agent sessions as journals: one append-only record per session.

Every session is a subject of the stream ``<prefix>_session`` —
``<prefix>.session.<agent>.<session_id>`` — to which each fact of its
replies is appended once: the request taken (with its owner), a step's tool
calls, a result, a step's messages, state changes (plan, permissions,
summary), the end (final answer and status). A fact carries only what it
adds: the messages appended to memory since the last fact (``add``, from
index ``m``), and a merge patch of the rest of the state (``set``). The
session is the fold of its journal.

Every append names the sequence it expects last on its subject
(``Nats-Expected-Last-Subject-Sequence``): a replica that lost its session
cannot write after the one that took it, and the fence needs no write of its
own. When memory is rewritten (a compression), or the facts since the last
snapshot outgrow it, a snapshot of the whole session is appended with a
rollup, which removes the facts before it: a journal stays bounded by five
times its session. A fact larger than the server's ``max_payload`` is stored in the
object store ``<prefix>_session_blobs`` and referenced.

Liveness is apart: a small lease with a TTL (:mod:`.leases`) says who runs
a session now and, going silent, that its owner died.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal

import msgspec
import orjson
from pydantic import BaseModel, Field

from fleetbus import tracing
from fleetbus.agents.messages import Msg, stored_messages
from fleetbus.agents.serving.leases import Leases, Recovery, lease_owner
from fleetbus.agents.state import AgentState, MemoryIndex
from fleetbus.bus import Bus, ObjectStore, check_name, object_store
from fleetbus.bus.journal import Journal, JournalEntry, journal
from fleetbus.bus.store import transient
from fleetbus.errors import (
    KeyNotFoundError,
    RevisionMismatchError,
    SessionBusyError,
    SessionLost,
    SessionNotFoundError,
    StoreError,
)
from fleetbus.protocol import new_id, utc_now

__all__ = [
    "Lease",
    "Recovery",
    "SessionFact",
    "SessionRecord",
    "SessionStatus",
    "SessionStore",
    "lease_owner",
    "read_fact",
    "session_key",
]

logger = logging.getLogger(__name__)

SessionStatus = Literal["idle", "running", "paused", "done", "error"]

_JOURNAL = "session"
_BLOBS = "session_blobs"
SNAPSHOT_BYTES = 64 * 1024
"""Facts since the last snapshot may take this many bytes, or
:data:`SNAPSHOT_MULTIPLE` times the snapshot, before a new snapshot rolls
them up."""
SNAPSHOT_MULTIPLE = 4
"""A snapshot costs what the session weighs: written once the facts since
the last one weigh this many times as much, it adds at most a quarter to what
the replies write, and a journal holds at most five times its session."""
_HEADROOM = 16 * 1024
"""Bytes kept free below ``max_payload`` for headers and framing."""
_CACHED_MESSAGES = 5_000
"""Messages the session cache holds at most, over all its sessions (a few MB)."""


class SessionRecord(BaseModel):
    """One agent session: the fold of its journal."""

    agent: str
    session_id: str
    status: SessionStatus = "idle"
    state: AgentState
    owner: str | None = None
    """The replica running the session (``None`` when it is not running)."""
    created_at: datetime = Field(default_factory=utc_now)
    updated_at: datetime = Field(default_factory=utc_now)
    final: dict[str, Any] | None = None
    """The ``final_answer`` of the last reply, as JSON."""
    reply_to: str | None = None
    """Where the request being served wants its answer (for a take-over)."""
    pending_input: dict[str, Any] | None = None
    """The request being served, as JSON, until the reply has recorded it."""
    messages: int = 0
    """How many messages memory holds."""
    seq: int = 0
    """The stream sequence of the journal's last fact."""

    @property
    def step(self) -> int:
        """The reasoning step of the reply in progress (0 when none)."""
        reply = self.state.reply
        return reply.iteration if reply is not None else 0


class SessionFact(BaseModel):
    """One fact of a session's journal, as ``history`` lists it."""

    n: int
    """Its place in the journal, from 1."""
    seq: int
    time: datetime | None
    kind: str
    """``taken``, ``input``, ``calls``, ``result``, ``step``, ``observed``,
    ``state``, ``end`` or ``snapshot``."""
    owner: str | None = None
    status: SessionStatus | None = None
    added: list[dict[str, Any]] = Field(default_factory=list)
    """The messages it appended to memory (JSON)."""
    changed: list[str] = Field(default_factory=list)
    """The fields of the state it changed."""
    final: dict[str, Any] | None = None
    writer: tuple[int, int] = (0, 0)
    """The epoch of the owner that appended it, and its number among that
    owner's facts: with the session, what names a fact before its sequence
    is known."""


@dataclass
class Lease:
    """A session held by this replica: the record, the journal's end, and
    what of the state is already written."""

    record: SessionRecord
    seq: int
    """The journal's last sequence: what the next append expects."""
    lease_revision: int = 0
    epoch: int = 0
    """The lease's revision when it was taken: named in every fact written."""
    previous: SessionStatus = "idle"
    """The status before this lease was taken."""
    previous_owner: str | None = None
    """The replica that held the session before (for a take-over's log)."""
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    writes: int = 0
    """Facts this owner appended (their ``n``: an unacknowledged one is known)."""
    persisted: int = 0
    """How many messages of memory are written."""
    persisted_ends: tuple[str, str] | None = None
    """``msg_id`` of the first and the last written message: memory that still
    starts and continues with them was only appended to."""
    written: dict[str, Any] = field(default_factory=dict)
    """The state but its memory, as written (the next fact patches it)."""
    since_snapshot: int = 0
    """Bytes of the facts after the last snapshot."""
    snapshot_bytes: int = 0
    blobs: list[str] = field(default_factory=list)
    """Objects the journal's facts reference."""
    renewals: int = 0
    renewed_at: float = field(default_factory=time.monotonic)
    orphan_input: dict[str, Any] | None = None
    """A request a dead owner had taken but not recorded (served first)."""
    orphan_reply_to: str | None = None
    """Where the request the dead owner was serving wants its answer."""
    orphan_final: dict[str, Any] | None = None
    """The answer a dead owner stored but may not have sent to ``orphan_reply_to``."""
    serving: dict[str, Any] | None = None
    """The ``call_id`` and reply subject of the request served, in the lease."""

    @property
    def key(self) -> str:
        return session_key(self.record.agent, self.record.session_id)


def session_key(agent: str, session_id: str) -> str:
    """The key of a session (its journal and its lease)."""
    return f"{agent}.{session_id}"


class _Fact(msgspec.Struct):
    """A fact as read: messages kept as their JSON (``msgspec.Raw``), read
    into messages with no dicts made on the way."""

    k: str = "step"
    e: int = 0
    n: int = 0
    owner: Any = msgspec.UNSET
    status: Any = msgspec.UNSET
    to: Any = msgspec.UNSET
    input: Any = msgspec.UNSET
    created: Any = msgspec.UNSET
    m: int = -1
    add: msgspec.Raw | msgspec.UnsetType = msgspec.UNSET
    set: Any = msgspec.UNSET
    rec: bool = False
    clear: bool = False
    final: Any = msgspec.UNSET
    ref: str | msgspec.UnsetType = msgspec.field(default=msgspec.UNSET, name="$blob")


_FACT = msgspec.json.Decoder(_Fact)


def _decode(data: bytes) -> _Fact:
    try:
        return _FACT.decode(data)
    except msgspec.DecodeError as exc:
        raise StoreError(f"a session fact is unreadable: {exc}") from None


class SessionStore:
    """Sessions of the fleet's agents: a journal each, leases apart.

    Args:
        bus: the connection.
        journal: the sessions' journal stream.
        leases: the leases.
        cache_size: sessions whose fold is kept in memory, so that the next
            message of a session reads only the facts since (and at most
            5,000 messages over all of them).
    """

    def __init__(
        self, bus: Bus, journal: Journal, leases: Leases, *, cache_size: int = 256
    ) -> None:
        self.bus = bus
        self.journal = journal
        self._leases = leases
        self.leases = leases.bucket
        """The lease bucket (see :mod:`.leases`)."""
        self._cache: OrderedDict[str, tuple[Lease, int | None]] = OrderedDict()
        self._cache_size = cache_size
        self._cached_messages = 0
        self._blobs: ObjectStore | None = None
        self._inline_limit = max(4096, bus.max_payload - _HEADROOM)

    @classmethod
    async def open(cls, bus: Bus, *, owner: str, lease_ttl: float = 10.0) -> SessionStore:
        """The fleet's session journal and leases (created on first use).

        Raises:
            StoreError: JetStream is off or a stream cannot be opened.
        """
        stream = await journal(bus, _JOURNAL)
        leases = await Leases.open(bus, owner=owner, ttl=lease_ttl)
        return cls(bus, stream, leases)

    @property
    def owner(self) -> str:
        return self._leases.owner

    @property
    def lease_ttl(self) -> float:
        return self._leases.ttl

    async def _blob_store(self) -> ObjectStore:
        if self._blobs is None:
            self._blobs = await object_store(self.bus, _BLOBS)
        return self._blobs

    async def _drop_blobs(self, names: Sequence[str]) -> None:
        for name in names:
            try:
                await (await self._blob_store()).delete(name)
            except (KeyNotFoundError, StoreError) as exc:
                logger.debug("blob %s not deleted: %s", name, exc)

    # -- reading: the fold ------------------------------------------------------------

    async def _facts(self, key: str, after: int = 0) -> list[tuple[JournalEntry, _Fact, int]]:
        """The facts of journal ``key`` after ``after``: each with its entry
        and its size as written (a fact stored by reference is read back)."""
        facts = []
        for entry in await self.journal.read(key, after=after):
            fact = _decode(entry.data)
            if fact.ref is not msgspec.UNSET:
                try:
                    data = await (await self._blob_store()).get(fact.ref)
                except KeyNotFoundError:
                    raise StoreError(f"session fact {fact.ref} is missing") from None
                whole = _decode(data)
                whole.ref = fact.ref
                facts.append((entry, whole, len(data)))
                continue
            facts.append((entry, fact, len(entry.data)))
        return facts

    async def _load(self, key: str, base: Lease | None = None) -> Lease | None:
        """The session as its journal folds (``None``: no journal), caught
        up from ``base`` (a fold of the same journal up to ``base.seq``)
        when it still holds that fact."""
        if base is not None:
            facts = await self._facts(key, after=base.seq - 1)
            if facts and facts[0][0].seq == base.seq:
                lease = _copy_lease(base)
                for entry, fact, size in facts[1:]:
                    _fold(lease, entry, fact, size)
                if len(facts) > 1:
                    lease.written = lease.record.state.model_dump(mode="json", exclude={"memory"})
                return lease
        facts = await self._facts(key)
        if not facts:
            return None
        agent, _, session_id = key.partition(".")
        record = SessionRecord(
            agent=agent, session_id=session_id, state=AgentState(agent_name=agent)
        )
        lease = Lease(record, 0)
        for entry, fact, size in facts:
            _fold(lease, entry, fact, size)
        lease.written = lease.record.state.model_dump(mode="json", exclude={"memory"})
        return lease

    async def get(self, agent: str, session_id: str) -> SessionRecord | None:
        """A session as its journal folds, or ``None``.

        Raises:
            StoreError: the read failed.
        """
        key = session_key(agent, session_id)
        cached = self._cache.get(key)
        lease = await self._load(key, cached[0] if cached else None)
        return lease.record if lease is not None else None

    async def records(self, agent: str | None = None) -> list[SessionRecord]:
        """Every session (of one agent), most recently updated first.

        One listing that creates no consumer on the server, then one read
        per session. For people and tools, not for loops. A session that
        cannot be read is left out (with a warning), unless the failure may
        pass (``StoreError.transient``): then it is raised, so that the
        caller can wait for the store rather than list less.

        Raises:
            StoreError: the stream failed.
        """
        records = []
        for key in await self.journal.keys(f"{agent}.*" if agent is not None else ">"):
            try:
                lease = await self._load(key)
            except (ValueError, StoreError) as exc:
                if transient(exc):
                    raise
                logger.warning("session %s is unreadable: %s", key, exc)
                continue
            if lease is not None:
                records.append(lease.record)
        return sorted(records, key=lambda r: r.updated_at, reverse=True)

    async def history(self, agent: str, session_id: str) -> list[SessionFact]:
        """The facts of a session's journal, oldest first (a snapshot stands
        for the facts it rolled up).

        Raises:
            SessionNotFoundError: there is no such session.
            StoreError: the read failed.
        """
        facts = await self._facts(session_key(agent, session_id))
        if not facts:
            raise SessionNotFoundError(
                f"agent {agent} has no session {session_id}", agent=agent, session_id=session_id
            )
        return [
            _listed(fact, n, entry.seq, entry.time) for n, (entry, fact, _) in enumerate(facts, 1)
        ]

    async def fork(
        self, agent: str, session_id: str, *, at: int, new_session: str | None = None
    ) -> SessionRecord:
        """A new session made of the first ``at`` facts of another (as
        :meth:`history` numbers them): the conversation as it stood then. A
        reply in progress at that fact goes on with the new session's next
        message; nobody is answered for the original's requests.

        Raises:
            SessionNotFoundError: no such session, or it has fewer facts.
            SessionBusyError: ``new_session`` exists already.
            StoreError: the stream failed.
        """
        facts = await self._facts(session_key(agent, session_id))
        if not facts:
            raise SessionNotFoundError(
                f"agent {agent} has no session {session_id}", agent=agent, session_id=session_id
            )
        if not 1 <= at <= len(facts):
            raise SessionNotFoundError(
                f"session {session_id} of {agent} has {len(facts)} facts, not {at}",
                agent=agent,
                session_id=session_id,
            )
        new = check_name(new_session, what="session id") if new_session else new_id()
        lease = Lease(
            SessionRecord(agent=agent, session_id=new, state=AgentState(agent_name=agent)), 0
        )
        for entry, fact, size in facts[:at]:
            _fold(lease, entry, fact, size)
        record = lease.record
        state = record.state
        running = record.pending_input is not None or (state.reply is not None and not state.paused)
        status: SessionStatus = "running" if running else record.status
        forked = record.model_copy(
            update={
                "session_id": new,
                "owner": None,
                "reply_to": None,
                "status": status,
                "created_at": utc_now(),
            }
        )
        if not await self.import_record(forked):
            raise SessionBusyError(
                f"agent {agent} has a session {new} already", agent=agent, session_id=new
            )
        return forked

    async def import_record(self, record: SessionRecord) -> bool:
        """Write ``record`` as the one fact (a snapshot) of its journal, if
        that journal is empty: a fork, or a session carried over from the
        layout before journals. ``False``: the journal has facts already.

        Raises:
            StoreError: the stream failed.
        """
        try:
            await self._append(Lease(record, 0), {"k": "snapshot"}, taking=True, rollup=True)
        except RevisionMismatchError:
            return False
        return True

    # -- taking a session -------------------------------------------------------------

    async def acquire(
        self,
        agent: str,
        session_id: str,
        *,
        fresh: AgentState | Callable[[], AgentState] | None = None,
        reply_to: str | None = None,
        pending_input: dict[str, Any] | None = None,
        wait: float = 0.0,
        take_over: bool = False,
        lease_revision: int | None = None,
        create: bool = True,
        joins: tuple[str, str] | None = None,
    ) -> Lease:
        """Take the session's lease, then append the ``taken`` fact (the
        session made if it is new): from then on only this replica's appends
        land.

        Args:
            agent: the agent's name.
            session_id: the session.
            fresh: the state a new session starts with (or what makes it).
            reply_to: where the request being served wants its answer.
            pending_input: the request being served (JSON), written with the
                ``taken`` fact so that a take-over can serve it if this
                replica dies before the reply has recorded it.
            wait: seconds to wait for another replica's lease to end. A lease
                that goes unrenewed for longer than its TTL meanwhile is
                taken (its owner died).
            take_over: only take a session left running by a dead owner
                (recovery); never create one.
            lease_revision: with ``take_over``, the lease revision found
                silent: the take-over happens only if it is still current.
            create: make the session if it does not exist (``False``: a
                message that only continues a session, a confirmation).
            joins: ``(call_id, reply subject)`` of a request sent again by a
                client that had no receipt: when another replica holds the
                lease serving that very request, it answers the copy too.

        Raises:
            RequestHeldError: (``joins``) another replica holds the lease
                serving that request.
            SessionBusyError: another replica holds the lease after ``wait``,
                or (``take_over``) the session needs no take-over.
            SessionNotFoundError: ``create`` is false and there is no such session.
            StoreError: a stream failed.
        """
        key = session_key(agent, session_id)
        call_id = (pending_input or {}).get("call_id")
        serving = {"reply_to": reply_to, "call_id": call_id} if isinstance(call_id, str) else None
        span = (
            tracing.span(
                "fleetbus session take-over",
                attributes={"fleetbus.agent": agent, "fleetbus.session_id": session_id},
            )
            if take_over
            else None
        )
        with span if span is not None else _no_span():
            taken = await self._leases.take(
                key,
                serving,
                wait=wait,
                take_over=take_over,
                lease_revision=lease_revision,
                joins=joins,
                what=(agent, session_id),
            )
            try:
                return await self._take(
                    key,
                    taken.revision,
                    fresh,
                    reply_to,
                    pending_input,
                    take_over=take_over,
                    from_dead=taken.from_dead,
                    marker=taken.marker,
                    create=create,
                    serving=serving,
                )
            except BaseException:
                await self._leases.drop(key, taken.revision)
                raise

    async def _take(
        self,
        key: str,
        epoch: int,
        fresh: AgentState | Callable[[], AgentState] | None,
        reply_to: str | None,
        pending_input: dict[str, Any] | None,
        *,
        take_over: bool,
        from_dead: bool,
        marker: int | None,
        create: bool,
        serving: dict[str, Any] | None,
    ) -> Lease:
        """Append the ``taken`` fact as owner ``epoch`` against the end of the
        journal as read (or as this replica released it, when nobody held
        the lease since: ``marker``)."""
        agent, _, session_id = key.partition(".")
        cached = self._cache.get(key)
        known = (
            cached[0] if cached is not None and marker is not None and cached[1] == marker else None
        )
        for _ in range(8):
            if known is not None:
                lease: Lease | None = _copy_lease(known)
                known = None
            else:
                lease = await self._load(key, cached[0] if cached is not None else None)
            fact: dict[str, Any] = {"k": "taken", "owner": self.owner}
            if lease is None:
                if take_over:
                    raise SessionBusyError(
                        f"session {session_id} of {agent} no longer exists",
                        agent=agent,
                        session_id=session_id,
                    )
                if not create:
                    raise SessionNotFoundError(
                        f"agent {agent} has no session {session_id}",
                        agent=agent,
                        session_id=session_id,
                    )
                state = (fresh() if callable(fresh) else fresh) or AgentState(agent_name=agent)
                lease = Lease(SessionRecord(agent=agent, session_id=session_id, state=state), 0)
                fact["created"] = lease.record.created_at.isoformat()
                record = lease.record
            else:
                record = lease.record
                undelivered = record.reply_to is not None and record.final is not None
                if take_over and record.status != "running" and not undelivered:
                    raise SessionBusyError(
                        f"session {session_id} of {agent} needs no take-over",
                        agent=agent,
                        session_id=session_id,
                    )
                lease.previous, lease.previous_owner = record.status, record.owner
                if not take_over and record.status == "running":  # its owner died
                    lease.orphan_input = record.pending_input
                    lease.orphan_reply_to = record.reply_to
                elif not take_over and from_dead and undelivered:
                    # Its owner died after writing the answer, maybe before sending it.
                    lease.orphan_final, lease.orphan_reply_to = record.final, record.reply_to
            fact["status"] = (
                "running" if record.status == "running" or not take_over else record.status
            )
            if not take_over:
                fact["to"] = reply_to
                fact["input"] = pending_input
            lease.epoch = lease.lease_revision = epoch
            lease.writes = 0
            lease.serving = serving if not take_over else _serving(record)
            try:
                await self._append(lease, fact, record.state, taking=True)
            except RevisionMismatchError:
                continue  # someone appended since it was read: read again
            return lease
        raise SessionBusyError(
            f"session {session_id} of {agent} keeps changing under this replica",
            agent=agent,
            session_id=session_id,
        )

    async def renew(self, lease: Lease) -> None:
        """Extend the lease (a small write; the journal is not touched).

        Raises:
            SessionLost: the lease was taken over.
            StoreError: the bucket failed (the lease may still be ours).
        """
        value = self._leases.value(lease.epoch, lease.renewals + 1, lease.serving)
        revision = await self._leases.renew(lease.key, value, lease.lease_revision)
        if revision is None:
            record = lease.record
            raise SessionLost(
                f"session {record.session_id} of {record.agent} was taken over",
                agent=record.agent,
                session_id=record.session_id,
            )
        lease.lease_revision = revision
        lease.renewals += 1
        lease.renewed_at = time.monotonic()

    async def release(self, lease: Lease) -> None:
        """Give the lease up, the session as last written (the end of a
        reply: written, answered, released)."""
        async with lease.lock:
            marker = await self._leases.drop(lease.key, lease.lease_revision)
            self._remember(lease, marker)

    # -- writing -----------------------------------------------------------------------

    async def save(
        self,
        lease: Lease,
        *,
        state: AgentState | None = None,
        status: SessionStatus | None = None,
        final: dict[str, Any] | None = None,
        release: bool = False,
        input_recorded: bool = False,
    ) -> None:
        """Append what changed since the last fact: the messages added to
        memory, the rest of the state, the status; maybe release the lease.

        Args:
            lease: the session held.
            state: the state now (its memory is compared with what is written).
            status: the new status.
            final: the final answer of the reply that ended.
            release: give the lease up (the reply is over).
            input_recorded: the pending input is in ``state`` now.

        Raises:
            SessionLost: another replica appended to the journal since: this
                replica no longer owns the session.
            StoreError: the stream failed.
        """
        async with lease.lock:
            with tracing.span(
                "fleetbus session save",
                attributes={
                    "fleetbus.agent": lease.record.agent,
                    "fleetbus.session_id": lease.record.session_id,
                    "fleetbus.status": status,
                    "fleetbus.release": release,
                },
            ):
                fact: dict[str, Any] = {"k": "end" if status is not None else "step"}
                if status is not None:
                    fact["status"] = status
                if final is not None:
                    fact["final"] = final
                if input_recorded and lease.record.pending_input is not None:
                    fact["rec"] = True
                if release:
                    fact["clear"] = True
                await self._append(lease, fact, state or lease.record.state)
                if release:
                    marker = await self._leases.drop(lease.key, lease.lease_revision)
                    self._remember(lease, marker)

    async def _append(
        self,
        lease: Lease,
        fact: dict[str, Any],
        state: AgentState | None = None,
        *,
        taking: bool = False,
        rollup: bool = False,
    ) -> None:
        """Append ``fact`` with what ``state`` adds to what is written (a
        snapshot instead when memory was rewritten, or when the facts since
        the last snapshot outgrew it), then hold it in ``lease``.

        Raises:
            RevisionMismatchError: (``taking``) the journal's end is another.
            SessionLost: the journal's end is another owner's.
        """
        state = state if state is not None else lease.record.state
        record = lease.record.model_copy(update=_meta(fact))
        fields = state.model_dump(mode="json", exclude={"memory"})
        rollup = rollup or _add_state(lease, fact, state, fields)
        # Numbered before it is sent: an append that lands after its writer
        # stopped waiting is never mistaken for a later one.
        n = lease.writes = lease.writes + 1
        data = orjson.dumps({**fact, "e": lease.epoch, "n": n})
        if not rollup and lease.since_snapshot + len(data) > max(
            SNAPSHOT_BYTES, SNAPSHOT_MULTIPLE * lease.snapshot_bytes
        ):
            rollup = True
        if rollup:
            fact = _snapshot(record, state, fields)
            data = orjson.dumps({**fact, "e": lease.epoch, "n": n})
        blob = None
        stored = data
        if len(data) > self._inline_limit:
            blob = f"{lease.key}.{new_id()}"
            await (await self._blob_store()).put(blob, data)
            stored = orjson.dumps({"k": fact["k"], "e": lease.epoch, "n": n, "$blob": blob})
        try:
            seq = await self._write(lease, stored, n, taking=taking, rollup=rollup)
        except BaseException:
            if blob is not None:
                await self._drop_blobs([blob])
            raise
        lease.record = record.model_copy(
            update={
                "state": state,
                "seq": seq,
                "updated_at": utc_now(),
                "messages": len(state.memory),
            }
        )
        lease.seq = seq
        lease.persisted, lease.persisted_ends = len(state.memory), _ends(state.memory)
        lease.written = fields
        dropped: list[str] = []
        if rollup:
            dropped, lease.blobs = lease.blobs, [blob] if blob else []
            lease.since_snapshot, lease.snapshot_bytes = 0, len(data)
        else:
            if blob is not None:
                lease.blobs.append(blob)
            lease.since_snapshot += len(data)
        if dropped:
            await self._drop_blobs(dropped)

    async def _write(self, lease: Lease, data: bytes, n: int, *, taking: bool, rollup: bool) -> int:
        """Append ``data`` after ``lease.seq``. A mismatch is ours to resolve
        when the journal's end is this owner's: this very fact landed but its
        acknowledgement was lost (a fail-over), or an earlier fact of ours
        landed after its writer stopped waiting (a cancelled save): its
        messages are placed by index, so writing over it repeats nothing."""
        expected = lease.seq
        for _ in range(3):
            try:
                return await self.journal.append(lease.key, data, expected=expected, rollup=rollup)
            except RevisionMismatchError:
                if taking:
                    raise
                last = await self.journal.last(lease.key)
                end = _decode(last.data) if last is not None else None
                if last is None or end is None or end.e != lease.epoch:
                    break
                if end.n == n:
                    return last.seq  # this fact landed, unacknowledged
                expected = last.seq  # an earlier fact of ours landed late
        record = lease.record
        raise SessionLost(
            f"session {record.session_id} of {record.agent} was taken over",
            agent=record.agent,
            session_id=record.session_id,
        )

    def _remember(self, lease: Lease, marker: int | None) -> None:
        """Keep the fold as written, for the next message of this session.

        Kept as it is, not copied: the reply that made it is over (only the
        end of a reply comes here), and a hit hands out a copy."""
        if self._cache_size <= 0:
            return
        key = lease.key
        self._forget(key)
        self._cache[key] = (lease, marker)
        self._cached_messages += len(lease.record.state.memory)
        while self._cache and (
            len(self._cache) > self._cache_size or self._cached_messages > _CACHED_MESSAGES
        ):
            self._forget(next(iter(self._cache)))

    def _forget(self, key: str) -> None:
        gone = self._cache.pop(key, None)
        if gone is not None:
            self._cached_messages -= len(gone[0].record.state.memory)

    async def delete(self, agent: str, session_id: str) -> None:
        """Forget a session: its journal, the objects it references, its lease.

        Raises:
            StoreError: a stream failed.
        """
        key = session_key(agent, session_id)
        facts = await self._facts(key)
        await self.journal.purge(key)
        await self._drop_blobs([f.ref for _, f, _ in facts if isinstance(f.ref, str)])
        await self.leases.delete(key)
        self._forget(key)

    def note_released(self, key: str, marker: int) -> None:
        """Lease ``key`` was released leaving a marker at ``marker``: the next
        acquire takes it with one write (see :meth:`Leases.note_released`)."""
        self._leases.note_released(key, marker)

    def recovery(
        self,
        agents: str | Sequence[str] | None,
        take_over: Callable[[str, str, int], Awaitable[None]],
        *,
        serves: Callable[[str], bool] | None = None,
        interval: float = 2.0,
        resync_interval: float = 30.0,
    ) -> Recovery:
        """The recovery machinery of some agents, or all (see :class:`Recovery`)."""
        return Recovery(
            self._leases,
            agents,
            take_over,
            serves=serves,
            interval=interval,
            resync_interval=resync_interval,
        )


class _no_span:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _add_state(
    lease: Lease, fact: dict[str, Any], state: AgentState, fields: dict[str, Any]
) -> bool:
    """Put into ``fact`` what ``state`` (``fields``: all of it but memory)
    adds to what is written: the messages appended to memory (``add`` from
    index ``m``) and a patch of the rest (``set``). ``True`` when memory was
    rewritten: the fact must be a snapshot."""
    memory = state.memory
    n = lease.persisted
    if n and not (
        len(memory) >= n and _ends(memory[:1] + memory[n - 1 : n]) == lease.persisted_ends
    ):
        return True
    if len(memory) > n:
        fact["m"] = n
        fact["add"] = [m.model_dump(mode="json") for m in memory[n:]]
    patch = _patch(lease.written, fields)
    if patch:
        fact["set"] = patch
    return False


def _snapshot(
    record: SessionRecord, state: AgentState, fields: dict[str, Any] | None = None
) -> dict[str, Any]:
    """A snapshot fact: the whole session."""
    return {
        "k": "snapshot",
        "owner": record.owner,
        "status": record.status,
        "to": record.reply_to,
        "input": record.pending_input,
        "final": record.final,
        "created": record.created_at.isoformat(),
        "m": 0,
        "add": [m.model_dump(mode="json") for m in state.memory],
        "set": fields if fields is not None else state.model_dump(mode="json", exclude={"memory"}),
    }


def _meta(fact: dict[str, Any]) -> dict[str, Any]:
    """What ``fact`` (its fields as written) changes of a record but its state."""
    update: dict[str, Any] = {}
    if isinstance(fact.get("created"), str):
        update["created_at"] = datetime.fromisoformat(fact["created"])
    if "owner" in fact:
        update["owner"] = fact["owner"]
    status = fact.get("status")
    if isinstance(status, str):
        update["status"] = status
        if status != "running" and "owner" not in fact:
            update["owner"] = None
    if "to" in fact:
        update["reply_to"] = fact["to"]
    if "input" in fact:
        update["pending_input"] = fact["input"]
    if "final" in fact:
        update["final"] = fact["final"]
    if fact.get("rec"):
        update["pending_input"] = None
    if fact.get("clear"):
        update.update(reply_to=None, pending_input=None)
    return update


_META = ("owner", "status", "to", "input", "created", "final", "rec", "clear")


def _patch(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """A merge patch (RFC 7386) from ``old`` to ``new``: top-level fields that
    changed, and within ``reply`` only its fields that changed. A field set
    to ``None`` is removed (every such field defaults to ``None``)."""
    patch: dict[str, Any] = {}
    for name, value in new.items():
        before = old.get(name)
        if value == before:
            continue
        if name == "reply" and isinstance(value, dict):
            if isinstance(before, dict):
                inner = {k: v for k, v in value.items() if before.get(k) != v}
                inner.update({k: None for k in before if k not in value})
            else:  # a reply begins: what differs from the defaults (all empty)
                inner = {k: v for k, v in value.items() if v}
            patch[name] = inner
        else:
            patch[name] = value
    for name in old:
        if name not in new:
            patch[name] = None
    return patch


def _merged(base: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for name, value in patch.items():
        if value is None:
            merged.pop(name, None)
        elif name == "reply" and isinstance(value, dict) and isinstance(merged.get(name), dict):
            inner = dict(merged[name])
            for k, v in value.items():
                if v is None:
                    inner.pop(k, None)
                else:
                    inner[k] = v
            merged[name] = inner
        else:
            merged[name] = value
    return merged


def _fold(lease: Lease, entry: JournalEntry, fact: _Fact, size: int) -> None:
    """Apply ``fact``, read from the journal, to ``lease``."""
    record = lease.record
    snapshot = fact.k == "snapshot"
    update = _meta({m: v for m in _META if (v := getattr(fact, m)) is not msgspec.UNSET})
    update["seq"] = entry.seq
    if entry.time is not None:
        update["updated_at"] = entry.time
    state = record.state
    memory = state.memory
    if fact.add is not msgspec.UNSET or snapshot:
        try:
            added = stored_messages(fact.add) if fact.add is not msgspec.UNSET else []
        except ValueError as exc:
            raise StoreError(f"session {lease.key} holds unreadable memory: {exc}") from None
        start = 0 if snapshot else max(0, min(fact.m, len(memory)))
        memory = [*memory[:start], *added]
    if fact.set is not msgspec.UNSET or snapshot or memory is not state.memory:
        base = {} if snapshot else state.model_dump(mode="json", exclude={"memory"})
        fields = _merged(base, fact.set) if isinstance(fact.set, dict) else base
        fields.setdefault("agent_name", record.agent)
        index = state.__dict__.get("_memory_index")
        state = AgentState.model_validate({**fields, "memory": []})
        state.memory = memory
        if isinstance(index, MemoryIndex):
            state.__dict__["_memory_index"] = index
    update["state"] = state
    update["messages"] = len(state.memory)
    lease.record = record.model_copy(update=update)
    lease.seq = entry.seq
    if fact.e == lease.epoch and fact.n > lease.writes:
        lease.writes = fact.n
    lease.persisted, lease.persisted_ends = len(state.memory), _ends(state.memory)
    if snapshot:
        lease.blobs = [fact.ref] if isinstance(fact.ref, str) else []
        lease.since_snapshot, lease.snapshot_bytes = 0, size
    else:
        if isinstance(fact.ref, str):
            lease.blobs.append(fact.ref)
        lease.since_snapshot += size


def read_fact(data: bytes) -> SessionFact:
    """A fact as its journal message holds it (a fact stored by reference
    lists only its kind), for a client that follows journals as they are
    written (``fleetbus watch``).

    Raises:
        StoreError: the message is no fact.
    """
    return _listed(_decode(data), 0, 0, None)


def _listed(fact: _Fact, n: int, seq: int, when: datetime | None) -> SessionFact:
    added = orjson.loads(bytes(fact.add)) if fact.add is not msgspec.UNSET else []
    return SessionFact(
        n=n,
        seq=seq,
        time=when,
        kind=_kind(fact, added),
        owner=fact.owner if isinstance(fact.owner, str) else None,
        status=fact.status if isinstance(fact.status, str) else None,
        added=added,
        changed=sorted(fact.set) if isinstance(fact.set, dict) else [],
        final=fact.final if isinstance(fact.final, dict) else None,
        writer=(fact.e, fact.n),
    )


def _kind(fact: _Fact, added: list[dict[str, Any]]) -> str:
    """What a fact is, for people (``history``)."""
    if fact.k in ("taken", "snapshot", "end"):
        return fact.k
    if added:
        last = added[-1]
        if any(b.get("type") == "tool_use" for b in last.get("content", [])):
            return "calls"
    if fact.rec:
        return "input"
    if added:
        if "observed" in (last.get("marks") or []):
            return "observed"
        return "step"
    reply = fact.set.get("reply") if isinstance(fact.set, dict) else None
    if isinstance(reply, dict) and "arrived" in reply:
        return "result"
    return "state"


def _serving(record: SessionRecord) -> dict[str, Any] | None:
    """What a take-over's lease says of the request it serves: its reply
    subject and ``call_id``, so that a copy of it sent again is known."""
    pending = record.pending_input or {}
    reply = record.state.reply
    call_id = pending.get("call_id") or (reply.request_id if reply is not None else None)
    if not record.reply_to or not isinstance(call_id, str):
        return None
    return {"reply_to": record.reply_to, "call_id": call_id}


def _ends(memory: list[Msg]) -> tuple[str, str] | None:
    return (memory[0].msg_id, memory[-1].msg_id) if memory else None


def _copy_state(state: AgentState) -> AgentState:
    """A copy whose later changes do not reach ``state`` (messages are shared:
    memory is appended to, not edited in place), with a copy of its memory
    index: the next reply of the session does not index its memory again."""
    copy = AgentState(
        format_version=state.format_version,
        agent_name=state.agent_name,
        memory=list(state.memory),
        summary=state.summary.model_copy(deep=True) if state.summary else None,
        plan=state.plan.model_copy(deep=True) if state.plan else None,
        permissions=state.permissions.model_copy(deep=True),
        active_groups=list(state.active_groups) if state.active_groups is not None else None,
        reply=state.reply.model_copy(deep=True) if state.reply else None,
    )
    index = state.__dict__.get("_memory_index")
    if isinstance(index, MemoryIndex):
        copy.__dict__["_memory_index"] = index.copy()
    return copy


def _copy_lease(lease: Lease) -> Lease:
    """A copy of ``lease``'s fold, holding a copy of its state."""
    record = lease.record.model_copy(update={"state": _copy_state(lease.record.state)})
    return Lease(
        record,
        lease.seq,
        persisted=lease.persisted,
        persisted_ends=lease.persisted_ends,
        written=lease.written,
        since_snapshot=lease.since_snapshot,
        snapshot_bytes=lease.snapshot_bytes,
        blobs=list(lease.blobs),
    )
