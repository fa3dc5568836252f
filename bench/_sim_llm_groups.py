"""``examples/guess_two_thirds.py``'s game played by a population whose two
groups use different models: the population ``bench/sim_llm.py`` runs to
show groups of a simulation reaching different model servers.

    fleetbus sim run bench/_sim_llm_groups.py:simulation --agents 50 ...

Agent ``p-<i>`` has the example's background (profession, reasoning depth)
and a group: ``b`` when ``i % 3 == 2``, else ``a`` (two thirds in ``a``, so
that the two groups' counts differ and a swapped route shows). The template
maps the groups to models (``Population``'s ``models=`` by ``group_by``):
group ``a`` to ``$SIM_LLM_MODEL_A`` (default ``bus:qwen-a``), group ``b`` to
``$SIM_LLM_MODEL_B`` (default ``bus:qwen-b``). The system prompt is the
example's with the agent's name added at its end (``Your name is p-7.``), so
that a listener on the bus can tell whose prompt each model call carries.

The example writes its real-model prompt (the rules, no arithmetic spelled
out) when ``FLEETBUS_MODEL`` names a real model; its groups' models are set
here instead, so :func:`simulation` sets ``FLEETBUS_MODEL`` to group ``a``'s
model when it is unset (every process of the run imports this file, and each
then prompts alike).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from fleetbus.sim import Population, Simulation

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "guess_two_thirds.py"
GROUP_OF_B = 2
"""Agent ``i`` is in group ``b`` when ``i % 3 == GROUP_OF_B``."""


def example() -> ModuleType:
    """``examples/guess_two_thirds.py``, imported once."""
    name = "_sim_llm_guess_two_thirds"
    module = sys.modules.get(name)
    if module is None:
        spec = importlib.util.spec_from_file_location(name, EXAMPLE)
        assert spec is not None
        assert spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return module


def group(i: int) -> str:
    """Agent ``i``'s group."""
    return "b" if i % 3 == GROUP_OF_B else "a"


def models() -> dict[str, str]:
    """The model string of each group."""
    return {
        "a": os.environ.get("SIM_LLM_MODEL_A", "bus:qwen-a"),
        "b": os.environ.get("SIM_LLM_MODEL_B", "bus:qwen-b"),
    }


def params(i: int) -> dict[str, Any]:
    """The example's background of agent ``i``, and its group."""
    made: dict[str, Any] = example().params(i)
    return {**made, "group": group(i)}


def simulation(agents: int = 50, rounds: int = 1) -> Simulation:
    """The example's game, its population in two groups with a model each."""
    chosen = models()
    os.environ.setdefault("FLEETBUS_MODEL", chosen["a"])
    base: Simulation = example().simulation(agents, rounds)
    template = dataclasses.replace(
        base.population.template,
        system_prompt=base.population.template.system_prompt + " Your name is {name}.",
        models=chosen,
        group_by="group",
    )
    population = Population.generate(agents, params, template=template, name_prefix="p-")
    return dataclasses.replace(
        base, population=population, record_params=(*base.record_params, "group")
    )
