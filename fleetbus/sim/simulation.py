"""What a simulation is: a population, an environment, and rounds.

A :class:`Simulation` names everything ``fleetbus sim run`` needs, and every
process of the run (the runner, the hosts serving the agents, the tool
workers) loads the same one from its SPEC::

    def prompt(ctx: RoundContext, agent: AgentView) -> str:
        return f"Round {ctx.round}. The price is {ctx.state['price']}. Buy or sell?"

    def apply(ctx: RoundContext, replies: Sequence[AgentReply]) -> dict[str, Any]:
        buys = sum(1 for r in replies if r.ok and "buy" in (r.text or "").lower())
        return {"buys": buys}          # the round's figures, in the summary

    simulation = Simulation(
        name="market",
        population=Population.generate(100, params, template=template),
        prompt=prompt,
        apply=apply,
        rounds=5,
        environment={"price": 10},
        tools=["fleetbus.tools_workers.builtin:calculator"],
    )

The SPEC is ``path/to/file.py:attr`` or ``module:attr`` naming a
:class:`Simulation` or a function returning one (:func:`load_simulation`).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import sys
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from fleetbus._imports import import_named
from fleetbus.bus import check_name
from fleetbus.errors import ConfigError, InvalidSubjectError, ToolDefinitionError
from fleetbus.sim.environment import ENVIRONMENT_TOOLS, Environment, environment_tools
from fleetbus.sim.population import Population
from fleetbus.tools_workers import Toolkit, ToolLike, load_toolkit

if TYPE_CHECKING:
    from fleetbus.sim.results import RoundSummary

__all__ = [
    "AgentReply",
    "AgentView",
    "Order",
    "ReplyStatus",
    "RoundContext",
    "Simulation",
    "load_simulation",
]

Order = Literal["parallel", "ordered"]
"""How a round asks its agents: all at once, or one after another (each
seeing the effects of those before it)."""

ReplyStatus = Literal["ok", "error", "late", "missing"]
"""How an agent's round ended: answered; answered with an error (or an answer
that could not be read); asked but not answered by the deadline; never asked
(the deadline passed first) or served by nobody."""


@dataclass(frozen=True, slots=True)
class AgentView:
    """One agent, as a round's prompt sees it.

    Attributes:
        name: its name.
        index: its position in the population.
        params: its parameters.
    """

    name: str
    index: int
    params: Mapping[str, Any]


@dataclass(slots=True)
class AgentReply:
    """How one agent's round went.

    Attributes:
        agent: its name.
        index: its position in the population.
        params: its parameters.
        status: see :data:`ReplyStatus`.
        text: the final answer's text (``None`` unless answered).
        value: what the simulation's ``parse`` read from the text.
        error: why it is not ``ok``.
        latency: seconds from the request to the answer.
        finished_reason: the final answer's.
    """

    agent: str
    index: int
    params: Mapping[str, Any]
    status: ReplyStatus
    text: str | None = None
    value: Any = None
    error: str | None = None
    latency: float | None = None
    finished_reason: str | None = None

    @property
    def ok(self) -> bool:
        """Whether the agent answered, and the answer was read."""
        return self.status == "ok"


@dataclass(slots=True)
class RoundContext:
    """What a round knows, handed to ``prompt``, ``on_reply`` and ``apply``.

    Attributes:
        round: this round's number, from 1.
        rounds: how many rounds the run has.
        environment: the shared state, to read and change.
        state: a snapshot of the environment when the round started (in an
            ordered round: taken again before each agent).
        history: the summaries of the rounds before (their ``metrics`` are
            what ``apply`` returned).
        replies: the replies of this round so far (an ordered round's earlier
            agents; empty in a parallel round until ``apply``).
    """

    round: int
    rounds: int
    environment: Environment
    state: dict[str, Any]
    history: list[RoundSummary] = field(default_factory=list)
    replies: list[AgentReply] = field(default_factory=list)

    @property
    def previous(self) -> Mapping[str, Any]:
        """The metrics of the round before (empty in the first)."""
        return self.history[-1].metrics if self.history else {}


Prompt = Callable[[RoundContext, AgentView], "str | Awaitable[str]"]
Apply = Callable[
    [RoundContext, Sequence[AgentReply]],
    "Mapping[str, Any] | Awaitable[Mapping[str, Any] | None] | None",
]
OnReply = Callable[[RoundContext, AgentReply], "Awaitable[None] | None"]


@dataclass(kw_only=True)
class Simulation:
    """A simulation: who takes part, what they share, and what each round does.

    Attributes:
        name: a subject token naming it (its environment bucket, its host group).
        population: the agents.
        prompt: an agent's prompt for a round (sync or async).
        rounds: how many rounds (``--rounds`` overrides).
        order: ``parallel`` (every agent at once) or ``ordered`` (one after
            another, in population order, each seeing what those before did).
        environment: the initial state of the environment.
        apply: called with every reply at the end of a round (in population
            order); changes the environment and returns the round's figures
            (``metrics`` of its summary). Sync or async.
        on_reply: called with each reply as it comes; in an ordered round,
            before the next agent is asked.
        parse: reads an answer's text into the record's ``value``; an
            exception makes the reply an ``error``.
        tools: what the tool workers serve: toolkit specs
            (``module[:attr]``), tools or toolkits.
        environment_tools: serve ``env_get``, ``env_set`` and ``env_add`` too.
        deadline: seconds a round may take (``--deadline`` overrides).
        record_params: parameters copied into every record of the results.
        answer_limit: characters of an answer kept in the record.
        description: one line about it.
    """

    name: str
    population: Population
    prompt: Prompt
    rounds: int = 1
    order: Order = "parallel"
    environment: Mapping[str, Any] = field(default_factory=dict)
    apply: Apply | None = None
    on_reply: OnReply | None = None
    parse: Callable[[str], Any] | None = None
    tools: Sequence[str | ToolLike | Toolkit] = ()
    environment_tools: bool = True
    deadline: float = 120.0
    record_params: Sequence[str] = ()
    answer_limit: int = 2000
    description: str = ""

    def __post_init__(self) -> None:
        try:
            check_name(self.name, what="simulation name")
        except InvalidSubjectError as exc:
            raise ConfigError(str(exc)) from exc
        if self.order not in ("parallel", "ordered"):
            raise ConfigError(f"order is 'parallel' or 'ordered', not {self.order!r}")
        if self.rounds < 0:
            raise ConfigError(f"rounds must be 0 or more, not {self.rounds}")
        if not self.deadline > 0:
            raise ConfigError(f"the deadline must be positive, not {self.deadline}")
        if not isinstance(self.population, Population):
            raise ConfigError(f"population must be a Population, not {type(self.population)}")

    def toolkit(self, environment: Environment | None = None) -> Toolkit:
        """What the simulation's tool workers serve: its ``tools``, and the
        environment tools on ``environment`` (when given and enabled).

        Raises:
            ConfigError: a tool spec cannot be loaded, or two tools share a name.
        """
        kit = Toolkit()
        try:
            for item in self.tools:
                loaded = load_toolkit(item) if isinstance(item, str) else item
                for t in loaded if isinstance(loaded, Toolkit) else [loaded]:
                    kit.add(t)
            if environment is not None and self.environment_tools:
                for t in environment_tools(environment):
                    kit.add(t)
        except ToolDefinitionError as exc:
            raise ConfigError(f"simulation {self.name}: {exc}") from exc
        return kit

    def tool_names(self) -> list[str]:
        """The names of every tool the simulation's workers serve.

        Raises:
            ConfigError: a tool spec cannot be loaded.
        """
        names = self.toolkit().names
        if self.environment_tools:
            names += [n for n in ENVIRONMENT_TOOLS if n not in names]
        return names


def load_simulation(
    spec: str, *, agents: int | None = None, rounds: int | None = None
) -> Simulation:
    """The :class:`Simulation` a SPEC names.

    SPEC is ``path/to/file.py:attr`` or ``module:attr`` (``attr`` defaults to
    ``simulation``). ``attr`` is a Simulation or a function returning one;
    with ``agents``, a function that takes an ``agents`` argument is called
    with it, else the population is resized (:meth:`Population.with_size`).

    Args:
        spec: the SPEC.
        agents: the population's size, overriding the spec's.
        rounds: the number of rounds, overriding the spec's.

    Raises:
        ConfigError: the file or module cannot be loaded, the attribute is
            missing or not a simulation, or the population cannot be resized.
    """
    target = _load_attr(spec)
    if callable(target) and not isinstance(target, Simulation):
        kwargs: dict[str, Any] = {}
        if agents is not None and _takes(target, "agents"):
            kwargs["agents"] = agents
        target = target(**kwargs)
    if not isinstance(target, Simulation):
        raise ConfigError(
            f"{spec} is a {type(target).__name__}, not a Simulation or a function returning one"
        )
    if agents is not None and len(target.population) != agents:
        target.population = target.population.with_size(agents)
    if rounds is not None:
        if rounds < 0:
            raise ConfigError(f"--rounds must be 0 or more, not {rounds}")
        target.rounds = rounds
    return target


def _load_attr(spec: str) -> Any:
    where, colon, attr = spec.rpartition(":")
    if not colon:
        where, attr = spec, ""
    attr = attr or "simulation"
    if where.endswith(".py") or "/" in where or "\\" in where:
        module = _import_file(Path(where))
    else:
        try:
            module = import_named(where)
        except ImportError as exc:
            raise ConfigError(f"cannot import {where!r}: {exc}") from exc
    target: Any = module
    for part in attr.split("."):
        if not hasattr(target, part):
            raise ConfigError(f"{where} has no attribute {attr!r}")
        target = getattr(target, part)
    return target


def _import_file(path: Path) -> Any:
    if not path.is_file():
        raise ConfigError(f"no file {path}")
    resolved = path.resolve()
    digest = hashlib.sha1(str(resolved).encode()).hexdigest()[:10]
    name = f"_fleetbus_sim_{resolved.stem}_{digest}"
    if name in sys.modules:
        return sys.modules[name]
    module_spec = importlib.util.spec_from_file_location(name, resolved)
    if module_spec is None or module_spec.loader is None:
        raise ConfigError(f"cannot load {path} as Python")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module  # dataclasses and pickling look their module up
    try:
        module_spec.loader.exec_module(module)
    except FileNotFoundError as exc:
        del sys.modules[name]
        raise ConfigError(f"{path}: {exc}") from exc
    except SyntaxError as exc:
        del sys.modules[name]
        raise ConfigError(f"{path} line {exc.lineno}: {exc.msg}") from exc
    except ImportError as exc:
        del sys.modules[name]
        raise ConfigError(f"{path}: {exc}") from exc
    return module


def _takes(fn: Callable[..., Any], parameter: str) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return parameter in params or any(
        p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()
    )
