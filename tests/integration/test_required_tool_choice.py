"""A reply that must end with a structured answer asks the provider for
``tool_choice="required"`` where the model supports it, ``auto`` and a
reminder in words where it does not: what the real openai SDK sent, read
back from the local OpenAI-wire server."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator

import pytest
from pydantic import BaseModel

from fleetbus.agents import Agent, AgentSettings
from fleetbus.bus import Bus
from fleetbus.models import ModelConfig, ModelError
from fleetbus.models.bus_model import BusChatModel
from fleetbus.models.model import ModelRequest, ModelStreamItem, supports_required_tool_choice
from fleetbus.models.model_worker import ModelWorker
from fleetbus.models.openai_model import OpenAIChatModel, OpenAIConfig
from fleetbus.testing import ScriptedModel
from fleetbus.tools_workers import Toolkit, tool
from tests.openai_server import FakeOpenAIServer, SseReply, sse, text_chunks, tool_call_chunks

FAST = OpenAIConfig(max_retries=0, connect_timeout=2.0, read_timeout=10.0)
NO_RETRY = ModelConfig(max_retries=0, backoff=0.0, timeout=20.0)
ANSWER = '{"city": "Oslo", "celsius": 3.5}'


class Forecast(BaseModel):
    city: str
    celsius: float


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


class Undeclared:
    """A model that says nothing of ``tool_choice="required"``: the adapter
    behind it, without its declaration."""

    def __init__(self, inner: OpenAIChatModel) -> None:
        self.inner = inner

    @property
    def name(self) -> str:
        return self.inner.name

    def stream(self, request: ModelRequest) -> AsyncIterator[ModelStreamItem]:
        return self.inner.stream(request)


@pytest.fixture
def server() -> Iterator[FakeOpenAIServer]:
    with FakeOpenAIServer() as fake:
        yield fake


def _finish_call() -> SseReply:
    return sse(tool_call_chunks(0, "call_1", "generate_response", ANSWER), finish="tool_calls")


async def test_structured_output_asks_for_required(server: FakeOpenAIServer) -> None:
    server.add(_finish_call())
    async with OpenAIChatModel("fake-model", base_url=server.url, config=FAST) as model:
        assert supports_required_tool_choice(model)
        agent = Agent(
            "weather", "You forecast.", model, settings=AgentSettings(model_calls=NO_RETRY)
        )
        final = await asyncio.wait_for(agent.reply("Oslo?", structured_model=Forecast), 30)

    assert final.structured == {"city": "Oslo", "celsius": 3.5}
    (body,) = server.bodies
    assert body["tool_choice"] == "required"
    assert [t["function"]["name"] for t in body["tools"]] == ["generate_response"]


async def test_a_reply_without_structured_output_asks_for_auto(server: FakeOpenAIServer) -> None:
    server.add(sse(text_chunks("Cold.")))
    async with OpenAIChatModel("fake-model", base_url=server.url, config=FAST) as model:
        agent = Agent(
            "weather",
            "You forecast.",
            model,
            toolkit=Toolkit([add]),
            settings=AgentSettings(model_calls=NO_RETRY),
        )
        await asyncio.wait_for(agent.reply("Oslo?"), 30)

    (body,) = server.bodies
    assert body["tool_choice"] == "auto"


@pytest.mark.parametrize("how", ["undeclared", "configured off"])
async def test_a_model_without_required_gets_auto_and_the_reminder(
    server: FakeOpenAIServer, how: str
) -> None:
    server.add(sse(text_chunks("It is cold in Oslo.")), _finish_call())
    config = FAST.model_copy(update={"required_tool_choice": how != "configured off"})
    async with OpenAIChatModel("fake-model", base_url=server.url, config=config) as adapter:
        model = Undeclared(adapter) if how == "undeclared" else adapter
        assert not supports_required_tool_choice(model)
        agent = Agent(
            "weather", "You forecast.", model, settings=AgentSettings(model_calls=NO_RETRY)
        )
        final = await asyncio.wait_for(agent.reply("Oslo?", structured_model=Forecast), 30)

    assert final.structured == {"city": "Oslo", "celsius": 3.5}
    first, second = server.bodies
    assert first["tool_choice"] == second["tool_choice"] == "auto"
    reminder = second["messages"][-1]
    assert reminder["role"] == "user"
    assert "generate_response" in reminder["content"]


async def test_a_fallback_that_cannot_be_forced_is_asked_for_auto(
    server: FakeOpenAIServer,
) -> None:
    class Forcing(ScriptedModel):
        supports_required_tool_choice = True

    primary = Forcing([ModelError("down", retryable=False)])
    server.add(_finish_call())
    async with OpenAIChatModel("fake-model", base_url=server.url, config=FAST) as adapter:
        config = NO_RETRY.model_copy(update={"fallback": Undeclared(adapter)})
        agent = Agent(
            "weather", "You forecast.", primary, settings=AgentSettings(model_calls=config)
        )
        final = await asyncio.wait_for(agent.reply("Oslo?", structured_model=Forecast), 30)

    assert final.structured == {"city": "Oslo", "celsius": 3.5}
    assert primary.requests[0].tool_choice == "required"
    assert server.bodies[0]["tool_choice"] == "auto"


@pytest.mark.parametrize("declared", [True, False])
async def test_a_model_on_the_bus_is_forced_where_its_worker_s_model_can_be(
    server: FakeOpenAIServer, bus: Bus, declared: bool
) -> None:
    """Through a model worker: the worker passes ``required`` on to a model
    that honours it, and asks one that does not for ``auto`` (the agent's
    reminder then brings the structured answer)."""
    if not declared:
        server.add(sse(text_chunks("It is cold in Oslo.")))
    server.add(_finish_call())
    async with OpenAIChatModel("fake-model", base_url=server.url, config=FAST) as adapter:
        served = adapter if declared else Undeclared(adapter)
        worker = ModelWorker(bus, served, name="forecaster")
        async with asyncio.TaskGroup() as tg:
            task = tg.create_task(worker.run())
            await worker.wait_ready()
            try:
                model = BusChatModel(bus, "forecaster", timeout=20)
                assert supports_required_tool_choice(model)
                agent = Agent(
                    "weather", "You forecast.", model, settings=AgentSettings(model_calls=NO_RETRY)
                )
                final = await asyncio.wait_for(agent.reply("Oslo?", structured_model=Forecast), 30)
            finally:
                worker.stop()
                await task

    assert final.structured == {"city": "Oslo", "celsius": 3.5}
    expected = "required" if declared else "auto"
    assert [body["tool_choice"] for body in server.bodies] == [expected] * len(server.bodies)
    assert len(server.bodies) == (1 if declared else 2)
