"""The factory ``bench/agent_factory.py`` serves: ``agents()`` returns
``FACTORY_AGENTS`` agents (default 10,000), ``fac-00000`` …, each built
with a model of its own and no tools of its own, as a user's factory does.

Served with ``fleetbus agent bench._factory_agents:agents``.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator

from fleetbus.agents import Agent
from fleetbus.models.model import ModelRequest, ModelResponse, ModelStreamItem
from fleetbus.protocol import TextBlock


class Answer:
    """Answers at once, naming its agent."""

    name = "answer"

    def __init__(self, agent_name: str) -> None:
        self.agent_name = agent_name

    async def stream(self, request: ModelRequest) -> AsyncIterator[ModelStreamItem]:
        yield ModelResponse([TextBlock(text=f"{self.agent_name} here")], model=self.name)


def agents() -> list[Agent]:
    """``FACTORY_AGENTS`` agents."""
    count = int(os.environ.get("FACTORY_AGENTS", "10000"))
    names = (f"fac-{i:05d}" for i in range(count))
    return [Agent(name, "You take part in a benchmark.", Answer(name)) for name in names]
