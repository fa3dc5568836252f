"""The agents' directory on the bus: which agents are served, what each does,
and with which tools.

Every :class:`~fleetbus.agents.serving.AgentHost` replica registers the NATS
micro service ``fleetbus-agents`` (:data:`AGENT_SERVICE_NAME`) and answers
``$SRV.PING``, ``$SRV.INFO`` and ``$SRV.STATS`` for it, as tool and model
workers do for theirs, so ``nats micro ls`` lists the agent hosts too. A
host given agent definitions lists one endpoint per agent:

- ``name``: the agent's name; ``subject``: its inbox
  (``<prefix>.agent.<name>.inbox``); ``queue_group``: the queue group it is
  served in (``host.<group>``, or ``agent.<name>`` without a group);
- ``metadata["description"]``: its description (``Agent(description=...)``);
- ``metadata["tools"]``: its toolkit's tools as a compact JSON text, a list
  of ``{"name": ..., "description": ...}`` (the tools in its toolkit when the
  host was built; tools a toolkit finds on the bus later are not listed).

The service's metadata holds ``fleetbus_prefix``, ``replica_id``, and
``group`` when the host has one. A host serving a population (an
:class:`~fleetbus.agents.serving.AgentSource` that builds its agents on
demand) lists no endpoint, since it would have to build every agent to
describe it, and says ``"population": "true"``.

The INFO document fits the server's ``max_payload``. When it would not, the
host makes it fit once, as it registers, in steps that keep every ``tools``
text valid JSON: descriptions cut to 256 characters and each tool's to 64;
then descriptions to 64 and tools by name only; then only the first agents
that fit are listed, and a warning says how many (with 1 MiB, a thousand
agents with 1,024-character descriptions and a few tools each are all listed,
their texts cut). ``MicroService`` would otherwise cut each metadata value of
every answer to 256 characters, a ``tools`` text mid-JSON.

:func:`discover_agents` asks every replica of this bus's prefix for its INFO
and merges the answers, one :class:`AgentInfo` per agent.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace

import msgspec

from fleetbus._version import __version__
from fleetbus.agents.agent import Agent
from fleetbus.bus import Bus, EndpointInfo, MicroService, discover
from fleetbus.bus.subjects import check_name
from fleetbus.errors import InvalidSubjectError
from fleetbus.protocol.codec import clip

__all__ = ["AGENT_SERVICE_NAME", "AgentInfo", "ToolInfo", "agent_service", "discover_agents"]

logger = logging.getLogger(__name__)

AGENT_SERVICE_NAME = "fleetbus-agents"
"""The NATS micro service name every agent host replica registers under."""

_CUTS: tuple[tuple[int | None, int | None], ...] = ((None, None), (256, 64), (64, 0))
"""Most characters of an agent's description and of each tool's, tried in
turn until the INFO document fits (``None``: whole)."""


@dataclass(frozen=True, slots=True)
class ToolInfo:
    """A tool of a served agent, as the directory lists it."""

    name: str
    description: str = ""


@dataclass(frozen=True, slots=True)
class AgentInfo:
    """A served agent found by :func:`discover_agents`."""

    name: str
    description: str
    """What it does (``Agent.description``; cut when the host's directory
    entry had to be shortened to fit ``max_payload``)."""
    tools: tuple[ToolInfo, ...]
    """Its toolkit's tools, in the toolkit's order."""
    replicas: int
    """How many host replicas list it."""


class _ToolDoc(msgspec.Struct):
    name: str
    description: str = ""


_tools_decoder = msgspec.json.Decoder(list[_ToolDoc])


def agent_service(
    bus: Bus, agents: Sequence[Agent] | None, *, replica_id: str, group: str | None
) -> MicroService:
    """The ``fleetbus-agents`` micro service of one host replica (not yet
    answering: run it with :meth:`MicroService.run`).

    Args:
        bus: the host's connection (its prefix and ``max_payload``).
        agents: the definitions to list; ``None`` for a population, which
            lists none.
        replica_id: the host replica's id.
        group: the host's group, if it serves with one.

    Raises:
        InvalidSubjectError: an agent name or the group is not a subject token.
    """
    metadata = {"fleetbus_prefix": bus.prefix, "replica_id": replica_id}
    if group is not None:
        metadata["group"] = group
    if agents is None:
        metadata["population"] = "true"
        return _service(bus, metadata, [])
    subjects = bus.subjects
    rows = [
        (
            agent.name,
            subjects.agent_inbox(agent.name),
            subjects.host_queue(group) if group is not None else subjects.agent_queue(agent.name),
            agent.description,
            [(spec.name, spec.description) for spec in agent.toolkit.specs()]
            if agent.toolkit is not None
            else [],
        )
        for agent in agents
    ]
    limit = bus.max_payload
    for description_chars, tool_chars in _CUTS:
        endpoints = [_endpoint(*row, description_chars, tool_chars) for row in rows]
        service = _service(bus, metadata, endpoints)
        if len(msgspec.json.encode(service.info())) <= limit:
            if description_chars is not None:
                logger.warning(
                    "the agents' directory entry of %s exceeds max_payload (%d bytes) with "
                    "whole texts: descriptions cut to %d characters, tools' to %d",
                    replica_id,
                    limit,
                    description_chars,
                    tool_chars,
                )
            return service
    # Still too large with the shortest texts: the first agents that fit.
    info = service.info()
    room = limit - len(msgspec.json.encode({**info, "endpoints": []}))
    kept = 0
    for endpoint in info["endpoints"]:
        room -= len(msgspec.json.encode(endpoint)) + 1  # and a comma
        if room < 0:
            break
        kept += 1
    logger.warning(
        "the agents' directory entry of %s exceeds max_payload (%d bytes): %d of %d agent(s) "
        "listed, their texts cut",
        replica_id,
        limit,
        kept,
        len(endpoints),
    )
    return _service(bus, metadata, endpoints[:kept])


def _service(bus: Bus, metadata: dict[str, str], endpoints: list[EndpointInfo]) -> MicroService:
    return MicroService(
        bus,
        name=AGENT_SERVICE_NAME,
        version=__version__,
        description="fleetbus agent host",
        metadata=metadata,
        endpoints=endpoints,
    )


def _endpoint(
    name: str,
    subject: str,
    queue_group: str,
    description: str,
    tools: list[tuple[str, str]],
    description_chars: int | None,
    tool_chars: int | None,
) -> EndpointInfo:
    listed = [
        {"name": tool_name, "description": _cut(text, tool_chars)} for tool_name, text in tools
    ]
    return EndpointInfo(
        name=name,
        subject=subject,
        queue_group=queue_group,
        metadata={
            "description": _cut(description, description_chars),
            "tools": msgspec.json.encode(listed).decode(),
        },
    )


def _cut(text: str, chars: int | None) -> str:
    if chars is None:
        return text
    return clip(text, chars) if chars else ""


async def discover_agents(bus: Bus, *, timeout: float = 0.5) -> list[AgentInfo]:
    """The agents served on this bus's prefix, sorted by name.

    Asks every agent host replica for its INFO (``$SRV.INFO.fleetbus-agents``)
    within ``timeout`` seconds, keeps those of this bus's prefix, and merges
    them: one :class:`AgentInfo` per agent, ``replicas`` the number of
    replicas that list it. A host serving a population lists none of its
    agents. An answer that is not an INFO document, or an endpoint whose
    name is not an agent name, is skipped (logged at debug level); an agent
    whose ``tools`` text cannot be read is listed with no tools unless
    another replica's entry can be read.

    Raises:
        BusError: the request could not be sent.
    """
    services = await discover(bus, AGENT_SERVICE_NAME, timeout=timeout)
    found: dict[str, AgentInfo] = {}
    unread: set[str] = set()  # agents listed so far only with tools that could not be read
    for service in services:
        if service.metadata.get("fleetbus_prefix") != bus.prefix:
            continue
        listed: set[str] = set()
        for endpoint in service.endpoints:
            try:
                name = check_name(endpoint.name, what="agent name")
            except InvalidSubjectError:
                logger.debug("%s %s lists a malformed agent name", AGENT_SERVICE_NAME, service.id)
                continue
            if name in listed:
                logger.debug("%s %s lists agent %s twice", AGENT_SERVICE_NAME, service.id, name)
                continue
            listed.add(name)
            description = endpoint.metadata.get("description", "")
            tools = _read_tools(endpoint.metadata.get("tools", "[]"))
            if tools is None:
                logger.debug(
                    "%s %s lists agent %s with unreadable tools",
                    AGENT_SERVICE_NAME,
                    service.id,
                    name,
                )
            known = found.get(name)
            if known is None:
                found[name] = AgentInfo(name, description, tools or (), replicas=1)
                if tools is None:
                    unread.add(name)
            elif name in unread and tools is not None:
                found[name] = AgentInfo(name, description, tools, replicas=known.replicas + 1)
                unread.discard(name)
            else:
                found[name] = replace(known, replicas=known.replicas + 1)
    return [found[name] for name in sorted(found)]


def _read_tools(text: str) -> tuple[ToolInfo, ...] | None:
    """The tools of an endpoint's ``tools`` text; ``None`` if it is not a
    JSON list of ``{"name", "description"}`` objects."""
    try:
        docs = _tools_decoder.decode(text)
    except msgspec.DecodeError:
        return None
    return tuple(ToolInfo(doc.name, doc.description) for doc in docs)
