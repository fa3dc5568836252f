"""Tool groups the model switches on and off itself with ``switch_tool_groups``."""

from __future__ import annotations

from fleetbus import Agent, Toolkit, tool
from fleetbus.agents import AgentState, Msg
from fleetbus.models.model import ModelRequest
from fleetbus.protocol import ToolResultBlock
from fleetbus.testing import ScriptedModel


@tool
def add(a: int, b: int) -> int:
    """Add two numbers."""
    return a + b


@tool(group="web")
def fetch_page(url: str) -> str:
    """Fetch a web page."""
    return f"<html>{url}</html>"


@tool(group="files")
def read_file(path: str) -> str:
    """Read a file."""
    return f"contents of {path}"


def _toolkit() -> Toolkit:
    return Toolkit(
        [add, fetch_page, read_file],
        groups={"web": "Browse the web.", "files": "Read files."},
        active_groups=["files"],
    )


def results_of(memory: list[Msg]) -> list[ToolResultBlock]:
    return [b for m in memory for b in m.tool_results]


def _offered(request: ModelRequest) -> set[str]:
    return {spec.name for spec in request.tools}


async def test_the_model_switches_a_group_on_and_calls_its_tool() -> None:
    model = ScriptedModel(
        [
            ScriptedModel.call("switch_tool_groups", {"web": True, "files": False}),
            ScriptedModel.call("fetch_page", {"url": "https://example.org"}),
            "Fetched.",
        ]
    )
    agent = Agent("browser", "You browse.", model, toolkit=_toolkit())

    answer = await agent.reply("Fetch example.org")

    assert answer.finished_reason == "completed"
    first, second, _ = model.requests
    # First turn: the always-on tools, the active group's, and the meta-tool.
    assert _offered(first) == {"add", "read_file", "switch_tool_groups"}
    meta = next(s for s in first.tools if s.name == "switch_tool_groups")
    assert "web: Browse the web." in meta.description
    assert "files: Read files." in meta.description
    assert set(meta.parameters["properties"]) == {"web", "files"}
    # Next turn: the group switched on is offered, the one switched off is not.
    assert _offered(second) == {"add", "fetch_page", "switch_tool_groups"}
    results = results_of(agent.memory)
    assert results[0].state == "success"
    assert results[1].state == "success"
    assert results[1].output == "<html>https://example.org</html>"
    assert agent.state.active_groups == ["web"]


async def test_a_call_of_an_inactive_groups_tool_tells_the_model_to_switch_it_on() -> None:
    model = ScriptedModel(
        [ScriptedModel.call("fetch_page", {"url": "https://example.org"}), "Cannot."]
    )
    agent = Agent("browser", "You browse.", model, toolkit=_toolkit())

    await agent.reply("Fetch example.org")

    (result,) = results_of(agent.memory)
    assert result.state == "error"
    assert "inactive_group" in str(result.output)
    assert 'switch_tool_groups with {"web": true}' in str(result.output)
    assert "fetch_page" not in _offered(model.requests[1])


async def test_switched_groups_survive_in_the_saved_state() -> None:
    model = ScriptedModel([ScriptedModel.call("switch_tool_groups", {"web": True}), "On."])
    agent = Agent("browser", "You browse.", model, toolkit=_toolkit())
    await agent.reply("Switch the web on")

    saved = AgentState.model_validate_json(agent.state.model_dump_json())
    assert saved.active_groups == ["web", "files"]
    later = ScriptedModel(["Hi."])
    restored = Agent("browser", "You browse.", later, toolkit=_toolkit(), state=saved)
    await restored.reply("Hello")
    assert _offered(later.requests[0]) == {"add", "fetch_page", "read_file", "switch_tool_groups"}
    # A new session of the agent starts from the toolkit's defaults.
    fresh = agent.clone()
    fresh.model = ScriptedModel(["Hi."])
    await fresh.reply("Hello")
    assert isinstance(fresh.model, ScriptedModel)
    assert _offered(fresh.model.requests[0]) == {"add", "read_file", "switch_tool_groups"}


async def test_unknown_groups_are_refused_and_nothing_changes() -> None:
    model = ScriptedModel([ScriptedModel.call("switch_tool_groups", {"mail": True}), "Ok."])
    agent = Agent("browser", "You browse.", model, toolkit=_toolkit())

    await agent.reply("Switch mail on")

    (result,) = results_of(agent.memory)
    assert result.state == "error"
    assert "no tool group 'mail'" in str(result.output)
    assert agent.state.active_groups is None


async def test_a_toolkit_without_switchable_groups_offers_every_tool_and_no_meta_tool() -> None:
    model = ScriptedModel(["Hi."])
    agent = Agent("plain", "", model, toolkit=Toolkit([add, fetch_page, read_file]))

    await agent.reply("Hello")

    assert _offered(model.requests[0]) == {"add", "fetch_page", "read_file"}


def test_set_active_marks_a_group_inactive() -> None:
    kit = Toolkit([add, fetch_page, read_file])
    kit.set_active("web", False)
    assert kit.group_descriptions == {"web": ""}
    assert kit.active_groups == []
    assert {s.name for s in kit.active_specs([])} == {"add", "read_file"}
    kit.set_active("web", True)
    assert kit.active_groups == ["web"]
