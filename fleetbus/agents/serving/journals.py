"""Sessions as journals: one append-only record per session.

Every session is a subject of the stream ``<prefix>_session`` —
``<prefix>.session.<agent>.<session_id>`` — to which each fact of its
replies is appended once (:mod:`.facts`); the session is the fold of its
journal. Every append names the sequence it expects last on its subject
(``Nats-Expected-Last-Subject-Sequence``): a replica that lost its session
cannot write after the one that took it, and the fence needs no write of its
own. When memory is rewritten (a compression), or the facts since the last
snapshot outgrow it, a snapshot of the whole session is appended with a
rollup, which removes the facts before it: a journal stays within five times
its session. A fact larger than the server's ``max_payload`` is stored in the
object store ``<prefix>_session_blobs`` and referenced.

:class:`SessionJournals` reads, forks and writes journals;
:class:`~fleetbus.agents.serving.sessions.SessionStore` adds the leases that
say who runs a session.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import msgspec
import orjson

from fleetbus.agents.messages import stored_json
from fleetbus.agents.serving.facts import (
    Fact,
    Lease,
    SessionFact,
    SessionRecord,
    SessionStatus,
    add_state,
    copy_lease,
    decode_fact,
    fact_meta,
    fold_facts,
    list_fact,
    memory_ends,
    recorded,
    session_key,
    snapshot_fact,
    updated,
)
from fleetbus.agents.state import AgentState
from fleetbus.bus import Bus, ObjectStore, check_name, object_store
from fleetbus.bus.journal import Journal, JournalEntry, journal
from fleetbus.bus.store import STORE_WAIT, transient
from fleetbus.errors import (
    KeyNotFoundError,
    RevisionMismatchError,
    SessionBusyError,
    SessionLost,
    SessionNotFoundError,
    StoreError,
)
from fleetbus.protocol import new_id, utc_now

__all__ = ["SNAPSHOT_BYTES", "SNAPSHOT_MULTIPLE", "SessionJournals"]

logger = logging.getLogger(__name__)

JOURNAL_NAME = "session"
_BLOBS = "session_blobs"
SNAPSHOT_BYTES = 16 * 1024
"""Facts since the last snapshot may take this many bytes, or
:data:`SNAPSHOT_MULTIPLE` times the snapshot, before a new snapshot rolls
them up."""
SNAPSHOT_MULTIPLE = 4
"""A snapshot costs what the session weighs: written once the facts since
the last one weigh this many times as much, it adds at most a quarter to what
the replies write, and a journal holds at most five times its session."""
_HEADROOM = 16 * 1024
"""Bytes kept free below ``max_payload`` for headers and framing."""
_READS_AT_ONCE = 64
"""Sessions a listing reads at once (:meth:`SessionJournals.records`): read
one after the other, 101,000 sessions took 36 s."""


class SessionJournals:
    """The session journals of a fleet: read, listed, forked, appended to.

    Args:
        bus: the connection.
        journal: the sessions' journal stream.
    """

    def __init__(self, bus: Bus, journal: Journal) -> None:
        self.bus = bus
        self.journal = journal
        self._cache: OrderedDict[str, tuple[Lease, int | None]] = OrderedDict()
        """Folds of sessions released here, with the lease marker left (see SessionStore)."""
        self._blobs: ObjectStore | None = None
        self._inline_limit = max(4096, bus.max_payload - _HEADROOM)
        self._snapshots_last = False
        """The last journal read whole was one snapshot (see :meth:`_whole`)."""

    @classmethod
    async def open_journals(cls, bus: Bus) -> SessionJournals:
        """The fleet's session journals, to read (created on first use).

        Raises:
            StoreError: JetStream is off or the stream cannot be opened.
        """
        return cls(bus, await journal(bus, JOURNAL_NAME))

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

    async def _facts(self, key: str, after: int = 0) -> list[tuple[JournalEntry, Fact, int]]:
        """The facts of journal ``key`` after ``after``: each with its entry
        and its size as written (a fact stored by reference is read back)."""
        facts = []
        for entry in await self.journal.read(key, after=after):
            facts.append((entry, *await self._resolved(entry.data)))
        return facts

    async def _whole(self, key: str) -> list[tuple[JournalEntry, Fact, int]]:
        """The facts of journal ``key``. While the journals read last were
        each one snapshot (a population's small sessions, each reply ending
        as one), its last message is read first: a snapshot is the whole
        journal, read in one message with no end of batch to follow."""
        if self._snapshots_last:
            last = await self.journal.last(key)
            if last is None:
                return []
            fact, size = await self._resolved(last.data)
            if fact.k == "snapshot":
                return [(last, fact, size)]
        facts = await self._facts(key)
        self._snapshots_last = len(facts) == 1 and facts[0][1].k == "snapshot"
        return facts

    async def _resolved(self, data: bytes) -> tuple[Fact, int]:
        """The fact ``data`` holds, or the one it references (stored in the
        object store), with its size as written."""
        fact = decode_fact(data)
        if fact.ref is msgspec.UNSET:
            return fact, len(data)
        try:
            whole = await (await self._blob_store()).get(fact.ref)
        except KeyNotFoundError:
            raise StoreError(f"session fact {fact.ref} is missing") from None
        resolved = decode_fact(whole)
        resolved.ref = fact.ref
        return resolved, len(whole)

    async def _load(self, key: str, base: Lease | None = None) -> Lease | None:
        """The session as its journal folds (``None``: no journal), caught
        up from ``base`` (a fold of the same journal up to ``base.seq``)
        when it still holds that fact."""
        if base is not None:
            facts = await self._facts(key, after=base.seq - 1)
            if facts and facts[0][0].seq == base.seq:
                lease = copy_lease(base)
                fold_facts(lease, facts[1:])
                return lease
        facts = await self._whole(key)
        if not facts:
            return None
        agent, _, session_id = key.partition(".")
        record = SessionRecord(
            agent=agent, session_id=session_id, state=AgentState(agent_name=agent)
        )
        lease = Lease(record, 0)
        fold_facts(lease, facts)
        if not lease.written:
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

    async def records(
        self,
        agent: str | None = None,
        *,
        where: Callable[[str, str], bool] | None = None,
    ) -> list[SessionRecord]:
        """Every session (of one agent; for which ``where(agent, session_id)``
        holds, when given), most recently updated first.

        One listing that creates no consumer on the server, then one read
        per session, :data:`_READS_AT_ONCE` at a time. For people and tools,
        not for loops. A session that cannot be read is left out (with a
        warning), unless the failure may pass (``StoreError.transient``):
        then it is raised, so that the caller can wait for the store rather
        than list less.

        Raises:
            StoreError: the stream failed.
        """
        keys = [
            key
            for key in await self.journal.keys(f"{agent}.*" if agent is not None else ">")
            if where is None or where(*key.split(".", 1))
        ]

        async def read(key: str) -> SessionRecord | None:
            try:
                lease = await self._load(key)
            except (ValueError, StoreError) as exc:
                if transient(exc):
                    raise
                logger.warning("session %s is unreadable: %s", key, exc)
                return None
            return lease.record if lease is not None else None

        records: list[SessionRecord] = []
        for start in range(0, len(keys), _READS_AT_ONCE):
            chunk = keys[start : start + _READS_AT_ONCE]
            try:
                async with asyncio.TaskGroup() as group:
                    reads = [group.create_task(read(key)) for key in chunk]
            except* Exception as failed:  # the first failure, as it would come one read at a time
                raise failed.exceptions[0] from None
            records.extend(r for task in reads if (r := task.result()) is not None)
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
            list_fact(fact, n, entry.seq, entry.time) for n, (entry, fact, _) in enumerate(facts, 1)
        ]

    async def follow(self, agent: str, session_id: str) -> AsyncIterator[SessionFact]:
        """The facts of a session's journal: those it holds, then each one as
        it is appended, until the caller stops iterating (catch up, then
        follow: a client that joins late sees the same facts in the same
        order as one that was there). A fact appended as the catch-up reads
        comes once. Live facts have no sequence (``seq`` 0).

        Raises:
            StoreError: the read failed.
        """
        key = session_key(agent, session_id)
        arrived: asyncio.Queue[bytes] = asyncio.Queue()

        async def heard(msg: Any) -> None:
            arrived.put_nowait(msg.data)

        sub = await self.bus.listen(self.journal.subject(key), callback=heard)
        try:
            await self.bus.flush(STORE_WAIT)  # following before the catch-up is read
            seen: set[tuple[int, int]] = set()
            n = 0
            for n, (entry, fact, _) in enumerate(await self._facts(key), 1):
                seen.add((fact.e, fact.n))
                yield list_fact(fact, n, entry.seq, entry.time)
            while True:
                fact, _ = await self._resolved(await arrived.get())
                if (fact.e, fact.n) in seen:
                    continue
                seen.add((fact.e, fact.n))
                n += 1
                yield list_fact(fact, n, 0, utc_now())
        finally:
            await sub.unsubscribe()

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
        fold_facts(lease, facts[:at])
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

    async def _append(
        self,
        lease: Lease,
        fact: dict[str, Any],
        state: AgentState | None = None,
        *,
        taking: bool = False,
        rollup: bool = False,
        small_rollup: bool = False,
    ) -> None:
        """Append ``fact`` with what ``state`` adds to what is written (a
        snapshot instead when memory was rewritten, or when the facts since
        the last snapshot outgrew it; with ``small_rollup``, also whenever
        the whole journal is still under :data:`SNAPSHOT_BYTES`), then hold
        it in ``lease``.

        Raises:
            RevisionMismatchError: (``taking``) the journal's end is another.
            SessionLost: the journal's end is another owner's.
        """
        if lease.untaken is not None:  # a clean take: written with the first fact
            # What the fact itself settles is not written twice: an owner
            # only while it runs, the request once memory holds it, where
            # to answer once the reply is over.
            settled = {
                "owner": fact.get("status", "running") != "running",
                "input": bool(fact.get("rec") or fact.get("clear")),
                "to": bool(fact.get("clear")),
            }
            taken = {k: v for k, v in lease.untaken.items() if not settled.get(k)}
            fact = {**taken, **fact}
        encoded: list[bytes] | None
        if state is None and lease.written:  # the state as written: nothing to add
            state = lease.record.state
            fields = lease.written
            encoded = lease.encoded if len(lease.encoded) == lease.persisted else []
        else:
            state = state if state is not None else lease.record.state
            fields = state.model_dump(mode="json", exclude={"memory"})
            encoded = add_state(lease, fact, state, fields)
        base, meta = lease.record, fact_meta(fact)
        rollup = rollup or encoded is None
        # Numbered before it is sent: an append that lands after its writer
        # stopped waiting is never mistaken for a later one.
        n = lease.writes = lease.writes + 1
        data = b""
        if (
            not rollup
            and small_rollup
            and lease.snapshot_bytes + lease.since_snapshot < SNAPSHOT_BYTES
        ):
            # While the whole journal is small, each write rolls it up: the
            # snapshot is made first, and written unless it is too large now.
            encoded = _all_encoded(encoded, state)
            whole = snapshot_fact(base, state, fields, encoded, meta)
            small = orjson.dumps({**whole, "e": lease.epoch, "n": n})
            if len(small) <= SNAPSHOT_BYTES:
                fact, data, rollup = whole, small, True
        if not data:
            if not rollup:
                data = orjson.dumps({**fact, "e": lease.epoch, "n": n})
                weight = lease.since_snapshot + len(data)
                rollup = weight > max(SNAPSHOT_BYTES, SNAPSHOT_MULTIPLE * lease.snapshot_bytes)
            if rollup:
                encoded = _all_encoded(encoded, state)
                fact = snapshot_fact(base, state, fields, encoded, meta)
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
        lease.record = updated(
            base,
            {
                **meta,
                "state": state,
                "seq": seq,
                "updated_at": utc_now(),
                "messages": len(state.memory),
            },
        )
        lease.seq, lease.writer = seq, lease.epoch
        if lease.untaken is not None:
            lease.untaken = None
            lease.serving = recorded(lease.serving)  # the journal holds the request now
        lease.persisted, lease.persisted_ends = len(state.memory), memory_ends(state.memory)
        lease.encoded = encoded if encoded and len(encoded) == len(state.memory) else []
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
                end = decode_fact(last.data) if last is not None else None
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

    async def delete(self, agent: str, session_id: str) -> None:
        """Forget a session: its journal and the objects it references.

        Raises:
            StoreError: the stream failed.
        """
        key = session_key(agent, session_id)
        facts = await self._facts(key)
        await self.journal.purge(key)
        await self._drop_blobs([f.ref for _, f, _ in facts if isinstance(f.ref, str)])


def _all_encoded(encoded: list[bytes] | None, state: AgentState) -> list[bytes]:
    """The JSON of each message of memory (``encoded`` when it has them all)."""
    if encoded is None or len(encoded) != len(state.memory):
        return [stored_json(m) for m in state.memory]
    return encoded
