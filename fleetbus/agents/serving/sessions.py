"""Agent sessions in a JetStream KV bucket: state, status, and a lease.

Each session of each agent is one key, ``<agent>.<session_id>``, holding a
:class:`SessionRecord`: the :class:`AgentState`, a status (``idle``,
``running``, ``paused``, ``done``, ``error``), the final answer of the last
reply, and a lease (owner and expiry). Every write is a compare-and-set on
the revision last read, so two replicas never both advance one session: the
one whose write fails has lost it. A lease whose owner died expires after
``lease_ttl`` seconds, and another replica can take the session over from its
last saved step.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, Field

from fleetbus.agents.state import AgentState
from fleetbus.bus import Bus, KeyValueStore, key_value
from fleetbus.errors import (
    KeyNotFoundError,
    RevisionMismatchError,
    SessionBusyError,
    SessionLostError,
)
from fleetbus.protocol import utc_now

__all__ = ["Lease", "SessionRecord", "SessionStatus", "SessionStore"]

logger = logging.getLogger(__name__)

SessionStatus = Literal["idle", "running", "paused", "done", "error"]

_BUCKET = "sessions"


class SessionRecord(BaseModel):
    """One agent session as stored."""

    agent: str
    session_id: str
    status: SessionStatus = "idle"
    state: AgentState
    owner: str | None = None
    """The replica holding the lease."""
    lease_until: float | None = None
    """Unix time the lease expires."""
    created_at: datetime = Field(default_factory=utc_now)
    updated_at: datetime = Field(default_factory=utc_now)
    final: dict[str, Any] | None = None
    """The ``final_answer`` of the last reply, as JSON."""
    reply_to: str | None = None
    """Where the request being served wants its answer (for a take-over)."""

    @property
    def step(self) -> int:
        """The reasoning step of the reply in progress (0 when none)."""
        reply = self.state.reply
        return reply.iteration if reply is not None else 0

    def leased(self, now: float | None = None) -> bool:
        """Whether some replica holds a lease that has not expired."""
        now = time.time() if now is None else now
        return self.owner is not None and (self.lease_until or 0.0) > now


@dataclass
class Lease:
    """A session held by this replica: the record and the revision to write on."""

    record: SessionRecord
    revision: int
    previous: SessionStatus = "idle"
    """The status before this lease was taken."""
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


def session_key(agent: str, session_id: str) -> str:
    """The KV key of a session."""
    return f"{agent}.{session_id}"


class SessionStore:
    """Sessions of the fleet's agents, with compare-and-set and leases.

    Args:
        kv: the bucket.
        owner: this replica's id (written into the leases it takes).
        lease_ttl: seconds a lease lasts without renewal.
    """

    def __init__(self, kv: KeyValueStore, *, owner: str, lease_ttl: float = 10.0) -> None:
        self.kv = kv
        self.owner = owner
        self.lease_ttl = lease_ttl

    @classmethod
    async def open(cls, bus: Bus, *, owner: str, lease_ttl: float = 10.0) -> SessionStore:
        """The fleet's session bucket (created on first use).

        Raises:
            StoreError: JetStream is off or the bucket cannot be opened.
        """
        return cls(await key_value(bus, _BUCKET), owner=owner, lease_ttl=lease_ttl)

    async def get(self, agent: str, session_id: str) -> SessionRecord | None:
        """A session as stored, or ``None``.

        Raises:
            StoreError: the read failed.
        """
        entry = await self.kv.get_or_none(session_key(agent, session_id))
        if entry is None:
            return None
        return SessionRecord.model_validate_json(entry.value)

    async def acquire(
        self,
        agent: str,
        session_id: str,
        *,
        fresh: AgentState | None = None,
        reply_to: str | None = None,
        wait: float = 0.0,
        take_over: bool = False,
    ) -> Lease:
        """Take the session's lease (creating the session if it is new).

        Args:
            agent: the agent's name.
            session_id: the session.
            fresh: the state a new session starts with.
            reply_to: where the request being served wants its answer.
            wait: seconds to wait for another replica's lease to end.
            take_over: only take a session whose lease has expired while it
                was running (recovery); never create one.

        Raises:
            SessionBusyError: another replica holds the lease after ``wait``.
            StoreError: the bucket failed.
        """
        key = session_key(agent, session_id)
        deadline = time.monotonic() + wait
        delay = 0.02
        while True:
            entry = await self.kv.get_or_none(key)
            now = time.time()
            if entry is None:
                if take_over:
                    raise SessionBusyError(
                        f"session {session_id} of {agent} no longer exists",
                        agent=agent,
                        session_id=session_id,
                    )
                record = SessionRecord(
                    agent=agent,
                    session_id=session_id,
                    state=fresh or AgentState(agent_name=agent),
                    status="running",
                    owner=self.owner,
                    lease_until=now + self.lease_ttl,
                    reply_to=reply_to,
                )
                try:
                    revision = await self.kv.create(key, record.model_dump_json().encode())
                except RevisionMismatchError:
                    continue  # created by someone else in between: read it
                return Lease(record, revision)
            record = SessionRecord.model_validate_json(entry.value)
            busy = record.leased(now) and record.owner != self.owner
            if take_over and (record.status != "running" or record.leased(now)):
                raise SessionBusyError(
                    f"session {session_id} of {agent} needs no take-over",
                    agent=agent,
                    session_id=session_id,
                )
            if not busy:
                previous = record.status
                record = record.model_copy(
                    update={
                        "status": "running",
                        "owner": self.owner,
                        "lease_until": now + self.lease_ttl,
                        "updated_at": utc_now(),
                        "reply_to": record.reply_to if take_over else reply_to,
                    }
                )
                try:
                    revision = await self.kv.update(
                        key, record.model_dump_json().encode(), revision=entry.revision
                    )
                except RevisionMismatchError:
                    continue
                return Lease(record, revision, previous)
            if time.monotonic() >= deadline:
                raise SessionBusyError(
                    f"session {session_id} of {agent} is being run by {record.owner}",
                    agent=agent,
                    session_id=session_id,
                )
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.25)

    async def save(
        self,
        lease: Lease,
        *,
        state: AgentState | None = None,
        status: SessionStatus | None = None,
        final: dict[str, Any] | None = None,
        release: bool = False,
    ) -> None:
        """Write the session (compare-and-set), renewing or releasing the lease.

        Raises:
            SessionLostError: someone else wrote it since: this replica no
                longer owns the session.
            StoreError: the bucket failed.
        """
        async with lease.lock:
            record = lease.record
            update: dict[str, Any] = {"updated_at": utc_now()}
            if state is not None:
                update["state"] = state
            if status is not None:
                update["status"] = status
            if final is not None:
                update["final"] = final
            if release:
                update.update(owner=None, lease_until=None, reply_to=None)
            else:
                update["lease_until"] = time.time() + self.lease_ttl
            record = record.model_copy(update=update)
            key = session_key(record.agent, record.session_id)
            try:
                lease.revision = await self.kv.update(
                    key, record.model_dump_json().encode(), revision=lease.revision
                )
            except RevisionMismatchError as exc:
                raise SessionLostError(
                    f"session {record.session_id} of {record.agent} was taken over",
                    agent=record.agent,
                    session_id=record.session_id,
                ) from exc
            lease.record = record

    async def renew(self, lease: Lease) -> None:
        """Extend the lease.

        Raises:
            SessionLostError: the session was taken over.
        """
        await self.save(lease)

    async def records(self, agent: str | None = None) -> list[SessionRecord]:
        """Every session (of one agent), most recently updated first.

        Raises:
            StoreError: the bucket failed.
        """
        records = []
        for key in await self.kv.keys():
            if agent is not None and not key.startswith(f"{agent}."):
                continue
            try:
                entry = await self.kv.get(key)
            except KeyNotFoundError:
                continue  # deleted meanwhile
            try:
                records.append(SessionRecord.model_validate_json(entry.value))
            except ValueError as exc:
                logger.warning("session %s is unreadable: %s", key, exc)
        return sorted(records, key=lambda r: r.updated_at, reverse=True)

    async def stale(self, agent: str) -> list[SessionRecord]:
        """Sessions of ``agent`` left running by a replica whose lease expired."""
        now = time.time()
        return [r for r in await self.records(agent) if r.status == "running" and not r.leased(now)]

    async def delete(self, agent: str, session_id: str) -> None:
        """Forget a session.

        Raises:
            StoreError: the bucket failed.
        """
        await self.kv.delete(session_key(agent, session_id))
