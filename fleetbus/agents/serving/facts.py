"""What a session's journal holds: the facts, and the record they fold into.

A fact carries only what it adds: the messages appended to memory since the
last fact (``add``, placed from index ``m``, so a fact appended twice repeats
nothing) and a merge patch of the rest of the state (``set``), with what the
fact is about (the owner that took the session, the status, the request
being served, the final answer). A snapshot carries the whole session. Every
fact names its writer: the owner's epoch (``e``) and its number among that
owner's facts (``n``). :func:`fold` applies a fact read from the journal to
a :class:`Lease`, which holds the record (:class:`SessionRecord`) and what
of it is written.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal

import msgspec
import orjson
from pydantic import BaseModel, Field

from fleetbus.agents.messages import Msg, stored_json, stored_messages
from fleetbus.agents.state import AgentState, MemoryIndex
from fleetbus.bus.journal import JournalEntry
from fleetbus.errors import StoreError
from fleetbus.protocol import utc_now

__all__ = [
    "Lease",
    "SessionFact",
    "SessionRecord",
    "SessionStatus",
    "read_fact",
    "session_key",
]

SessionStatus = Literal["idle", "running", "paused", "done", "error"]


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
    writer: int = 0
    """The epoch named by the journal's last fact (its writer's)."""
    untaken: dict[str, Any] | None = None
    """The ``taken`` fact of a clean take, not written: the first fact this
    owner appends carries it (its request is in the lease until then)."""
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
    encoded: list[bytes] = field(default_factory=list)
    """The JSON of each written message, as written (all of memory's, or
    none when not known): a snapshot writes them again without encoding them
    again."""
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


def updated(record: SessionRecord, update: Mapping[str, Any]) -> SessionRecord:
    """``record.model_copy(update=update)`` (no field validated, as there),
    without its generic path: a served reply copies its record a few times."""
    copy = object.__new__(SessionRecord)
    fields = dict(record.__dict__)
    fields.update(update)
    object.__setattr__(copy, "__dict__", fields)
    object.__setattr__(
        copy, "__pydantic_fields_set__", record.__pydantic_fields_set__ | update.keys()
    )
    object.__setattr__(copy, "__pydantic_extra__", None)
    object.__setattr__(copy, "__pydantic_private__", None)
    return copy


def session_key(agent: str, session_id: str) -> str:
    """The key of a session (its journal and its lease)."""
    return f"{agent}.{session_id}"


class Fact(msgspec.Struct):
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


_FACT_JSON = msgspec.json.Decoder(Fact)


def decode_fact(data: bytes) -> Fact:
    try:
        return _FACT_JSON.decode(data)
    except msgspec.DecodeError as exc:
        raise StoreError(f"a session fact is unreadable: {exc}") from None


def add_state(
    lease: Lease, fact: dict[str, Any], state: AgentState, fields: dict[str, Any]
) -> list[bytes] | None:
    """Put into ``fact`` what ``state`` (``fields``: all of it but memory)
    adds to what is written: the messages appended to memory (``add`` from
    index ``m``) and a patch of the rest (``set``); the JSON of memory's
    messages once the fact is written (``[]``: not known). ``None`` when
    memory was rewritten: the fact must be a snapshot."""
    memory = state.memory
    n = lease.persisted
    if n and not (
        len(memory) >= n and memory_ends(memory[:1] + memory[n - 1 : n]) == lease.persisted_ends
    ):
        return None
    new = [stored_json(m) for m in memory[n:]]
    if new:
        fact["m"] = n
        fact["add"] = json_array(new)
    patch = _patch(lease.written, fields)
    if patch:
        fact["set"] = patch
    return [*lease.encoded, *new] if len(lease.encoded) == n else []


def json_array(encoded: list[bytes]) -> orjson.Fragment:
    """JSON values, encoded already, as one JSON array (not encoded again)."""
    return orjson.Fragment(b"[" + b",".join(encoded) + b"]")


def snapshot_fact(
    record: SessionRecord,
    state: AgentState,
    fields: dict[str, Any] | None = None,
    encoded: list[bytes] | None = None,
    meta: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """A snapshot fact: the whole session (``encoded``: the JSON of memory's
    messages, when known). Its record's fields are ``record``'s as ``meta``
    (what the fact changes of them: :func:`fact_meta`) changes them, read
    without a copy of the record made."""
    if encoded is None or len(encoded) != len(state.memory):
        encoded = [stored_json(m) for m in state.memory]
    meta = meta or {}
    return {
        "k": "snapshot",
        "owner": meta.get("owner", record.owner),
        "status": meta.get("status", record.status),
        "to": meta.get("reply_to", record.reply_to),
        "input": meta.get("pending_input", record.pending_input),
        "final": meta.get("final", record.final),
        "created": meta.get("created_at", record.created_at).isoformat(),
        "m": 0,
        "add": json_array(encoded),
        "set": fields if fields is not None else state.model_dump(mode="json", exclude={"memory"}),
    }


def fact_meta(fact: dict[str, Any]) -> dict[str, Any]:
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


def fold_facts(lease: Lease, facts: Sequence[tuple[JournalEntry, Fact, int]]) -> None:
    """Apply ``facts``, read from the journal in order, to ``lease``: the
    record's fields and the state's patches merged as plain data, memory
    spliced, and the state validated once at the end (a fact at a time, a
    long journal cost a validation each)."""
    if not facts:
        return
    record = lease.record
    state = record.state
    memory = state.memory
    fields: dict[str, Any] | None = None  # (the state's, once a fact changes them)
    update: dict[str, Any] = {}
    encoded: list[bytes] | None = list(lease.encoded) if len(lease.encoded) == len(memory) else None
    for entry, fact, size in facts:
        snapshot = fact.k == "snapshot"
        update.update(
            fact_meta({m: v for m in _META if (v := getattr(fact, m)) is not msgspec.UNSET})
        )
        update["seq"] = entry.seq
        if entry.time is not None:
            update["updated_at"] = entry.time
        if fact.add is not msgspec.UNSET or snapshot:
            try:
                added = stored_messages(fact.add) if fact.add is not msgspec.UNSET else []
            except ValueError as exc:
                raise StoreError(f"session {lease.key} holds unreadable memory: {exc}") from None
            start = 0 if snapshot else max(0, min(fact.m, len(memory)))
            memory = [*memory[:start], *added]
            if encoded is not None:
                parts = _RAW_LIST.decode(fact.add) if fact.add is not msgspec.UNSET else []
                encoded = [*encoded[:start], *(bytes(p) for p in parts)]
        if snapshot:
            fields = dict(fact.set) if isinstance(fact.set, dict) else {}
        elif isinstance(fact.set, dict):
            if fields is None:
                fields = lease.written or state.model_dump(mode="json", exclude={"memory"})
            fields = _merged(fields, fact.set)
        lease.seq, lease.writer = entry.seq, fact.e
        if fact.e == lease.epoch and fact.n > lease.writes:
            lease.writes = fact.n
        if snapshot:
            lease.blobs = [fact.ref] if isinstance(fact.ref, str) else []
            lease.since_snapshot, lease.snapshot_bytes = 0, size
        else:
            if isinstance(fact.ref, str):
                lease.blobs.append(fact.ref)
            lease.since_snapshot += size
    if fields is not None or memory is not state.memory:
        if fields is None:
            fields = dict(lease.written) or state.model_dump(mode="json", exclude={"memory"})
        fields.setdefault("agent_name", record.agent)
        index = state.__dict__.get("_memory_index")
        state = AgentState.model_validate({**fields, "memory": []})
        state.memory = memory
        if isinstance(index, MemoryIndex):
            state.__dict__["_memory_index"] = index
        # Dumped afresh, not the fields it was validated from: those share
        # nested values with the state (a dict under ``Any``), and a change
        # made in place would then patch as no change.
        lease.written = state.model_dump(mode="json", exclude={"memory"})
    update["state"] = state
    update["messages"] = len(state.memory)
    lease.record = updated(record, update)
    lease.persisted, lease.persisted_ends = len(state.memory), memory_ends(state.memory)
    lease.encoded = encoded if encoded is not None and len(encoded) == len(memory) else []


_RAW_LIST = msgspec.json.Decoder(list[msgspec.Raw])


_OPTIONAL = frozenset({"output_schema", "metadata", "receipt", "structured", "sources"})
"""Fields of the protocol's messages that a fact leaves out when empty: the
message decodes the same without them (they default to empty)."""


def compact(message: dict[str, Any] | None) -> dict[str, Any] | None:
    """A protocol message (JSON) as a fact keeps it: its empty optional
    fields left out."""
    if message is None:
        return None
    return {k: v for k, v in message.items() if k not in _OPTIONAL or v}


def read_fact(data: bytes) -> SessionFact:
    """A fact as its journal message holds it (a fact stored by reference
    lists only its kind), for a client that follows journals as they are
    written (``fleetbus watch``).

    Raises:
        StoreError: the message is no fact.
    """
    return list_fact(decode_fact(data), 0, 0, None)


def list_fact(fact: Fact, n: int, seq: int, when: datetime | None) -> SessionFact:
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


def _kind(fact: Fact, added: list[dict[str, Any]]) -> str:
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


def serving_request(record: SessionRecord) -> dict[str, Any] | None:
    """What a take-over's lease says of the request it serves: its reply
    subject and ``call_id``, so that a copy of it sent again is known."""
    pending = record.pending_input or {}
    reply = record.state.reply
    call_id = pending.get("call_id") or (reply.request_id if reply is not None else None)
    if not record.reply_to or not isinstance(call_id, str):
        return None
    return {"reply_to": record.reply_to, "call_id": call_id}


def recorded(serving: dict[str, Any] | None) -> dict[str, Any] | None:
    """What a lease says of the request it serves once the journal holds
    it: its reply subject and ``call_id`` (``None``: it has no ``call_id``,
    so no copy of it is to be known)."""
    if serving is None or not isinstance(serving.get("call_id"), str):
        return None
    return {"reply_to": serving.get("reply_to"), "call_id": serving["call_id"]}


def memory_ends(memory: list[Msg]) -> tuple[str, str] | None:
    return (memory[0].msg_id, memory[-1].msg_id) if memory else None


def copy_state(state: AgentState) -> AgentState:
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


def copy_lease(lease: Lease) -> Lease:
    """A copy of ``lease``'s fold, holding a copy of its state."""
    record = lease.record.model_copy(update={"state": copy_state(lease.record.state)})
    return Lease(
        record,
        lease.seq,
        writer=lease.writer,
        persisted=lease.persisted,
        persisted_ends=lease.persisted_ends,
        written=lease.written,
        since_snapshot=lease.since_snapshot,
        snapshot_bytes=lease.snapshot_bytes,
        blobs=list(lease.blobs),
        encoded=list(lease.encoded),
    )
