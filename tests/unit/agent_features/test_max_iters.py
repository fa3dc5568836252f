"""The step limit: after ``max_iters`` steps the model must answer without tools."""

from __future__ import annotations

from fleetbus import Agent, ModelConfig, Toolkit, tool
from fleetbus.agents import AgentSettings
from fleetbus.models import ModelError
from fleetbus.testing import ScriptedModel, Turn

from ._support import text_of, unanswered


def _kit(runs: list[int]) -> Toolkit:
    @tool
    def step() -> int:
        """Take one more step."""
        runs.append(len(runs))
        return len(runs)

    return Toolkit([step])


def _always_calling(*last: Turn) -> ScriptedModel:
    # A fresh call each step (different ids), so nothing is a repeated failure.
    return ScriptedModel([ScriptedModel.call("step") for _ in range(3)] + list(last))


async def test_after_max_iters_one_last_call_without_tools_gives_the_answer() -> None:
    runs: list[int] = []
    model = _always_calling("I took three steps and am not done.")
    agent = Agent("a", "You step.", model, toolkit=_kit(runs), settings=AgentSettings(max_iters=3))

    answer = await agent.reply("Step forever")

    assert runs == [0, 1, 2]
    assert len(model.requests) == 4
    assert all(r.tools and r.tool_choice == "auto" for r in model.requests[:3])
    last = model.requests[3]
    assert last.tools == []
    assert last.tool_choice == "none"
    assert "3 reasoning steps" in text_of(last.messages[-1])
    assert answer.finished_reason == "exceed_max_iters"
    assert answer.content == "I took three steps and am not done."
    assert agent.memory[-1].text == answer.content
    assert all("reasoning steps" not in m.text for m in agent.memory)  # the instruction is not kept
    assert unanswered(agent.memory) == []
    assert agent.state.reply is None


async def test_failing_last_call_says_it_stopped_after_max_iters() -> None:
    runs: list[int] = []
    model = _always_calling(ModelError("the model is down", retryable=False))
    agent = Agent(
        "a",
        "You step.",
        model,
        toolkit=_kit(runs),
        settings=AgentSettings(max_iters=3, model_calls=ModelConfig(max_retries=0)),
    )

    answer = await agent.reply("Step forever")

    assert runs == [0, 1, 2]
    assert len(model.requests) == 4
    assert answer.finished_reason == "exceed_max_iters"
    assert answer.content == "Stopped after 3 steps without a final answer."
    assert agent.memory[-1].role == "tool"  # no empty answer was stored
    assert unanswered(agent.memory) == []


async def test_answer_within_max_iters_completes() -> None:
    runs: list[int] = []
    model = _always_calling("Done in time.")
    agent = Agent("a", "You step.", model, toolkit=_kit(runs), settings=AgentSettings(max_iters=4))

    answer = await agent.reply("Step a bit")

    assert answer.finished_reason == "completed"
    assert answer.content == "Done in time."
    assert len(model.requests) == 4
    assert model.requests[3].tool_choice == "auto"
