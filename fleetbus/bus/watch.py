"""Hints of writes to KV keys, without a JetStream consumer.

A KV write is a message published on ``$KV.<bucket>.<key>``; a plain (core
NATS) subscription on that subject sees it as it is published. That costs
the server one subscription and no consumer — a JetStream watcher, by
contrast, is an ordered consumer per watch, and listings made with watchers
every few seconds exhausted the server's consumer limit within minutes.

What it sees are hints, not the truth: a write published while this client
was disconnected is missed, and (without ``republish``) a compare-and-set
write the stream rejected is seen all the same. Whoever acts on a hint
confirms it by reading the key.

A bucket opened with ``republish`` (:func:`~fleetbus.bus.key_value`) has the
server repeat each write once stored, on ``<prefix>.kv.<name>.<key>`` with
its revision; followed there, only stored writes are seen, each with the
revision a compare-and-set needs, and no read is made to learn it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import nats.errors

from fleetbus.bus._seam import Client, Delivered, Received, header_value
from fleetbus.bus.connection import Bus
from fleetbus.bus.store import KeyValueStore
from fleetbus.bus.subjects import Subjects
from fleetbus.errors import BusError

__all__ = ["KeyUpdates"]

logger = logging.getLogger(__name__)

_OPERATION = "KV-Operation"
_SEQUENCE = "Nats-Sequence"


class KeyUpdates:
    """Calls ``callback(key, value, revision)`` for every write published to
    keys of ``kv`` matching ``pattern``; ``value`` is ``None`` for a delete or
    purge, ``revision`` the write's revision (``None`` unless ``kv`` was
    opened with ``republish``).

    Args:
        bus: the connection.
        kv: the bucket.
        pattern: keys to follow (``*`` and ``>`` wildcards).
        callback: called on the event loop for each write; must not raise.
    """

    def __init__(
        self,
        bus: Bus,
        kv: KeyValueStore,
        pattern: str,
        callback: Callable[[str, bytes | None, int | None], None],
    ) -> None:
        self._bus = bus
        self._prefix = kv.republished or Subjects.kv_keys(kv.bucket, "")
        self._subject = self._prefix + pattern
        self._callback = callback
        self._sub: Any = None

    @property
    def reconnects(self) -> int:
        """How many times the connection was re-established: a change means
        writes may have been missed."""
        return int(self._bus.nc.stats.get("reconnects", 0))

    async def start(self) -> None:
        """Subscribe (and flush, so no later write is missed); once.

        Raises:
            BusError: the subscription failed.
        """
        if self._sub is not None:
            return

        async def deliver(msg: Any) -> None:  # (what the route declines; see _seam)
            headers = msg.headers or {}
            self._deliver(msg.subject, msg.data, headers.get(_OPERATION), headers.get(_SEQUENCE))

        def take(msg: Received) -> bool:
            block = msg.block if isinstance(msg, Delivered) else b""
            operation, sequence = header_value(block, _OPERATION), header_value(block, _SEQUENCE)
            self._deliver(msg.subject, msg.data, operation, sequence)
            return True

        nc = self._bus.nc
        try:
            self._sub = await nc.subscribe(self._subject, cb=deliver)
        except nats.errors.Error as exc:
            raise BusError(f"cannot follow {self._subject}: {exc}") from exc
        if isinstance(nc, Client):
            # Every replica hears every lease write of the fleet: handed
            # over where nats-py parses it, with no queue, task or Msg.
            # Two headers are read, of the seven each comes with.
            nc.route(self._sub, take, unparsed=True)
        await self._bus.flush()

    def _deliver(
        self, subject: str, data: bytes, operation: str | None, sequence: str | None
    ) -> None:
        key = subject[len(self._prefix) :]
        value = None if operation in ("DEL", "PURGE") else bytes(data)
        revision = int(sequence) if sequence and sequence.isdigit() else None
        try:
            self._callback(key, value, revision)
        except Exception:  # a callback bug must not end the subscription
            logger.exception("key update callback failed for %s", key)

    async def close(self) -> None:
        """Unsubscribe (idempotent)."""
        sub, self._sub = self._sub, None
        if sub is not None:
            try:
                await sub.unsubscribe()
            except nats.errors.Error as exc:
                logger.debug("unsubscribe %s: %s", self._subject, exc)
