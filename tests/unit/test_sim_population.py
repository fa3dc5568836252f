"""Populations: from a CSV, a JSON Lines table, rows and a generator; the
errors a user can make; agents built on demand, cheaply."""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path
from typing import Any

import pytest

from fleetbus.agents.serving.host import AgentSource
from fleetbus.errors import ConfigError
from fleetbus.models import OfflineModel
from fleetbus.sim import AgentTemplate, Population, load_simulation
from fleetbus.testing import ScriptedModel

TEMPLATE = AgentTemplate(system_prompt="You are {name}, {background}. Depth {k}.", model="offline")


def test_a_csv_table_gives_one_agent_per_row_with_numbers_read_as_numbers(tmp_path: Path) -> None:
    table = tmp_path / "people.csv"
    table.write_text("name,background,k,group\nada,a chess player,2,a\nbob,a nurse,0.5,b\n")
    people = Population.from_table(table, template=TEMPLATE)
    assert list(people) == ["ada", "bob"]
    assert len(people) == 2
    assert "ada" in people
    assert "eve" not in people
    assert 3 not in people
    assert people.params("ada") == {"background": "a chess player", "k": 2, "group": "a"}
    assert people.params("bob")["k"] == 0.5
    agent = people.agent("bob")
    assert agent.name == "bob"
    assert agent.system_prompt == "You are bob, a nurse. Depth 0.5."
    assert isinstance(agent.model, OfflineModel)
    assert isinstance(people, AgentSource)


def test_a_json_lines_table_and_a_model_per_group(tmp_path: Path) -> None:
    table = tmp_path / "people.jsonl"
    rows = [
        {"name": "a1", "background": "x", "k": 1, "group": "scripted"},
        {"name": "a2", "background": "y", "k": 2, "group": "plain"},
        {"name": "a3", "background": "z", "k": 3, "group": "plain", "model": "offline"},
    ]
    table.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    scripted = ScriptedModel(["hi"])
    template = AgentTemplate(
        system_prompt="{background}", model="offline", models={"scripted": scripted}
    )
    people = Population.from_table(table, template=template)
    assert people.agent("a1").model is scripted
    assert isinstance(people.agent("a2").model, OfflineModel)
    assert people.agent("a2").model is people.agent("a3").model  # one model per string
    assert people.params("a3")["model"] == "offline"


def test_a_generator_builds_agents_on_demand_and_can_be_resized() -> None:
    calls: list[int] = []

    def params(i: int) -> dict[str, Any]:
        calls.append(i)
        return {"background": f"person {i}", "k": i % 4}

    people = Population.generate(10_000, params, template=TEMPLATE, name_prefix="p-")
    assert calls == [0]  # checked against the template once, nothing built
    assert len(people) == 10_000
    assert "p-9999" in people
    for absent in ("p-10000", "p-01", "p--1", "q-1", "p-", "p-\uff11"):
        assert absent not in people
    assert people.agent("p-42").system_prompt == "You are p-42, person 42. Depth 2."
    assert people.index("p-42") == 42
    assert people.name_at(42) == "p-42"
    assert list(people.with_size(3)) == ["p-0", "p-1", "p-2"]
    assert len(people.with_size(20_000)) == 20_000


def test_an_idle_agent_costs_almost_nothing() -> None:
    rows = [{"name": f"a{i}", "background": "b" * 40, "k": i % 5} for i in range(10_000)]
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    table = Population.from_rows(rows, template=TEMPLATE)
    held = tracemalloc.get_traced_memory()[0] - before
    generated = Population.generate(
        10_000, lambda i: {"background": "b", "k": 1}, template=TEMPLATE
    )
    held_generated = tracemalloc.get_traced_memory()[0] - before - held
    tracemalloc.stop()
    assert len(table) == 10_000
    assert held / 10_000 < 400, held  # bytes per agent: a name, an index entry, a tuple
    assert held_generated < 10_000, held_generated  # nothing per agent
    del rows
    assert generated.agent("agent-9999").name == "agent-9999"


@pytest.mark.parametrize(
    ("content", "error"),
    [
        ("name,k\nada,1\n", "people.csv: no column 'background' (columns: name, k)"),
        ("who,background,k\nada,x,1\n", "no column 'name'"),
        ("name,background,k\nada,x,1\nada,y,2\n", "two rows name the agent 'ada'"),
        ("name,background,k\nad a,x,1\n", "row 1: invalid agent name 'ad a'"),
    ],
)
def test_table_errors_are_one_clear_line(tmp_path: Path, content: str, error: str) -> None:
    table = tmp_path / "people.csv"
    table.write_text(content)
    with pytest.raises(ConfigError) as caught:
        Population.from_table(table, template=TEMPLATE)
    assert error in str(caught.value)
    assert "\n" not in str(caught.value)


def test_other_mistakes(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        Population.from_table(tmp_path / "absent.csv", template=TEMPLATE)
    (tmp_path / "t.jsonl").write_text('{"name": "a"}\nnot json\n')
    with pytest.raises(ConfigError, match="line 2 is not JSON"):
        Population.from_table(tmp_path / "t.jsonl", template=AgentTemplate())
    (tmp_path / "n.jsonl").write_text(json.dumps({"name": "a", "background": None, "k": 1}))
    with pytest.raises(ConfigError, match="row 1 has no 'background'"):
        Population.from_table(tmp_path / "n.jsonl", template=TEMPLATE)
    with pytest.raises(ConfigError, match=r"\.csv, \.jsonl or \.ndjson"):
        Population.from_table(tmp_path / "t.txt", template=TEMPLATE)
    with pytest.raises(ConfigError, match="lack 'k'"):
        Population.generate(3, lambda i: {"background": "x"}, template=TEMPLATE)
    with pytest.raises(ConfigError, match="agent name prefix"):
        Population.generate(3, template=AgentTemplate(), name_prefix="a.b")
    small = Population.from_rows([{"name": "a"}], template=AgentTemplate())
    with pytest.raises(ConfigError, match="has 1 agents; it cannot make 2"):
        small.with_size(2)


def test_load_simulation_from_a_file_with_agents_and_rounds(tmp_path: Path) -> None:
    spec = tmp_path / "spec.py"
    spec.write_text(
        "from fleetbus.sim import AgentTemplate, Population, Simulation\n"
        "def simulation(agents: int = 5) -> Simulation:\n"
        "    pop = Population.generate(agents, template=AgentTemplate(model='offline'))\n"
        "    return Simulation(name='s', population=pop, prompt=lambda c, a: 'hi', rounds=2)\n"
        "fixed = simulation(4)\n"
    )
    assert len(load_simulation(f"{spec}:simulation").population) == 5
    loaded = load_simulation(f"{spec}:simulation", agents=50, rounds=7)
    assert (len(loaded.population), loaded.rounds) == (50, 7)
    assert len(load_simulation(f"{spec}:fixed", agents=9).population) == 9  # resized
    with pytest.raises(ConfigError, match="has no attribute 'nope'"):
        load_simulation(f"{spec}:nope")
    with pytest.raises(ConfigError, match="no file"):
        load_simulation(f"{tmp_path}/absent.py:simulation")
    with pytest.raises(ConfigError, match="cannot import 'no_such_module_x'"):
        load_simulation("no_such_module_x:simulation")
    with pytest.raises(ConfigError, match="not a Simulation"):
        load_simulation("fleetbus.sim:ENVIRONMENT_TOOLS")
