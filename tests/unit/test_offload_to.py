"""The fleet commands give every served agent without an offloading
capability the fleet's offloader, and leave one that has its own."""

from __future__ import annotations

from pathlib import Path

from fleetbus.agents import Agent
from fleetbus.agents.offload import DirectoryOffloader
from fleetbus.capabilities import Offloading, Planning
from fleetbus.cli.fleet_file import offload_to
from fleetbus.testing import ScriptedModel


def test_an_agent_without_offloading_is_given_the_fleets(tmp_path: Path) -> None:
    fleet = DirectoryOffloader(tmp_path / "fleet")
    agent = Agent("a", "", ScriptedModel([]), capabilities=[Planning()])
    offload_to(agent, fleet)
    offload_to(agent, DirectoryOffloader(tmp_path / "other"))  # (it has one now)
    assert [type(c) for c in agent.capabilities] == [Planning, Offloading]
    given = agent.capabilities[1]
    assert isinstance(given, Offloading)
    assert given.offloader is fleet


def test_an_agent_with_its_own_offloading_keeps_it(tmp_path: Path) -> None:
    own = Offloading(DirectoryOffloader(tmp_path / "own"))
    agent = Agent("a", "", ScriptedModel([]), capabilities=[own])
    offload_to(agent, DirectoryOffloader(tmp_path / "fleet"))
    offload_to(agent, None)
    assert agent.capabilities == [own]
