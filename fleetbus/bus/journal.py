"""Append-only journals in one JetStream stream: a subject per journal.

Each journal (a session's, say) is the sequence of messages stored on one
subject. An append names the sequence it expects last on that subject
(``Nats-Expected-Last-Subject-Sequence``): only a writer that has seen the
journal's end can add to it, which makes the append a compare-and-set, a
fence, with no write of its own. An append with a rollup
(``Nats-Rollup: sub``) replaces every earlier message of the subject, which
keeps a journal bounded by a snapshot of what it stood for. A journal is read
in one request (a batched direct get); a client follows one as it is written
with a plain subscription to its subject (the appends are messages like any).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import UTC, datetime

import nats.errors
import nats.js.errors
import orjson
from nats.js.api import StorageType, StreamConfig

from fleetbus.bus._replicas import ensure_replicas, placement_error, wanted_replicas
from fleetbus.bus._seam import Received
from fleetbus.bus._stream_config import require
from fleetbus.bus.connection import Bus
from fleetbus.bus.store import ADMIN_TIMEOUT, _store_error, stored_sequence, stream_subjects
from fleetbus.errors import StoreError

__all__ = ["Journal", "JournalEntry", "journal"]

logger = logging.getLogger(__name__)

_EXPECTED_LAST = "Nats-Expected-Last-Subject-Sequence"
_ROLLUP = {"Nats-Rollup": "sub"}
_BATCH = 256
"""Messages one direct get returns at most (a journal is read in pieces of this)."""


@dataclass(frozen=True, slots=True)
class JournalEntry:
    """One message of a journal."""

    seq: int
    """Its sequence in the stream (what the next append expects last)."""
    data: bytes
    time: datetime | None = None
    """When the server stored it."""


async def journal(bus: Bus, name: str, *, replicas: int | None = None) -> Journal:
    """The fleet's journal stream ``name`` (``<prefix>_<name>``, subjects
    ``<prefix>.<name>.>``), created if missing.

    Raises:
        ConfigError: ``replicas`` is not between 1 and 5.
        StoreError: JetStream is off, or the stream cannot be opened or made.
    """
    stream = bus.subjects.kv_bucket(name)
    subjects = f"{bus.prefix}.{name}.>"
    what = f"journal stream {stream}"
    wanted = wanted_replicas(bus, replicas)
    admin = bus.nc.jetstream(timeout=ADMIN_TIMEOUT)
    try:
        try:
            await admin.stream_info(stream)
        except nats.js.errors.NotFoundError:
            made = await admin.add_stream(
                StreamConfig(
                    name=stream,
                    subjects=[subjects],
                    storage=StorageType.FILE,
                    num_replicas=wanted,
                    allow_direct=True,
                    allow_rollup_hdrs=True,
                    duplicate_window=0,
                )
            )
            # Reads are direct gets, and a rollup keeps a journal bounded.
            needed = {"num_replicas": wanted, "allow_direct": True, "allow_rollup_hdrs": True}
            require(made.config, needed, what=what, server=bus.server_version)
        else:
            await ensure_replicas(admin, stream, wanted, what=what)
    except StoreError:
        raise
    except (nats.errors.Error, TimeoutError) as exc:
        error = placement_error(exc, what=what, wanted=wanted, bus=bus)
        raise error or _store_error(exc, f"opening {what}") from exc
    return Journal(bus, stream, f"{bus.prefix}.{name}.")


class Journal:
    """Journals on the subjects ``<stem><key>`` of stream ``stream``.

    Args:
        bus: the connection.
        stream: the stream's name.
        stem: the subjects' common start (keys follow it).
    """

    def __init__(self, bus: Bus, stream: str, stem: str, *, timeout: float = 5.0) -> None:
        self.bus = bus
        self.stream = stream
        self.stem = stem
        self.timeout = timeout
        self._direct = f"$JS.API.DIRECT.GET.{stream}"

    def subject(self, key: str) -> str:
        """The subject of journal ``key``."""
        return self.stem + key

    async def append(self, key: str, data: bytes, *, expected: int, rollup: bool = False) -> int:
        """Add ``data`` to journal ``key`` if its last message is ``expected``
        (0: the journal is empty); the new message's sequence.

        With ``rollup``, every earlier message of the journal is removed once
        this one is stored.

        Raises:
            RevisionMismatchError: the journal's last message is another.
            StoreError: the append failed (it may still have been stored).
        """
        headers = {_EXPECTED_LAST: str(expected), **(_ROLLUP if rollup else {})}
        what = f"append to {key!r}"
        try:
            msg = await self.bus._replies.request(self.subject(key), data, self.timeout, headers)
        except (nats.errors.Error, TimeoutError) as exc:
            raise _store_error(exc, what) from exc
        mismatch = f"journal {key!r} no longer ends at {expected}"
        return stored_sequence(msg.data, what, key=key, expected=expected, mismatch=mismatch)

    async def read(self, key: str, *, after: int = 0) -> list[JournalEntry]:
        """The messages of journal ``key`` after sequence ``after``, in order.

        Raises:
            StoreError: the read failed.
        """
        entries: list[JournalEntry] = []
        start = after + 1
        while True:
            batch, more = await self._batch(key, start)
            entries += batch
            if not more or not batch:
                return entries
            start = batch[-1].seq + 1

    async def _batch(self, key: str, start: int) -> tuple[list[JournalEntry], bool]:
        """One direct get of up to :data:`_BATCH` messages: each comes to the
        request's reply subject, then a status (204 ``EOB``, with what is
        left; 404 when there is nothing) ends it."""
        what = f"read {key!r}"
        query = orjson.dumps({"seq": start, "next_by_subj": self.subject(key), "batch": _BATCH})
        entries: list[JournalEntry] = []

        def take(msg: Received) -> bool:
            headers = msg.headers or {}
            if "Status" in headers:
                return False  # the end of the batch: the request's answer
            stamp = headers.get("Nats-Time-Stamp")
            seq = headers.get("Nats-Sequence", "")
            entries.append(
                JournalEntry(
                    int(seq) if seq.isdigit() else 0,
                    msg.data,
                    _parse_time(stamp) if stamp else None,
                )
            )
            return True

        try:
            end = await self.bus._replies.request(
                self._direct, query, self.timeout, None, stream=take
            )
        except (nats.errors.Error, TimeoutError) as exc:
            raise _store_error(exc, what) from exc
        headers = end.headers or {}
        status = headers.get("Status")
        if status == "404":
            return entries, False
        if status != "204":
            raise _status_error(what, str(status))
        return entries, int(headers.get("Nats-Num-Pending") or 0) > 0

    async def last(self, key: str) -> JournalEntry | None:
        """The last message of journal ``key``, or ``None`` when it is empty.

        Raises:
            StoreError: the read failed.
        """
        what = f"read the end of {key!r}"
        try:
            msg = await self.bus._replies.request(
                f"{self._direct}.{self.subject(key)}", b"", self.timeout, None
            )
        except (nats.errors.Error, TimeoutError) as exc:
            raise _store_error(exc, what) from exc
        headers = msg.headers or {}
        status = headers.get("Status")
        if status == "404":
            return None
        if status is not None:
            raise _status_error(what, status)
        stamp = headers.get("Nats-Time-Stamp")
        return JournalEntry(
            int(headers.get("Nats-Sequence") or 0), msg.data, _parse_time(stamp) if stamp else None
        )

    async def keys(self, pattern: str = ">") -> dict[str, int]:
        """The journals matching ``pattern`` with how many messages each
        holds: stream-info requests (a page of up to 100,000 journals each),
        no consumer.

        Raises:
            StoreError: the listing failed.
        """
        subjects = await stream_subjects(
            self.bus.nc,
            self.stream,
            self.subject(pattern),
            timeout=self.timeout,
            what="list journals",
        )
        n = len(self.stem)
        return {s[n:]: count for s, count in sorted(subjects.items())}

    async def purge(self, key: str) -> None:
        """Remove journal ``key`` whole.

        Raises:
            StoreError: the purge failed.
        """
        js = self.bus.nc.jetstream(timeout=self.timeout)
        try:
            await js.purge_stream(self.stream, subject=self.subject(key))
        except (nats.errors.Error, TimeoutError) as exc:
            raise _store_error(exc, f"purge {key!r}") from exc


def _status_error(what: str, status: str) -> StoreError:
    """A direct get answered with a status: 503 (no responders, the stream
    electing a leader) and 408 (a timeout) may pass."""
    return StoreError(f"{what}: the server answered {status}", transient=status in ("503", "408"))


def _parse_time(stamp: str) -> datetime | None:
    """A server time stamp (RFC 3339 with nanoseconds, in UTC) as a datetime,
    to the microsecond (Python 3.11's ``fromisoformat`` reads it whole)."""
    try:
        when = datetime.fromisoformat(stamp)
    except ValueError:
        return None
    return when if when.tzinfo is not None else when.replace(tzinfo=UTC)
