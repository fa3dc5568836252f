"""Capabilities: plug-ins that hook into the loop through the middleware
seams, and the old keywords they replace (deprecated, still working)."""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

import pytest

from fleetbus import Agent
from fleetbus.agents import (
    AgentSettings,
    AgentState,
    AgentView,
    ContextConfig,
    Middleware,
    Permissions,
    PlanNotebook,
    ReplyContext,
)
from fleetbus.agents.offload import DirectoryOffloader
from fleetbus.capabilities import Knowledge, Memory, Offloading, Passage, Planning, Talk
from fleetbus.errors import ConfigError
from fleetbus.models import ModelConfig, ModelRequest, ModelResponse
from fleetbus.protocol import ToolResultBlock, ToolSpec, ToolUseBlock
from fleetbus.testing import ScriptedModel
from fleetbus.tools_workers import Toolkit, tool

from ._support import result_for

CLOCK = ToolSpec(
    name="clock",
    description="The time.",
    parameters={"type": "object", "properties": {}},
)


@tool(name="clock")
def toolkit_clock() -> str:
    """The toolkit's clock, which the capability's hides."""
    return "the toolkit's time"


class _ClockLayer(Middleware):
    def __init__(self, seen: list[str]) -> None:
        self.seen = seen

    def tools(self, ctx: ReplyContext) -> Sequence[ToolSpec]:
        return (CLOCK,)

    async def on_tool_call(
        self,
        ctx: ReplyContext,
        call: ToolUseBlock,
        call_next: Callable[[ToolUseBlock], Awaitable[ToolResultBlock]],
    ) -> ToolResultBlock:
        if call.name != CLOCK.name:
            return await call_next(call)
        return ToolResultBlock(id=call.id, name=call.name, output="noon", state="success")

    async def on_model_call(
        self,
        ctx: ReplyContext,
        request: ModelRequest,
        call_next: Callable[[ModelRequest], Awaitable[ModelResponse]],
    ) -> ModelResponse:
        self.seen.append("clock")
        return await call_next(request)


class Clock:
    """A capability of a test: a tool of its own, and a note in each new state."""

    def __init__(self) -> None:
        self.seen: list[str] = []
        self.prepared: list[AgentState] = []

    def middlewares(self, agent: AgentView) -> Sequence[Middleware]:
        return (_ClockLayer(self.seen),)

    def prepare_state(self, state: AgentState) -> None:
        self.prepared.append(state)


class Outer(Middleware):
    def __init__(self, seen: list[str]) -> None:
        self.seen = seen

    async def on_model_call(
        self,
        ctx: ReplyContext,
        request: ModelRequest,
        call_next: Callable[[ModelRequest], Awaitable[ModelResponse]],
    ) -> ModelResponse:
        self.seen.append("agent's")
        return await call_next(request)


async def test_a_capability_offers_its_own_tool_and_answers_it_without_toolkit_or_rules() -> None:
    clock = Clock()
    model = ScriptedModel([ScriptedModel.call("clock", {}, call_id="c"), "It is noon."])
    agent = Agent(
        "a",
        "",
        model,
        toolkit=Toolkit([toolkit_clock]),
        permissions=Permissions.from_strings(deny=["clock"]),
        middlewares=[Outer(clock.seen)],
        capabilities=[clock],
    )

    answer = await agent.reply("What time is it?")

    assert answer.content == "It is noon."
    assert [t.name for t in model.requests[0].tools] == ["clock"]  # the toolkit's is hidden
    assert result_for(agent.memory, "c").output == "noon"
    # Its layer wraps the agent's middleware: it sees each model call first.
    assert clock.seen == ["clock", "agent's", "clock", "agent's"]


def test_a_capability_prepares_the_agents_state_and_each_new_sessions() -> None:
    clock = Clock()
    agent = Agent("a", "", ScriptedModel([]), capabilities=[clock])
    session = agent.clone()
    restored = agent.clone(state=AgentState(agent_name="a"))

    assert [id(s) for s in clock.prepared] == [id(agent.state), id(session.state)]
    assert id(restored.state) not in [id(s) for s in clock.prepared]


def test_planning_gives_each_new_session_its_own_notebook_and_keeps_a_saved_one() -> None:
    notebook = PlanNotebook()
    agent = Agent(
        "a", "", ScriptedModel([]), capabilities=[Planning()], state=AgentState(agent_name="a")
    )
    kept = Agent(
        "a",
        "",
        ScriptedModel([]),
        capabilities=[Planning()],
        state=AgentState(agent_name="a", plan=notebook),
    )

    assert agent.state.plan is not None
    assert agent.initial_state().plan is not agent.state.plan
    assert kept.state.plan is notebook


async def test_talk_offers_its_tools_and_tells_the_model_when_nobody_serves_the_agent() -> None:
    model = ScriptedModel(
        [ScriptedModel.call("send_message", {"to": "bob", "message": "hi"}, call_id="s"), "Ok."]
    )
    agent = Agent("alice", "", model, capabilities=[Talk()])

    await agent.reply("Greet Bob.")

    assert [t.name for t in model.requests[0].tools] == ["send_message", "publish"]
    sent = result_for(agent.memory, "s")
    assert sent.state == "error"
    assert "not served on the bus" in str(sent.output)


def test_the_agent_takes_at_most_thirteen_parameters() -> None:
    # Capabilities are plug-ins, not parameters; the description is what a
    # directory of agents (the gateway's models, A2A cards) shows of it.
    parameters = [p for p in inspect.signature(Agent.__init__).parameters if p != "self"]
    assert len(parameters) <= 13


def test_something_that_is_not_a_capability_is_refused() -> None:
    with pytest.raises(ConfigError, match="is not a capability"):
        Agent("a", "", ScriptedModel([]), capabilities=[object()])  # type: ignore[list-item]


def test_settings_out_of_range_fail_as_they_are_made() -> None:
    with pytest.raises(ValueError, match="max_iters"):
        AgentSettings(max_iters=0)
    with pytest.raises(ValueError, match="max_repeated_calls"):
        AgentSettings(max_repeated_calls=1)
    with pytest.raises(ValueError, match="tool_timeout"):
        AgentSettings(tool_timeout=0)
    assert AgentSettings(max_repeated_calls=None).max_repeated_calls is None


class _Base:
    async def retrieve(
        self, query: str, *, limit: int, score_threshold: float | None
    ) -> list[Passage]:
        return []


class _Store:
    async def record(
        self, agent_name: str, key: str, texts: Sequence[str], *, record_id: str | None = None
    ) -> int:
        return 0

    async def retrieve(
        self, agent_name: str, key: str, query: str, *, limit: int, max_chars: int
    ) -> list[str]:
        return []


def test_the_old_keywords_still_work_with_a_deprecation_warning(tmp_path: Path) -> None:
    notebook = PlanNotebook()
    offloader = DirectoryOffloader(tmp_path)
    calls = ModelConfig(max_retries=0)
    with pytest.deprecated_call(match=r"Agent\(.*max_iters=.*\) is deprecated"):
        agent = Agent(
            "a",
            "",
            ScriptedModel([]),
            max_iters=4,
            max_repeated_calls=None,
            model_config=calls,
            context=None,
            plan=notebook,
            offloader=offloader,
            knowledge=[_Base()],
            long_term_memory=_Store(),
            long_term_memory_mode="both",
        )

    assert agent.settings.max_iters == 4
    assert agent.settings.max_repeated_calls is None
    assert agent.settings.model_calls is calls
    assert agent.settings.context == ContextConfig()
    assert [type(c) for c in agent.capabilities] == [Knowledge, Memory, Planning, Offloading]
    memory = agent.capabilities[1]
    assert isinstance(memory, Memory)
    assert memory.mode == "both"
    assert agent.state.plan is notebook
    offloading = agent.capabilities[3]
    assert isinstance(offloading, Offloading)
    assert offloading.offloader is offloader


def test_an_old_keyword_out_of_range_or_given_twice_is_a_config_error() -> None:
    with pytest.deprecated_call(), pytest.raises(ConfigError, match="max_iters"):
        Agent("a", "", ScriptedModel([]), max_iters=0)
    with pytest.deprecated_call(), pytest.raises(ConfigError, match="not both"):
        Agent("a", "", ScriptedModel([]), settings=AgentSettings(), max_iters=2)
    with pytest.raises(TypeError, match="'maxiters'"):
        Agent("a", "", ScriptedModel([]), maxiters=2)  # type: ignore[call-arg]


def test_the_model_config_attribute_stays_assignable() -> None:
    agent = Agent("a", "", ScriptedModel([]), capabilities=[Planning()])
    agent.model_config = ModelConfig(max_retries=5)
    assert agent.settings.model_calls.max_retries == 5
    assert agent.model_config.max_retries == 5
