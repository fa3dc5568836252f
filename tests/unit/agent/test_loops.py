"""Loops real models fall into: the same call made again and again after it
succeeded, or a short cycle of calls (A, B, A, B). The first time the model is
shown what it does, in the result of the call that closed the loop; going on
ends the reply ``repeated_action``. Calls repeated with other arguments are
not loops, and a take-over goes on detecting from the saved state."""

from __future__ import annotations

from typing import Any

import pytest

from fleetbus.agents import Agent, AgentSettings, AgentState, Msg
from fleetbus.protocol import ToolResultBlock
from fleetbus.testing import ScriptedModel
from fleetbus.tools_workers import Toolkit, tool
from tests.unit.agent.test_failures import assert_consistent

WARNING = "Loop warning"


def toolkit(runs: list[str]) -> Toolkit:
    @tool
    def weather(city: str) -> str:
        """The weather in a city."""
        runs.append(f"weather {city}")
        return f"sunny in {city}"

    @tool
    def convert(celsius: float) -> dict[str, float]:
        """Celsius to Fahrenheit."""
        runs.append(f"convert {celsius}")
        return {"fahrenheit": celsius * 9 / 5 + 32}

    @tool
    def news(topic: str) -> str:
        """The news on a topic."""
        runs.append(f"news {topic}")
        return f"nothing new on {topic}"

    return Toolkit([weather, convert, news])


CALLS: dict[str, tuple[str, dict[str, Any]]] = {
    "A": ("weather", {"city": "Oslo"}),
    "B": ("convert", {"celsius": 3}),
    "C": ("news", {"topic": "Oslo"}),
}


def turns(pattern: str) -> list[Any]:
    """One model turn calling each letter's tool (see CALLS)."""
    return [ScriptedModel.call(*CALLS[letter]) for letter in pattern]


def seen_result(model: ScriptedModel, request: int) -> ToolResultBlock:
    """The last tool result the model was sent in its ``request``-th request."""
    message = model.requests[request].messages[-1]
    assert message.role == "tool"
    block = message.content[0]
    assert isinstance(block, ToolResultBlock)
    return block


def warned(memory: list[Msg]) -> list[ToolResultBlock]:
    return [r for m in memory for r in m.tool_results if WARNING in str(r.output)]


async def test_the_same_successful_call_is_shown_to_the_model_then_ends_the_reply() -> None:
    runs: list[str] = []
    model = ScriptedModel([*turns("AAAA"), ScriptedModel.text("never asked")])
    agent = Agent("a", "", model, toolkit=toolkit(runs))

    final = await agent.reply("Weather in Oslo?")

    # The first two repeats pass; the third call's result shows the loop.
    assert WARNING not in str(seen_result(model, 1).output)
    assert WARNING not in str(seen_result(model, 2).output)
    third = seen_result(model, 3)
    assert third.state == "success"
    assert str(third.output).startswith("sunny in Oslo\n\n")  # the result, then the note
    assert 'weather({"city": "Oslo"}), 3 times' in third.output
    assert "Calling it again ends the reply" in third.output
    # The fourth ends the reply, saying what repeated.
    assert final.finished_reason == "repeated_action"
    assert 'weather({"city": "Oslo"}) was called 4 times with the same arguments' in (final.content)
    assert runs == ["weather Oslo"] * 4
    assert model.remaining == 1
    assert agent.state.reply is None
    # The note lives in the one tool result, not as a message of its own.
    assert [(m.role, m.text) for m in agent.memory if m.role == "user"] == [
        ("user", "Weather in Oslo?")
    ]
    assert all(WARNING not in m.text for m in agent.memory)
    assert len(warned(agent.memory)) == 1
    assert_consistent(agent.memory)


@pytest.mark.parametrize(
    ("cycle", "names"), [("AB", "weather → convert"), ("ABC", "weather → convert → news")]
)
async def test_a_short_cycle_is_shown_to_the_model_then_ends_the_reply(
    cycle: str, names: str
) -> None:
    runs: list[str] = []
    model = ScriptedModel([*turns(cycle * 2 + cycle[0]), ScriptedModel.text("never asked")])
    agent = Agent("a", "", model, toolkit=toolkit(runs))

    final = await agent.reply("Weather in Oslo, in Fahrenheit?")

    rounds = 2 * len(cycle)
    assert all(WARNING not in str(seen_result(model, i).output) for i in range(1, rounds))
    closing = seen_result(model, rounds)
    assert f"your last calls go round in a loop: {names}, 2 times" in closing.output
    assert "Another round ends the reply" in closing.output
    if cycle == "AB":  # a non-text result becomes text with the note after it
        assert str(closing.output).startswith('{"fahrenheit": 37.4}\n\n')
    assert final.finished_reason == "repeated_action"
    assert f"the calls {names[len('weather → ') :]} → weather went round in a loop" in (
        final.content
    )
    assert 'the last: weather({"city": "Oslo"})' in final.content
    assert len(runs) == rounds + 1
    assert model.remaining == 1
    assert len(warned(agent.memory)) == 1
    assert_consistent(agent.memory)


async def test_calls_repeated_with_other_arguments_are_not_loops() -> None:
    runs: list[str] = []
    model = ScriptedModel(
        [
            # The same tools again and again, each time with new arguments;
            # one call made twice stays under the limit.
            ScriptedModel.call("weather", {"city": "Oslo"}),
            ScriptedModel.call("convert", {"celsius": 3}),
            ScriptedModel.call("weather", {"city": "Paris"}),
            ScriptedModel.call("convert", {"celsius": 11}),
            ScriptedModel.call("weather", {"city": "Rome"}),
            ScriptedModel.call("convert", {"celsius": 18}),
            ScriptedModel.call("weather", {"city": "Oslo"}),
            ScriptedModel.call("weather", {"city": "Lima"}),
            ScriptedModel.text("Oslo 37.4 °F, Paris 51.8 °F, Rome 64.4 °F."),
        ]
    )
    agent = Agent("a", "", model, toolkit=toolkit(runs), settings=AgentSettings(max_iters=10))

    final = await agent.reply("Weather in three cities, in Fahrenheit?")

    assert final.finished_reason == "completed"
    assert len(runs) == 8
    assert warned(agent.memory) == []
    assert all(WARNING not in str(seen_result(model, i).output) for i in range(1, 9))


async def test_a_model_that_stops_repeating_after_the_warning_completes() -> None:
    runs: list[str] = []
    model = ScriptedModel([*turns("AAA"), ScriptedModel.text("It is sunny in Oslo.")])
    agent = Agent("a", "", model, toolkit=toolkit(runs))

    final = await agent.reply("Weather in Oslo?")

    assert WARNING in str(seen_result(model, 3).output)
    assert final.finished_reason == "completed"
    assert final.content == "It is sunny in Oslo."
    assert_consistent(agent.memory)


async def test_max_repeated_calls_sets_the_limit_and_none_turns_detection_off() -> None:
    runs: list[str] = []
    strict = ScriptedModel([*turns("AAA"), ScriptedModel.text("never asked")])
    answer = await Agent(
        "a", "", strict, toolkit=toolkit(runs), settings=AgentSettings(max_repeated_calls=2)
    ).reply("?")
    assert WARNING in str(seen_result(strict, 2).output)
    assert (answer.finished_reason, strict.remaining) == ("repeated_action", 1)

    off = ScriptedModel([*turns("AAAAABABAB"), ScriptedModel.text("done")])
    agent = Agent(
        "a",
        "",
        off,
        toolkit=toolkit(runs),
        settings=AgentSettings(max_repeated_calls=None, max_iters=12),
    )
    answer = await agent.reply("?")
    assert answer.finished_reason == "completed"
    assert warned(agent.memory) == []


async def test_a_take_over_goes_on_detecting_from_the_saved_state() -> None:
    saved: list[str] = []

    async def checkpoint(state: AgentState) -> None:
        saved.append(state.model_dump_json())

    runs: list[str] = []
    first = ScriptedModel([*turns("AAA"), ScriptedModel.text("done")])
    agent = Agent("a", "", first, toolkit=toolkit(runs), checkpoint=checkpoint)
    await agent.reply("Weather in Oslo?")
    # The last state saved mid-reply: the loop was shown, the reply goes on.
    states = [AgentState.model_validate_json(s) for s in saved]
    mid = [s for s in states if s.reply is not None and s.reply.loops_shown][-1]

    second = ScriptedModel([*turns("A"), ScriptedModel.text("never asked")])
    restored = Agent("a", "", second, toolkit=toolkit(runs), state=mid)
    final = await restored.reply()

    assert final.finished_reason == "repeated_action"
    assert "was called 4 times" in final.content
    assert second.remaining == 1
    assert_consistent(restored.memory)


async def test_the_saved_state_keeps_only_the_last_calls() -> None:
    lengths: list[int] = []

    async def checkpoint(state: AgentState) -> None:
        if state.reply is not None:
            lengths.append(len(state.reply.recent_calls))

    runs: list[str] = []
    calls = [ScriptedModel.call("weather", {"city": f"city {i}"}) for i in range(30)]
    model = ScriptedModel([*calls, ScriptedModel.text("done")])
    agent = Agent(
        "a",
        "",
        model,
        toolkit=toolkit(runs),
        checkpoint=checkpoint,
        settings=AgentSettings(max_iters=31),
    )

    final = await agent.reply("Weather everywhere?")

    assert final.finished_reason == "completed"
    assert len(runs) == 30
    assert max(lengths) == 20


def test_a_call_is_known_by_its_tool_and_arguments_whatever_their_order() -> None:
    from datetime import UTC, datetime

    from fleetbus.agents._tool_running import _signature
    from fleetbus.protocol import ToolUseBlock

    def signature(name: str, arguments: dict[Any, Any]) -> str:
        return _signature(ToolUseBlock(id="c1", name=name, input=arguments))

    one = signature("weather", {"city": "Oslo", "days": [1, 2], "units": {"t": "C", "w": "m/s"}})
    same = signature("weather", {"units": {"w": "m/s", "t": "C"}, "days": [1, 2], "city": "Oslo"})
    assert one == same
    assert one.startswith("weather:")
    assert one != signature("weather", {"city": "Oslo", "days": [2, 1], "units": {"t": "C"}})
    assert one != signature("news", {"city": "Oslo", "days": [1, 2], "units": {"t": "C"}})
    # What JSON cannot hold is taken as its text, not refused.
    when = datetime(2026, 12, 5, tzinfo=UTC)
    assert signature("at", {"when": when, 1: "x"}) == signature("at", {1: "x", "when": when})
