"""An agent with skills that the skills process test serves (``fleetbus agent
tests.integration.skill_specs:skilled``): its toolkit is
``Toolkit(skills=…)`` on the folders in ``$FLEETBUS_TEST_SKILLS``, its model
the :class:`~tests.integration.agent_specs.CommandModel`."""

from __future__ import annotations

import os

from fleetbus.agents import Agent, AgentSettings
from fleetbus.tools_workers import Toolkit
from tests.integration.agent_specs import CommandModel


def skilled() -> Agent:
    """Skills loaded in the agent's own process."""
    folders = os.environ["FLEETBUS_TEST_SKILLS"].split(os.pathsep)
    return Agent(
        "skilled",
        "",
        CommandModel(),
        toolkit=Toolkit(skills=folders),
        settings=AgentSettings(max_iters=5),
    )
