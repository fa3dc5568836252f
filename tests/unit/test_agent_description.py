"""An agent's one-line description: taken by ``Agent``, kept by its clones,
read from fleet files, and refused when it is not a string or too long."""

from __future__ import annotations

from pathlib import Path

import pytest

from fleetbus.agents import Agent
from fleetbus.agents.agent import MAX_DESCRIPTION_CHARS
from fleetbus.agents.state import AgentState
from fleetbus.cli.fleet_file import load_agents
from fleetbus.errors import ConfigError
from fleetbus.testing import ScriptedModel


def test_an_agent_keeps_its_description_and_its_clones_too() -> None:
    agent = Agent("helper", "You help.", ScriptedModel([]), description="Answers arithmetic.")
    assert agent.description == "Answers arithmetic."
    assert agent.clone().description == "Answers arithmetic."
    saved = agent.clone(state=AgentState(agent_name="helper"))
    assert saved.description == "Answers arithmetic."


def test_an_agent_without_a_description_has_an_empty_one() -> None:
    assert Agent("helper", "", ScriptedModel([])).description == ""


def test_a_description_of_the_longest_length_is_taken() -> None:
    text = "x" * MAX_DESCRIPTION_CHARS
    assert Agent("helper", "", ScriptedModel([]), description=text).description == text


@pytest.mark.parametrize(
    ("description", "message"),
    [
        ("x" * (MAX_DESCRIPTION_CHARS + 1), "has 1025 characters; at most 1024"),
        (42, "must be a string, not int"),
        (None, "must be a string, not NoneType"),
    ],
)
def test_a_description_that_is_too_long_or_not_a_string_is_refused(
    description: object, message: str
) -> None:
    with pytest.raises(ConfigError, match=f"agent 'helper': the description {message}"):
        Agent("helper", "", ScriptedModel([]), description=description)  # type: ignore[arg-type]


def test_a_fleet_file_gives_each_agent_its_description(tmp_path: Path) -> None:
    spec = tmp_path / "agents.toml"
    spec.write_text(
        """
[agent.assistant]
description = "Answers arithmetic and keeps notes."

[agent.listener]
"""
    )
    assistant, listener = load_agents(str(spec))
    assert assistant.description == "Answers arithmetic and keeps notes."
    assert listener.description == ""


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("42", "the description must be a string, not int"),
        ('["a"]', "the description must be a string, not list"),
        (f'"{"x" * 1025}"', "the description has 1025 characters; at most 1024"),
    ],
    ids=["int", "list", "too-long"],
)
def test_a_fleet_file_description_is_checked(tmp_path: Path, value: str, message: str) -> None:
    spec = tmp_path / "agents.toml"
    spec.write_text(f"[agent.assistant]\ndescription = {value}\n")
    with pytest.raises(ConfigError, match=f"agents.toml: agent.assistant: {message}"):
        load_agents(str(spec))
