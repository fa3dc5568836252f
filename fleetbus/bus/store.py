"""JetStream key-value and object store helpers.

Buckets are named per fleet (``<prefix>_<name>``), created on first use, and
their errors are fleetbus errors. Agents keep session state in a KV bucket
(compare-and-set on the revision they read) and offload large tool results to
an object store.

A failure that may pass (``StoreError.transient``: on a cluster, a stream
whose leader died answers nothing for the seconds its new leader takes to be
elected) is ridden out the same way by every user of the store — an agent
taking a session, ``fleetbus sessions``, ``confirm``, ``cancel``, the
dashboard: :func:`wait_for_store` retries it, with jittered backoff, for up to
:data:`STORE_WAIT` seconds.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import functools
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import nats.errors
import nats.js.errors
import orjson
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.api import RePublish
from nats.js.kv import KeyValue
from nats.js.object_store import ObjectStore as _NatsObjectStore

from fleetbus._retry import Retry
from fleetbus.bus._replicas import (
    ensure_replicas,
    kv_stream_name,
    object_stream_name,
    placement_error,
    wanted_replicas,
)
from fleetbus.bus._replies import Replies
from fleetbus.bus._seam import Received
from fleetbus.bus._stream_config import matches, require
from fleetbus.bus.connection import Bus
from fleetbus.bus.subjects import Subjects
from fleetbus.errors import (
    ConnectionClosedError,
    KeyNotFoundError,
    RevisionMismatchError,
    StoreError,
)

__all__ = [
    "STORE_WAIT",
    "Entry",
    "KeyValueStore",
    "ObjectStore",
    "ObjectSummary",
    "delete_key_value",
    "key_value",
    "object_store",
    "stream_subjects",
    "transient",
    "wait_for_store",
]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

STORE_WAIT = 30.0
"""Seconds :func:`wait_for_store` rides out a transient store failure by
default: well past the few seconds a cluster takes to elect a stream's new
leader after a node dies."""

# JetStream's "wrong last sequence" API error codes (a compare-and-set lost).
_WRONG_LAST_SEQUENCE = (10071, 10164)
_KV_OPERATION = "KV-Operation"
_NO_MESSAGE = 10037
_DELETE = {_KV_OPERATION: "DEL"}
_EXPECTED_LAST = "Nats-Expected-Last-Subject-Sequence"


@dataclass(frozen=True, slots=True)
class Entry:
    """A value read from a bucket, with the revision to compare-and-set on."""

    key: str
    value: bytes
    revision: int
    deleted: bool = False
    """A deletion (or purge) marker: the key holds no value (see :meth:`KeyValueStore.last`)."""


@dataclass(frozen=True, slots=True)
class ObjectSummary:
    """What the object store knows of one object."""

    name: str
    size: int
    digest: str | None


def _store_error(exc: BaseException, what: str) -> StoreError | ConnectionClosedError:
    if isinstance(exc, nats.errors.ConnectionClosedError):
        return ConnectionClosedError(f"{what}: the bus connection is closed")
    # Each may pass: a stream electing a leader answers nothing for seconds.
    if isinstance(exc, nats.errors.NoRespondersError):
        return StoreError(
            f"{what}: no JetStream stream answered (is JetStream enabled?)", transient=True
        )
    if isinstance(exc, nats.js.errors.ServiceUnavailableError):
        return StoreError(
            f"{what}: JetStream is not available (is it enabled on the server?)", transient=True
        )
    return StoreError(f"{what} failed: {exc or type(exc).__name__}", transient=True)


def _answered_error(what: str, error: dict[str, Any]) -> StoreError:
    """The error JetStream answered; transient when it says it is unavailable (503)."""
    return StoreError(
        f"{what} failed: {error.get('description') or error}", transient=error.get("code") == 503
    )


async def _api_answer(
    request: Awaitable[Received], what: str
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The JSON of a JetStream API answer, and the error it holds (``None``:
    none), for the caller to tell which errors are answers (``what``: what
    the request was for, in the errors raised).

    Raises:
        StoreError: the request failed, or its answer is not a JSON object.
    """
    try:
        answer = orjson.loads((await request).data)
    except (nats.errors.Error, TimeoutError) as exc:
        raise _store_error(exc, what) from exc
    except orjson.JSONDecodeError:
        raise StoreError(f"{what}: the server's answer is not JSON") from None
    if not isinstance(answer, dict):
        raise StoreError(f"{what}: the server's answer is malformed")
    return answer, answer.get("error") or None


_SUBJECTS_INFO = "$JS.API.STREAM.INFO."


async def stream_subjects(
    nc: NATS, stream: str, subjects_filter: str, *, timeout: float, what: str
) -> dict[str, int]:
    """The subjects of ``stream`` matching ``subjects_filter``, with how many
    messages each holds: stream-info requests, which create no consumer.

    The server answers at most 100,000 subjects a request, with how many
    match in all (``total``); the next request asks from where the last
    page ended (``offset``), until every page is read. A subject added or
    removed while the pages are read may be missed, as by any listing of a
    stream that changes.

    Raises:
        StoreError: a request failed (``what`` says what was being done), or
            the server's answer is not stream info.
    """
    subjects: dict[str, int] = {}
    offset = 0
    while True:
        query: dict[str, Any] = {"subjects_filter": subjects_filter}
        if offset:
            query["offset"] = offset
        request = nc.request(_SUBJECTS_INFO + stream, orjson.dumps(query), timeout=timeout)
        answer, error = await _api_answer(request, what)
        if error:
            raise _answered_error(what, error)
        try:
            page = answer["state"].get("subjects") or {}
            total = int(answer.get("total") or 0)
        except (KeyError, TypeError, AttributeError, ValueError):
            raise StoreError(f"{what}: the server's answer is malformed") from None
        if not isinstance(page, dict):
            raise StoreError(f"{what}: the server's answer is malformed")
        subjects.update(page)
        offset += len(page)
        if not page or offset >= total:
            return subjects


def stored_sequence(ack: bytes, what: str, *, key: str, expected: int | None, mismatch: str) -> int:
    """The sequence JetStream's ``ack`` of a write gives it.

    Raises:
        RevisionMismatchError: (``expected``: a compare-and-set) the subject's
            last sequence was another (``mismatch`` says so).
        StoreError: the write was refused, or the answer is unreadable.
    """
    try:
        answer = orjson.loads(ack)
    except orjson.JSONDecodeError:
        raise StoreError(f"{what}: the server's answer is not JSON") from None
    error = answer.get("error") if isinstance(answer, dict) else None
    if error:
        if expected is not None and error.get("err_code") in _WRONG_LAST_SEQUENCE:
            raise RevisionMismatchError(mismatch, key=key, expected=expected)
        raise _answered_error(what, error)
    try:
        return int(answer["seq"])
    except (KeyError, TypeError, ValueError):
        raise StoreError(f"{what}: the server's answer has no sequence") from None


def transient(exc: BaseException) -> bool:
    """Whether ``exc`` is a store failure that may pass (see ``StoreError.transient``)."""
    return isinstance(exc, StoreError) and exc.transient


async def wait_for_store(
    call: Callable[[], Awaitable[_T]],
    *,
    timeout: float = STORE_WAIT,
    waiting: Callable[[StoreError], object] | None = None,
) -> _T:
    """``await call()``, retried while it fails with a transient store error,
    for up to ``timeout`` seconds.

    Args:
        call: the store operation (opening a bucket, a read, a write, or a
            whole command's reading of the store).
        timeout: seconds from the first attempt after which no retry is
            made (an attempt under way is not cut); zero: no retry.
        waiting: called once, with the error, at the first transient
            failure (to say that the call waits).

    Raises:
        StoreError: a failure that is not transient, or the last transient
            one once ``timeout`` has passed.
    """
    started = asyncio.get_running_loop().time()
    try:  # the first attempt: most find the store
        return await call()
    except StoreError as exc:
        if not exc.transient:
            raise
        if waiting is not None:
            waiting(exc)
        first = exc
    return await _store_retry(timeout).after(call, first, started)


@functools.lru_cache(maxsize=32)
def _store_retry(timeout: float) -> Retry:
    """The policy of :func:`wait_for_store` (made once for each timeout: a
    host waits this way for every store operation of every reply)."""
    return Retry(on=transient, attempts=None, backoff=0.1, max_backoff=1.0, timeout=timeout)


JS_TIMEOUT = 5.0
"""Seconds a KV read or write waits for JetStream's answer (nats-py's own default)."""

ADMIN_TIMEOUT = 15.0
"""Seconds JetStream may take to make or change a bucket's stream."""


async def key_value(
    bus: Bus,
    name: str,
    *,
    ttl: float | None = None,
    history: int = 1,
    create: bool = True,
    replicas: int | None = None,
    expiring_markers: bool = False,
    republish: bool = False,
) -> KeyValueStore:
    """The fleet's KV bucket ``name``, created if missing (and ``create``).

    An existing bucket with fewer replicas than wanted is updated to that
    count, with a warning; if JetStream refuses, it is used as it is.

    Args:
        bus: the connection.
        name: the bucket's short name (the fleet prefix is added).
        ttl: seconds a value lives; for ever when ``None``.
        history: revisions kept per key (1-64).
        create: create the bucket if it does not exist.
        replicas: copies JetStream keeps (1-5); else ``bus.js_replicas``;
            else 3 on a JetStream cluster and 1 on a single server.
        expiring_markers: make sure the bucket takes per-message TTLs
            (nats-server 2.11+), so that :meth:`KeyValueStore.purge` can
            leave a marker that expires; ``KeyValueStore.expiring_markers``
            says whether it can.
        republish: make sure the server repeats every stored write on
            ``<prefix>.kv.<name>.<key>`` with its revision (the
            ``Nats-Sequence`` header), so that :class:`~fleetbus.bus.KeyUpdates`
            learns revisions without reading; ``KeyValueStore.republished``
            is that subject's stem, or ``None`` if JetStream refused.

    Raises:
        ConfigError: ``replicas`` is not between 1 and 5.
        StoreError: JetStream is off, the bucket cannot be opened or made, or
            the server cannot keep that many replicas.
    """
    bucket = bus.subjects.kv_bucket(name)
    what = f"KV bucket {bucket}"
    wanted = wanted_replicas(bus, replicas)
    js = bus.nc.jetstream(timeout=JS_TIMEOUT)
    # Making or changing a stream is a Raft proposal on a cluster: more time
    # than a read or a write gets (an R3 bucket made on three busy nodes took
    # longer than nats-py's 5 s).
    admin = bus.nc.jetstream(timeout=ADMIN_TIMEOUT)
    writes = (
        RePublish(src=Subjects.kv_keys(bucket, ">"), dest=bus.subjects.kv_writes(name))
        if republish
        else None
    )
    try:
        try:
            kv = await js.key_value(bucket)
        except nats.js.errors.BucketNotFoundError:
            if not create:
                raise StoreError(f"KV bucket {bucket} does not exist") from None
            await admin.create_key_value(
                bucket=bucket, ttl=ttl, history=history, replicas=wanted, republish=writes
            )
            made = await admin.stream_info(kv_stream_name(bucket))
            settings: dict[str, object] = {"max_msgs_per_subject": history, "num_replicas": wanted}
            if ttl:
                settings["max_age"] = float(ttl)
            require(made.config, settings, what=what, server=bus.server_version)
            kv = await js.key_value(bucket)  # reads and writes keep their own timeout
        else:
            await ensure_replicas(admin, kv_stream_name(bucket), wanted, what=what)
        markers = expiring_markers and await _allow_msg_ttl(admin, kv_stream_name(bucket), what)
        republished = writes is not None and await _republish(admin, kv_stream_name(bucket), writes)
    except StoreError:
        raise
    except (nats.errors.Error, TimeoutError) as exc:
        error = placement_error(exc, what=what, wanted=wanted, bus=bus)
        raise error or _store_error(exc, f"opening {what}") from exc
    store = KeyValueStore(kv, bucket, js, bus.nc, replies=bus._replies)
    store.expiring_markers = markers
    store.republished = bus.subjects.kv_writes(name, "") if republished else None
    return store


async def delete_key_value(bus: Bus, bucket: str) -> bool:
    """Delete KV bucket ``bucket`` (its full name); ``False`` when it does not exist.

    Raises:
        StoreError: JetStream is off or the deletion failed.
    """
    try:
        return bool(await bus.nc.jetstream(timeout=ADMIN_TIMEOUT).delete_key_value(bucket))
    except nats.js.errors.NotFoundError:
        return False
    except (nats.errors.Error, TimeoutError) as exc:
        raise _store_error(exc, f"deleting KV bucket {bucket}") from exc


async def _allow_msg_ttl(js: JetStreamContext, stream: str, what: str) -> bool:
    """Whether ``stream`` takes per-message TTLs, turned on if it can be."""
    return await _ensure_config(
        js,
        stream,
        "allow_msg_ttl",
        True,
        lambda now: bool(now),
        f"{what} takes no per-message TTL (%s): its deletions stay",
    )


async def _republish(js: JetStreamContext, stream: str, writes: RePublish) -> bool:
    """Whether ``stream`` repeats its stored writes as ``writes`` says, set if
    it can be."""
    return await _ensure_config(
        js,
        stream,
        "republish",
        writes,
        lambda now: matches(now, writes),
        f"{stream} repeats no writes (%s): revisions are read instead",
    )


async def _ensure_config(
    js: JetStreamContext,
    stream: str,
    field: str,
    wanted: object,
    holds: Callable[[Any], bool],
    refused: str,
) -> bool:
    """Whether ``stream``'s setting ``field`` already ``holds``, else set it to
    ``wanted``; ``False`` (and ``refused`` logged with the reason) if
    JetStream will not.

    The configuration the server answers the update with is read back: a
    server that does not know the setting takes the update and drops it
    (nats-server 2.10 does so with ``allow_msg_ttl``), which is a refusal too.
    """
    info = await js.stream_info(stream)
    if holds(getattr(info.config, field)):
        return True
    try:
        updated = await js.update_stream(info.config.evolve(**{field: wanted}))
    except (nats.errors.Error, TimeoutError) as exc:
        logger.info(refused, exc)
        return False
    if not holds(getattr(updated.config, field)):
        logger.info(refused, f"the server took the update without {field}")
        return False
    return True


class KeyValueStore:
    """A JetStream KV bucket with fleetbus errors.

    Keys are strings of letters, digits and ``-_/=.``; values are bytes.

    Reads and writes are JetStream API requests made here on the connection
    (a message get from the stream's leader; a publish with the
    compare-and-set header), their answers parsed with orjson, not through
    nats-py's KV layer: that layer costs a third more CPU per operation, and
    sessions make several per reply (``bench/simulation.py``). What is sent
    is what nats-py sends.

    Args:
        kv: nats-py's bucket (what this class does not do itself).
        bucket: the bucket's name.
        js: the JetStream context ``kv`` was opened with.
        nc: the connection the requests go on.
        replies: the bus's reply inbox, for the requests.
        timeout: seconds a read or a write waits for its answer.
    """

    def __init__(
        self,
        kv: KeyValue,
        bucket: str,
        js: JetStreamContext,
        nc: NATS,
        *,
        replies: Replies | None = None,
        timeout: float = JS_TIMEOUT,
    ) -> None:
        self._kv = kv
        self._js = js
        self._nc = nc
        self._replies = replies
        self.bucket = bucket
        # Subjects by their documented names: fleetbus opens its buckets in
        # the account's own JetStream (no domain, no API prefix).
        self._prefix = Subjects.kv_keys(bucket, "")
        self._msg_get = f"$JS.API.STREAM.MSG.GET.{Subjects.kv_stream(bucket)}"
        self._timeout = timeout
        self.expiring_markers = False
        """Whether :meth:`purge` can leave a marker that expires (see :func:`key_value`)."""
        self.republished: str | None = None
        """The stem of the subjects on which the server repeats each stored
        write with its revision (see :func:`key_value`), or ``None``."""

    async def _read(self, key: str) -> tuple[bytes, int, bool] | None:
        """``(value, revision, deleted)`` of ``key``'s last write, or ``None``."""
        what = f"get {key!r}"
        query = orjson.dumps({"last_by_subj": self._prefix + key})
        answer, error = await _api_answer(self._request(self._msg_get, query, None), what)
        if error:
            if error.get("err_code") == _NO_MESSAGE or error.get("code") == 404:
                return None
            raise _answered_error(what, error)
        try:
            stored = answer["message"]
            revision = int(stored["seq"])
            data = base64.b64decode(stored["data"]) if stored.get("data") else b""
            headers = base64.b64decode(stored["hdrs"]) if stored.get("hdrs") else b""
        except (KeyError, TypeError, ValueError, binascii.Error):
            raise StoreError(f"{what}: the server's answer is malformed") from None
        deleted = b"KV-Operation: DEL" in headers or b"KV-Operation: PURGE" in headers
        return data, revision, deleted

    async def _write(
        self,
        key: str,
        value: bytes,
        *,
        revision: int | None,
        headers: dict[str, str] | None = None,
    ) -> int:
        """Publish a write; its revision. ``revision``: compare-and-set on it."""
        if revision is not None:
            headers = {**(headers or {}), _EXPECTED_LAST: str(revision)}
        operation = (headers or {}).get(_KV_OPERATION)
        what = f"{operation.lower() if operation else 'write'} {key!r}"
        try:
            msg = await self._request(self._prefix + key, value, headers)
        except (nats.errors.Error, TimeoutError) as exc:
            raise _store_error(exc, what) from exc
        mismatch = f"key {key!r} in bucket {self.bucket} is no longer at revision {revision}"
        return stored_sequence(msg.data, what, key=key, expected=revision, mismatch=mismatch)

    async def _request(
        self, subject: str, payload: bytes, headers: dict[str, str] | None
    ) -> Received:
        if self._replies is not None:  # the bus's own reply inbox: less CPU a request
            return await self._replies.request(subject, payload, self._timeout, headers)
        return await self._nc.request(subject, payload, timeout=self._timeout, headers=headers)

    async def get(self, key: str) -> Entry:
        """The current value of ``key``.

        Raises:
            KeyNotFoundError: no such key (or it was deleted).
            StoreError: the read failed.
        """
        read = await self._read(key)
        if read is None or read[2]:
            raise KeyNotFoundError(f"no key {key!r} in bucket {self.bucket}")
        return Entry(key=key, value=read[0], revision=read[1])

    async def get_or_none(self, key: str) -> Entry | None:
        """The current value of ``key``, or ``None``.

        Raises:
            StoreError: the read failed.
        """
        read = await self._read(key)
        if read is None or read[2]:
            return None
        return Entry(key=key, value=read[0], revision=read[1])

    async def last(self, key: str) -> Entry | None:
        """The last write of ``key``, a deletion included (``deleted``, an
        empty value): what a compare-and-set :meth:`update` is against. ``None``:
        never written, or purged.

        Raises:
            StoreError: the read failed.
        """
        read = await self._read(key)
        if read is None:
            return None
        return Entry(key=key, value=b"" if read[2] else read[0], revision=read[1], deleted=read[2])

    async def put(self, key: str, value: bytes) -> int:
        """Write ``value`` whatever the current revision; returns the new revision.

        Raises:
            StoreError: the write failed.
        """
        return await self._write(key, value, revision=None)

    async def create(self, key: str, value: bytes, *, over_deleted: bool = True) -> int:
        """Write ``value`` only if ``key`` does not exist (or was deleted);
        returns the revision.

        ``over_deleted=False``: only if the key holds no record at all, not
        even a deletion marker — one write, where a key found deleted is
        otherwise read and written again.

        Raises:
            RevisionMismatchError: the key exists.
            StoreError: the write failed.
        """
        try:
            return await self._write(key, value, revision=0)
        except RevisionMismatchError:
            if not over_deleted:
                raise RevisionMismatchError(
                    f"key {key!r} has a record in bucket {self.bucket}", key=key, expected=None
                ) from None
            read = await self._read(key)
            if read is None or not read[2]:
                raise RevisionMismatchError(
                    f"key {key!r} already exists in bucket {self.bucket}", key=key, expected=None
                ) from None
            # Deleted: a write over its deletion marker, if nobody wrote since.
            try:
                return await self._write(key, value, revision=read[1])
            except RevisionMismatchError:
                raise RevisionMismatchError(
                    f"key {key!r} already exists in bucket {self.bucket}", key=key, expected=None
                ) from None

    async def update(self, key: str, value: bytes, *, revision: int) -> int:
        """Compare-and-set: write only if the key is still at ``revision``.

        Raises:
            RevisionMismatchError: someone else wrote the key since.
            StoreError: the write failed.
        """
        return await self._write(key, value, revision=revision)

    async def delete(self, key: str, *, revision: int | None = None) -> int:
        """Delete ``key``; with ``revision``, only if the key is still at that
        revision (compare-and-delete). Returns the revision of the deletion
        marker: a compare-and-set :meth:`update` against it writes the key
        again without reading it first.

        Raises:
            RevisionMismatchError: ``revision`` was given and someone else
                wrote the key since.
            StoreError: the delete failed.
        """
        return await self._write(key, b"", revision=revision or None, headers=_DELETE)

    async def purge(self, key: str, *, revision: int | None = None, ttl: float) -> int:
        """Remove ``key`` and its history, leaving a marker that expires after
        ``ttl`` seconds (then the key is gone for good: listings no longer
        show it); with ``revision``, only if the key is still at it. Returns
        the marker's revision. Needs ``expiring_markers``.

        Raises:
            RevisionMismatchError: ``revision`` was given and someone else
                wrote the key since.
            StoreError: the purge failed.
        """
        headers = {
            _KV_OPERATION: "PURGE",
            "Nats-Rollup": "sub",
            "Nats-TTL": str(max(1, int(ttl))),
        }
        return await self._write(key, b"", revision=revision or None, headers=headers)

    async def revision(self, key: str) -> int | None:
        """The revision of ``key``'s last write, a deletion included (``None``:
        never written, or purged): what :meth:`update` compares against.

        Raises:
            StoreError: the read failed.
        """
        read = await self._read(key)
        return None if read is None else read[1]

    async def subjects(self, pattern: str = ">") -> list[str]:
        """The keys matching ``pattern`` (``*`` and ``>`` wildcards) that hold a
        value or a deletion marker, sorted; without reading any value.

        Stream-info requests (:func:`stream_subjects`): they create no
        consumer on the server, unlike nats-py's ``keys()``, whose watcher
        outlives the listing for minutes (listings every few seconds
        exhausted the server's consumer limit).

        Raises:
            StoreError: the listing failed.
        """
        prefix = Subjects.kv_keys(self.bucket, "")
        subjects = await stream_subjects(
            self._nc,
            Subjects.kv_stream(self.bucket),
            Subjects.kv_keys(self.bucket, pattern),
            timeout=self._timeout,
            what="list keys",
        )
        return sorted(s[len(prefix) :] for s in subjects)

    async def keys(self, pattern: str = ">") -> list[str]:
        """Every live key matching ``pattern``, sorted: one listing (no
        consumer), then one read per key to leave deleted ones out.

        Raises:
            StoreError: the listing failed.
        """
        live = []
        for key in await self.subjects(pattern):
            entry = await self.get_or_none(key)
            if entry is not None and entry.value:
                live.append(key)
        return live


async def object_store(
    bus: Bus,
    name: str,
    *,
    create: bool = True,
    replicas: int | None = None,
    ttl: float | None = None,
) -> ObjectStore:
    """The fleet's object store bucket ``name``, created if missing.

    An existing store with fewer replicas than wanted is updated to that
    count, with a warning; if JetStream refuses, it is used as it is.

    Args:
        bus: the connection.
        name: the bucket's short name (the fleet prefix is added).
        create: create the bucket if it does not exist.
        ttl: seconds an object lives (when the store is created); for ever
            when ``None``.
        replicas: copies JetStream keeps (1-5); else ``bus.js_replicas``;
            else 3 on a JetStream cluster and 1 on a single server.

    Raises:
        ConfigError: ``replicas`` is not between 1 and 5.
        StoreError: JetStream is off, the bucket cannot be opened or made, or
            the server cannot keep that many replicas.
    """
    bucket = bus.subjects.kv_bucket(name)
    what = f"object store {bucket}"
    wanted = wanted_replicas(bus, replicas)
    js: JetStreamContext = bus.nc.jetstream()
    try:
        try:
            store = await js.object_store(bucket)
        except nats.js.errors.BucketNotFoundError:
            if not create:
                raise StoreError(f"object store {bucket} does not exist") from None
            admin = bus.nc.jetstream(timeout=ADMIN_TIMEOUT)
            await admin.create_object_store(bucket, replicas=wanted, ttl=ttl)
            made = await admin.stream_info(object_stream_name(bucket))
            settings: dict[str, object] = {"num_replicas": wanted}
            if ttl:
                settings["max_age"] = float(ttl)
            require(made.config, settings, what=what, server=bus.server_version)
            store = await js.object_store(bucket)
        else:
            admin = bus.nc.jetstream(timeout=ADMIN_TIMEOUT)
            await ensure_replicas(admin, object_stream_name(bucket), wanted, what=what)
    except StoreError:
        raise
    except (nats.errors.Error, TimeoutError) as exc:
        error = placement_error(exc, what=what, wanted=wanted, bus=bus)
        raise error or _store_error(exc, f"opening {what}") from exc
    return ObjectStore(store, bucket)


class ObjectStore:
    """A JetStream object store bucket: blobs of any size, chunked."""

    def __init__(self, store: _NatsObjectStore, bucket: str) -> None:
        self._store = store
        self.bucket = bucket

    def url(self, name: str) -> str:
        """A reference to an object, for a ``data`` content block."""
        return f"nats-object://{self.bucket}/{name}"

    async def put(self, name: str, data: bytes) -> ObjectSummary:
        """Store ``data`` under ``name`` (replacing any previous object).

        Raises:
            StoreError: the write failed.
        """
        try:
            info = await self._store.put(name, data)
        except (nats.errors.Error, TimeoutError) as exc:
            raise _store_error(exc, f"put object {name!r}") from exc
        return ObjectSummary(name=name, size=info.size or 0, digest=info.digest)

    async def get(self, name: str) -> bytes:
        """The object's bytes.

        Raises:
            KeyNotFoundError: no such object.
            StoreError: the read failed.
        """
        try:
            result = await self._store.get(name)
        except (nats.js.errors.ObjectNotFoundError, nats.js.errors.ObjectDeletedError):
            raise KeyNotFoundError(f"no object {name!r} in {self.bucket}") from None
        except (nats.errors.Error, TimeoutError) as exc:
            raise _store_error(exc, f"get object {name!r}") from exc
        return result.data or b""

    async def delete(self, name: str) -> None:
        """Delete an object.

        Raises:
            KeyNotFoundError: no such object.
            StoreError: the delete failed.
        """
        try:
            await self._store.delete(name)
        except (nats.js.errors.ObjectNotFoundError, nats.js.errors.ObjectDeletedError):
            raise KeyNotFoundError(f"no object {name!r} in {self.bucket}") from None
        except (nats.errors.Error, TimeoutError) as exc:
            raise _store_error(exc, f"delete object {name!r}") from exc

    async def list(self) -> list[ObjectSummary]:
        """Every live object, sorted by name.

        Raises:
            StoreError: the listing failed.
        """
        try:
            infos = await self._store.list(ignore_deletes=True)
        except nats.js.errors.NotFoundError:
            return []
        except (nats.errors.Error, TimeoutError) as exc:
            raise _store_error(exc, "list objects") from exc
        return sorted(
            (ObjectSummary(name=i.name, size=i.size or 0, digest=i.digest) for i in infos),
            key=lambda s: s.name,
        )
