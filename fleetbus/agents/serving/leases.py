"""Who runs a session now: a small lease with a TTL, apart from the journal.

The KV bucket ``<prefix>_session_leases`` holds one record per running
session, key ``<agent>.<session_id>``: its owner, its *epoch* (the lease's
revision when it was taken, named in every fact the owner appends), its
renewals, and the ``call_id`` and reply subject of the request it serves (a
copy of that request sent again by a client that had no receipt is known by
them) — the whole request until the journal records it: a session taken
cleanly (released by its last owner) writes nothing to its journal before
its first fact, and a take-over finds the request in the dead owner's
lease. Idle sessions have no lease. A released lease leaves a marker that
expires; whoever knows its revision takes the lease with one
compare-and-set.

:class:`Recovery` finds the sessions whose owner stopped renewing without
listing the store: it follows lease writes through a plain subscription (no
JetStream consumer), keeps a timer per running session, and confirms a
silent lease by reading it before handing the session over.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from fleetbus._retry import Retry
from fleetbus.agents.serving.facts import recorded
from fleetbus.bus import Bus, Entry, KeyUpdates, KeyValueStore, key_value
from fleetbus.bus.store import transient
from fleetbus.errors import (
    FleetbusError,
    RequestHeldError,
    RevisionMismatchError,
    SessionBusyError,
    StoreError,
)

__all__ = ["DeadRequest", "Leases", "Recovery", "lease_owner"]

logger = logging.getLogger(__name__)

_LEASES = "session_leases"
_LEASE_KEEP = 24 * 3600.0
"""Seconds the bucket keeps a record (renewals keep live ones fresh); a
session left running while no replica of its agent ran for longer than this
is resumed by its next message instead of by recovery."""
_MARKER_TTL = 5.0
"""Seconds the marker of a released lease stays. Its release is heard by
every replica as it is written (the marker's revision), so a take soon after
is one write against it; a take later writes the lease as new. Short, so the
bucket and each replica's memory of releases (:data:`_RELEASED_KEPT`) hold
the last seconds' releases, not every session's: at 100,000 agents on two
hosts a marker of a minute kept some 110,000 markers on the server and
about 50 MB of releases in each host."""
_RELEASED_KEPT = 250_000
"""Leases released that are remembered, at most (about 280 bytes each). Where
markers expire (nats-server 2.11+), only those released within a marker's
life are kept: a take against an expired marker would fail, then read, then
write, where one write finds the lease gone; and a resync of :class:`Recovery`
lists no key whose marker expired."""
_CARRIED_BYTES = 16 * 1024
"""A lease carries the whole request up to this size (a larger one is
recorded in the journal with the ``taken`` fact)."""


@dataclass
class Taken:
    """A lease just taken."""

    revision: int
    from_dead: bool
    """It was taken from an owner that stopped renewing it."""
    marker: int | None
    """The marker of this replica's own release it was taken over (nobody held it since)."""
    carried: bool = False
    """The lease carries the whole request (its ``input``)."""
    dead: DeadRequest | None = None
    """The request the lease taken from a dead owner carried whole."""


@dataclass
class DeadRequest:
    """The request a dead owner's lease carried whole: served by whoever
    takes the session over when that owner appended nothing (``epoch``)."""

    epoch: int
    owner: str | None
    input: dict[str, Any]
    reply_to: str | None

    @classmethod
    def of(cls, entry: Entry | None) -> DeadRequest | None:
        """The request lease ``entry`` carries whole, or ``None``."""
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
        owner, reply_to = value.get("owner"), request.get("reply_to")
        return cls(
            epoch,
            owner if isinstance(owner, str) else None,
            request["input"],
            reply_to if isinstance(reply_to, str) else None,
        )


class Leases:
    """The session leases of a fleet, held by replica ``owner``.

    Args:
        bus: the connection.
        bucket: the leases bucket.
        owner: this replica's id (written into the leases it takes).
        ttl: seconds a lease may go unrenewed before another replica may
            take the session over.
    """

    def __init__(self, bus: Bus, bucket: KeyValueStore, *, owner: str, ttl: float) -> None:
        self.bus = bus
        self.bucket = bucket
        self.owner = owner
        self.ttl = ttl
        self._drop_retry = Retry(
            on=transient, attempts=None, backoff=0.05, max_backoff=1.0, timeout=ttl
        )
        """How a release is tried again (for up to a lease's TTL: see :meth:`drop`)."""
        # The revision of the marker each released lease left (here, or
        # heard; ``None``: found gone, its marker unknown), and when: the next
        # take writes against it without reading first, while the marker
        # lives (``marker_life``); and a resync of Recovery does not read it.
        self._released: OrderedDict[str, tuple[int | None, float]] = OrderedDict()
        marker_ttl = _MARKER_TTL
        self.marker_life = marker_ttl
        """Seconds after a release during which its marker is taken to be
        there still (forever where markers do not expire): its TTL, counted
        from before the release was sent. The server stamps the marker after
        that and expires it a TTL after its stamp, so within this time it is
        there. A take within it writes against the marker first, a take
        after it writes the lease as new first."""
        self._marker_gone = marker_ttl + min(30.0, marker_ttl / 2)
        """Seconds after a release by which the server has surely expired
        its marker (its TTL, and time for the server's expiry to run)."""

    @classmethod
    async def open(cls, bus: Bus, *, owner: str, ttl: float) -> Leases:
        """The fleet's lease bucket (created on first use).

        Raises:
            StoreError: JetStream is off or the bucket cannot be opened.
        """
        bucket = await key_value(
            bus, _LEASES, ttl=_LEASE_KEEP, expiring_markers=True, republish=True
        )
        return cls(bus, bucket, owner=owner, ttl=ttl)

    def value(self, epoch: int, renewals: int, serving: dict[str, Any] | None) -> bytes:
        """A lease record of this owner (``serving``: the request served, with
        its ``input`` when it is carried whole)."""
        value: dict[str, Any] = {
            "owner": self.owner,
            "epoch": epoch,
            "renewals": renewals,
        }
        if serving is not None:
            value["request"] = serving
        return orjson.dumps(value)

    async def take(
        self,
        key: str,
        serving: dict[str, Any] | None,
        *,
        wait: float,
        take_over: bool,
        lease_revision: int | None,
        joins: tuple[str, str] | None,
        what: tuple[str, str],
    ) -> Taken:
        """Take lease ``key``: at once when it is free, else once its owner
        releases it (up to ``wait`` seconds) or stops renewing it.

        ``serving``: the request to serve; its ``input`` is carried whole
        when it is small (:data:`_CARRIED_BYTES`).

        Raises:
            RequestHeldError: (``joins``) its owner serves that very request.
            SessionBusyError: it is held after ``wait``; (``take_over``) it
                is no longer the one found silent (``lease_revision``).
            StoreError: the bucket failed.
        """
        agent, session_id = what
        value = self.value(0, 0, serving)
        carried = serving is not None and "input" in serving
        if carried and len(value) > _CARRIED_BYTES:
            value = self.value(0, 0, recorded(serving))
            carried = False
        if not take_over:
            # The common cases in one write: a lease nobody wrote since its
            # release (compare-and-set against its marker), or a session never
            # leased (or whose marker expired). A marker that may have expired
            # is tried the other way second, without reading; anyone else's
            # write makes both fail, and then the lease is read.
            known = self._known_marker(key)
            if known is None:
                ways: list[int | None] = [None]
            else:
                marker, fresh = known
                ways = [marker, None] if fresh else [None, marker]
            for released in ways:
                try:
                    if released is not None:
                        revision = await self.bucket.update(key, value, revision=released)
                    else:
                        revision = await self.bucket.create(key, value, over_deleted=known is None)
                except RevisionMismatchError:
                    continue
                return Taken(revision, False, released, carried)
        deadline = time.monotonic() + wait
        delay = 0.02
        seen: tuple[int, float] | None = None
        while True:
            entry = await self.bucket.get_or_none(key)
            holder = lease_owner(entry.value) if entry is not None else None
            if entry is not None and holder is not None and holder != self.owner:
                if take_over:
                    if entry.revision != lease_revision:
                        raise _needs_none(agent, session_id)
                else:
                    now = time.monotonic()
                    if seen is None or seen[0] != entry.revision:
                        seen = (entry.revision, now)
                    if now - seen[1] <= self.ttl:  # alive; else its owner died
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
                raise _needs_none(agent, session_id)
            try:
                if entry is None:
                    revision = await self.bucket.create(key, value)
                else:
                    revision = await self.bucket.update(key, value, revision=entry.revision)
            except RevisionMismatchError:
                continue  # someone else moved first: look again
            from_dead = entry is not None and holder is not None and holder != self.owner
            dead = DeadRequest.of(entry) if from_dead or take_over else None
            return Taken(revision, from_dead, None, carried, dead)

    async def renew(self, key: str, value: bytes, revision: int) -> int | None:
        """Write ``value`` over lease revision ``revision``; its new revision,
        or ``None`` when the lease is another's now.

        Raises:
            StoreError: the bucket failed (the lease may still be ours).
        """
        try:
            return await self.bucket.update(key, value, revision=revision)
        except RevisionMismatchError:
            entry = await self.bucket.get_or_none(key)
            if entry is None or entry.value != value:
                return None
            return entry.revision  # our write landed, unacknowledged

    async def _remove(self, key: str, revision: int) -> int:
        """Remove a lease of ours; the marker's revision. The marker expires
        where the server allows (nats-server 2.11+): released leases do not
        pile up in the bucket, nor in the listings recovery makes."""
        if self.bucket.expiring_markers:
            return await self.bucket.purge(key, revision=revision, ttl=_MARKER_TTL)
        return await self.bucket.delete(key, revision=revision)

    async def drop(self, key: str, revision: int) -> int | None:
        """Release a lease of ours; the revision of the marker left, or
        ``None`` when it was not released here.

        A store failing for a moment (a cluster electing the bucket's new
        leader) is tried again for up to a lease's TTL, by when the lease
        would have lapsed anyway: a lease left to lapse holds the session's
        next request for a whole TTL, which across a cluster node's death
        made that session's next answer far later than the others'."""
        retry = self._drop_retry
        sent = time.monotonic()  # (the marker is stamped later: it lives longer)
        try:
            try:
                marker = await retry.call(self._remove, key, revision)
            except RevisionMismatchError:
                # A renewal of ours may have landed after its writer stopped
                # waiting; anyone else's lease stays.
                entry = await retry.call(self.bucket.get_or_none, key)
                if entry is None or lease_owner(entry.value) != self.owner:
                    logger.info("lease of %s was taken over before its release", key)
                    return None
                marker = await retry.call(self._remove, key, entry.revision)
        except RevisionMismatchError:
            logger.info("lease of %s was taken over before its release", key)
            return None
        except StoreError as exc:
            logger.warning("lease of %s not released (it will lapse): %s", key, exc)
            return None
        self.note_released(key, marker, at=sent)
        return marker

    def note_released(self, key: str, marker: int | None, *, at: float | None = None) -> None:
        """Lease ``key`` was released, leaving a marker at revision ``marker``
        (here, or by another replica: :class:`Recovery` hears it): the next
        take writes against it without reading the lease first. ``None``:
        found released, the marker's revision unknown. ``at``: the monotonic
        time no later than the marker's stamp (now, by default)."""
        released = self._released
        now = time.monotonic()
        released[key] = (marker, now if at is None else at)
        released.move_to_end(key)
        if len(released) > _RELEASED_KEPT:
            released.popitem(last=False)
        if self.bucket.expiring_markers:
            while released and next(iter(released.values()))[1] < now - self._marker_gone:
                released.popitem(last=False)  # expired on the server meanwhile

    def released(self, key: str) -> bool:
        """Whether lease ``key`` is known released (its marker not yet expired)."""
        return key in self._released

    def note_held(self, key: str, revision: int | None) -> None:
        """Lease ``key`` was written by a holder, at ``revision``: a release
        noted before it is no longer the key's last write."""
        known = self._released.get(key)
        if known is not None and (known[0] is None or revision is None or known[0] < revision):
            del self._released[key]

    def forget_released(self) -> None:
        """Forget every release noted (writes may have been missed meanwhile)."""
        self._released.clear()

    def _known_marker(self, key: str) -> tuple[int, bool] | None:
        """The revision of the marker lease ``key`` left when released, and
        whether it is surely there still (else it may have expired); ``None``
        when it has surely expired or is not known. Forgotten once asked for."""
        marker, at = self._released.pop(key, (None, 0.0))
        if marker is None:
            return None
        if not self.bucket.expiring_markers:
            return marker, True
        age = time.monotonic() - at
        if age >= self._marker_gone:
            return None  # gone by now: the lease is written as new
        return marker, age < self.marker_life


def _needs_none(agent: str, session_id: str) -> SessionBusyError:
    return SessionBusyError(
        f"session {session_id} of {agent} needs no take-over", agent=agent, session_id=session_id
    )


def _serves(entry: Entry, request: tuple[str, str]) -> bool:
    """Whether the lease ``entry`` serves the request ``(call_id, reply subject)``."""
    try:
        carried = orjson.loads(entry.value).get("request") if entry.value else None
    except (orjson.JSONDecodeError, AttributeError):
        return False
    if not isinstance(carried, dict):
        return False
    call_id, reply_to = request
    return carried.get("reply_to") == reply_to and carried.get("call_id") == call_id


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


@dataclass
class _Watched:
    revision: int | None
    """The lease revision last heard (the write's, republished) or read
    (None: heard of without one)."""
    since: float
    """Monotonic time of the last sign of life."""


class Recovery:
    """Finds the sessions whose owner stopped renewing its lease, and hands
    each to ``take_over(agent, session_id, lease_revision)``.

    Lease writes are followed through plain subscriptions (no JetStream
    consumer); each running session has a timer, restarted by every renewal
    heard. A lease silent for longer than its TTL is read; if it is still at
    the revision last heard (or read), its owner is dead. Only leases of
    running sessions exist, so idle sessions cost nothing. Every
    ``resync_interval`` seconds (and after a reconnection) the lease keys
    are listed — one request per pattern, no consumer — to learn of leases
    whose writes were missed.

    Args:
        leases: the leases.
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
        leases: Leases,
        agents: str | Sequence[str] | None,
        take_over: Callable[[str, str, int], Awaitable[None]],
        *,
        serves: Callable[[str], bool] | None = None,
        interval: float = 2.0,
        resync_interval: float = 30.0,
    ) -> None:
        self.leases = leases
        self._take_over = take_over
        self.interval = interval
        self.resync_interval = resync_interval
        self.watched: dict[str, _Watched] = {}
        """Running sessions by lease key (``<agent>.<session>``). The keys
        known released are the leases' (:meth:`Leases.released`): a resync
        does not read them."""
        if agents is None:
            self._patterns = ["*.*"]
        else:
            self._patterns = [f"{a}.*" for a in ([agents] if isinstance(agents, str) else agents)]
        self._serves = serves
        self._updates = [
            KeyUpdates(leases.bus, leases.bucket, pattern, self._heard)
            for pattern in self._patterns
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
            # Released (by any replica): the next take is one write.
            self.leases.note_released(key, revision if value is None else None)
            return
        self.leases.note_held(key, revision)
        watched = self.watched.get(key)
        if watched is None:
            self.watched[key] = _Watched(revision, time.monotonic())
        else:
            watched.revision, watched.since = revision, time.monotonic()

    @property
    def _reconnects_seen(self) -> int:
        return self._updates[0].reconnects

    async def start(self) -> None:
        """Follow the lease writes and learn the current leases (again
        after a failure: the following starts once).

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
            self.leases.forget_released()  # writes may have been missed while away
            self._reconnects = reconnects
        self._resynced = time.monotonic()
        bucket = self.leases.bucket
        for pattern in self._patterns:
            for key in await bucket.subjects(pattern):
                if key in self.watched or self.leases.released(key) or not self._ours(key):
                    continue
                entry = await bucket.last(key)
                if entry is None or entry.deleted or lease_owner(entry.value) is None:
                    marker = entry.revision if entry is not None and entry.deleted else None
                    self.leases.note_released(key, marker)
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
        ttl = self.leases.ttl
        for key, watched in list(self.watched.items()):
            if now - watched.since <= ttl:
                continue
            entry = await self.leases.bucket.get_or_none(key)
            if entry is None or lease_owner(entry.value) is None:
                self.watched.pop(key, None)
                continue
            if entry.revision != watched.revision:
                watched.revision, watched.since = entry.revision, time.monotonic()
                continue
            self.watched.pop(key, None)
            agent, _, session = key.partition(".")
            await self._take_over(agent, session, entry.revision)

    def watch_again(self, key: str, revision: int) -> None:
        """Watch lease ``key`` (found silent at ``revision``) again, from now:
        its take-over failed, and a lease still silent a TTL on is handed
        over again."""
        self.watched[key] = _Watched(revision, time.monotonic())

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
