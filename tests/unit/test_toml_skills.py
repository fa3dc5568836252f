"""A TOML agent spec gives its agent skill folders (``skills = [...]``),
relative to the file."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from fleetbus.cli.fleet_file import load_agents
from fleetbus.errors import ConfigError
from fleetbus.tools_workers import Toolkit

EXAMPLE_SKILLS = Path(__file__).resolve().parents[2] / "examples" / "skills"


def test_skills_of_a_toml_agent_are_folders_next_to_the_file(tmp_path: Path) -> None:
    shutil.copytree(EXAMPLE_SKILLS, tmp_path / "skills")
    spec = tmp_path / "agents.toml"
    spec.write_text('[agent.coder]\nmodel = "offline"\nskills = ["skills"]\n')
    (agent,) = load_agents(str(spec))
    assert isinstance(agent.toolkit, Toolkit)
    (load,) = [s for s in agent.toolkit.specs() if s.name == "load_skill"]
    assert "rot13" in load.description


@pytest.mark.parametrize(
    ("value", "message"),
    [('"skills"', "is a list of folders"), ('["absent"]', "absent")],
)
def test_bad_skills_are_one_clear_error(tmp_path: Path, value: str, message: str) -> None:
    spec = tmp_path / "agents.toml"
    spec.write_text(f'[agent.coder]\nmodel = "offline"\nskills = {value}\n')
    with pytest.raises(ConfigError, match=message):
        load_agents(str(spec))
