"""The plan notebook: a model drives it through tools, and bad calls change nothing."""

from __future__ import annotations

import json
from typing import Any

import pytest

from fleetbus.agents.plan import Plan, PlanNotebook, PlanToolResult, SubTask


def _subtask(name: str) -> dict[str, str]:
    return {"name": name, "description": f"do {name}", "expected_outcome": f"{name} exists"}


def _plan_args(*names: str) -> dict[str, Any]:
    return {
        "name": "report",
        "description": "write the report",
        "expected_outcome": "report.md",
        "subtasks": [_subtask(n) for n in names],
    }


def _ok(nb: PlanNotebook, name: str, arguments: Any) -> str:
    result = nb.call(name, arguments)
    assert result.ok, result.text
    return result.text


def _plan_state(nb: PlanNotebook) -> str:
    assert nb.plan is not None
    return nb.plan.state


def _states(nb: PlanNotebook) -> list[str]:
    assert nb.plan is not None
    return [s.state for s in nb.plan.subtasks]


@pytest.fixture
def mid_plan() -> PlanNotebook:
    """A plan of a, b, c, d: a done, b in progress, c and d todo; one plan in history."""
    nb = PlanNotebook()
    _ok(nb, "create_plan", _plan_args("old"))
    _ok(nb, "finish_plan", {"state": "abandoned", "outcome": "changed my mind"})
    _ok(nb, "create_plan", _plan_args("a", "b", "c", "d"))
    _ok(nb, "update_subtask_state", {"subtask_idx": 0, "state": "in_progress"})
    _ok(nb, "finish_subtask", {"subtask_idx": 0, "subtask_outcome": "found 3 sources"})
    assert _states(nb) == ["done", "in_progress", "todo", "todo"]
    return nb


def test_full_lifecycle_driven_like_a_model() -> None:
    nb = PlanNotebook()
    assert nb.hint() is None
    text = _ok(nb, "create_plan", _plan_args("gather", "draft"))
    assert "0. [todo] gather" in text
    plan = nb.plan
    assert plan is not None
    assert _plan_state(nb) == "todo"
    assert plan.created_at is not None

    _ok(nb, "update_subtask_state", {"subtask_idx": 0, "state": "in_progress"})
    assert _plan_state(nb) == "in_progress"
    text = _ok(nb, "finish_subtask", {"subtask_idx": 0, "subtask_outcome": "notes.txt"})
    assert "draft" in text
    assert _states(nb) == ["done", "in_progress"]

    _ok(
        nb,
        "revise_current_plan",
        {"subtask_idx": 2, "action": "add", "subtask": _subtask("review")},
    )
    _ok(
        nb,
        "revise_current_plan",
        {"subtask_idx": 1, "action": "revise", "subtask": _subtask("write")},
    )
    assert plan.subtasks[1].name == "write"
    assert plan.subtasks[1].state == "in_progress"
    assert _states(nb) == ["done", "in_progress", "todo"]

    # Models often send the arguments as a JSON string.
    _ok(nb, "finish_subtask", json.dumps({"subtask_idx": 1, "subtask_outcome": "draft.md"}))
    text = _ok(nb, "view_subtasks", {"subtask_idx": [0, 2]})
    assert "outcome: notes.txt" in text
    assert "review exists" in text
    assert "write" not in text
    text = _ok(nb, "finish_subtask", {"subtask_idx": 2, "subtask_outcome": "reviewed"})
    assert "finish_plan" in text
    _ok(nb, "finish_plan", {"state": "done", "outcome": "report.md written"})

    assert nb.plan is None
    assert nb.hint() is None
    [finished] = nb.history
    assert finished.state == "done"
    assert finished.outcome == "report.md written"
    assert finished.finished_at is not None
    assert [s.outcome for s in finished.subtasks] == ["notes.txt", "draft.md", "reviewed"]
    assert "report [done]" in _ok(nb, "view_historical_plans", {})
    _ok(nb, "create_plan", _plan_args("next"))


def test_finishing_skips_abandoned_subtasks_and_abandoning_the_plan_closes_the_rest(
    mid_plan: PlanNotebook,
) -> None:
    _ok(mid_plan, "update_subtask_state", {"subtask_idx": 2, "state": "abandoned"})
    _ok(mid_plan, "finish_subtask", {"subtask_idx": 1, "subtask_outcome": "ok"})
    assert _states(mid_plan) == ["done", "done", "abandoned", "in_progress"]
    _ok(mid_plan, "finish_plan", {"state": "abandoned", "outcome": "out of time"})
    assert mid_plan.plan is None
    assert [s.state for s in mid_plan.history[-1].subtasks] == [
        "done",
        "done",
        "abandoned",
        "abandoned",
    ]
    assert mid_plan.history[-1].state == "abandoned"


def test_subtasks_can_be_put_back_revised_and_deleted(mid_plan: PlanNotebook) -> None:
    _ok(mid_plan, "update_subtask_state", {"subtask_idx": 1, "state": "todo"})
    _ok(mid_plan, "revise_current_plan", {"subtask_idx": 1, "action": "delete"})
    _ok(
        mid_plan,
        "revise_current_plan",
        {"subtask_idx": 1, "action": "add", "subtask": _subtask("x")},
    )
    assert mid_plan.plan is not None
    assert [s.name for s in mid_plan.plan.subtasks] == ["a", "x", "c", "d"]
    # Finishing a todo subtask directly is allowed once the earlier ones are finished.
    _ok(mid_plan, "finish_subtask", {"subtask_idx": 1, "subtask_outcome": "done at once"})
    assert _states(mid_plan) == ["done", "done", "in_progress", "todo"]


REFUSALS: list[tuple[str, Any, str]] = [
    ("create_plan", _plan_args("z"), "still active"),
    ("create_plan", {"name": "p"}, "- description: Field required"),
    ("create_plan", {**_plan_args(), "subtasks": []}, "- subtasks:"),
    ("create_plan", {**_plan_args("z"), "steps": []}, "- steps: Extra inputs"),
    ("create_plan", "[1, 2]", "- arguments: must be a JSON object"),
    ("create_plan", "{not json", "Invalid JSON"),
    ("create_plan", [1], "must be a JSON object"),
    ("make_plan", {}, "Unknown plan tool 'make_plan'"),
    ("revise_current_plan", {"subtask_idx": 4, "action": "add"}, "give `subtask`"),
    (
        "revise_current_plan",
        {"subtask_idx": 1, "action": "add", "subtask": _subtask("z")},
        "2 or later",
    ),
    ("revise_current_plan", {"subtask_idx": 5, "action": "add", "subtask": _subtask("z")}, "(0-4)"),
    (
        "revise_current_plan",
        {"subtask_idx": 0, "action": "revise", "subtask": _subtask("z")},
        "already done",
    ),
    ("revise_current_plan", {"subtask_idx": 1, "action": "delete"}, "Abandon it"),
    ("revise_current_plan", {"subtask_idx": -1, "action": "delete"}, "out of range (0-3)"),
    ("revise_current_plan", {"subtask_idx": 2, "action": "remove"}, "- action:"),
    ("update_subtask_state", {"subtask_idx": 1, "state": "done"}, "call finish_subtask"),
    ("update_subtask_state", {"subtask_idx": 2, "state": "in_progress"}, "earlier subtask 1 'b'"),
    ("update_subtask_state", {"subtask_idx": 0, "state": "todo"}, "final"),
    ("update_subtask_state", {"subtask_idx": 1, "state": "in_progress"}, "already in_progress"),
    ("update_subtask_state", {"subtask_idx": 9, "state": "todo"}, "out of range (0-3)"),
    ("update_subtask_state", {"subtask_idx": "one", "state": "todo"}, "- subtask_idx:"),
    ("finish_subtask", {"subtask_idx": 3, "subtask_outcome": "x"}, "earlier subtask 1 'b'"),
    ("finish_subtask", {"subtask_idx": 0, "subtask_outcome": "x"}, "already done"),
    ("finish_subtask", {"subtask_idx": 1, "subtask_outcome": "  "}, "- subtask_outcome:"),
    ("finish_subtask", {"subtask_idx": 1}, "- subtask_outcome: Field required"),
    ("view_subtasks", {"subtask_idx": [0, 7]}, "out of range"),
    ("finish_plan", {"state": "done", "outcome": "x"}, "subtasks [1, 2, 3] are not done"),
    ("finish_plan", {"state": "finished", "outcome": "x"}, "- state:"),
    ("view_historical_plans", {"verbose": True}, "- verbose: Extra inputs"),
]


@pytest.mark.parametrize(("name", "arguments", "expected"), REFUSALS)
def test_refusals_explain_and_change_nothing(
    mid_plan: PlanNotebook, name: str, arguments: Any, expected: str
) -> None:
    before = mid_plan.model_copy(deep=True)
    result = mid_plan.call(name, arguments)
    assert isinstance(result, PlanToolResult)
    assert not result.ok
    assert expected in result.text
    assert mid_plan == before


@pytest.mark.parametrize(
    ("name", "arguments"),
    [
        ("revise_current_plan", {"subtask_idx": 0, "action": "delete"}),
        ("update_subtask_state", {"subtask_idx": 0, "state": "in_progress"}),
        ("finish_subtask", {"subtask_idx": 0, "subtask_outcome": "x"}),
        ("view_subtasks", {"subtask_idx": []}),
        ("finish_plan", {"state": "abandoned", "outcome": "x"}),
    ],
)
def test_tools_refuse_without_a_plan(
    mid_plan: PlanNotebook, name: str, arguments: dict[str, Any]
) -> None:
    _ok(mid_plan, "finish_plan", {"state": "abandoned", "outcome": "stop"})
    before = mid_plan.model_copy(deep=True)
    result = mid_plan.call(name, arguments)
    assert not result.ok
    assert "no current plan" in result.text
    assert "create_plan" in result.text
    assert mid_plan == before


def test_max_subtasks_limits_creating_and_adding() -> None:
    nb = PlanNotebook(max_subtasks=2)
    [create] = [s for s in nb.tool_specs() if s.name == "create_plan"]
    assert "At most 2 subtasks" in create.description
    result = nb.call("create_plan", _plan_args("a", "b", "c"))
    assert not result.ok
    assert "at most 2" in result.text
    assert nb.plan is None
    _ok(nb, "create_plan", _plan_args("a", "b"))
    add = {"subtask_idx": 2, "action": "add", "subtask": _subtask("c")}
    assert not nb.call("revise_current_plan", add).ok
    assert _states(nb) == ["todo", "todo"]


def test_the_only_subtask_cannot_be_deleted() -> None:
    nb = PlanNotebook()
    _ok(nb, "create_plan", _plan_args("a"))
    result = nb.call("revise_current_plan", {"subtask_idx": 0, "action": "delete"})
    assert not result.ok
    assert "only one" in result.text
    assert _states(nb) == ["todo"]


def test_only_one_subtask_is_in_progress_even_in_a_state_loaded_from_elsewhere() -> None:
    subtasks = [SubTask(**_subtask("a")), SubTask(**_subtask("b"), state="in_progress")]
    plan = Plan(name="p", description="d", expected_outcome="e", subtasks=subtasks)
    nb = PlanNotebook(plan=plan)
    result = nb.call("update_subtask_state", {"subtask_idx": 0, "state": "in_progress"})
    assert not result.ok
    assert "subtask 1 'b' is in progress" in result.text
    assert _states(nb) == ["todo", "in_progress"]


def test_hints_follow_the_state() -> None:
    nb = PlanNotebook()
    assert nb.hint() is None
    _ok(nb, "create_plan", _plan_args("gather", "draft"))
    hint = nb.hint()
    assert hint is not None
    assert "just created" in hint
    assert "update_subtask_state(subtask_idx=0, state='in_progress')" in hint
    assert "0. [todo] gather" in hint

    _ok(nb, "update_subtask_state", {"subtask_idx": 0, "state": "in_progress"})
    hint = nb.hint()
    assert hint is not None
    assert "subtask 0 'gather': do gather" in hint
    assert "gather exists" in hint
    assert "finish_subtask(subtask_idx=0" in hint

    _ok(nb, "finish_subtask", {"subtask_idx": 0, "subtask_outcome": "notes.txt"})
    _ok(nb, "update_subtask_state", {"subtask_idx": 1, "state": "todo"})
    hint = nb.hint()
    assert hint is not None
    assert "just created" not in hint
    assert "Next, start subtask 1 'draft'" in hint
    assert "0. [done] gather -> notes.txt" in hint

    _ok(nb, "finish_subtask", {"subtask_idx": 1, "subtask_outcome": "draft.md"})
    hint = nb.hint()
    assert hint is not None
    assert "All subtasks are finished" in hint
    assert "finish_plan(state='done'" in hint
    _ok(nb, "finish_plan", {"state": "done", "outcome": "ok"})
    assert nb.hint() is None


def test_json_round_trip_mid_plan(mid_plan: PlanNotebook) -> None:
    restored = PlanNotebook.model_validate_json(mid_plan.model_dump_json())
    assert restored == mid_plan
    assert restored.hint() == mid_plan.hint()
    _ok(restored, "finish_subtask", {"subtask_idx": 1, "subtask_outcome": "ok"})
    assert _states(restored) == ["done", "done", "in_progress", "todo"]
    assert _states(mid_plan) == ["done", "in_progress", "todo", "todo"]


def _walk(node: Any) -> list[dict[str, Any]]:
    """Every schema object below ``node`` (property maps excluded)."""
    if isinstance(node, list):
        return [d for item in node for d in _walk(item)]
    if not isinstance(node, dict):
        return []
    found = [node]
    for key, value in node.items():
        children = list(value.values()) if key == "properties" else [value]
        found += [d for child in children for d in _walk(child)]
    return found


def test_tool_specs_give_precise_schemas() -> None:
    nb = PlanNotebook()
    specs = {s.name: s for s in nb.tool_specs()}
    assert set(specs) == PlanNotebook.TOOL_NAMES
    assert all(nb.handles(name) for name in specs)
    assert not nb.handles("search")
    required = {name: set(spec.parameters.get("required", [])) for name, spec in specs.items()}
    assert required == {
        "create_plan": {"name", "description", "expected_outcome", "subtasks"},
        "revise_current_plan": {"subtask_idx", "action"},
        "update_subtask_state": {"subtask_idx", "state"},
        "finish_subtask": {"subtask_idx", "subtask_outcome"},
        "view_subtasks": {"subtask_idx"},
        "finish_plan": {"state", "outcome"},
        "view_historical_plans": set(),
    }
    for spec in specs.values():
        assert spec.parameters["type"] == "object"
        assert "title" not in spec.parameters
        assert len(spec.description) > 80
        for schema in _walk(spec.parameters):
            assert "$ref" not in schema
            assert "title" not in schema
    items = specs["create_plan"].parameters["properties"]["subtasks"]["items"]
    assert set(items["required"]) == {"name", "description", "expected_outcome"}
    state = specs["update_subtask_state"].parameters["properties"]["state"]
    assert state["enum"] == ["todo", "in_progress", "abandoned"]
    # The specs are copies: changing one does not change the next.
    specs["finish_plan"].parameters["properties"].clear()
    assert nb.tool_specs()[5].parameters["properties"]
