"""Agents for `fleetbus agent` from module:factory specs and TOML files."""

from __future__ import annotations

from pathlib import Path

import pytest

from fleetbus.capabilities import Handoffs
from fleetbus.cli.fleet_file import load_agents
from fleetbus.errors import ConfigError
from fleetbus.models import OfflineModel


def test_a_toml_file_defines_agents(tmp_path: Path) -> None:
    spec = tmp_path / "agents.toml"
    spec.write_text(
        """
[agent.assistant]
system_prompt = "You help."
tools = ["fleetbus.tools_workers.builtin"]
ask = ["write_file"]
max_iters = 4

[agent.listener]
plan = true
"""
    )
    assistant, listener = load_agents(str(spec))
    assert (assistant.name, assistant.system_prompt, assistant.settings.max_iters) == (
        "assistant",
        "You help.",
        4,
    )
    assert isinstance(assistant.model, OfflineModel)
    assert assistant.toolkit is not None
    assert "calculator" in assistant.toolkit
    assert [str(r) for r in assistant.state.permissions.rules] == ["write_file"]
    assert listener.state.plan is not None


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[nothing]\n", r"has no \[agent.NAME\] table"),
        ('[agent."bad name"]\n', "invalid agent name"),
        ('[agent.a]\nmodel = "no.such:model"\n', "cannot load the model"),
        ("not toml = = =\n", "cannot read"),
    ],
)
def test_bad_toml_is_a_clear_error(tmp_path: Path, text: str, message: str) -> None:
    spec = tmp_path / "agents.toml"
    spec.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_agents(str(spec))


def test_a_toml_file_declares_handoffs(tmp_path: Path) -> None:
    spec = tmp_path / "agents.toml"
    spec.write_text(
        """
[agent.triage]
handoffs = [
  "billing",
  { agent = "refunds", description = "Money back.", input_filter = "no_tools" },
  { agent = "notes", input_filter = "copy:copy", tool_name = "to_notes" },
]
"""
    )
    (triage,) = load_agents(str(spec))
    (handoffs,) = [c for c in triage.capabilities if isinstance(c, Handoffs)]
    assert [(t.agent, t.tool, t.description) for t in handoffs.targets] == [
        ("billing", "transfer_to_billing", ""),
        ("refunds", "transfer_to_refunds", "Money back."),
        ("notes", "to_notes", ""),
    ]
    assert handoffs.targets[1].input_filter == "no_tools"
    assert callable(handoffs.targets[2].input_filter)


@pytest.mark.parametrize(
    ("handoffs", "message"),
    [
        ('"billing"', "a list of agent names or tables"),
        ("[3]", "not an agent name or a table"),
        ('[{ agent = "b", filter = "all" }]', "unknown keys"),
        ('[{ agent = "b", input_filter = "some" }]', "unknown input filter"),
        ('[{ agent = "b", input_filter = "no.such:thing" }]', "cannot import"),
        ('["billing", "billing"]', "once"),
        ('["triage"]', "to itself"),
    ],
)
def test_bad_handoffs_stop_the_command_naming_the_file_and_agent(
    tmp_path: Path, handoffs: str, message: str
) -> None:
    spec = tmp_path / "agents.toml"
    spec.write_text(f"[agent.triage]\nhandoffs = {handoffs}\n")
    with pytest.raises(ConfigError, match=message) as caught:
        load_agents(str(spec))
    assert "agents.toml: agent.triage.handoffs" in str(caught.value)


def test_module_specs() -> None:
    (agent,) = load_agents("fleetbus.cli.demo_fleet:agents")
    assert agent.name == "assistant"
    with pytest.raises(ConfigError, match="cannot import"):
        load_agents("no_such_module:agents")
    with pytest.raises(ConfigError, match="is not an Agent"):
        load_agents("fleetbus.cli.demo_fleet:SYSTEM_PROMPT")


def test_a_population_spec_is_called_when_it_is_a_class_and_used_as_it_is_otherwise() -> None:
    from fleetbus.cli.fleet_file import PopulationSpec, load_served

    served = load_served("bench._sim_population:population")  # an instance: used as it is
    assert isinstance(served, PopulationSpec)
    assert "sim-00000" in served
    assert served.agent("sim-00001").name == "sim-00001"
    # The class is called, like a factory; it needs its size: one clear line.
    with pytest.raises(ConfigError, match="calling it failed: TypeError"):
        load_served("bench._sim_population:Population")
    with pytest.raises(ConfigError, match="a population"):
        load_agents("bench._sim_population:population")
