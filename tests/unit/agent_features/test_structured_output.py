"""Structured output: the model answers by calling ``generate_response``."""

from __future__ import annotations

import json

import pytest
from pydantic import BaseModel

from fleetbus import Agent
from fleetbus.agents import AgentSettings
from fleetbus.models import FINISH_TOOL
from fleetbus.testing import ScriptedModel

from ._support import results_of, text_of, unanswered


class Forecast(BaseModel):
    city: str
    celsius: float
    sunny: bool = False


async def test_finish_tool_is_offered_with_the_schema_of_the_structured_model() -> None:
    model = ScriptedModel([ScriptedModel.call(FINISH_TOOL, {"city": "Oslo", "celsius": 3})])
    agent = Agent("forecaster", "You forecast.", model)

    await agent.reply("Weather in Oslo?", structured_model=Forecast)

    offered = {spec.name: spec for spec in model.requests[0].tools}
    expected = Forecast.model_json_schema()
    expected.pop("title")
    assert offered[FINISH_TOOL].parameters == expected
    assert model.requests[0].tool_choice == "auto"


async def test_plain_reply_does_not_offer_the_finish_tool() -> None:
    model = ScriptedModel(["Sunny."])
    agent = Agent("forecaster", "You forecast.", model)

    answer = await agent.reply("Weather in Oslo?")

    assert FINISH_TOOL not in [spec.name for spec in model.requests[0].tools]
    assert answer.structured is None


async def test_valid_finish_call_completes_with_the_validated_dump() -> None:
    # "3.5" is coerced by validation: .structured is the validated model, not the raw input.
    model = ScriptedModel([ScriptedModel.call(FINISH_TOOL, {"city": "Oslo", "celsius": "3.5"})])
    agent = Agent("forecaster", "You forecast.", model)

    answer = await agent.reply("Weather in Oslo?", structured_model=Forecast)

    expected = Forecast(city="Oslo", celsius=3.5).model_dump(mode="json")
    assert answer.finished_reason == "completed"
    assert answer.structured == expected
    assert isinstance(answer.content, str)
    assert json.loads(answer.content) == expected
    assert len(model.requests) == 1
    assert unanswered(agent.memory) == []
    assert agent.state.reply is None


async def test_invalid_finish_call_is_shown_to_the_model_then_a_corrected_call_succeeds() -> None:
    model = ScriptedModel(
        [
            ScriptedModel.call(FINISH_TOOL, {"city": "Oslo"}),
            ScriptedModel.call(FINISH_TOOL, {"city": "Oslo", "celsius": -2, "sunny": True}),
        ]
    )
    agent = Agent("forecaster", "You forecast.", model)

    answer = await agent.reply("Weather in Oslo?", structured_model=Forecast)

    seen = model.requests[1].messages[-1]
    assert seen.role == "tool"
    [error] = results_of(seen)
    assert error.name == FINISH_TOOL
    assert error.state == "error"
    assert "invalid_parameters" in error.output
    assert "celsius" in error.output
    assert answer.finished_reason == "completed"
    assert answer.structured == {"city": "Oslo", "celsius": -2.0, "sunny": True}
    assert unanswered(agent.memory) == []


@pytest.mark.parametrize("retries", [0, 1, 2, 4])
async def test_model_that_keeps_answering_text_ends_in_error_after_the_grace(
    retries: int,
) -> None:
    model = ScriptedModel(["It is sunny."], repeat_last=True)
    agent = Agent(
        "forecaster", "You forecast.", model, settings=AgentSettings(structured_retries=retries)
    )

    answer = await agent.reply("Weather in Oslo?", structured_model=Forecast)

    assert answer.finished_reason == "error"
    assert FINISH_TOOL in str(answer.content)
    assert answer.structured is None
    assert len(model.requests) == retries + 1
    for request in model.requests[1:]:
        reminder = request.messages[-1]
        assert reminder.role == "user"
        assert FINISH_TOOL in text_of(reminder)
    assert agent.state.reply is None


async def test_invalid_finish_calls_past_the_grace_end_in_error() -> None:
    # Different wrong arguments each time, so this is not a repeated action.
    model = ScriptedModel(
        [
            ScriptedModel.call(FINISH_TOOL, {"city": "Oslo"}),
            ScriptedModel.call(FINISH_TOOL, {"celsius": 1}),
            ScriptedModel.call(FINISH_TOOL, {"city": "Oslo", "celsius": 1}),
        ]
    )
    agent = Agent(
        "forecaster", "You forecast.", model, settings=AgentSettings(structured_retries=1)
    )

    answer = await agent.reply("Weather in Oslo?", structured_model=Forecast)

    assert answer.finished_reason == "error"
    assert answer.structured is None
    assert len(model.requests) == 2
    assert model.remaining == 1
    assert unanswered(agent.memory) == []


async def test_a_raw_schema_is_checked_in_full_ranges_lengths_and_nested_refs_too() -> None:
    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "minLength": 2},
            "days": {"type": "array", "items": {"$ref": "#/$defs/Day"}},
        },
        "required": ["city", "days"],
        "$defs": {
            "Day": {
                "type": "object",
                "properties": {"celsius": {"type": "number", "minimum": -90}},
                "required": ["celsius"],
            }
        },
    }
    wrong = {"city": "O", "days": [{"celsius": -100}, {}, {"celsius": "cold"}]}
    right = {"city": "Oslo", "days": [{"celsius": -2}]}
    model = ScriptedModel(
        [ScriptedModel.call(FINISH_TOOL, wrong), ScriptedModel.call(FINISH_TOOL, right)]
    )
    agent = Agent("forecaster", "You forecast.", model)

    answer = await agent.reply("Weather in Oslo?", structured_schema=schema)

    [error] = results_of(model.requests[1].messages[-1])
    assert error.state == "error"
    assert error.output == (
        "invalid_parameters: city: 'O' is too short; "
        "days[0].celsius: -100 is less than the minimum of -90; "
        "days[1]: missing required field(s): celsius; "
        "days[2].celsius: should be number, not string. Call it again."
    )
    assert answer.finished_reason == "completed"
    assert answer.structured == right
