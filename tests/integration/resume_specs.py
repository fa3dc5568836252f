"""An agent with a tool that runs outside it, for the ``fleetbus resume``
tests (``fleetbus agent tests.integration.resume_specs:desk``)."""

from __future__ import annotations

from fleetbus.agents import Agent
from fleetbus.tools_workers import Toolkit, tool
from tests.integration.agent_specs import CommandModel


@tool(external=True)
def lookup(query: str) -> str:
    """Look something up (done outside the agent, by whoever asked)."""
    raise AssertionError("an external tool is never run by the agent")


def desk() -> Agent:
    """Pauses at every ``lookup`` call until its result comes from outside."""
    return Agent("desk", "", CommandModel(), toolkit=Toolkit([lookup]))
