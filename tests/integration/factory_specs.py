"""A factory of many agents (``fleetbus agent
tests.integration.factory_specs:agents``): ``FACTORY_AGENTS`` of them (300
by default), ``many-00000`` …, each without tools of its own and with a model
of its own that answers ``<name> heard <text>`` (and, asked ``tools?``, the
names of the tools it is offered)."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator

from fleetbus.agents import Agent
from fleetbus.models import ModelRequest, ModelResponse
from fleetbus.models.model import ModelStreamItem
from fleetbus.protocol import TextBlock


class NamedEcho:
    """Answers with the agent's name and the user's last text."""

    def __init__(self, agent_name: str) -> None:
        self.name = "named-echo"
        self.agent_name = agent_name

    async def stream(self, request: ModelRequest) -> AsyncIterator[ModelStreamItem]:
        last = request.messages[-1]
        text = "".join(b.text for b in last.content if isinstance(b, TextBlock))
        if text == "tools?":
            text = ",".join(sorted(t.name for t in request.tools)) or "none"
        yield ModelResponse(content=[TextBlock(text=f"{self.agent_name} heard {text}")])


def agents() -> list[Agent]:
    """``FACTORY_AGENTS`` agents, each with a model of its own."""
    count = int(os.environ.get("FACTORY_AGENTS", "300"))
    names = (f"many-{i:05d}" for i in range(count))
    return [Agent(name, "You answer.", NamedEcho(name)) for name in names]
