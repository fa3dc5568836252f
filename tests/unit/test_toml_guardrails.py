"""Guardrails declared in a fleet file (``[agent.NAME.guardrails]``): loaded
into a ``Guardrails`` capability that trips as declared, and every bad entry
stopping the load with the file and the agent named."""

from __future__ import annotations

from pathlib import Path

import pytest

from fleetbus.capabilities import (
    AgentGuardrail,
    Checked,
    FunctionGuardrail,
    GuardrailContext,
    GuardrailResult,
    Guardrails,
    PatternGuardrail,
    guardrail,
)
from fleetbus.cli.fleet_file import bind_guardrails, load_agents
from fleetbus.errors import ConfigError
from fleetbus.testing import ScriptedModel


def no_homework(checked: Checked, ctx: GuardrailContext) -> GuardrailResult:
    """A function a fleet file names."""
    if "homework" in checked.text:
        return GuardrailResult.trip("homework is not what this agent is for")
    return GuardrailResult.passed()


@guardrail(name="made-in-python", fail_open=True)
def ready_made(checked: Checked, ctx: GuardrailContext) -> GuardrailResult:
    """A guardrail a fleet file names as it is."""
    return GuardrailResult.passed()


FLEET = """
[agent.helper]
system_prompt = "You help."

[agent.helper.guardrails]
input = [
  { patterns = ["(?i)password"], name = "no-secrets", run_in_parallel = false },
  { agent = "moderator", timeout = 5.0 },
  { function = "tests.unit.test_toml_guardrails:no_homework", fail_open = true },
]
output = [{ patterns = ["secret", "token"] }]
tools = [{ function = "tests.unit.test_toml_guardrails:ready_made" }]
tool_output = [{ patterns = ["BEGIN PRIVATE KEY"], name = "no-keys" }]

[agent.plain]
"""


def rails_of(agent: object) -> Guardrails:
    [rails] = [c for c in getattr(agent, "capabilities", []) if isinstance(c, Guardrails)]
    return rails


def test_a_fleet_file_declares_guardrails(tmp_path: Path) -> None:
    spec = tmp_path / "fleet.toml"
    spec.write_text(FLEET)
    helper, plain = load_agents(str(spec))

    rails = rails_of(helper)
    secrets, moderator, homework = rails.input
    assert isinstance(secrets, PatternGuardrail)
    assert (secrets.name, secrets.run_in_parallel, [p.pattern for p in secrets.patterns]) == (
        "no-secrets",
        False,
        ["(?i)password"],
    )
    assert isinstance(moderator, AgentGuardrail)
    assert (moderator.name, moderator.agent_name, moderator.timeout) == (
        "moderator",
        "moderator",
        5.0,
    )
    assert not moderator.bound
    assert isinstance(homework, FunctionGuardrail)
    assert (homework.name, homework.function, homework.fail_open) == (
        "no_homework",
        no_homework,
        True,
    )
    [output] = rails.output
    assert isinstance(output, PatternGuardrail)
    assert output.name == "patterns"
    assert rails.tool_input == (ready_made,)
    assert [g.name for g in rails.tool_output] == ["made-in-python", "no-keys"]
    assert not [c for c in plain.capabilities if isinstance(c, Guardrails)]

    bind_guardrails([helper, plain], bus=object())  # type: ignore[arg-type]
    assert moderator.bound


async def test_a_declared_guardrail_trips(tmp_path: Path) -> None:
    spec = tmp_path / "fleet.toml"
    spec.write_text(
        """
[agent.tutor.guardrails]
input = [{ function = "tests.unit.test_toml_guardrails:no_homework", name = "no-homework" }]
"""
    )
    [tutor] = load_agents(str(spec))
    tutor.model = ScriptedModel([ScriptedModel.text("Sure, here it is.")])
    final = await tutor.reply("Do my homework")

    assert final.finished_reason == "guardrail_tripped"
    assert final.guardrail is not None
    assert (final.guardrail.name, final.guardrail.stage) == ("no-homework", "input")
    assert final.guardrail.reason == "homework is not what this agent is for"


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ("guardrails = 3", r"agent\.a\.guardrails is not a table"),
        ("guardrails = { inputs = [] }", r"agent\.a\.guardrails: unknown key\(s\) inputs"),
        ("guardrails = { input = { patterns = ['x'] } }", r"guardrails\.input is a list"),
        ("guardrails = { input = ['x'] }", r"guardrails\.input\[0\] is not a table"),
        ("guardrails = { input = [{ name = 'x' }] }", r"input\[0\]: give one of patterns"),
        (
            "guardrails = { input = [{ patterns = ['x'], agent = 'm' }] }",
            r"input\[0\]: give one of patterns",
        ),
        ("guardrails = { output = [{ patterns = ['('] }] }", r"output\[0\]: .*bad pattern"),
        ("guardrails = { output = [{ patterns = 'x' }] }", r"output\[0\]: patterns is a list"),
        ("guardrails = { output = [{ patterns = [] }] }", r"output\[0\]: .*has no pattern"),
        ("guardrails = { tools = [{ agent = 'a b' }] }", r"tools\[0\]: invalid guardrail agent"),
        ("guardrails = { tools = [{ agent = 'm', timeout = -1 }] }", r"tools\[0\]: .*timeout"),
        ("guardrails = { tools = [{ agent = 'm', fail_open = 1 }] }", r"fail_open is a bool"),
        ("guardrails = { tools = [{ agent = 'm', when = 'x' }] }", r"unknown key\(s\) when"),
        ("guardrails = { input = [{ function = 'nomodule' }] }", r"function is 'module:attr'"),
        (
            "guardrails = { input = [{ function = 'no_such_module_x:f' }] }",
            r"input\[0\]: cannot import 'no_such_module_x'",
        ),
        (
            "guardrails = { input = [{ function = 'tests.unit.test_toml_guardrails:nothing' }] }",
            "has no attribute 'nothing'",
        ),
        (
            "guardrails = { input = [{ function = 'tests.unit.test_toml_guardrails:FLEET' }] }",
            "neither a guardrail nor a function",
        ),
        (
            "guardrails = { input = [{ function = 'tests.unit.test_toml_guardrails:ready_made', "
            "name = 'x' }] }",
            "is a guardrail already",
        ),
    ],
)
def test_a_bad_guardrail_entry_names_the_file_and_the_agent(
    tmp_path: Path, table: str, message: str
) -> None:
    spec = tmp_path / "fleet.toml"
    spec.write_text(f"[agent.a]\n{table}\n")
    with pytest.raises(ConfigError, match=message) as caught:
        load_agents(str(spec))
    assert str(caught.value).startswith(f"{spec}: agent.a.guardrails")


def test_a_population_binds_the_guardrails_of_each_agent_it_builds() -> None:
    from fleetbus.agents import Agent
    from fleetbus.cli.fleet_file import PopulationSpec

    built: list[AgentGuardrail] = []

    class Moderated:
        """A population whose every agent asks a moderator (given no bus)."""

        def __contains__(self, name: object) -> bool:
            return True

        def agent(self, name: str) -> Agent:
            rail = AgentGuardrail("moderator")
            built.append(rail)
            return Agent(name, "", ScriptedModel(), capabilities=[Guardrails(input=[rail])])

    population = PopulationSpec(Moderated(), "moderated", None, {})
    bus = object()
    bind_guardrails(population, bus)  # type: ignore[arg-type]
    population.agent("a-1")
    population.agent("a-2")

    assert [rail.bound for rail in built] == [True, True]
