"""The tool groups a model switched on belong to its session: an agent
served on the bus keeps them for the session's next request (they are saved
with the session's state), and another session starts from the toolkit's."""

from __future__ import annotations

import asyncio

from fleetbus.agents import Agent, AgentHost
from fleetbus.bus import Bus, EmbeddedServer
from fleetbus.models.model import ModelRequest
from fleetbus.protocol import FinalAnswer, UserRequest
from fleetbus.testing import ScriptedModel
from fleetbus.tools_workers import Toolkit, tool


@tool
def add(a: int, b: int) -> int:
    """Add two numbers."""
    return a + b


@tool(group="web")
def fetch_page(url: str) -> str:
    """Fetch a web page."""
    return f"<html>{url}</html>"


def _offered(request: ModelRequest) -> set[str]:
    return {spec.name for spec in request.tools}


async def _ask(bus: Bus, text: str, session: str) -> FinalAnswer:
    answer = await bus.request(
        bus.subjects.agent_inbox("browser"),
        UserRequest(content=text, session_id=session),
        timeout=20.0,
    )
    assert isinstance(answer, FinalAnswer)
    return answer


async def test_switched_groups_hold_for_the_session_on_the_bus(
    nats_server: EmbeddedServer, prefix: str, bus: Bus
) -> None:
    model = ScriptedModel(
        [
            ScriptedModel.call("switch_tool_groups", {"web": True}),
            "The web is on.",
            "Hello again.",
            "Hello, new session.",
        ]
    )
    toolkit = Toolkit([add, fetch_page], groups={"web": "Browse the web."}, active_groups=[])
    agent = Agent("browser", "You browse.", model, toolkit=toolkit)
    host_bus = await Bus.connect(nats_server.url, prefix=prefix, name="host")
    try:
        host = AgentHost(host_bus, [agent], replica_id="r1", lease_ttl=1.0, drain_timeout=5.0)
        async with asyncio.TaskGroup() as tg:
            tg.create_task(host.run())
            try:
                await host.wait_ready()
                assert (await _ask(bus, "Switch the web on", "s-1")).finished_reason == "completed"
                await _ask(bus, "Hello", "s-1")
                await _ask(bus, "Hello", "s-2")
            finally:
                host.stop()
    finally:
        await host_bus.close()

    first, after_switch, same_session, other_session = model.requests
    assert _offered(first) == {"add", "switch_tool_groups"}
    assert _offered(after_switch) == {"add", "fetch_page", "switch_tool_groups"}
    assert _offered(same_session) == {"add", "fetch_page", "switch_tool_groups"}
    assert _offered(other_session) == {"add", "switch_tool_groups"}
