"""A plan notebook in the loop: plan tools offered, run, and a hint per step."""

from __future__ import annotations

from typing import Any

from fleetbus import Agent
from fleetbus.agents import PlanNotebook
from fleetbus.capabilities import Planning
from fleetbus.testing import ScriptedModel

from ._support import results_of, text_of

HINT = "<plan_hint>"


def _subtask(name: str) -> dict[str, str]:
    return {"name": name, "description": f"do {name}", "expected_outcome": f"{name} done"}


CREATE: dict[str, Any] = {
    "name": "Trip",
    "description": "Plan a trip to Oslo",
    "expected_outcome": "A booked trip",
    "subtasks": [_subtask("flights"), _subtask("hotel")],
}


async def test_plan_tools_are_offered_and_no_hint_is_sent_before_a_plan_exists() -> None:
    model = ScriptedModel(["Nothing to plan."])
    agent = Agent("planner", "You plan.", model, capabilities=[Planning()])

    await agent.reply("Hello")

    offered = {spec.name for spec in model.requests[0].tools}
    assert offered >= PlanNotebook.TOOL_NAMES
    assert not any(HINT in text_of(m) for m in model.requests[0].messages)


async def test_without_plan_no_plan_tools_are_offered() -> None:
    model = ScriptedModel(["Hi."])
    agent = Agent("planner", "You plan.", model)

    await agent.reply("Hello")

    assert not {spec.name for spec in model.requests[0].tools} & PlanNotebook.TOOL_NAMES
    assert agent.state.plan is None


async def test_create_plan_changes_the_state_and_the_next_step_gets_the_hint() -> None:
    model = ScriptedModel(
        [
            ScriptedModel.call("create_plan", CREATE),
            ScriptedModel.call("update_subtask_state", {"subtask_idx": 0, "state": "in_progress"}),
            "Working on flights.",
        ]
    )
    agent = Agent("planner", "You plan.", model, capabilities=[Planning()])

    answer = await agent.reply("Plan my trip to Oslo")

    assert answer.finished_reason == "completed"
    notebook = agent.state.plan
    assert notebook is not None
    assert notebook.plan is not None
    assert notebook.plan.name == "Trip"
    assert [s.state for s in notebook.plan.subtasks] == ["in_progress", "todo"]
    # Step 1: the plan was just created; the hint is the last message, after the result.
    after_create = model.requests[1].messages
    [created] = results_of(after_create[-2])
    assert created.name == "create_plan"
    assert created.state == "success"
    assert after_create[-1].role == "user"
    assert HINT in text_of(after_create[-1])
    assert "Trip" in text_of(after_create[-1])
    assert "update_subtask_state(subtask_idx=0" in text_of(after_create[-1])
    # Step 2: the hint follows the plan's new state, and only one hint is sent per step.
    after_start = model.requests[2].messages
    assert "Now work on subtask 0 'flights'" in text_of(after_start[-1])
    assert sum(HINT in text_of(m) for m in after_start) == 1


async def test_plan_hint_is_never_stored_in_memory() -> None:
    model = ScriptedModel(
        [ScriptedModel.call("create_plan", CREATE), "Planned.", "You are welcome."]
    )
    agent = Agent("planner", "You plan.", model, capabilities=[Planning()])

    await agent.reply("Plan my trip")
    answer = await agent.reply("Thanks")

    assert answer.finished_reason == "completed"
    # The next reply is sent the hint again (the plan is still active)...
    assert HINT in text_of(model.requests[2].messages[-1])
    # ...but no reply ever stored one.
    assert all(HINT not in m.text for m in agent.memory)
    assert all("hint" not in m.marks for m in agent.memory)
    assert [m.role for m in agent.memory] == [
        "user",
        "assistant",
        "tool",
        "assistant",
        "user",
        "assistant",
    ]


async def test_invalid_plan_call_changes_nothing_and_the_model_sees_why() -> None:
    model = ScriptedModel(
        [ScriptedModel.call("create_plan", {"name": "Trip", "subtasks": []}), "Giving up."]
    )
    agent = Agent("planner", "You plan.", model, capabilities=[Planning()])

    await agent.reply("Plan my trip")

    notebook = agent.state.plan
    assert notebook is not None
    assert notebook.plan is None
    [refused] = results_of(model.requests[1].messages[-1])
    assert refused.state == "error"
    assert "Invalid arguments for create_plan" in refused.output
    assert not any(HINT in text_of(m) for m in model.requests[1].messages)
