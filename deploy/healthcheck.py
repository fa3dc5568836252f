"""The health check of a fleetbus container: exit 0 when what the container
runs is serving, 1 (with one line on stderr saying why) when it is not.

    python /opt/fleetbus/healthcheck.py tools     # a tool worker
    python /opt/fleetbus/healthcheck.py models    # a model worker
    python /opt/fleetbus/healthcheck.py agents    # an agent host (fleetbus agent)
    python /opt/fleetbus/healthcheck.py http://127.0.0.1:8710/healthz

A word: the process of this container answers the service discovery of the
fleet (``$SRV.INFO``) under that kind's service name, on the fleet's prefix.
Its worker id (``worker.<host>-<pid>``, ``model-worker.<host>-<pid>``) or
replica id (``<label>@<host>-<pid>``) names this container's host name, which
Docker makes the container's id: the answer of this container, not of another
one of the same service. A worker or host answers once it serves, so a
process that started but cannot reach NATS, or has not registered yet, is
not healthy.

A URL: it answers 200, and a JSON object it answers has no ``"ok": false``
(the gateway's ``/healthz`` says whether it is connected to NATS; the
nats-server monitor's ``/healthz`` answers 503 until JetStream is ready).

NATS is reached as ``fleetbus`` commands reach it (``FLEETBUS_NATS_URL``,
``FLEETBUS_PREFIX`` and the credential variables). The Dockerfile copies this
file into the image; docker-compose.yml runs it.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import sys
import urllib.error
import urllib.request

SERVICES = {"tools": "fleetbus", "models": "fleetbus-models", "agents": "fleetbus-agents"}
"""The micro service each kind registers under (fleetbus.bus.SERVICE_NAME,
fleetbus.models.model_worker.MODEL_SERVICE_NAME,
fleetbus.agents.serving.AGENT_SERVICE_NAME), named here so that a check does
not import the agents' and models' packages."""

IDS = ("worker_id", "replica_id")
"""The metadata that names the process: a worker's id, an agent host replica's."""

TIMEOUT = 3.0
"""Seconds a check waits for its answers."""


async def serving(kind: str, host: str) -> str | None:
    """Why this container's ``kind`` is not serving, or None when it is."""
    from fleetbus.bus import Bus, ConnectOptions, discover

    options = ConnectOptions.from_env(name=f"healthcheck.{host}", connect_timeout=TIMEOUT)
    bus = await Bus.connect(options=options, timeout=TIMEOUT)
    try:
        found = await discover(bus, SERVICES[kind], timeout=TIMEOUT)
    finally:
        await bus.close()
    mine = re.compile(rf"[.@]{re.escape(host)}-\d+")
    for service in found:
        if service.metadata.get("fleetbus_prefix") != bus.prefix:
            continue
        if any(mine.search(service.metadata.get(key, "")) for key in IDS):
            return None
    return (
        f"no {SERVICES[kind]} service of host {host} answered on prefix {bus.prefix} "
        f"({len(found)} other(s) did)"
    )


def answers(url: str) -> str | None:
    """Why ``url`` is not healthy, or None when it is."""
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT) as response:
            body = response.read()
    except (urllib.error.URLError, OSError) as exc:
        return f"{url}: {exc}"
    try:
        doc = json.loads(body)
    except ValueError:
        return None
    if isinstance(doc, dict) and doc.get("ok") is False:
        return f"{url}: {body.decode(errors='replace')}"
    return None


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not (argv[0] in SERVICES or argv[0].startswith("http")):
        print(f"usage: healthcheck.py {{{','.join(SERVICES)}}} | URL", file=sys.stderr)
        return 2
    what = argv[0]
    try:
        if what in SERVICES:
            problem = asyncio.run(serving(what, socket.gethostname()))
        else:
            problem = answers(what)
    except Exception as exc:  # any failure means: not serving
        problem = f"{type(exc).__name__}: {exc}"
    if problem:
        print(problem, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
