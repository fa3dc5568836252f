"""``$SRV.STATS`` of every service of a name: the NATS micro documents the
tool workers answer (docs/protocol.md, section 7)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import orjson

from fleetbus.bus import Bus
from fleetbus.errors import BusError, CallTimeoutError

__all__ = ["collect_stats"]

logger = logging.getLogger(__name__)


async def collect_stats(
    bus: Bus, service: str, *, timeout: float, limit: int
) -> list[dict[str, Any]]:
    """The STATS documents of the instances of ``service`` that answer within
    ``timeout`` seconds (at most ``limit``); stops early once answers pause
    for a tenth of that after the first, as discovery does.

    Raises:
        BusError: the request could not be sent, or the connection closed
            before any answer (:class:`~fleetbus.errors.ConnectionClosedError`).
    """
    inbox = bus.new_inbox()
    listener = await bus.listen(inbox)
    try:
        await bus.publish_bytes(f"$SRV.STATS.{service}", b"", reply=inbox)
    except BusError:
        await listener.unsubscribe()
        raise
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    idle = max(timeout / 10, 0.02)
    found: list[dict[str, Any]] = []
    try:
        while len(found) < limit:
            remaining = deadline - loop.time()
            if remaining <= 0:
                break
            try:
                msg = await listener.next(min(remaining, idle) if found else remaining)
            except CallTimeoutError:
                break
            try:
                doc = orjson.loads(msg.data)
            except orjson.JSONDecodeError:
                logger.debug("ignoring a malformed STATS answer")
                continue
            if isinstance(doc, dict):
                found.append(doc)
    except BusError:  # the connection closed while collecting
        if not found:
            raise
    finally:
        await listener.unsubscribe()
    return found
