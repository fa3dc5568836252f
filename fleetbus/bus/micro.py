"""NATS micro services: registration (``$SRV.PING``, ``$SRV.INFO``,
``$SRV.STATS``) and discovery.

fleetbus speaks the NATS micro protocol itself rather than through
``nats.micro``: that module dispatches requests through subscription
callbacks, one at a time per endpoint, while fleetbus serves with its own
bounded-concurrency loops (:meth:`Bus.serve`). A registered service answers
the three control verbs on all three subject forms (``$SRV.<VERB>``,
``$SRV.<VERB>.<name>``, ``$SRV.<VERB>.<name>.<id>``) with the standard JSON
documents, so ``nats micro ls`` and any micro-aware tool list fleetbus workers.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import msgspec
import nats.errors
from nats.aio.msg import Msg
from nats.nuid import NUID

from fleetbus.bus._serve import settle
from fleetbus.bus.connection import Bus
from fleetbus.errors import BusError, ConnectionClosedError
from fleetbus.protocol.codec import clip

__all__ = ["EndpointInfo", "EndpointStats", "MicroService", "ServiceInfo", "discover"]

logger = logging.getLogger(__name__)

_VERBS = ("PING", "INFO", "STATS")
_nuid = NUID()

MAX_LAST_ERROR = 512
"""Most characters of an endpoint's ``last_error`` in STATS: an error that
quotes what a request carried is cut there, so the document stays small."""


@dataclass(frozen=True, slots=True)
class EndpointInfo:
    """One endpoint of a service, as INFO describes it."""

    name: str
    subject: str
    queue_group: str
    metadata: dict[str, str] = field(default_factory=dict)


@dataclass(slots=True)
class EndpointStats:
    """Counters of one endpoint, as STATS reports them (times in ns)."""

    num_requests: int = 0
    num_errors: int = 0
    last_error: str = ""
    processing_time: int = 0

    def record(self, elapsed_ns: int, error: str | None = None) -> None:
        """Count one handled request."""
        self.num_requests += 1
        self.processing_time += elapsed_ns
        if error is not None:
            self.num_errors += 1
            self.last_error = clip(error, MAX_LAST_ERROR)

    @property
    def average_processing_time(self) -> int:
        """Mean processing time in ns."""
        return self.processing_time // self.num_requests if self.num_requests else 0


@dataclass(frozen=True, slots=True)
class ServiceInfo:
    """A service instance found by :func:`discover`."""

    name: str
    id: str
    version: str
    description: str
    metadata: dict[str, str]
    endpoints: list[EndpointInfo]


class MicroService:
    """Registration of one service instance on the bus.

    Args:
        bus: the connection to answer on.
        name: service name (letters, digits, ``-``, ``_``).
        version: semantic version.
        description: shown by INFO.
        metadata: string pairs shown by PING, INFO and STATS.
        endpoints: the endpoints to advertise.
    """

    def __init__(
        self,
        bus: Bus,
        *,
        name: str,
        version: str,
        description: str = "",
        metadata: dict[str, str] | None = None,
        endpoints: list[EndpointInfo] | None = None,
    ) -> None:
        self._bus = bus
        self.name = name
        self.version = version
        self.description = description
        self.metadata = dict(metadata or {})
        self.endpoints = list(endpoints or [])
        self.id = _nuid.next().decode()
        self.started = datetime.now(UTC)
        self.stats: dict[str, EndpointStats] = {e.name: EndpointStats() for e in self.endpoints}

    def record(self, endpoint: str, started_ns: int, error: str | None = None) -> None:
        """Count a request on ``endpoint`` that began at ``started_ns``
        (``time.perf_counter_ns``)."""
        self.stats[endpoint].record(time.perf_counter_ns() - started_ns, error)

    def _identity(self, kind: str) -> dict[str, Any]:
        return {
            "type": f"io.nats.micro.v1.{kind}_response",
            "name": self.name,
            "id": self.id,
            "version": self.version,
            "metadata": self.metadata,
        }

    def ping(self) -> dict[str, Any]:
        """The PING document."""
        return self._identity("ping")

    def info(self) -> dict[str, Any]:
        """The INFO document."""
        doc = self._identity("info")
        doc["description"] = self.description
        doc["endpoints"] = [
            {
                "name": e.name,
                "subject": e.subject,
                "queue_group": e.queue_group,
                "metadata": e.metadata,
            }
            for e in self.endpoints
        ]
        return doc

    def stats_doc(self) -> dict[str, Any]:
        """The STATS document."""
        doc = self._identity("stats")
        doc["started"] = self.started.isoformat().replace("+00:00", "Z")
        doc["endpoints"] = [
            {
                "name": e.name,
                "subject": e.subject,
                "queue_group": e.queue_group,
                "num_requests": self.stats[e.name].num_requests,
                "num_errors": self.stats[e.name].num_errors,
                "last_error": self.stats[e.name].last_error,
                "processing_time": self.stats[e.name].processing_time,
                "average_processing_time": self.stats[e.name].average_processing_time,
            }
            for e in self.endpoints
        ]
        return doc

    async def run(self, stop: asyncio.Event, ready: asyncio.Event | None = None) -> None:
        """Answer PING/INFO/STATS until ``stop`` is set.

        Raises:
            ConnectionClosedError: the bus is closed.
        """
        nc = self._bus.nc
        subs = []
        try:
            for verb in _VERBS:
                for subject in (
                    f"$SRV.{verb}",
                    f"$SRV.{verb}.{self.name}",
                    f"$SRV.{verb}.{self.name}.{self.id}",
                ):
                    subs.append(await nc.subscribe(subject))
            await settle(nc)
        except (nats.errors.Error, TimeoutError) as exc:
            raise ConnectionClosedError(f"cannot register service {self.name}: {exc}") from exc
        if ready is not None:
            ready.set()
        answers = {"PING": self.ping, "INFO": self.info, "STATS": self.stats_doc}
        try:
            async with asyncio.TaskGroup() as tg:
                for sub in subs:
                    verb = sub.subject.split(".")[1]
                    tg.create_task(self._answer(sub.messages, answers[verb], verb))
                await stop.wait()
                for sub in subs:
                    await _unsubscribe(sub)
        finally:
            for sub in subs:
                await _unsubscribe(sub)

    async def _answer(self, messages: Any, make: Callable[[], dict[str, Any]], verb: str) -> None:
        msg: Msg
        async for msg in messages:
            if not msg.reply:
                continue
            try:
                await msg.respond(self._fit(make(), verb))
            except nats.errors.Error as exc:
                logger.warning("%s reply of %s not sent: %s", verb, self.name, exc)

    def _fit(self, doc: dict[str, Any], verb: str) -> bytes:
        """``doc`` encoded, within the server's ``max_payload``.

        The counters and names are small; what can make a document too large
        is the endpoints' texts (tool descriptions and schemas, last errors).
        Those are cut first; endpoints that still do not fit are left out,
        and a warning says how many.
        """
        limit = self._bus.max_payload
        payload = msgspec.json.encode(doc)
        if len(payload) <= limit:
            return payload
        endpoints: list[dict[str, Any]] = doc.get("endpoints", [])
        doc["endpoints"] = [_brief_endpoint(e) for e in endpoints]
        payload = msgspec.json.encode(doc)
        while len(payload) > limit and doc["endpoints"]:
            doc["endpoints"] = doc["endpoints"][: len(doc["endpoints"]) // 2]
            payload = msgspec.json.encode(doc)
        logger.warning(
            "%s document of %s exceeds max_payload (%d bytes): texts cut, %d of %d endpoint(s) "
            "listed",
            verb,
            self.name,
            limit,
            len(doc["endpoints"]),
            len(endpoints),
        )
        return payload


def _brief_endpoint(endpoint: dict[str, Any]) -> dict[str, Any]:
    """``endpoint`` of a document with its long texts cut."""
    brief = dict(endpoint)
    if "last_error" in brief:
        brief["last_error"] = clip(brief["last_error"], 64)
    if "metadata" in brief:
        brief["metadata"] = {k: clip(v, 256) for k, v in brief["metadata"].items()}
    return brief


async def _unsubscribe(sub: Any) -> None:
    try:
        await sub.unsubscribe()
    except nats.errors.Error:
        pass  # already gone with the connection


class _InfoDoc(msgspec.Struct):
    name: str
    id: str
    version: str = ""
    description: str = ""
    metadata: dict[str, str] | None = None
    endpoints: list[dict[str, Any]] | None = None


async def discover(bus: Bus, name: str | None = None, *, timeout: float = 0.5) -> list[ServiceInfo]:
    """Ask every service (or those named ``name``) for its INFO.

    Collects the answers that arrive within ``timeout`` seconds; returns
    early when answers stop arriving for a tenth of that after the first.

    Raises:
        BusError: the request could not be sent.
    """
    nc = bus.nc
    inbox = nc.new_inbox()
    subject = f"$SRV.INFO.{name}" if name else "$SRV.INFO"
    found: list[ServiceInfo] = []
    try:
        sub = await nc.subscribe(inbox)
        await nc.publish(subject, b"", reply=inbox)
    except nats.errors.Error as exc:
        raise BusError(f"service discovery failed: {exc}") from exc
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    idle = max(timeout / 10, 0.02)
    try:
        while True:
            remaining = deadline - loop.time()
            if remaining <= 0:
                break
            wait = min(remaining, idle) if found else remaining
            try:
                msg = await sub.next_msg(timeout=wait)
            except nats.errors.TimeoutError:
                break
            try:
                doc = msgspec.json.decode(msg.data, type=_InfoDoc)
            except msgspec.DecodeError:
                logger.debug("ignoring a malformed INFO answer")
                continue
            found.append(
                ServiceInfo(
                    name=doc.name,
                    id=doc.id,
                    version=doc.version,
                    description=doc.description,
                    metadata=dict(doc.metadata or {}),
                    endpoints=[_endpoint(e) for e in doc.endpoints or [] if isinstance(e, dict)],
                )
            )
    finally:
        await _unsubscribe(sub)
    return found


def _endpoint(raw: dict[str, Any]) -> EndpointInfo:
    metadata = raw.get("metadata") or {}
    return EndpointInfo(
        name=str(raw.get("name", "")),
        subject=str(raw.get("subject", "")),
        queue_group=str(raw.get("queue_group", "")),
        metadata={str(k): str(v) for k, v in metadata.items()}
        if isinstance(metadata, dict)
        else {},
    )
