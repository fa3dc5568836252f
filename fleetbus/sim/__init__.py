"""Simulations: populations of agents, a shared environment, and rounds.

- :class:`Population` — N agents from an :class:`AgentTemplate` and a row of
  parameters each (a CSV or JSON Lines table, or a generator), built on
  demand: the agent source an ``AgentHost`` serves;
- :class:`Environment` — shared state on the bus (JetStream KV) with
  compare-and-set, which agents read and change through
  :func:`environment_tools`;
- :class:`Simulation` — the population, the environment's initial state,
  each round's prompt and what ``apply`` makes of the replies;
- :class:`SimulationRunner` — runs the rounds (in parallel or in order) with
  a deadline each, writes the results (:class:`RunFiles`), and resumes an
  interrupted run from its last finished round;
- :class:`PopulationHost`, :class:`SimulationToolWorker` — the processes that
  serve the agents and the tools;
- :mod:`fleetbus.sim.report` — a run's results as one self-contained HTML
  page of charts (``write_report``).

``fleetbus sim run SPEC`` does it all from the command line, ``fleetbus sim
report RUN_DIR`` draws the page; see ``docs/simulations.md``.
"""

from fleetbus.sim.environment import ENVIRONMENT_TOOLS, Environment, Versioned, environment_tools
from fleetbus.sim.population import AgentTemplate, Params, Population
from fleetbus.sim.results import RoundSummary, RunFiles, RunState
from fleetbus.sim.runner import RunListener, RunResult, SimulationRunner
from fleetbus.sim.serving import PopulationHost, SimulationToolWorker
from fleetbus.sim.simulation import (
    AgentReply,
    AgentView,
    Order,
    ReplyStatus,
    RoundContext,
    Simulation,
    load_simulation,
)

__all__ = [
    "ENVIRONMENT_TOOLS",
    "AgentReply",
    "AgentTemplate",
    "AgentView",
    "Environment",
    "Order",
    "Params",
    "Population",
    "PopulationHost",
    "ReplyStatus",
    "RoundContext",
    "RoundSummary",
    "RunFiles",
    "RunListener",
    "RunResult",
    "RunState",
    "Simulation",
    "SimulationRunner",
    "SimulationToolWorker",
    "Versioned",
    "environment_tools",
    "load_simulation",
]
