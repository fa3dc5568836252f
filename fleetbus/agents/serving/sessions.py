"""Agent sessions in JetStream: state written ahead, a lease apart, recovery
without scans.

Three KV buckets and an object store hold the sessions of a fleet's agents:

``<prefix>_sessions`` — the *head* of each session, key ``<agent>.<session_id>``:
    status (``idle``, ``running``, ``paused``, ``done``, ``error``), the last
    final answer, the request being served (its reply subject and, until the
    reply has recorded it, the input itself), the state without its memory
    (summary, plan, permissions, the reply in progress), the newest messages
    (the *tail*), and the list of sealed memory chunks. Every write is a
    compare-and-set on the revision last read.
``<prefix>_session_chunks`` — older memory, key ``<agent>.<session>.<epoch>.<n>``:
    when the tail passes :data:`CHUNK_BYTES` it is sealed into a chunk, written
    once and never again. A step therefore writes what it added plus the head
    (bounded), whatever the length of the conversation; compression, which
    rewrites memory, starts a new set of chunks.
``<prefix>_session_leases`` — the lease, key ``<agent>.<session_id>``: a small
    record renewed by compare-and-set without touching the state. Its revision
    at acquisition is the owner's *epoch*, part of every chunk key, so an old
    owner that has not noticed its loss can never overwrite what the new owner
    references. It carries the request being served with its reply subject
    (or, when the request is larger than :data:`_CARRIED_BYTES`, or the lease
    a take-over's, only its ``call_id``): a copy of the request sent again
    by a client that had no receipt is known by it.
``<prefix>_session_blobs`` — any head or chunk larger than the server's
    ``max_payload`` allows is stored here and referenced, transparently: no
    session size is limited by ``max_payload``.

Recovery finds sessions whose owner stopped renewing without listing the
store: :class:`Recovery` follows lease writes through a plain subscription
(no JetStream consumer), keeps a timer per running session, and confirms a
silent lease by reading it before taking the session over.
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
from fleetbus._retry import Retry
from fleetbus.agents.messages import stored_messages
from fleetbus.agents.state import AgentState, MemoryIndex
from fleetbus.bus import (
    Bus,
    Entry,
    KeyUpdates,
    KeyValueStore,
    ObjectStore,
    key_value,
    object_store,
)
from fleetbus.bus.store import transient
from fleetbus.errors import (
    FleetbusError,
    KeyNotFoundError,
    RequestHeldError,
    RevisionMismatchError,
    SessionBusyError,
    SessionLost,
    SessionNotFoundError,
    StoreError,
)
from fleetbus.protocol import new_id, utc_now

__all__ = [
    "CHUNK_BYTES",
    "Lease",
    "Recovery",
    "SessionRecord",
    "SessionStatus",
    "SessionStore",
]

logger = logging.getLogger(__name__)

SessionStatus = Literal["idle", "running", "paused", "done", "error"]

CHUNK_BYTES = 16 * 1024
"""The tail of memory kept in the head is sealed into a chunk past this size."""

_HEADS = "sessions"
_CHUNKS = "session_chunks"
_LEASES = "session_leases"
_BLOBS = "session_blobs"
_FORMAT = 2
_BLOB_REF = b'{"$blob":'
_LEASE_KEEP = 24 * 3600.0
_MARKER_TTL = 60.0
"""Seconds the marker of a released lease stays (at least; 6 lease TTLs)."""
_RELEASED_KEPT = 20_000
_CARRIED_BYTES = 16 * 1024
"""A request up to this size (JSON) rides in the lease value: then a session
handed over cleanly needs no fencing write of its head."""
_CACHED_MESSAGES = 5_000
"""Messages the session cache holds at most, over all its sessions (a few MB)."""
_GONE_KEPT = 100_000
"""Released lease keys a Recovery remembers, so a resync does not read them."""
"""Leases released here whose revision is remembered (about 100 bytes each)."""
"""Seconds the lease bucket keeps a record (renewals keep live ones fresh);
a session left running while no replica of its agent ran for longer than
this is resumed by its next message instead of by recovery."""
_HEADROOM = 16 * 1024
"""Bytes kept free below ``max_payload`` for headers and framing."""


class SessionRecord(BaseModel):
    """One agent session as stored."""

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

    @property
    def step(self) -> int:
        """The reasoning step of the reply in progress (0 when none)."""
        reply = self.state.reply
        return reply.iteration if reply is not None else 0


@dataclass
class Lease:
    """A session held by this replica: the record, the revisions to write on,
    and what of memory is already stored."""

    record: SessionRecord
    revision: int
    """The head's revision (while ``fresh``: the session's deletion's, or 0)."""
    lease_revision: int
    epoch: int
    """The lease's revision when it was taken: this owner's epoch."""
    previous: SessionStatus = "idle"
    """The status before this lease was taken."""
    previous_owner: str | None = None
    """The replica that held the session before (for a take-over's log)."""
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    persisted: int = 0
    """How many messages of memory are stored."""
    persisted_ends: tuple[str, str] | None = None
    """``msg_id`` of the first and the last stored message: memory that still
    starts and continues with them was only appended to (checked in constant
    time: a save costs what the step added, not the conversation)."""
    tail: bytes = b"[]"
    """The stored messages the head holds, as the head holds them (a JSON
    array): a write appends the new ones, and nothing is encoded again."""
    tail_bytes: int = 2
    chunks: list[list[int]] = field(default_factory=list)
    """Sealed chunks as ``[epoch, first, last]`` ranges."""
    next_chunk: int = 0
    seq: int = 0
    """Head writes by this owner (recognises a write that landed unacknowledged)."""
    blob: str | None = None
    """The object holding the head, when it did not fit in a KV value."""
    renewals: int = 0
    renewed_at: float = field(default_factory=time.monotonic)
    orphan_input: dict[str, Any] | None = None
    """A request a dead owner had taken but not recorded (served first)."""
    orphan_reply_to: str | None = None
    """Where the request the dead owner was serving wants its answer."""
    orphan_final: dict[str, Any] | None = None
    """The answer a dead owner stored but may not have sent to ``orphan_reply_to``."""
    carried: dict[str, Any] | None = None
    """The request being served as the lease value carries it (``reply_to``
    and ``input``), written again with each renewal."""
    fresh: bool = False
    """A new session whose head is not written yet: its first write is a
    compare-and-set against ``revision``, so that a session deleted
    meanwhile is not written again."""


def session_key(agent: str, session_id: str) -> str:
    """The KV key of a session (head and lease)."""
    return f"{agent}.{session_id}"


def _chunk_key(key: str, epoch: int, n: int) -> str:
    return f"{key}.{epoch}.{n}"


class SessionStore:
    """Sessions of the fleet's agents: compare-and-set heads, chunked memory,
    leases apart.

    Args:
        bus: the connection.
        heads: the sessions bucket.
        chunks: the memory chunks bucket.
        leases: the leases bucket.
        owner: this replica's id (written into the leases it takes).
        lease_ttl: seconds a lease may go unrenewed before another replica
            may take the session over.
        cache_size: sessions whose last stored state is kept in memory, so
            that the next message of a session skips reading its chunks (and
            at most 5,000 messages over all of them).
    """

    def __init__(
        self,
        bus: Bus,
        heads: KeyValueStore,
        chunks: KeyValueStore,
        leases: KeyValueStore,
        *,
        owner: str,
        lease_ttl: float = 10.0,
        cache_size: int = 256,
    ) -> None:
        self.bus = bus
        self.heads = heads
        self.chunks = chunks
        self.leases = leases
        self.owner = owner
        self.lease_ttl = lease_ttl
        # key: (head revision, lease as released, the marker that release left)
        self._cache: OrderedDict[str, tuple[int, Lease, int | None]] = OrderedDict()
        self._cache_size = cache_size
        self._cached_messages = 0
        """Messages held by the cache: it is bounded by them too (sessions grow)."""
        # The revision of the deletion marker each released lease left (here,
        # or heard): the next acquire writes against it without reading first.
        self._released: OrderedDict[str, int] = OrderedDict()
        self._blobs: ObjectStore | None = None
        self._inline_limit = max(4096, bus.max_payload - _HEADROOM)

    @classmethod
    async def open(cls, bus: Bus, *, owner: str, lease_ttl: float = 10.0) -> SessionStore:
        """The fleet's session buckets (created on first use).

        Raises:
            StoreError: JetStream is off or a bucket cannot be opened.
        """
        heads = await key_value(bus, _HEADS)
        chunks = await key_value(bus, _CHUNKS)
        leases = await key_value(
            bus, _LEASES, ttl=_LEASE_KEEP, expiring_markers=True, republish=True
        )
        return cls(bus, heads, chunks, leases, owner=owner, lease_ttl=lease_ttl)

    # -- values that may not fit in one message ------------------------------------

    async def _blob_store(self) -> ObjectStore:
        if self._blobs is None:
            self._blobs = await object_store(self.bus, _BLOBS)
        return self._blobs

    async def _pack(self, key: str, data: bytes) -> tuple[bytes, str | None]:
        """``data`` as a KV value: itself, or a reference to a new object."""
        if len(data) <= self._inline_limit:
            return data, None
        name = f"{key}.{new_id()}"
        await (await self._blob_store()).put(name, data)
        return orjson.dumps({"$blob": name}), name

    async def _unpack(self, value: bytes) -> tuple[bytes, str | None]:
        if not value.startswith(_BLOB_REF):
            return value, None
        name = str(orjson.loads(value)["$blob"])
        try:
            return await (await self._blob_store()).get(name), name
        except KeyNotFoundError:
            raise StoreError(f"session data {name} is missing from the object store") from None

    async def _drop_blob(self, name: str | None) -> None:
        if name is None:
            return
        try:
            await (await self._blob_store()).delete(name)
        except (KeyNotFoundError, StoreError) as exc:
            logger.debug("blob %s not deleted: %s", name, exc)

    # -- reading -------------------------------------------------------------------

    async def _read_head(self, key: str) -> tuple[int, dict[str, Any], str | None] | None:
        read = await self._read_head_or_none(key)
        return None if read is None or read[1] is None else (read[0], read[1], read[2])

    async def _read_head_or_none(
        self, key: str
    ) -> tuple[int, dict[str, Any] | None, str | None] | None:
        """The head (revision, head, blob), or for a session deleted the
        revision of its deletion with no head; ``None``: never written."""
        entry = await self.heads.last(key)
        if entry is None:
            return None
        if entry.deleted or not entry.value:
            return entry.revision, None, None
        data, blob = await self._unpack(entry.value)
        return entry.revision, _decode_head(data), blob

    def _cached(
        self, key: str, *, revision: int | None = None, marker: int | None = None
    ) -> Lease | None:
        """A copy of the session as this replica released it, if the cache
        holds it at head ``revision``, or with the lease at ``marker`` (the
        release this replica made)."""
        cached = self._cache.get(key)
        if cached is None:
            return None
        if revision is not None and cached[0] != revision:
            return None
        if marker is not None and cached[2] != marker:
            return None
        self._cache.move_to_end(key)
        return _copy_lease(cached[1])

    async def _load(self, key: str, revision: int, head: dict[str, Any], blob: str | None) -> Lease:
        """The record of a head, memory read from its chunks (or the cache)."""
        cached = self._cached(key, revision=revision)
        if cached is not None:
            return cached
        if "format" not in head:  # a session stored whole, before chunks existed
            record = SessionRecord.model_validate(head)
            return Lease(record, revision, 0, 0)
        ranges: list[list[int]] = head.get("chunks", [])
        keys = [_chunk_key(key, e, n) for e, first, last in ranges for n in range(first, last + 1)]
        parts = await asyncio.gather(*(self._read_chunk(k) for k in keys))
        tail: bytes = head.get("tail", _NO_TAIL)
        try:
            # Read from the JSON as stored, into messages: no dicts on the way.
            memory = [m for part in (*parts, tail) for m in stored_messages(part)]
        except ValueError as exc:
            raise StoreError(f"session {key} holds unreadable memory: {exc}") from None
        state = AgentState.model_validate({**head["state"], "memory": memory})
        record = SessionRecord(
            agent=head["agent"],
            session_id=head["session_id"],
            status=head["status"],
            state=state,
            owner=head.get("owner"),
            created_at=head["created_at"],
            updated_at=head["updated_at"],
            final=head.get("final"),
            reply_to=head.get("reply_to"),
            pending_input=head.get("pending_input"),
            messages=len(memory),
        )
        return Lease(
            record,
            revision,
            0,
            int(head.get("epoch", 0)),
            persisted=len(state.memory),
            persisted_ends=_ends(state.memory),
            tail=tail,
            tail_bytes=len(tail),
            chunks=ranges,
            seq=int(head.get("seq", 0)),
            blob=blob,
        )

    async def _read_chunk(self, key: str) -> bytes:
        """A sealed chunk of memory: its stored messages, a JSON array."""
        entry = await self.chunks.get_or_none(key)
        if entry is None:
            raise StoreError(f"memory chunk {key} of a session is missing")
        data, _ = await self._unpack(entry.value)
        return data

    async def get(self, agent: str, session_id: str) -> SessionRecord | None:
        """A session as stored (memory and all), or ``None``.

        Raises:
            StoreError: the read failed.
        """
        key = session_key(agent, session_id)
        read = await self._read_head(key)
        if read is None:
            return None
        return (await self._load(key, *read)).record

    async def records(self, agent: str | None = None) -> list[SessionRecord]:
        """Every session (of one agent), most recently updated first.

        One listing that creates no consumer on the server, then one read
        per session (and its chunks). For people and tools, not for loops.
        A session that cannot be read is left out (with a warning), unless
        the failure may pass (``StoreError.transient``): then it is raised,
        so that the caller can wait for the store rather than list less.

        Raises:
            StoreError: the bucket failed.
        """
        records = []
        pattern = f"{agent}.*" if agent is not None else ">"
        for key in await self.heads.subjects(pattern):
            try:
                read = await self._read_head(key)
                if read is not None:
                    records.append((await self._load(key, *read)).record)
            except (ValueError, StoreError) as exc:
                if transient(exc):
                    raise
                logger.warning("session %s is unreadable: %s", key, exc)
        return sorted(records, key=lambda r: r.updated_at, reverse=True)

    # -- the lease -------------------------------------------------------------------

    def _lease_value(
        self, epoch: int, renewals: int, carried: dict[str, Any] | None = None
    ) -> bytes:
        value: dict[str, Any] = {
            "owner": self.owner,
            "epoch": epoch,
            "renewals": renewals,
            "ttl": self.lease_ttl,
        }
        if carried is not None:
            value["request"] = carried
        return orjson.dumps(value)

    def _carried(
        self, reply_to: str | None, pending_input: dict[str, Any] | None
    ) -> dict[str, Any] | None:
        """The request to carry in the lease value: all of it if small enough
        to (``input``), else only its ``call_id`` (a copy of it sent again is
        known by that: :func:`_serves`)."""
        if pending_input is None:
            return None
        carried = {"reply_to": reply_to, "input": pending_input}
        if len(orjson.dumps(carried)) <= _CARRIED_BYTES:
            return carried
        call_id = pending_input.get("call_id")
        return {"reply_to": reply_to, "call_id": call_id} if isinstance(call_id, str) else None

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
        """Take the session's lease, then fence its head (creating the session
        if it is new): from then on only this replica's writes land.

        Args:
            agent: the agent's name.
            session_id: the session.
            fresh: the state a new session starts with (or what makes it).
            reply_to: where the request being served wants its answer.
            pending_input: the request being served (JSON), stored with the
                lease so that a take-over can serve it if this replica dies
                before the reply has recorded it.
            wait: seconds to wait for another replica's lease to end. A lease
                that goes unrenewed for longer than ``lease_ttl`` meanwhile is
                taken (its owner died).
            take_over: only take a session left running by a dead owner
                (recovery); never create one.
            lease_revision: with ``take_over``, the lease revision found
                silent: the take-over happens only if it is still current.
            create: make the session if it does not exist (``False``: a
                message that only continues a session, a confirmation).
            joins: ``(call_id, reply subject)`` of a request sent again by a
                client that had no receipt: when another replica holds the
                lease serving that very request (its lease carries it), it
                answers the copy too, and no wait is made.

        Raises:
            RequestHeldError: (``joins``) another replica holds the lease
                serving that request.
            SessionBusyError: another replica holds the lease after ``wait``,
                or (``take_over``) the session needs no take-over.
            SessionNotFoundError: ``create`` is false and there is no such session.
            StoreError: a bucket failed.
        """
        args = (
            agent,
            session_id,
            fresh,
            reply_to,
            pending_input,
            wait,
            take_over,
            lease_revision,
            create,
            joins,
        )
        if not take_over:
            return await self._acquire(*args)
        with tracing.span(
            "fleetbus session take-over",
            attributes={"fleetbus.agent": agent, "fleetbus.session_id": session_id},
        ):
            return await self._acquire(*args)

    async def _acquire(
        self,
        agent: str,
        session_id: str,
        fresh: AgentState | Callable[[], AgentState] | None,
        reply_to: str | None,
        pending_input: dict[str, Any] | None,
        wait: float,
        take_over: bool,
        lease_revision: int | None,
        create: bool,
        joins: tuple[str, str] | None,
    ) -> Lease:
        key = session_key(agent, session_id)
        deadline = time.monotonic() + wait
        delay = 0.02
        seen: tuple[int, float] | None = None
        carried = self._carried(reply_to, pending_input)
        if not take_over:
            # The common cases in one write: a lease nobody wrote since this
            # replica released it (compare-and-set against its deletion), or
            # a session never leased. Anyone else's write makes this fail;
            # then the lease is read and judged below.
            released = self._released.pop(key, None)
            value = self._lease_value(0, 0, carried)
            try:
                if released is not None:
                    revision = await self.leases.update(key, value, revision=released)
                else:
                    revision = await self.leases.create(key, value)
            except RevisionMismatchError:
                pass
            else:
                # Taken over the marker of this replica's own release: nobody
                # held the lease since, so nobody wrote the head since, and
                # the head as released here is the head (no read).
                known = self._cached(key, marker=released) if released is not None else None
                try:
                    return await self._fence(
                        key,
                        agent,
                        session_id,
                        revision,
                        fresh,
                        reply_to,
                        pending_input,
                        False,
                        carried=carried,
                        handed_over=released is not None,
                        known=known,
                        create=create,
                    )
                except BaseException:
                    await self._drop_lease(key, revision)
                    raise
        while True:
            entry = await self.leases.get_or_none(key)
            holder = lease_owner(entry.value) if entry is not None else None
            if entry is not None and holder is not None and holder != self.owner:
                if take_over:
                    if entry.revision != lease_revision:
                        raise SessionBusyError(
                            f"session {session_id} of {agent} needs no take-over",
                            agent=agent,
                            session_id=session_id,
                        )
                else:
                    now = time.monotonic()
                    if seen is None or seen[0] != entry.revision:
                        seen = (entry.revision, now)
                    if now - seen[1] <= self.lease_ttl:  # alive; else its owner died
                        if joins is not None and _serves(entry, joins):
                            raise RequestHeldError(
                                f"session {session_id} of {agent} is serving this request "
                                f"at {holder}",
                                agent=agent,
                                session_id=session_id,
                            )
                        if now >= deadline:
                            raise SessionBusyError(
                                f"session {session_id} of {agent} is being run by {holder}",
                                agent=agent,
                                session_id=session_id,
                            )
                        await asyncio.sleep(delay)
                        delay = min(delay * 2, 0.25)
                        continue
            elif take_over and (entry is None or entry.revision != lease_revision):
                raise SessionBusyError(
                    f"session {session_id} of {agent} needs no take-over",
                    agent=agent,
                    session_id=session_id,
                )
            value = self._lease_value(0, 0, carried)
            try:
                if entry is None:
                    revision = await self.leases.create(key, value)
                else:
                    revision = await self.leases.update(key, value, revision=entry.revision)
            except RevisionMismatchError:
                continue  # someone else moved first: look again
            from_dead = entry is not None and holder is not None and holder != self.owner
            try:
                return await self._fence(
                    key,
                    agent,
                    session_id,
                    revision,
                    fresh,
                    reply_to,
                    pending_input,
                    take_over,
                    from_dead=from_dead,
                    carried=carried,
                    dead=_dead_request(entry) if from_dead or take_over else None,
                    create=create,
                )
            except BaseException:
                await self._drop_lease(key, revision)
                raise

    async def _fence(
        self,
        key: str,
        agent: str,
        session_id: str,
        epoch: int,
        fresh: AgentState | Callable[[], AgentState] | None,
        reply_to: str | None,
        pending_input: dict[str, Any] | None,
        take_over: bool,
        *,
        from_dead: bool = False,
        carried: dict[str, Any] | None = None,
        handed_over: bool = False,
        dead: tuple[int, dict[str, Any], str | None] | None = None,
        known: Lease | None = None,
        create: bool = True,
    ) -> Lease:
        """Write the head as this owner's (epoch), so that a previous owner's
        late writes fail their compare-and-set.

        Not written when the request is ``carried`` whole in the lease and
        the lease was ``handed_over`` (taken over the marker its last owner
        left on release: whoever wrote the head before was fenced by the
        owner that took it from them), or the session is new (nobody wrote
        its head). A take-over finds the request in the lease (and makes a
        new session's head from it); the first save writes the head.

        ``dead``: the epoch, carried request and owner of a dead owner's
        lease: its request still to serve when that owner never wrote the head.
        ``known``: the head as it is, known without reading it.
        """
        whole = carried is not None and "input" in carried  # a take-over finds it there
        for _ in range(8):
            # A deleted session's head is gone; its first save of a new life
            # compares against the deletion's revision, as against none.
            seen = None if known is not None else await self._read_head_or_none(key)
            base = seen[0] if seen is not None else 0
            read = None if seen is None or seen[1] is None else (seen[0], seen[1], seen[2])
            if read is None and known is None and dead is None:
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
                state = fresh() if callable(fresh) else fresh
                record = SessionRecord(
                    agent=agent,
                    session_id=session_id,
                    state=state or AgentState(agent_name=agent),
                    status="running",
                    owner=self.owner,
                    reply_to=reply_to,
                    pending_input=pending_input,
                )
                lease = Lease(record, base, epoch, epoch, fresh=True)
                lease.carried = carried
                if whole:
                    # A new session whose request rides in the lease: its first
                    # save creates the head (a take-over creates it from the
                    # lease). Nobody wrote it before, so nobody is to fence.
                    return lease
                try:
                    await self._write_head(lease, record, record.state, create=True)
                except RevisionMismatchError:
                    continue
                return lease
            if known is not None:
                lease, known = known, None  # (a failed write below reads it again)
            elif read is not None:
                lease = await self._load(key, *read)
            else:
                # A dead owner's new session, never saved: what it served is in
                # its lease (``dead``, made running below).
                assert dead is not None
                state = fresh() if callable(fresh) else fresh
                record = SessionRecord(
                    agent=agent,
                    session_id=session_id,
                    state=state or AgentState(agent_name=agent),
                    owner=dead[2],
                )
                lease = Lease(record, base, 0, 0, fresh=True)
            record = lease.record
            if dead is not None and dead[0] != lease.epoch:
                # The dead owner never wrote the head: its request is in its lease.
                record = record.model_copy(
                    update={
                        "status": "running",
                        "pending_input": dead[1]["input"],
                        "reply_to": dead[1]["reply_to"],
                    }
                )
            undelivered = record.reply_to is not None and record.final is not None
            if take_over and record.status != "running" and not undelivered:
                raise SessionBusyError(
                    f"session {session_id} of {agent} needs no take-over",
                    agent=agent,
                    session_id=session_id,
                )
            lease.previous, lease.previous_owner = record.status, record.owner
            if not take_over and record.status == "running":  # its owner died
                lease.orphan_input, lease.orphan_reply_to = record.pending_input, record.reply_to
            elif not take_over and from_dead and undelivered:
                # Its owner died after storing the answer, maybe before sending it.
                lease.orphan_final, lease.orphan_reply_to = record.final, record.reply_to
            lease.epoch = lease.lease_revision = epoch
            lease.next_chunk = 0
            lease.seq = 0
            update: dict[str, Any] = {"owner": self.owner}
            if record.status == "running" or not take_over:
                update["status"] = "running"  # (an answer to re-send keeps its status)
            if not take_over:
                update.update(reply_to=reply_to, pending_input=pending_input)
            lease.carried = carried if not take_over else _serving(record)
            if handed_over and record.status != "running" and (whole or not pending_input):
                lease.record = record.model_copy(update=update)
                return lease
            try:
                await self._write_head(
                    lease,
                    record.model_copy(update=update),
                    record.state,
                    create=lease.fresh,
                )
            except RevisionMismatchError:
                continue
            return lease
        raise SessionBusyError(
            f"session {session_id} of {agent} keeps changing under this replica",
            agent=agent,
            session_id=session_id,
        )

    async def renew(self, lease: Lease) -> None:
        """Extend the lease (a small write; the state is not touched).

        Raises:
            SessionLost: the lease was taken over.
            StoreError: the bucket failed (the lease may still be ours).
        """
        record = lease.record
        key = session_key(record.agent, record.session_id)
        value = self._lease_value(lease.epoch, lease.renewals + 1, lease.carried)
        try:
            lease.lease_revision = await self.leases.update(
                key, value, revision=lease.lease_revision
            )
        except RevisionMismatchError:
            entry = await self.leases.get_or_none(key)
            if entry is None or entry.value != value:
                raise SessionLost(
                    f"session {record.session_id} of {record.agent} was taken over",
                    agent=record.agent,
                    session_id=record.session_id,
                ) from None
            lease.lease_revision = entry.revision  # our write landed, unacknowledged
        lease.renewals += 1
        lease.renewed_at = time.monotonic()

    async def release(self, lease: Lease) -> None:
        """Give the lease up, the session as last saved (the end of a reply:
        saved, answered, released)."""
        record = lease.record
        key = session_key(record.agent, record.session_id)
        async with lease.lock:
            marker = await self._drop_lease(key, lease.lease_revision)
            self._remember(key, lease, record.state, marker)

    async def _remove_lease(self, key: str, revision: int) -> int:
        """Remove a lease of ours; the marker's revision. The marker expires
        where the server allows (nats-server 2.11+): released leases do not
        pile up in the bucket, nor in the listings recovery makes."""
        if self.leases.expiring_markers:
            ttl = max(_MARKER_TTL, 6 * self.lease_ttl)
            return await self.leases.purge(key, revision=revision, ttl=ttl)
        return await self.leases.delete(key, revision=revision)

    async def _drop_lease(self, key: str, revision: int) -> int | None:
        """Release a lease of ours; the revision of the marker left, or
        ``None`` when it was not released here.

        A store failing for a moment (a cluster electing the bucket's new
        leader) is tried again for up to a lease's TTL, by when the lease
        would have lapsed anyway: a lease left to lapse held the session's
        next request for that long (measured: answers 15-31 s late across a
        cluster node's death, against 5-7 s for the others)."""
        retry = Retry(
            on=transient, attempts=None, backoff=0.05, max_backoff=1.0, timeout=self.lease_ttl
        )
        try:
            try:
                marker = await retry.call(self._remove_lease, key, revision)
            except RevisionMismatchError:
                # A renewal of ours may have landed after its writer stopped
                # waiting; anyone else's lease stays.
                entry = await retry.call(self.leases.get_or_none, key)
                if entry is None or lease_owner(entry.value) != self.owner:
                    logger.info("lease of %s was taken over before its release", key)
                    return None
                marker = await retry.call(self._remove_lease, key, entry.revision)
        except RevisionMismatchError:
            logger.info("lease of %s was taken over before its release", key)
            return None
        except StoreError as exc:
            logger.warning("lease of %s not released (it will lapse): %s", key, exc)
            return None
        self.note_released(key, marker)
        return marker

    def note_released(self, key: str, marker: int) -> None:
        """Lease ``key`` was released, leaving a marker at revision ``marker``
        (here, or by another replica: :class:`Recovery` hears it): the next
        acquire writes against it without reading the lease first."""
        self._released[key] = marker
        self._released.move_to_end(key)
        if len(self._released) > _RELEASED_KEPT:
            self._released.popitem(last=False)

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
        """Write the session (compare-and-set): the memory added since the last
        write, the rest of the state, and the status; maybe release the lease.

        Args:
            lease: the session held.
            state: the state now (its memory is diffed against what is stored).
            status: the new status.
            final: the final answer of the reply that ended.
            release: give the lease up (the reply is over).
            input_recorded: the pending input is in ``state`` now.

        Raises:
            SessionLost: someone else wrote the session since: this replica no
                longer owns it.
            StoreError: the bucket failed.
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
                await self._save(lease, state, status, final, release, input_recorded)

    async def _save(
        self,
        lease: Lease,
        state: AgentState | None,
        status: SessionStatus | None,
        final: dict[str, Any] | None,
        release: bool,
        input_recorded: bool,
    ) -> None:
        update: dict[str, Any] = {"updated_at": utc_now()}
        if status is not None:
            update["status"] = status
            if status != "running":
                update["owner"] = None  # nobody runs it (the lease may still be dropping)
        if final is not None:
            update["final"] = final
        if release:
            update.update(reply_to=None, pending_input=None)
        if input_recorded:
            update["pending_input"] = None
        record = lease.record.model_copy(update=update)
        await self._write_head(lease, record, state or lease.record.state)
        if release:
            key = session_key(record.agent, record.session_id)
            marker = await self._drop_lease(key, lease.lease_revision)
            self._remember(key, lease, state, marker)

    async def _write_head(
        self, lease: Lease, record: SessionRecord, state: AgentState, *, create: bool = False
    ) -> None:
        """Store memory added since the last write and the head; commit the
        bookkeeping to ``lease`` only once the head write landed."""
        key = session_key(record.agent, record.session_id)
        memory = state.memory
        n = lease.persisted
        obsolete: list[str] = []
        tail, chunks, next_chunk = lease.tail, lease.chunks, lease.next_chunk
        if n == 0 or (
            len(memory) >= n and _ends(memory[:1] + memory[n - 1 : n]) == lease.persisted_ends
        ):
            added = memory[n:]
        else:  # memory was rewritten (compression): store it anew
            obsolete = [_chunk_key(key, e, i) for e, a, b in chunks for i in range(a, b + 1)]
            added, tail, chunks = list(memory), _NO_TAIL, []
            n = 0
        if added:
            tail = _appended(tail, [orjson.dumps(m.model_dump(mode="json")) for m in added])
        tail_bytes = len(tail)
        if tail_bytes > CHUNK_BYTES:
            await self._write_chunk(_chunk_key(key, lease.epoch, next_chunk), tail)
            chunks = _add_range(chunks, lease.epoch, next_chunk)
            next_chunk += 1
            tail, tail_bytes = _NO_TAIL, len(_NO_TAIL)
        write_id = new_id()
        head = {
            "format": _FORMAT,
            "agent": record.agent,
            "session_id": record.session_id,
            "status": record.status,
            "owner": record.owner,
            "epoch": lease.epoch,
            "seq": lease.seq + 1,
            "write": write_id,
            "created_at": record.created_at.isoformat(),
            "updated_at": record.updated_at.isoformat(),
            "final": record.final,
            "reply_to": record.reply_to,
            "pending_input": record.pending_input,
            "state": state.model_dump(mode="json", exclude={"memory"}),
            "chunks": chunks,
            "tail": orjson.Fragment(tail),  # as it is: the old messages are not encoded again
        }
        value, blob = await self._pack(key, orjson.dumps(head))
        try:
            if create:  # (a mismatch: the caller reads the head again)
                revision = await self.heads.update(key, value, revision=lease.revision)
            else:
                revision = await self._update_head(lease, key, value, write_id)
        except BaseException:
            await self._drop_blob(blob)
            raise
        await self._drop_blob(lease.blob)
        for chunk in obsolete:
            await self._drop_chunk(chunk)
        lease.revision, lease.seq, lease.blob = revision, lease.seq + 1, blob
        lease.fresh = False
        lease.persisted, lease.persisted_ends = n + len(added), _ends(memory)
        lease.tail, lease.tail_bytes = tail, tail_bytes
        lease.chunks, lease.next_chunk = chunks, next_chunk
        lease.record = record.model_copy(update={"messages": lease.persisted})
        if lease.record.state is not state:
            lease.record.state = state

    async def _update_head(self, lease: Lease, key: str, value: bytes, write_id: str) -> int:
        """Compare-and-set the head. A mismatch is ours to resolve when the head
        still carries this owner's epoch: this very write landed but its
        acknowledgement was lost (a fail-over), or an earlier write of ours
        landed after its writer stopped waiting (a cancelled save). Only
        another epoch means the session was taken over."""
        record = lease.record
        revision = lease.revision
        for _ in range(3):
            try:
                # (A new session's first write too: against its deletion, or none.)
                return await self.heads.update(key, value, revision=revision)
            except RevisionMismatchError:
                read = await self._read_head(key)
                if read is None or read[1].get("epoch") != lease.epoch:
                    break
                if read[1].get("write") == write_id:
                    return read[0]  # this write landed, unacknowledged
                revision = read[0]  # an earlier write of ours landed late: write over it
        raise SessionLost(
            f"session {record.session_id} of {record.agent} was taken over",
            agent=record.agent,
            session_id=record.session_id,
        )

    async def _write_chunk(self, key: str, messages: bytes) -> None:
        value, _ = await self._pack(key, messages)
        await self.chunks.put(key, value)

    async def _drop_chunk(self, key: str) -> None:
        try:
            entry = await self.chunks.get_or_none(key)
            if entry is not None and entry.value.startswith(_BLOB_REF):
                await self._drop_blob(str(orjson.loads(entry.value)["$blob"]))
            await self.chunks.delete(key)
        except StoreError as exc:
            logger.warning("memory chunk %s not deleted: %s", key, exc)

    def _remember(
        self, key: str, lease: Lease, state: AgentState | None, marker: int | None
    ) -> None:
        """Keep the state as stored, for the next message of this session.

        Kept as it is, not copied: the reply that made it is over (only the
        end of a reply comes here), and a hit hands out a copy. A host of more
        sessions than the cache holds (a simulation's) copied every state for
        nothing: 4 % of its CPU, proportional to memory."""
        if self._cache_size <= 0:
            return
        kept = _copy_lease(lease, state, copy_state=False)
        self._forget(key)
        self._cache[key] = (lease.revision, kept, marker)
        self._cached_messages += len(kept.record.state.memory)
        while self._cache and (
            len(self._cache) > self._cache_size or self._cached_messages > _CACHED_MESSAGES
        ):
            self._forget(next(iter(self._cache)))

    def _forget(self, key: str) -> None:
        """Drop ``key`` from the cache (if there)."""
        gone = self._cache.pop(key, None)
        if gone is not None:
            self._cached_messages -= len(gone[1].record.state.memory)

    async def delete(self, agent: str, session_id: str) -> None:
        """Forget a session: head, memory chunks, lease.

        Raises:
            StoreError: a bucket failed.
        """
        key = session_key(agent, session_id)
        read = await self._read_head(key)
        await self.heads.delete(key)
        for chunk in await self.chunks.subjects(f"{key}.>"):
            await self._drop_chunk(chunk)
        if read is not None:
            await self._drop_blob(read[2])
        await self.leases.delete(key)
        self._forget(key)

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
            self,
            agents,
            take_over,
            serves=serves,
            interval=interval,
            resync_interval=resync_interval,
        )


@dataclass
class _Watched:
    revision: int | None
    """The lease revision confirmed by a read (None: only heard of)."""
    since: float
    """Monotonic time of the last sign of life."""


class Recovery:
    """Finds the sessions whose owner stopped renewing its lease, and hands
    each to ``take_over(agent, session_id, lease_revision)``.

    Lease writes are followed through plain subscriptions (no JetStream
    consumer); each running session has a timer, restarted by every renewal
    heard. A lease silent for longer than ``lease_ttl`` is read; if it is
    still at the revision read before, its owner is dead. Only leases of
    running sessions exist, so idle sessions cost nothing. Every
    ``resync_interval`` seconds (and after a reconnection) the lease keys are
    listed — one request per pattern, no consumer — to learn of leases whose
    writes were missed.

    Args:
        store: the session store.
        agents: the agent followed, or several (a subscription each), or
            ``None`` for every agent of the fleet (one subscription: a host
            serving a population).
        take_over: called for each session found dead.
        serves: with ``agents=None``, which agent names to act for (the
            leases of others are ignored).
        interval: seconds between checks of the timers.
        resync_interval: seconds between listings of the lease keys.
    """

    def __init__(
        self,
        store: SessionStore,
        agents: str | Sequence[str] | None,
        take_over: Callable[[str, str, int], Awaitable[None]],
        *,
        serves: Callable[[str], bool] | None = None,
        interval: float = 2.0,
        resync_interval: float = 30.0,
    ) -> None:
        self.store = store
        self._take_over = take_over
        self.interval = interval
        self.resync_interval = resync_interval
        self.watched: dict[str, _Watched] = {}
        """Running sessions by lease key (``<agent>.<session>``)."""
        self._gone: OrderedDict[str, None] = OrderedDict()
        """Lease keys known deleted (not read again at a resync); bounded."""
        if agents is None:
            self._patterns = ["*.*"]
        else:
            self._patterns = [f"{a}.*" for a in ([agents] if isinstance(agents, str) else agents)]
        self._serves = serves
        self._updates = [
            KeyUpdates(store.bus, store.leases, pattern, self._heard) for pattern in self._patterns
        ]
        self._reconnects = -1
        self._resynced = 0.0

    @property
    def agent(self) -> str:
        """What is followed, for log lines."""
        return ", ".join(p[:-2] if p != "*.*" else "every agent" for p in self._patterns)

    def _ours(self, key: str) -> bool:
        return self._serves is None or self._serves(key.partition(".")[0])

    def _heard(self, key: str, value: bytes | None, revision: int | None) -> None:
        if not self._ours(key):
            return
        owner = lease_owner(value) if value else None
        if owner is None:
            self.watched.pop(key, None)
            self._note_gone(key)
            if revision is not None and value is None:
                # Released (by any replica): the next take is one write.
                self.store.note_released(key, revision)
            return
        self._gone.pop(key, None)
        watched = self.watched.get(key)
        if watched is None:
            self.watched[key] = _Watched(None, time.monotonic())
        else:
            watched.since = time.monotonic()

    def _note_gone(self, key: str) -> None:
        self._gone[key] = None
        self._gone.move_to_end(key)
        if len(self._gone) > _GONE_KEPT:
            self._gone.popitem(last=False)

    @property
    def _reconnects_seen(self) -> int:
        return self._updates[0].reconnects

    async def start(self) -> None:
        """Follow the lease writes and learn the current leases.

        Raises:
            BusError: the subscription failed.
            StoreError: the listing failed.
        """
        for updates in self._updates:
            await updates.start()
        await self._resync()

    async def close(self) -> None:
        """Stop following (the subscriptions are removed)."""
        for updates in self._updates:
            await updates.close()

    async def _resync(self) -> None:
        reconnects = self._reconnects_seen
        if reconnects != self._reconnects:
            self._gone.clear()  # writes may have been missed while away
            self._reconnects = reconnects
        self._resynced = time.monotonic()
        for pattern in self._patterns:
            for key in await self.store.leases.subjects(pattern):
                if key in self.watched or key in self._gone or not self._ours(key):
                    continue
                entry = await self.store.leases.get_or_none(key)
                if entry is None or lease_owner(entry.value) is None:
                    self._note_gone(key)
                    continue
                self.watched[key] = _Watched(entry.revision, time.monotonic())

    async def check(self) -> None:
        """Look at the timers once: confirm silent leases, take over dead ones.

        Raises:
            StoreError: the bucket failed.
        """
        now = time.monotonic()
        if (
            now - self._resynced >= self.resync_interval
            or self._reconnects_seen != self._reconnects
        ):
            await self._resync()
        ttl = self.store.lease_ttl
        for key, watched in list(self.watched.items()):
            if now - watched.since <= ttl:
                continue
            entry = await self.store.leases.get_or_none(key)
            if entry is None or lease_owner(entry.value) is None:
                self.watched.pop(key, None)
                continue
            if entry.revision != watched.revision:
                watched.revision, watched.since = entry.revision, time.monotonic()
                continue
            self.watched.pop(key, None)
            agent, _, session = key.partition(".")
            await self._take_over(agent, session, entry.revision)

    async def run(self, stop: asyncio.Event) -> None:
        """Check every ``interval`` seconds until ``stop`` is set."""
        try:
            while not stop.is_set():
                try:
                    async with asyncio.timeout(self.interval):
                        await stop.wait()
                except TimeoutError:
                    pass
                if stop.is_set():
                    return
                try:
                    await self.check()
                except FleetbusError as exc:
                    logger.warning("%s: recovery check failed: %s", self.agent, exc)
        finally:
            await self.close()


_NO_TAIL = b"[]"


class _Head(msgspec.Struct):
    """A head as :meth:`SessionStore._write_head` writes it, for reading: its
    tail is kept as the JSON it is (``msgspec.Raw``), read into messages only
    by a load, and never into dicts."""

    format: Any = msgspec.UNSET
    agent: Any = msgspec.UNSET
    session_id: Any = msgspec.UNSET
    status: Any = msgspec.UNSET
    owner: Any = msgspec.UNSET
    epoch: Any = msgspec.UNSET
    seq: Any = msgspec.UNSET
    write: Any = msgspec.UNSET
    created_at: Any = msgspec.UNSET
    updated_at: Any = msgspec.UNSET
    final: Any = msgspec.UNSET
    reply_to: Any = msgspec.UNSET
    pending_input: Any = msgspec.UNSET
    state: Any = msgspec.UNSET
    chunks: Any = msgspec.UNSET
    tail: msgspec.Raw | msgspec.UnsetType = msgspec.UNSET


_HEAD_FIELDS = _Head.__struct_fields__
_HEAD_JSON = msgspec.json.Decoder(_Head)


def _decode_head(data: bytes) -> dict[str, Any]:
    """A head's fields as written (``tail``: the JSON array of its stored
    messages, as ``bytes``). A head of the format before chunks (the whole
    session record) is read whole.

    Raises:
        StoreError: the head is not a JSON object.
    """
    try:
        read = _HEAD_JSON.decode(data)
    except msgspec.DecodeError as exc:
        raise StoreError(f"a session head is unreadable: {exc}") from None
    if read.format is msgspec.UNSET:
        whole: dict[str, Any] = orjson.loads(data)
        return whole
    head = {
        name: value for name in _HEAD_FIELDS if (value := getattr(read, name)) is not msgspec.UNSET
    }
    if "tail" in head:
        head["tail"] = bytes(head["tail"])
    return head


def _appended(tail: bytes, messages: list[bytes]) -> bytes:
    """The JSON array ``tail`` (as read, so whitespace and all) with the
    encoded ``messages`` added at its end."""
    if not messages:
        return tail
    added = b",".join(messages)
    body = tail.rstrip()[:-1].rstrip()  # all but the closing bracket
    if body.endswith(b"["):  # nothing in it yet
        return body + added + b"]"
    return body + b"," + added + b"]"


def _dead_request(entry: Entry | None) -> tuple[int, dict[str, Any], str | None] | None:
    """The epoch of a lease, the request it carries and its owner (``None``:
    it carries none)."""
    if entry is None or not entry.value:
        return None
    try:
        value = orjson.loads(entry.value)
        request = value.get("request")
        epoch = int(value.get("epoch") or entry.revision)
    except (orjson.JSONDecodeError, AttributeError, TypeError, ValueError):
        return None
    if not isinstance(request, dict) or not isinstance(request.get("input"), dict):
        return None
    owner = value.get("owner")
    return epoch, request, owner if isinstance(owner, str) else None


def _serving(record: SessionRecord) -> dict[str, Any] | None:
    """What a take-over's lease carries (from its first renewal on) of the
    request it serves: its reply subject and ``call_id``, so that a copy of
    it sent again is known (:func:`_serves`)."""
    pending = record.pending_input or {}
    reply = record.state.reply
    call_id = pending.get("call_id") or (reply.request_id if reply is not None else None)
    if not record.reply_to or not isinstance(call_id, str):
        return None
    return {"reply_to": record.reply_to, "call_id": call_id}


def _serves(entry: Entry, request: tuple[str, str]) -> bool:
    """Whether the lease ``entry`` carries the request ``(call_id, reply subject)``
    (all of it, or its ``call_id`` only)."""
    try:
        carried = orjson.loads(entry.value).get("request") if entry.value else None
    except (orjson.JSONDecodeError, AttributeError):
        return False
    if not isinstance(carried, dict):
        return False
    call_id, reply_to = request
    whole = carried.get("input")
    carried_id = whole.get("call_id") if isinstance(whole, dict) else carried.get("call_id")
    return carried.get("reply_to") == reply_to and carried_id == call_id


def lease_owner(value: bytes | None) -> str | None:
    """The replica a lease record names as its owner (``None``: a release, or
    not a lease record)."""
    if not value:
        return None
    try:
        owner = orjson.loads(value).get("owner")
    except (orjson.JSONDecodeError, AttributeError):
        return None
    return owner if isinstance(owner, str) else None


def _ends(memory: list[Any]) -> tuple[str, str] | None:
    return (memory[0].msg_id, memory[-1].msg_id) if memory else None


def _add_range(ranges: list[list[int]], epoch: int, n: int) -> list[list[int]]:
    if ranges and ranges[-1][0] == epoch and ranges[-1][2] == n - 1:
        return [*ranges[:-1], [epoch, ranges[-1][1], n]]
    return [*ranges, [epoch, n, n]]


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


def _copy_lease(lease: Lease, state: AgentState | None = None, *, copy_state: bool = True) -> Lease:
    """A copy of ``lease`` holding a copy of its state (or of ``state``; the
    state itself with ``copy_state=False``)."""
    kept = lease.record.state if state is None else state
    record = lease.record.model_copy(update={"state": _copy_state(kept) if copy_state else kept})
    return Lease(
        record,
        lease.revision,
        0,
        lease.epoch,
        persisted=lease.persisted,
        persisted_ends=lease.persisted_ends,
        tail=lease.tail,
        tail_bytes=lease.tail_bytes,
        chunks=[list(r) for r in lease.chunks],
        seq=lease.seq,
        blob=lease.blob,
    )
