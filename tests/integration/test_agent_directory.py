"""The agents' directory: every AgentHost replica registers the micro service
``fleetbus-agents`` listing its agents, and ``discover_agents`` merges the
replicas' answers."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import jsonschema  # type: ignore[import-untyped]
import msgspec
import pytest
from nats.aio.msg import Msg

from fleetbus.agents import Agent, AgentHost
from fleetbus.agents.agent import MAX_DESCRIPTION_CHARS
from fleetbus.agents.serving import (
    AGENT_SERVICE_NAME,
    AgentInfo,
    ToolInfo,
    discover_agents,
)
from fleetbus.bus import Bus, EmbeddedServer
from fleetbus.protocol import FinalAnswer, UserRequest
from fleetbus.testing import ScriptedModel
from fleetbus.tools_workers import Toolkit, tool

DISCOVERY = 5.0
"""Seconds a discovery that expects answers may take: it returns once the
answers stop coming for a tenth of that, so a busy machine's late replica
is still counted."""


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@tool
def shout(text: str) -> str:
    """Upper-case a text."""
    return text.upper()


def tools_named(*names: str, description: str = "") -> Toolkit:
    """A toolkit of tools that do nothing, one per name."""

    def noop() -> str:
        return ""

    return Toolkit([tool(name=n, description=description or f"the {n} tool")(noop) for n in names])


MICRO_INFO = {
    "type": "object",
    "required": ["type", "name", "id", "version", "description", "endpoints"],
    "properties": {
        "type": {"const": "io.nats.micro.v1.info_response"},
        "name": {"type": "string", "pattern": "^[A-Za-z0-9_-]+$"},
        "id": {"type": "string", "minLength": 1},
        "version": {"type": "string", "pattern": r"^\d+\.\d+\.\d+"},
        "description": {"type": "string"},
        "metadata": {"type": "object", "additionalProperties": {"type": "string"}},
        "endpoints": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["name", "subject", "queue_group", "metadata"],
                "properties": {
                    "name": {"type": "string", "pattern": "^[A-Za-z0-9_-]+$"},
                    "subject": {"type": "string", "minLength": 1},
                    "queue_group": {"type": "string", "minLength": 1},
                    "metadata": {"type": "object", "additionalProperties": {"type": "string"}},
                },
            },
        },
    },
}
"""What ``nats micro`` reads of an INFO answer (the micro v1 protocol), with
the fields fleetbus always sends required."""


@asynccontextmanager
async def hosting(
    url: str, prefix: str, agents: Any, *, replica: str, **options: Any
) -> AsyncIterator[AgentHost]:
    """``agents`` served by an :class:`AgentHost` on a connection of its own
    until the block ends; the connection is closed then."""
    host_bus = await Bus.connect(url, prefix=prefix, name=f"host-{replica}")
    options.setdefault("lease_ttl", 1.0)
    options.setdefault("drain_timeout", 5.0)
    try:
        host = AgentHost(host_bus, agents, replica_id=replica, **options)
        async with asyncio.TaskGroup() as tg:
            tg.create_task(host.run())
            try:
                await host.wait_ready()
                yield host
            finally:
                host.stop()
    finally:
        await host_bus.close()


def two_agents() -> list[Agent]:
    model = ScriptedModel(["done"], repeat_last=True)
    return [
        Agent("beta", "", model, description="Says done.", toolkit=Toolkit()),
        Agent(
            "alpha",
            "",
            model,
            description="Adds numbers and shouts.",
            toolkit=Toolkit([add, shout]),
        ),
    ]


async def info_of(bus: Bus, host: AgentHost) -> dict[str, Any]:
    reply = await bus.nc.request(
        f"$SRV.INFO.{AGENT_SERVICE_NAME}.{host.service.id}", b"", timeout=5
    )
    assert len(reply.data) <= bus.max_payload
    doc: dict[str, Any] = msgspec.json.decode(reply.data)
    return doc


async def test_two_replicas_of_two_agents_are_discovered_once_each(
    nats_server: EmbeddedServer, bus: Bus
) -> None:
    async with (
        hosting(nats_server.url, bus.prefix, two_agents(), replica="r1"),
        hosting(nats_server.url, bus.prefix, two_agents(), replica="r2"),
    ):
        found = await discover_agents(bus, timeout=DISCOVERY)
    assert found == [
        AgentInfo(
            name="alpha",
            description="Adds numbers and shouts.",
            tools=(ToolInfo("add", "Add two integers."), ToolInfo("shout", "Upper-case a text.")),
            replicas=2,
        ),
        AgentInfo(name="beta", description="Says done.", tools=(), replicas=2),
    ]


async def test_a_host_on_another_prefix_is_not_listed(
    nats_server: EmbeddedServer, bus: Bus
) -> None:
    async with (
        hosting(nats_server.url, bus.prefix, two_agents()[:1], replica="mine"),
        hosting(nats_server.url, f"{bus.prefix}x", two_agents(), replica="theirs"),
    ):
        found = await discover_agents(bus, timeout=DISCOVERY)
    assert [(a.name, a.replicas) for a in found] == [("beta", 1)]


async def test_a_stopped_replica_leaves_the_directory(
    nats_server: EmbeddedServer, bus: Bus
) -> None:
    async with hosting(nats_server.url, bus.prefix, two_agents(), replica="stays"):
        async with hosting(nats_server.url, bus.prefix, two_agents(), replica="goes"):
            before = await discover_agents(bus, timeout=DISCOVERY)
        after = await discover_agents(bus, timeout=DISCOVERY)
    gone = await discover_agents(bus, timeout=1.0)
    assert [(a.name, a.replicas) for a in before] == [("alpha", 2), ("beta", 2)]
    assert [(a.name, a.replicas) for a in after] == [("alpha", 1), ("beta", 1)]
    assert gone == []


async def test_the_directory_answers_the_micro_verbs_with_valid_documents(
    nats_server: EmbeddedServer, bus: Bus
) -> None:
    async with hosting(
        nats_server.url, bus.prefix, two_agents(), replica="r1", group="crew"
    ) as host:
        answer = await bus.request(
            bus.subjects.agent_inbox("alpha"),
            UserRequest(content="hi", session_id="s1"),
            timeout=10,
        )
        info = await info_of(bus, host)
        ping = msgspec.json.decode(
            (await bus.nc.request(f"$SRV.PING.{AGENT_SERVICE_NAME}.{host.service.id}", b"")).data
        )
        # The request is counted once its reply has ended, just after the answer.
        deadline = asyncio.get_running_loop().time() + 10
        while True:
            stats = msgspec.json.decode(
                (
                    await bus.nc.request(f"$SRV.STATS.{AGENT_SERVICE_NAME}.{host.service.id}", b"")
                ).data
            )
            counted = {e["name"]: e["num_requests"] for e in stats["endpoints"]}
            if counted["alpha"] or asyncio.get_running_loop().time() > deadline:
                break
            await asyncio.sleep(0.01)
    assert isinstance(answer, FinalAnswer)
    jsonschema.validate(info, MICRO_INFO)
    assert info["name"] == AGENT_SERVICE_NAME
    assert info["metadata"] == {"fleetbus_prefix": bus.prefix, "replica_id": "r1", "group": "crew"}
    by_name = {e["name"]: e for e in info["endpoints"]}
    assert list(by_name) == ["beta", "alpha"]  # the host's order
    alpha = by_name["alpha"]
    assert alpha["subject"] == bus.subjects.agent_inbox("alpha")
    assert alpha["queue_group"] == "host.crew"
    assert alpha["metadata"]["description"] == "Adds numbers and shouts."
    assert alpha["metadata"]["tools"] == (
        '[{"name":"add","description":"Add two integers."},'
        '{"name":"shout","description":"Upper-case a text."}]'
    )
    assert by_name["beta"]["metadata"]["tools"] == "[]"
    assert ping["type"] == "io.nats.micro.v1.ping_response"
    assert ping["id"] == host.service.id
    assert stats["type"] == "io.nats.micro.v1.stats_response"
    assert counted == {"beta": 0, "alpha": 1}


async def test_a_host_without_a_group_lists_each_agents_own_queue_group(
    nats_server: EmbeddedServer, bus: Bus
) -> None:
    async with hosting(nats_server.url, bus.prefix, two_agents(), replica="r1") as host:
        info = await info_of(bus, host)
    assert {e["name"]: e["queue_group"] for e in info["endpoints"]} == {
        "beta": "agent.beta",
        "alpha": "agent.alpha",
    }
    assert "group" not in info["metadata"]


class Unlisted:
    """Every agent whose name starts with ``p-``: a population that cannot list
    its agents."""

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name.startswith("p-")

    def agent(self, name: str) -> Agent:
        return Agent(name, "", ScriptedModel(["hi"]), description="built on demand")


async def test_a_population_registers_with_no_agents_listed(
    nats_server: EmbeddedServer, bus: Bus
) -> None:
    async with hosting(nats_server.url, bus.prefix, Unlisted(), replica="p1", group="pop") as host:
        info = await info_of(bus, host)
        found = await discover_agents(bus, timeout=1.0)
    jsonschema.validate(info, MICRO_INFO)
    assert info["endpoints"] == []
    assert info["metadata"]["population"] == "true"
    assert found == []


async def test_a_thousand_agents_with_long_descriptions_are_all_listed_with_cut_texts(
    nats_server: EmbeddedServer, bus: Bus, caplog: pytest.LogCaptureFixture
) -> None:
    model = ScriptedModel(["done"], repeat_last=True)
    toolkit = tools_named("lookup", "store", "notify", description="y" * 2000)
    agents = [
        Agent(f"a-{i:04d}", "", model, description="x" * MAX_DESCRIPTION_CHARS, toolkit=toolkit)
        for i in range(1000)
    ]
    with caplog.at_level(logging.WARNING, logger="fleetbus.agents.serving.directory"):
        async with hosting(nats_server.url, bus.prefix, agents, replica="big", group="big") as host:
            info = await info_of(bus, host)
            found = await discover_agents(bus, timeout=DISCOVERY)
    jsonschema.validate(info, MICRO_INFO)
    assert len(found) == 1000
    first = found[0]
    assert first.name == "a-0000"
    assert first.description.startswith("x" * 256 + "…")
    assert [t.name for t in first.tools] == ["lookup", "store", "notify"]
    assert all(t.description.startswith("y" * 64 + "…") for t in first.tools)
    assert "descriptions cut to 256 characters, tools' to 64" in caplog.text
    assert f"document of {AGENT_SERVICE_NAME} exceeds" not in caplog.text  # not cut per answer


async def test_agents_past_max_payload_are_left_out_with_a_warning(
    nats_server: EmbeddedServer, bus: Bus, caplog: pytest.LogCaptureFixture
) -> None:
    model = ScriptedModel(["done"], repeat_last=True)
    toolkit = tools_named(*(f"tool_with_a_long_name_{n:02d}" for n in range(20)))
    agents = [Agent(f"a-{i:04d}", "", model, toolkit=toolkit) for i in range(1000)]
    with caplog.at_level(logging.WARNING, logger="fleetbus.agents.serving.directory"):
        async with hosting(
            nats_server.url, bus.prefix, agents, replica="huge", group="huge"
        ) as host:
            info = await info_of(bus, host)
            found = await discover_agents(bus, timeout=DISCOVERY)
    jsonschema.validate(info, MICRO_INFO)
    kept = len(info["endpoints"])
    assert 0 < kept < 1000
    assert [a.name for a in found] == [f"a-{i:04d}" for i in range(kept)]
    assert all(len(a.tools) == 20 and a.tools[0].description == "" for a in found)
    assert f"{kept} of 1000 agent(s) listed" in caplog.text
    assert f"document of {AGENT_SERVICE_NAME} exceeds" not in caplog.text  # not cut per answer


async def test_malformed_info_answers_are_skipped(nats_server: EmbeddedServer, bus: Bus) -> None:
    """Answers that are not INFO documents, or list what is not an agent,
    are skipped; the real host is still found."""

    def endpoint(name: str, tools: str) -> dict[str, Any]:
        return {
            "name": name,
            "subject": "x",
            "queue_group": "q",
            "metadata": {"description": "odd", "tools": tools},
        }

    def doc(endpoints: Any, metadata: Any = None) -> bytes:
        return json.dumps(
            {
                "type": "io.nats.micro.v1.info_response",
                "name": AGENT_SERVICE_NAME,
                "id": "fake",
                "version": "0.0.1",
                "metadata": metadata or {"fleetbus_prefix": bus.prefix},
                "endpoints": endpoints,
            }
        ).encode()

    answers = [
        b"not json",
        b"[1, 2]",
        doc("not a list"),
        doc([], metadata={"fleetbus_prefix": 7}),
        doc([endpoint("beta", "[]"), "not an object"]),
        doc([endpoint("bad name", "[]"), endpoint("beta", "[]"), endpoint("beta", "[]")]),
        doc([endpoint("alpha", '{"not": "a list"}'), endpoint("gamma", '[{"name": 1}]')]),
    ]

    async def answer(msg: Msg) -> None:
        for payload in answers:
            await msg.respond(payload)

    sub = await bus.nc.subscribe(f"$SRV.INFO.{AGENT_SERVICE_NAME}", cb=answer)
    try:
        await bus.nc.flush()
        async with hosting(nats_server.url, bus.prefix, two_agents(), replica="real"):
            found = await discover_agents(bus, timeout=DISCOVERY)
    finally:
        await sub.unsubscribe()
    by_name = {a.name: a for a in found}
    assert sorted(by_name) == ["alpha", "beta", "gamma"]
    # Listed by the real host and by the fake one, whose unreadable tools
    # do not hide the real host's.
    assert by_name["alpha"].replicas == 2
    assert [t.name for t in by_name["alpha"].tools] == ["add", "shout"]
    assert by_name["beta"].replicas == 2
    assert by_name["gamma"] == AgentInfo(name="gamma", description="odd", tools=(), replicas=1)
