"""The population ``bench/simulation.py`` serves: N agents, each of whose
replies is one ReAct step with one call of the ``noop`` tool on a tool
worker, then an answer.

Served with ``fleetbus agent bench._sim_population:population --group G``;
``SIM_AGENTS`` sets N (default 10,000).
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator

from fleetbus.agents import Agent, AgentSettings
from fleetbus.models.model import ModelRequest, ModelResponse, ModelStreamItem
from fleetbus.protocol import TextBlock, ToolResultBlock, ToolUseBlock, new_id


class OneCallModel:
    """Calls the first tool on offer once, then answers: constant work a step."""

    name = "one-call"

    async def stream(self, request: ModelRequest) -> AsyncIterator[ModelStreamItem]:
        last = request.messages[-1]
        if any(isinstance(b, ToolResultBlock) for b in last.content) or not request.tools:
            yield ModelResponse([TextBlock(text="done")], finish_reason="stop", model=self.name)
            return
        use = ToolUseBlock(id=f"c-{new_id()[:12]}", name=request.tools[0].name, input={})
        yield ModelResponse([use], finish_reason="tool_calls", model=self.name)


class Population:
    """``sim-00000`` … : the agents of the benchmark, built on demand."""

    name = "bench"

    def __init__(self, size: int) -> None:
        self.size = size
        self._model = OneCallModel()
        self._settings = AgentSettings(max_iters=3)  # frozen: one for all, as fleetbus.sim does

    def __len__(self) -> int:
        return self.size

    def __iter__(self) -> Iterator[str]:
        return (f"sim-{i:05d}" for i in range(self.size))

    def __contains__(self, name: object) -> bool:
        if not isinstance(name, str) or not name.startswith("sim-"):
            return False
        digits = name[4:]
        # Five digits at least, as __iter__ writes them: sim-00042, sim-123456.
        return digits.isdigit() and int(digits) < self.size and name == f"sim-{int(digits):05d}"

    def agent(self, name: str) -> Agent:
        return Agent(name, "You take part in a benchmark.", self._model, settings=self._settings)


population = Population(int(os.environ.get("SIM_AGENTS", "10000")))
