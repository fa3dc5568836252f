"""What ``fleetbus agent SPEC`` serves, loaded from ``SPEC``: a fleet file
(TOML, ``[agent.NAME]`` tables) or a ``module:factory`` returning agents or a
population, each given the model and model settings of the command line."""

from __future__ import annotations

import contextlib
import os
import re
import tomllib
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from fleetbus._imports import import_named
from fleetbus.agents import Agent, AgentSettings, Permissions
from fleetbus.agents.agent import check_description
from fleetbus.agents.long_term_memory import STORE_TOOLS
from fleetbus.agents.offload import Offloader
from fleetbus.agents.serving.host import AgentSource
from fleetbus.agents.serving.remote import MessageBus
from fleetbus.bus import ToolClient
from fleetbus.bus.subjects import check_name
from fleetbus.capabilities import Guardrails, Handoffs, HandoffTo, Offloading, Planning
from fleetbus.errors import ConfigError
from fleetbus.models import ChatModel, ModelConfig, default_model
from fleetbus.models.strings import (
    ModelSettings,
    load_model_settings,
    model_config_from_settings,
    model_from_string,
)
from fleetbus.tools_workers import RemoteToolProxy, Toolkit, load_toolkit

__all__ = ["PopulationSpec", "bind_guardrails", "load_agents", "load_served", "offload_to"]


def load_agents(
    spec: str, *, model: str | None = None, settings: Mapping[str, Any] | None = None
) -> list[Agent]:
    """The agents named by ``module:factory`` or a TOML file.

    Args:
        spec: ``module:factory`` (an Agent, a list of them, or a factory of
            either) or a TOML file of ``[agent.NAME]`` tables.
        model: a model string for every agent, over what the spec says.
        settings: model settings by field name (``timeout``, ``retries``…),
            over the spec's and the environment's.

    A TOML agent's model is ``model``, else its ``model =`` key, else
    ``FLEETBUS_MODEL``, else the offline model; its settings are ``settings``
    over its ``[agent.NAME.model_settings]`` table over ``FLEETBUS_MODEL_*``.
    A factory runs with ``model`` and ``settings`` in ``FLEETBUS_MODEL`` and
    ``FLEETBUS_MODEL_*`` (so :func:`~fleetbus.models.default_model` sees
    them); then ``model`` replaces each agent's model and the timeout,
    retries and fallback of ``settings`` its ``ModelConfig``.

    Raises:
        ConfigError: nothing loadable, not agents, or a model that cannot be
            configured.
    """
    served = load_served(spec, model=model, settings=settings)
    if not isinstance(served, list):
        raise ConfigError(f"{spec} is a population of agents, not a list of them")
    return served


def load_served(
    spec: str, *, model: str | None = None, settings: Mapping[str, Any] | None = None
) -> list[Agent] | PopulationSpec:
    """What ``fleetbus agent SPEC`` serves: agents (see :func:`load_agents`),
    or a population — an :class:`~fleetbus.agents.serving.AgentSource` that
    builds its agents on demand, each given ``model`` and ``settings`` as it
    is built.

    Raises:
        ConfigError: nothing loadable, not agents, or a model that cannot be
            configured.
    """
    cli = {k: v for k, v in (settings or {}).items() if v is not None}
    if spec.endswith(".toml"):
        return _agents_from_toml(Path(spec), model, cli)
    module_name, _, attr = spec.partition(":")
    with _model_environment(model, cli):
        try:
            module = import_named(module_name)
        except ImportError as exc:
            raise ConfigError(f"cannot import {module_name!r}: {exc}") from exc
        target: Any = getattr(module, attr or "agents", None)
        if target is None:
            raise ConfigError(f"module {module_name!r} has no attribute {attr or 'agents'!r}")
        # A class (a population's too: it has the methods) or a factory is
        # called; an agent or a population instance is used as it is.
        if isinstance(target, type) or (
            callable(target) and not isinstance(target, Agent | AgentSource)
        ):
            try:
                target = target()
            except ConfigError:
                raise
            except Exception as exc:  # the user's factory: one line, not a traceback
                raise ConfigError(
                    f"{spec}: calling it failed: {type(exc).__name__}: {exc}"
                ) from exc
    if isinstance(target, AgentSource) and not isinstance(target, Agent | list | tuple):
        name = getattr(target, "name", None) or attr or module_name.rpartition(".")[2]
        return PopulationSpec(target, re.sub(r"[^A-Za-z0-9_-]", "-", str(name))[:64], model, cli)
    agents = (
        [target]
        if isinstance(target, Agent)
        else list(target)
        if isinstance(target, list | tuple)
        else []
    )
    if not agents or not all(isinstance(a, Agent) for a in agents):
        raise ConfigError(
            f"{spec} is not an Agent, a list of agents, a population, or a factory of them"
        )
    names = [a.name for a in agents]
    if len(set(names)) != len(names):
        raise ConfigError(f"{spec} defines agents with the same name: {names}")
    for agent in agents:
        _apply_model(agent, model, cli)
    return agents


def _apply_model(agent: Agent, model: str | None, cli: Mapping[str, Any]) -> None:
    """Give ``agent`` the model and settings of the command line, if any."""
    if model is None and not cli:
        return
    merged = load_model_settings(cli=cli)
    # Only what the command line gave overrides the factory's own ModelConfig.
    given = ModelSettings.model_construct(**{k: getattr(merged, k) for k in cli})
    if model is not None:
        agent.model = model_from_string(model, merged)
    agent.model_config = model_config_from_settings(given, base=agent.model_config)


class PopulationSpec:
    """A population served by ``fleetbus agent``: each agent it builds gets
    the command line's model and settings, and the tools served on the bus
    (once :meth:`with_remote_tools` found them).

    Args:
        source: the population.
        name: the host group it is served in by default.
        model: a model string for every agent.
        cli: model settings from the command line.
    """

    def __init__(
        self, source: AgentSource, name: str, model: str | None, cli: Mapping[str, Any]
    ) -> None:
        self.source = source
        self.name = name
        self._model = model
        self._cli = dict(cli)
        self._remote: list[RemoteToolProxy] = []
        self._remote_toolkit: Toolkit | None = None
        self.offloader: Offloader | None = None
        """Given to every agent built without an offloader of its own."""
        self.bus: MessageBus | None = None
        """What the agent guardrails without a bus of every agent built ask on."""

    def __contains__(self, name: object) -> bool:
        return name in self.source

    def __iter__(self) -> Iterator[str]:
        if not isinstance(self.source, Iterable):
            raise ConfigError(f"the population {self.name} cannot list its agents")
        return iter(self.source)

    def agent(self, name: str) -> Agent:
        agent = self.source.agent(name)
        _apply_model(agent, self._model, self._cli)
        offload_to(agent, self.offloader)
        if self.bus is not None:
            _bind(agent, self.bus)
        if self._remote:
            if agent.toolkit is None:
                # One toolkit of the remote tools for every agent built without
                # one: an agent is built for each of its replies, and a new
                # toolkit each would cost every reply its construction.
                if self._remote_toolkit is None:
                    self._remote_toolkit = Toolkit()
                agent.toolkit = self._remote_toolkit
            if isinstance(agent.toolkit, Toolkit):
                for proxy in self._remote:
                    if proxy.name not in agent.toolkit:
                        agent.toolkit.add(proxy, group="remote")
        return agent

    def sample(self) -> Agent:
        """One agent of the population (to check its model), built now.

        Raises:
            ConfigError: the population is empty or cannot list its agents.
        """
        for name in self:
            return self.agent(name)
        raise ConfigError(f"the population {self.name} has no agents")

    async def with_remote_tools(self, client: ToolClient) -> list[str]:
        """Find the tools served on the bus; every agent built from now on has them."""
        found = await client.discover(timeout=1.0)
        for name in STORE_TOOLS:  # the memory worker's own: never the model's
            found.pop(name, None)
        self._remote = [RemoteToolProxy(spec, client) for spec in found.values()]
        self._remote_toolkit = None
        return sorted(found)


@contextlib.contextmanager
def _model_environment(model: str | None, cli: Mapping[str, Any]) -> Iterator[None]:
    """``FLEETBUS_MODEL`` and ``FLEETBUS_MODEL_*`` set from the command line, for a
    while: a factory that builds its model from the environment sees them."""
    values = {f"FLEETBUS_MODEL_{k.upper()}": str(v) for k, v in cli.items()}
    if model is not None:
        values["FLEETBUS_MODEL"] = model
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _agents_from_toml(path: Path, model: str | None, cli: Mapping[str, Any]) -> list[Agent]:
    """``[agent.NAME]`` tables: system_prompt, description (one line, at most
    1,024 characters), model (a model string), model_settings (a table),
    tools (MODULE[:ATTR] specs), skills (folders, relative to the file),
    max_iters, allow/ask/deny rule lists, plan, guardrails (a table, see
    :meth:`~fleetbus.capabilities.Guardrails.from_table`), handoffs (agent
    names, or tables of agent, description, input_filter, tool_name)."""
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from exc
    tables = data.get("agent")
    if not isinstance(tables, dict) or not tables:
        raise ConfigError(f"{path} has no [agent.NAME] table")
    agents = []
    for name, table in tables.items():
        if not isinstance(table, dict):
            raise ConfigError(f"{path}: agent.{name} is not a table")
        check_name(name, what="agent name")
        description = check_description(table.get("description", ""), f"{path}: agent.{name}")
        toolkit = Toolkit()
        for tool_spec in table.get("tools", []):
            for t in load_toolkit(tool_spec):
                toolkit.add(t)
        skills = table.get("skills", [])
        if not isinstance(skills, list) or not all(isinstance(s, str) for s in skills):
            raise ConfigError(f"{path}: agent.{name}.skills is a list of folders")
        if skills:  # folders relative to the file
            toolkit.add_skills([path.parent / folder for folder in skills])
        chat_model, model_config = _toml_model(path, name, table, model, cli)
        capabilities: list[Any] = [Planning()] if table.get("plan", False) else []
        if "guardrails" in table:
            where = f"{path}: agent.{name}.guardrails"
            capabilities.append(Guardrails.from_table(table["guardrails"], where=where))
        capabilities += _toml_handoffs(path, name, table)
        agents.append(
            Agent(
                name,
                str(table.get("system_prompt", "")),
                chat_model,
                description=description,
                toolkit=toolkit,
                permissions=Permissions.from_strings(
                    allow=table.get("allow", []),
                    ask=table.get("ask", []),
                    deny=table.get("deny", []),
                    default=table.get("default", "allow"),
                ),
                capabilities=capabilities,
                settings=AgentSettings(
                    max_iters=int(table.get("max_iters", 10)), model_calls=model_config
                ),
            )
        )
    return agents


def _toml_handoffs(path: Path, name: str, table: dict[str, Any]) -> list[Handoffs]:
    """An agent table's ``handoffs``: agent names, or tables ``{agent,
    description, input_filter, tool_name}`` (``input_filter``: a filter's
    name, or ``MODULE:ATTR`` naming a function)."""
    where = f"{path}: agent.{name}.handoffs"
    entries = table.get("handoffs", [])
    if not isinstance(entries, list):
        raise ConfigError(f"{where} is a list of agent names or tables")
    if not entries:
        return []
    targets: list[str | HandoffTo] = []
    for entry in entries:
        if isinstance(entry, str):
            targets.append(entry)
            continue
        if not isinstance(entry, dict) or not isinstance(entry.get("agent"), str):
            raise ConfigError(f"{where}: {entry!r} is not an agent name or a table with agent")
        unknown = set(entry) - {"agent", "description", "input_filter", "tool_name"}
        if unknown:
            raise ConfigError(f"{where}: unknown keys {sorted(unknown)} for {entry['agent']}")
        chosen = entry.get("input_filter", "all")
        if not isinstance(chosen, str):
            raise ConfigError(f"{where}: the input_filter of {entry['agent']} is not a string")
        input_filter: Any = chosen if ":" not in chosen else _named_function(chosen, where)
        try:
            targets.append(
                HandoffTo(
                    entry["agent"],
                    description=str(entry.get("description", "")),
                    input_filter=input_filter,
                    tool_name=entry.get("tool_name"),
                )
            )
        except ConfigError as exc:
            raise ConfigError(f"{where}: {exc}") from exc
    try:
        handoffs = Handoffs(targets)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from exc
    if any(t.agent == name for t in handoffs.targets):
        raise ConfigError(f"{where}: agent {name} cannot hand the conversation to itself")
    return [handoffs]


def _named_function(spec: str, where: str) -> Any:
    """The function ``MODULE:ATTR`` names."""
    module_name, _, attr = spec.partition(":")
    try:
        found = getattr(import_named(module_name), attr, None)
    except ImportError as exc:
        raise ConfigError(f"{where}: cannot import {module_name!r}: {exc}") from exc
    if not callable(found):
        raise ConfigError(f"{where}: {spec} is not a function")
    return found


def _toml_model(
    path: Path, name: str, table: dict[str, Any], model: str | None, cli: Mapping[str, Any]
) -> tuple[ChatModel, ModelConfig]:
    """An agent table's model and ModelConfig: the command line over the table
    over the environment."""
    where = f"{path}: agent.{name}"
    toml_settings = table.get("model_settings", {})
    if not isinstance(toml_settings, dict):
        raise ConfigError(f"{where}.model_settings is not a table")
    settings = load_model_settings(toml=toml_settings, cli=cli, where=f"{where}.model_settings")
    text = model if model is not None else table.get("model")
    if text is not None and not isinstance(text, str):
        raise ConfigError(f"{where}.model is not a string")
    try:
        chat_model = default_model(settings) if text is None else model_from_string(text, settings)
        return chat_model, model_config_from_settings(settings)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from exc


def bind_guardrails(served: list[Agent] | PopulationSpec, bus: MessageBus) -> None:
    """Bind the agent guardrails of the served agents that have no bus to
    ``bus``: those of a population's agents as each is built."""
    if isinstance(served, PopulationSpec):
        served.bus = bus
        return
    for agent in served:
        _bind(agent, bus)


def _bind(agent: Agent, bus: MessageBus) -> None:
    for capability in agent.capabilities:
        if isinstance(capability, Guardrails):
            capability.bind(bus)


def offload_to(agent: Agent, offloader: Offloader | None) -> None:
    """Give ``agent`` the offloading capability, keeping whole in
    ``offloader`` the tool results cut in its context, unless it has one."""
    if offloader is not None and not any(isinstance(c, Offloading) for c in agent.capabilities):
        agent.capabilities = [*agent.capabilities, Offloading(offloader)]
