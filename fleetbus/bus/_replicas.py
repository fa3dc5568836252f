"""How many copies JetStream keeps of each asset fleetbus creates.

Every KV bucket and object store made through :func:`fleetbus.bus.key_value`
and :func:`fleetbus.bus.object_store` gets a replica count: the caller's
argument, else the connection's setting (``ConnectOptions.js_replicas``, from
``FLEETBUS_JS_REPLICAS`` or ``--js-replicas``), else the server's default:

- **1** on a server that is not part of a cluster: JetStream there keeps one
  copy and refuses more ("replicas > 1 not supported in non-clustered mode",
  API error 10074).
- **3** on a cluster: the smallest count that survives losing a server (a
  write needs a majority, 2 of 3).

The server's INFO tells which: measured with nats-server 2.15.1, a single
server's INFO has no ``cluster`` field, and every node of a 3-node cluster
sends ``"cluster": "<name>"`` with the three ``connect_urls``. A server with a
``cluster`` block runs JetStream only with routes to other servers (it exits
with "JetStream cluster requires configured routes" otherwise), so the field
means a JetStream cluster. The INFO costs no request and no permission. We do
not count the live servers instead (``connect_urls``, or ``$SYS`` pings that a
user restricted to the fleet's subjects may not send): the count is wrong
exactly when it matters, as a 3-node cluster with a node down counts 2 and
would get R1 assets that never regain their copies. On a cluster of fewer than
three JetStream servers, creating an R3 asset fails with a
:class:`~fleetbus.errors.StoreError` that says to set the count.

The default is worked out once per :class:`~fleetbus.bus.Bus` and kept.
"""

from __future__ import annotations

import asyncio
import logging
import weakref

import nats.errors
import nats.js.errors
from nats.js import JetStreamContext
from nats.js.client import KV_STREAM_TEMPLATE
from nats.js.object_store import OBJ_STREAM_TEMPLATE

from fleetbus.bus.connection import Bus
from fleetbus.errors import ConfigError, StoreError

__all__ = [
    "CLUSTER_REPLICAS",
    "MAX_REPLICAS",
    "default_replicas",
    "ensure_replicas",
    "kv_stream_name",
    "object_stream_name",
    "placement_error",
    "wanted_replicas",
]

logger = logging.getLogger(__name__)

CLUSTER_REPLICAS = 3
"""The default replica count on a JetStream cluster."""
MAX_REPLICAS = 5
"""JetStream's limit on the copies of a stream."""

# JetStream API error codes (nats-server's server/errors.json).
_NOT_CLUSTERED = 10074  # "replicas > 1 not supported in non-clustered mode"
_NO_PEERS = 10005  # "no suitable peers for placement"
_INSUFFICIENT_RESOURCES = 10023  # "insufficient resources"

_HOW_TO_SET = "set FLEETBUS_JS_REPLICAS (or --js-replicas) to fewer"

_defaults: weakref.WeakKeyDictionary[Bus, int] = weakref.WeakKeyDictionary()


def kv_stream_name(bucket: str) -> str:
    """The JetStream stream behind KV bucket ``bucket``."""
    return KV_STREAM_TEMPLATE.format(bucket=bucket)


def object_stream_name(bucket: str) -> str:
    """The JetStream stream behind object store ``bucket``."""
    return OBJ_STREAM_TEMPLATE.format(bucket=bucket)


def _cluster(bus: Bus) -> str | None:
    name = bus.server_info.get("cluster")
    return name if isinstance(name, str) and name else None


def _cluster_servers(bus: Bus) -> int:
    urls = bus.server_info.get("connect_urls")
    return len(urls) if isinstance(urls, list) else 0


def default_replicas(bus: Bus) -> int:
    """The replica count the server calls for: 3 on a JetStream cluster, 1 on a
    single server. Worked out from the server's INFO once per bus."""
    cached = _defaults.get(bus)
    if cached is not None:
        return cached
    info = bus.server_info
    if not info:  # not connected yet: decide later
        return 1
    cluster = _cluster(bus)
    replicas = CLUSTER_REPLICAS if cluster else 1
    _defaults[bus] = replicas
    logger.debug(
        "JetStream assets default to %d replica(s): %s",
        replicas,
        f"cluster {cluster}" if cluster else "a single server",
    )
    return replicas


def wanted_replicas(bus: Bus, replicas: int | None) -> int:
    """The replica count for a new or opened asset: ``replicas``, else the
    bus's ``js_replicas`` setting, else :func:`default_replicas`.

    Raises:
        ConfigError: the count is not between 1 and 5.
    """
    wanted = replicas if replicas is not None else bus.js_replicas
    if wanted is None:
        return default_replicas(bus)
    if not 1 <= wanted <= MAX_REPLICAS:
        raise ConfigError(f"a JetStream replica count is 1 to {MAX_REPLICAS}, not {wanted}")
    return wanted


def placement_error(exc: BaseException, *, what: str, wanted: int, bus: Bus) -> StoreError | None:
    """A clear error when JetStream refused ``wanted`` copies of ``what``;
    ``None`` when ``exc`` is another failure.
    """
    if not isinstance(exc, nats.js.errors.APIError):
        return None
    if exc.err_code == _NOT_CLUSTERED:
        return _not_clustered(what, wanted)
    if exc.err_code in (_NO_PEERS, _INSUFFICIENT_RESOURCES):
        cluster = _cluster(bus)
        known = _cluster_servers(bus)
        seen = f"; {known} are in the cluster now" if known else ""
        return StoreError(
            f"{what} wants {wanted} replicas, but JetStream cluster {cluster or '?'} cannot "
            f"place them ({exc.description or 'no suitable peers'}): it needs {wanted} "
            f"JetStream servers up{seen}; {_HOW_TO_SET}"
        )
    return None


def _not_clustered(what: str, wanted: int) -> StoreError:
    return StoreError(
        f"{what} wants {wanted} replicas, but the NATS server is not part of a "
        f"JetStream cluster and keeps one copy: {_HOW_TO_SET} (1), or run a "
        "cluster (docs/cluster.md)"
    )


async def ensure_replicas(
    js: JetStreamContext, stream: str, wanted: int, *, what: str, settle_timeout: float = 10.0
) -> None:
    """Raise an existing asset's replica count to ``wanted``.

    An asset with fewer copies is updated and a warning names it, with the
    current and wanted counts. An update JetStream refuses, or answers with
    fewer copies than asked for (the configuration it answers is read back),
    is reported as a warning and the asset is used as it is, except on a
    server outside a cluster (the stream's info names no cluster), where more
    than one copy can never be: that is an error, the update not tried.

    JetStream answers the update before the stream, now a new Raft group, has
    elected its leader (measured: about 70 ms with no leader on a local
    3-node cluster), and a write sent meanwhile waits out its whole timeout
    (5 s); so this returns once the stream has a leader again, or after
    ``settle_timeout`` seconds.

    Args:
        js: the JetStream context.
        stream: the asset's stream.
        wanted: the replica count it should have.
        what: the asset, for messages (``KV bucket fleet_sessions``).
        settle_timeout: seconds to wait for the updated stream's leader.

    Raises:
        StoreError: ``wanted`` is more than 1 on a server outside a cluster.
        nats.errors.Error: reading the stream's configuration failed (the
            caller translates it).
    """
    info = await js.stream_info(stream)
    current = info.config.num_replicas or 1
    if current >= wanted:
        return
    if info.cluster is None or not info.cluster.name:
        # A stream outside a JetStream cluster (its info names none): 2.15
        # refuses the update (10074), but 2.11 and 2.12.0 take it and answer
        # the copies asked for, which one server cannot keep.
        raise _not_clustered(what, wanted)
    try:
        updated = await js.update_stream(info.config.evolve(num_replicas=wanted))
    except (nats.errors.Error, TimeoutError) as exc:
        if isinstance(exc, nats.js.errors.APIError) and exc.err_code == _NOT_CLUSTERED:
            raise _not_clustered(what, wanted) from exc
        reason = getattr(exc, "description", None) or str(exc) or type(exc).__name__
        logger.warning(
            "%s has %d replica(s), %d wanted; updating it failed (%s), it keeps %d",
            what,
            current,
            wanted,
            reason,
            current,
        )
        return
    kept = updated.config.num_replicas or 1
    if kept < wanted:  # taken, and not done: read back, not believed
        logger.warning(
            "%s has %d replica(s), %d wanted; the server took the update but keeps %d",
            what,
            current,
            wanted,
            kept,
        )
        return
    if await _wait_for_leader(js, stream, timeout=settle_timeout):
        logger.warning(
            "%s had %d replica(s), %d wanted; updated it to %d", what, current, wanted, wanted
        )
    else:
        logger.warning(
            "%s had %d replica(s), %d wanted; updated it to %d, but it has no leader after %gs",
            what,
            current,
            wanted,
            wanted,
            settle_timeout,
        )


async def _wait_for_leader(js: JetStreamContext, stream: str, *, timeout: float) -> bool:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        remaining = deadline - loop.time()
        if remaining <= 0:
            return False
        try:
            info = await asyncio.wait_for(js.stream_info(stream), min(1.0, remaining))
        except (nats.errors.Error, TimeoutError):
            pass
        else:
            if info.cluster is None or info.cluster.leader:
                return True
        await asyncio.sleep(0.05)
