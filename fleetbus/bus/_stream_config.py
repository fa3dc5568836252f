"""What JetStream kept of the settings fleetbus gave a stream.

A server that does not know a stream setting drops it without an error:
nats-server 2.10 accepts an update asking for per-message TTLs
(``allow_msg_ttl``) and answers with a configuration that has none. So
fleetbus reads back the configuration the server answers a creation or an
update with (its stream info) and compares it with what it asked for:
:func:`dropped` names what is missing. Where a setting has a fallback
(per-message TTLs, republished writes, more replicas) the caller takes it;
where it has none, :func:`require` makes the asset's opening fail clearly.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from nats.js.api import RePublish, StreamConfig

from fleetbus.errors import StoreError

__all__ = ["dropped", "matches", "require"]


def matches(now: object, wanted: object) -> bool:
    """Whether a stream setting the server answered (``now``) is the one asked
    for (``wanted``): a flag set as asked, a duration within a microsecond
    (the server keeps nanoseconds), the same republish source and
    destination, else an equal value."""
    if isinstance(wanted, bool):
        return bool(now) == wanted
    if isinstance(wanted, float):
        return isinstance(now, int | float) and math.isclose(now, wanted, abs_tol=1e-6)
    if isinstance(wanted, RePublish):
        return isinstance(now, RePublish) and (now.src, now.dest) == (wanted.src, wanted.dest)
    return bool(now == wanted)


def dropped(config: StreamConfig, wanted: Mapping[str, object]) -> list[str]:
    """The settings of ``wanted`` (``StreamConfig`` field names and values)
    that ``config``, what the server answered, does not hold."""
    return [field for field, value in wanted.items() if not matches(getattr(config, field), value)]


def require(config: StreamConfig, wanted: Mapping[str, object], *, what: str, server: str) -> None:
    """Fail unless ``config``, what the server answered for ``what``, holds
    every setting of ``wanted``.

    Args:
        config: the stream's configuration as the server answered it.
        wanted: the settings asked for that fleetbus cannot do without.
        what: the asset, for the message (``journal stream fleet_session``).
        server: the server's version, for the message.

    Raises:
        StoreError: the server dropped one of them.
    """
    missing = dropped(config, wanted)
    if missing:
        kept = ", ".join(f"{field}={getattr(config, field)!r}" for field in missing)
        asked = ", ".join(f"{field}={wanted[field]!r}" for field in missing)
        raise StoreError(
            f"{what}: nats-server {server} dropped settings fleetbus needs (asked for "
            f"{asked}; it keeps {kept})"
        )
