"""Sessions of the layout before journals, carried into the journal.

That layout kept a session's *head* in the KV bucket ``<prefix>_sessions`` (key
``<agent>.<session_id>``): its status, final answer and request, the state
without memory, the newest messages (``tail``) and the ranges ``[epoch, first,
last]`` of its memory chunks (``"format": 2``); a head older than chunks is the
whole session record. Chunks (JSON arrays of older messages) were in
``<prefix>_session_chunks``, key ``<agent>.<session_id>.<epoch>.<n>``. A head
or chunk over ``max_payload`` went to the object store
``<prefix>_session_blobs``, referenced as ``{"$blob": name}``.

:func:`migrate` writes each session into its journal as one snapshot, unless
the journal has facts already (the journal wins; so a second run carries
nothing twice), and with ``drop`` removes the old buckets and the objects
they referenced (the object store is the journal's too).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import orjson

from fleetbus.agents.messages import stored_messages
from fleetbus.agents.serving.sessions import SessionRecord, SessionStore
from fleetbus.agents.state import AgentState
from fleetbus.bus import Bus, KeyValueStore, ObjectStore, key_value, object_store
from fleetbus.bus.store import delete_key_value, transient
from fleetbus.errors import KeyNotFoundError, StoreError

__all__ = ["Migration", "migrate"]

logger = logging.getLogger(__name__)

_HEADS = "sessions"
_CHUNKS = "session_chunks"
_BLOBS = "session_blobs"
_BLOB_REF = b'{"$blob":'


@dataclass
class Migration:
    """What :func:`migrate` did, by session key (``<agent>.<session_id>``)."""

    carried: list[str] = field(default_factory=list)
    """Sessions written into their journal."""
    kept: list[str] = field(default_factory=list)
    """Sessions whose journal had facts already: left as the journal says."""
    failed: dict[str, str] = field(default_factory=dict)
    """Sessions that could not be read, with why (then nothing is dropped)."""
    dropped: list[str] = field(default_factory=list)
    """The buckets removed (``drop``)."""


async def migrate(bus: Bus, store: SessionStore, *, drop: bool = False) -> Migration:
    """Carry the sessions of the layout before journals into ``store``.

    Args:
        bus: the connection.
        store: the sessions' journal.
        drop: then remove the old buckets and the objects they referenced
            (not when a session could not be read).

    Raises:
        StoreError: a bucket or the stream failed (running it again is safe).
    """
    done = Migration()
    heads = await _bucket(bus, _HEADS)
    if heads is None:  # never made: nothing to carry
        return done
    old = _Old(bus, heads, await _bucket(bus, _CHUNKS))
    for key in await heads.subjects():
        try:
            record = await old.record(key)
        except (KeyError, TypeError, ValueError, StoreError) as exc:
            if transient(exc):
                raise
            logger.warning("session %s of the old layout is unreadable: %s", key, exc)
            done.failed[key] = str(exc) if isinstance(exc, ValueError | StoreError) else repr(exc)
            continue
        if record is None:  # deleted
            continue
        if await store.import_record(record):
            logger.info("session %s carried into its journal", key)
            done.carried.append(key)
        else:
            done.kept.append(key)
    if drop and not done.failed:
        done.dropped = await old.drop()
    return done


async def _bucket(bus: Bus, name: str) -> KeyValueStore | None:
    """KV bucket ``name``, or ``None`` when it does not exist."""
    try:
        return await key_value(bus, name, create=False)
    except StoreError as exc:
        if transient(exc):
            raise
        return None


class _Old:
    """The old layout's buckets."""

    def __init__(self, bus: Bus, heads: KeyValueStore, chunks: KeyValueStore | None) -> None:
        self.bus = bus
        self.heads = heads
        self.chunks = chunks
        self._blobs: ObjectStore | None = None

    async def _objects(self) -> ObjectStore:
        if self._blobs is None:
            self._blobs = await object_store(self.bus, _BLOBS, create=False)
        return self._blobs

    async def _unpack(self, value: bytes) -> bytes:
        name = _blob_name(value)
        if name is None:
            return value
        try:
            return await (await self._objects()).get(name)
        except KeyNotFoundError:
            raise StoreError(f"object {name} is missing from {_BLOBS}") from None

    async def _chunk(self, key: str) -> bytes:
        entry = await self.chunks.get_or_none(key) if self.chunks is not None else None
        if entry is None:
            raise StoreError(f"memory chunk {key} is missing")
        return await self._unpack(entry.value)

    async def record(self, key: str) -> SessionRecord | None:
        """The session under ``key`` (``None``: deleted).

        Raises:
            KeyError, TypeError, ValueError: it is unreadable.
            StoreError: a bucket failed, or a part of the session is missing.
        """
        entry = await self.heads.get_or_none(key)
        if entry is None or not entry.value:
            return None
        head: Any = orjson.loads(await self._unpack(entry.value))
        if not isinstance(head, dict):
            raise ValueError("the head is not a JSON object")
        agent, _, session_id = key.partition(".")
        if "format" not in head:  # stored whole, before chunks existed
            return SessionRecord.model_validate({**head, "agent": agent, "session_id": session_id})
        memory = []
        for epoch, first, last in head.get("chunks") or []:
            for n in range(first, last + 1):
                memory += stored_messages(await self._chunk(f"{key}.{epoch}.{n}"))
        memory += stored_messages(head.get("tail") or [])
        return SessionRecord.model_validate(
            {
                # (its "seq" counted the old owner's writes, not the journal's)
                **{k: v for k, v in head.items() if k in SessionRecord.model_fields and k != "seq"},
                "agent": agent,
                "session_id": session_id,
                "state": AgentState.model_validate({**head["state"], "memory": memory}),
                "messages": len(memory),
            }
        )

    async def drop(self) -> list[str]:
        """Remove the buckets, then the objects their values referenced; the
        buckets removed."""
        buckets = [b for b in (self.heads, self.chunks) if b is not None]
        names = []
        for bucket in buckets:
            for key in await bucket.subjects():
                entry = await bucket.get_or_none(key)
                if entry is not None and (name := _blob_name(entry.value)) is not None:
                    names.append(name)
        for bucket in buckets:
            await delete_key_value(self.bus, bucket.bucket)
        for name in names:
            try:
                await (await self._objects()).delete(name)
            except KeyNotFoundError:
                pass
        return [b.bucket for b in buckets]


def _blob_name(value: bytes) -> str | None:
    """The object a value stands for (``{"$blob": name}``), or ``None``."""
    return str(orjson.loads(value)["$blob"]) if value.startswith(_BLOB_REF) else None
