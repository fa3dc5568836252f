"""Agent sessions: journals (:mod:`.journals`), and leases (:mod:`.leases`).

A session's state is the fold of its journal, appended to by whichever
replica holds its lease: a small record with a TTL that says who runs the
session now and, going silent, that its owner died. :class:`SessionStore`
takes a session (the lease, then the ``taken`` fact), appends what each step
adds, and releases it; :class:`Recovery` finds the sessions whose owner died.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from fleetbus import tracing
from fleetbus.agents.serving.facts import (
    Lease,
    SessionFact,
    SessionRecord,
    SessionStatus,
    compact,
    copy_lease,
    fact_meta,
    read_fact,
    recorded,
    serving_request,
    session_key,
    updated,
)
from fleetbus.agents.serving.journals import (
    JOURNAL_NAME,
    SNAPSHOT_BYTES,
    SNAPSHOT_MULTIPLE,
    SessionJournals,
)
from fleetbus.agents.serving.leases import Leases, Recovery, Taken, lease_owner
from fleetbus.agents.state import AgentState
from fleetbus.bus import Bus
from fleetbus.bus.journal import Journal, journal
from fleetbus.errors import (
    RevisionMismatchError,
    SessionBusyError,
    SessionLost,
    SessionNotFoundError,
    StoreError,
)
from fleetbus.protocol import ConfirmResult, ExternalResult

__all__ = [
    "SNAPSHOT_BYTES",
    "SNAPSHOT_MULTIPLE",
    "Lease",
    "Recovery",
    "SessionFact",
    "SessionJournals",
    "SessionRecord",
    "SessionStatus",
    "SessionStore",
    "lease_owner",
    "read_fact",
    "session_key",
]

logger = logging.getLogger(__name__)

_CACHED_MESSAGES = 5_000
"""Messages the session cache holds at most, over all its sessions (a few MB)."""
_IDLE_TAKES = 4
"""The cache holds no new fold after this many times its size in takes of
sessions that did not come back to it (a session released here and taken
again here, nobody else's write between, comes back); one that does turns
it on again."""
_CONTINUING = frozenset(t.__struct_config__.tag for t in (ConfirmResult, ExternalResult))
"""The requests that only continue a session: a take-over does not begin
one for them."""


def _starts_session(request: dict[str, Any]) -> bool:
    """Whether ``request`` (a message as JSON) may begin a session."""
    return request.get("type") not in _CONTINUING


class SessionStore(SessionJournals):
    """Sessions of the fleet's agents: a journal each, leases apart.

    Args:
        bus: the connection.
        journal: the sessions' journal stream.
        leases: the leases.
        cache_size: sessions whose fold is kept in memory, so that the next
            message of a session reads only the facts since (and at most
            5,000 messages over all of them). Folds are kept only while
            sessions come back to this replica within that many releases:
            a population whose agents each speak once a round never does,
            and holding folds that are never used cost more than reading.
    """

    def __init__(
        self, bus: Bus, journal: Journal, leases: Leases, *, cache_size: int = 256
    ) -> None:
        super().__init__(bus, journal)
        self._leases = leases
        self.leases = leases.bucket
        """The lease bucket (see :mod:`.leases`)."""
        self._cache_size = cache_size
        self._cached_messages = 0
        self._released_here: OrderedDict[str, int | None] = OrderedDict()
        """The marker of each of the last ``cache_size`` sessions released
        here, cached or not: a take against one is a session that came back
        (see :meth:`_remember`)."""
        self._takes_since_return = 0

    @classmethod
    async def open(cls, bus: Bus, *, owner: str, lease_ttl: float = 10.0) -> SessionStore:
        """The fleet's session journal and leases (created on first use).

        Raises:
            StoreError: JetStream is off or a stream cannot be opened.
        """
        stream = await journal(bus, JOURNAL_NAME)
        leases = await Leases.open(bus, owner=owner, ttl=lease_ttl)
        return cls(bus, stream, leases)

    @property
    def owner(self) -> str:
        return self._leases.owner

    @property
    def lease_ttl(self) -> float:
        return self._leases.ttl

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
        # The request served, whole (its input carried while the journal
        # does not hold it); a copy sent again is known by its call_id.
        serving: dict[str, Any] | None = (
            {"reply_to": reply_to, "call_id": call_id} if isinstance(call_id, str) else None
        )
        if pending_input is not None:
            serving = {**(serving or {"reply_to": reply_to}), "input": pending_input}
        span = (
            tracing.span(
                "fleetbus session take-over",
                attributes={"fleetbus.agent": agent, "fleetbus.session_id": session_id},
            )
            if take_over
            else None
        )
        with span if span is not None else contextlib.nullcontext():
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
                    taken=taken,
                    create=create,
                    serving=serving,
                )
            except BaseException as exc:
                # A take-over the store failed leaves the lease to lapse:
                # released, nobody would take the dead owner's reply over.
                if not (take_over and isinstance(exc, StoreError)):
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
        taken: Taken,
        create: bool,
        serving: dict[str, Any] | None,
    ) -> Lease:
        """Append the ``taken`` fact as owner ``epoch`` against the end of the
        journal as read (or as this replica released it, when nobody held
        the lease since: ``taken.marker``).

        A clean take — a session released by its last owner, the request
        carried whole in the lease — appends nothing: nobody is to be fenced
        (a lease taken from a dead owner always is), and the first fact this
        owner appends carries the ``taken`` fact's fields. A new session
        begins with its ``taken`` fact (appended against an empty journal:
        one deleted meanwhile is not written again). A
        take-over finds a dead owner's request in its lease when the journal
        has nothing of that owner (``taken.dead``): of a new session too, whose
        owner died between its lease and its first fact (the take-over
        begins the session, unless that request only continues one)."""
        agent, _, session_id = key.partition(".")
        cached = self._cache.get(key)
        marker, from_dead, dead = taken.marker, taken.from_dead, taken.dead
        if marker is not None and self._released_here.get(key, -1) == marker:
            self._takes_since_return = 0  # came back: its fold is worth holding
        else:
            self._takes_since_return += 1
        known = (
            cached[0] if cached is not None and marker is not None and cached[1] == marker else None
        )
        for _ in range(8):
            if known is not None:
                lease: Lease | None = copy_lease(known)
                known = None
            else:
                lease = await self._load(key, cached[0] if cached is not None else None)
            fact: dict[str, Any] = {"k": "taken", "owner": self.owner}
            if lease is None:
                if take_over and (dead is None or not _starts_session(dead.input)):
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
            unwritten = dead is not None and lease.writer != dead.epoch
            if unwritten:
                # Its owner died before appending anything: the request it
                # took is in its lease.
                assert dead is not None
                record = record.model_copy(
                    update={
                        "status": "running",
                        "owner": dead.owner,
                        "pending_input": dead.input,
                        "reply_to": dead.reply_to,
                    }
                )
                lease.record = record
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
            elif unwritten:  # the journal records the dead owner's request now
                fact["to"], fact["input"] = record.reply_to, record.pending_input
            lease.epoch = lease.lease_revision = epoch
            lease.writes = 0
            lease.serving = serving if not take_over else serving_request(record)
            clean = not (take_over or from_dead or "created" in fact) and record.status != "running"
            if clean and taken.carried:
                del fact["k"]
                lease.untaken = fact
                lease.record = updated(record, fact_meta(fact))
                return lease
            lease.serving = recorded(lease.serving)  # the journal holds the request
            try:
                await self._append(lease, fact, taking=True)  # (the state as read)
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
            if lease.untaken is None:  # (else the fold is not the journal's)
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
        small_rollup: bool = False,
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
            small_rollup: write a snapshot (and roll the journal up) while
                the whole journal is under ``SNAPSHOT_BYTES``: the next read
                of the session is one message (a population's host, which
                reads most sessions it serves from the store).

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
                fact: dict[str, Any] = {"k": "end"} if status is not None else {}
                if status is not None:
                    fact["status"] = status
                if final is not None:
                    fact["final"] = compact(final)
                if input_recorded and lease.record.pending_input is not None:
                    fact["rec"] = True
                if release:
                    fact["clear"] = True
                await self._append(
                    lease, fact, state or lease.record.state, small_rollup=small_rollup
                )
                if release:
                    marker = await self._leases.drop(lease.key, lease.lease_revision)
                    self._remember(lease, marker)

    def _remember(self, lease: Lease, marker: int | None) -> None:
        """Keep the fold as written, for the next message of this session.

        Kept as it is, not copied: the reply that made it is over (only the
        end of a reply comes here), and a hit hands out a copy."""
        if self._cache_size <= 0:
            return
        key = lease.key
        self._forget(key)
        released = self._released_here
        released[key] = marker
        released.move_to_end(key)
        if len(released) > self._cache_size:
            released.popitem(last=False)
        if self._takes_since_return > _IDLE_TAKES * self._cache_size:
            # No session came back while it would have been held: holding
            # folds that are never used, then freeing them cold, costs more
            # than reading the few that come back.
            return
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
        await super().delete(agent, session_id)
        key = session_key(agent, session_id)
        await self.leases.delete(key)
        self._forget(key)
        self._released_here.pop(key, None)

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
