"""A full agent reply with tools over an OpenAI-compatible endpoint, through a
model-worker process: the API key lives only on the worker."""

from __future__ import annotations

import asyncio

from fleetbus.agents import Agent, AgentSettings
from fleetbus.bus import Bus, EmbeddedServer
from fleetbus.models import BusChatModel, ModelConfig
from fleetbus.protocol import Event
from fleetbus.tools_workers import Toolkit, tool
from tests.helpers import running
from tests.openai_server import FakeOpenAIServer, sse, text_chunks, tool_call_chunks


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


async def wait_for_model(bus: Bus, name: str, timeout: float = 30.0) -> None:
    from fleetbus.bus import discover

    deadline = asyncio.get_running_loop().time() + timeout
    while asyncio.get_running_loop().time() < deadline:
        services = await discover(bus, "fleetbus-models", timeout=0.3)
        if any(
            e.name == name
            for s in services
            if s.metadata.get("fleetbus_prefix") == bus.prefix
            for e in s.endpoints
        ):
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"no model worker serves {name}")


async def test_an_agent_reply_with_tools_through_a_model_worker_process(
    nats_server: EmbeddedServer, bus: Bus
) -> None:
    with FakeOpenAIServer() as endpoint:
        endpoint.add(
            sse(tool_call_chunks(0, "call_1", "add", '{"a": 2, ', '"b": 40}'), finish="tool_calls"),
            sse(text_chunks("2 + 40 ", "= 42.")),
        )
        env = {"OPENAI_BASE_URL": endpoint.url, "OPENAI_API_KEY": "sk-on-the-worker-only"}
        command = [
            "model-worker",
            "--model",
            "gpt-test",
            "--nats",
            nats_server.url,
            "--prefix",
            bus.prefix,
        ]
        with running([command], env=env):
            await wait_for_model(bus, "gpt-test")
            agent = Agent(
                "calc",
                "You add.",
                BusChatModel(bus, "gpt-test"),
                toolkit=Toolkit([add]),
                settings=AgentSettings(model_calls=ModelConfig(max_retries=0)),
            )
            events = [
                item
                async for item in agent.reply_stream("What is 2 + 40?")
                if isinstance(item, Event)
            ]
            final = agent.state.memory[-1]
    assert final.text == "2 + 40 = 42."
    deltas = [e.data["text"] for e in events if e.event == "text_delta"]
    assert "".join(deltas) == "2 + 40 = 42."
    first, second = endpoint.bodies
    assert [t["function"]["name"] for t in first["tools"]] == ["add"]
    assert second["messages"][-1] == {"role": "tool", "tool_call_id": "call_1", "content": "42"}
    assert all(
        r.headers.get("authorization") == "Bearer sk-on-the-worker-only" for r in endpoint.requests
    )
