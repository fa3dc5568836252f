"""The fleet commands: ``agent``, ``ask``, ``sessions``, ``confirm``,
``resume``, ``cancel`` and ``watch``."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time
import tomllib
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

from rich.table import Table
from rich.text import Text

from fleetbus import logs
from fleetbus._imports import import_named
from fleetbus.agents import Agent, Permissions
from fleetbus.agents.long_term_memory import STORE_TOOLS
from fleetbus.agents.offload import ObjectStoreOffloader, Offloader
from fleetbus.agents.permissions import checked_confirmation, suggest_rules
from fleetbus.agents.serving.host import AgentHost, AgentSource
from fleetbus.agents.serving.remote import RemoteAgent
from fleetbus.agents.serving.sessions import SessionRecord, SessionStore
from fleetbus.bus import Bus, ToolClient
from fleetbus.bus.store import wait_for_store
from fleetbus.bus.subjects import check_name
from fleetbus.cli._common import (
    child_environment,
    connect,
    console,
    err_console,
    fail,
    model_option_args,
    model_options,
    on_stop_signals,
    run,
)
from fleetbus.cli._parsers import SESSION_SUBCOMMANDS, add_fleet_commands
from fleetbus.errors import ConfigError, FleetbusError, RemoteError, StoreError
from fleetbus.models import ChatModel, ModelConfig, default_model
from fleetbus.models.strings import (
    BusModelRef,
    ModelSettings,
    check_model,
    describe_model,
    load_model_settings,
    model_config_from_settings,
    model_from_string,
)
from fleetbus.protocol import (
    AgentMessage,
    AnyMessage,
    Cancel,
    Confirmation,
    ConfirmResult,
    ErrorDetail,
    ErrorMessage,
    ExternalOutput,
    ExternalResult,
    FinalAnswer,
    Message,
    UserRequest,
    new_id,
    to_builtins,
)
from fleetbus.tools_workers import RemoteToolProxy, Toolkit, load_toolkit

__all__ = [
    "add_fleet_commands",
    "commands",
    "confirm_result",
    "external_result",
    "load_agents",
    "stream_reply",
]

_T = TypeVar("_T")


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

    def __contains__(self, name: object) -> bool:
        return name in self.source

    def __iter__(self) -> Iterator[str]:
        if not isinstance(self.source, Iterable):
            raise ConfigError(f"the population {self.name} cannot list its agents")
        return iter(self.source)

    def agent(self, name: str) -> Agent:
        agent = self.source.agent(name)
        _apply_model(agent, self._model, self._cli)
        if agent.offloader is None:
            agent.offloader = self.offloader
        if self._remote:
            if agent.toolkit is None:
                # One toolkit of the remote tools for every agent built without
                # one: a new one each (an agent is built for each of its
                # replies) was 3 % of a simulation host's CPU.
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
    """``[agent.NAME]`` tables: system_prompt, model (a model string),
    model_settings (a table), tools (MODULE[:ATTR] specs), skills (folders,
    relative to the file), max_iters, allow/ask/deny rule lists."""
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
        agents.append(
            Agent(
                name,
                str(table.get("system_prompt", "")),
                chat_model,
                toolkit=toolkit,
                max_iters=int(table.get("max_iters", 10)),
                permissions=Permissions.from_strings(
                    allow=table.get("allow", []),
                    ask=table.get("ask", []),
                    deny=table.get("deny", []),
                    default=table.get("default", "allow"),
                ),
                plan=bool(table.get("plan", False)),
                model_config=model_config,
            )
        )
    return agents


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


# -- fleetbus agent ------------------------------------------------------------------------


def cmd_agent(args: argparse.Namespace) -> int:
    """Serve agents; with ``--replicas N``, supervise N processes doing so."""
    if args.replicas < 1:
        raise ConfigError("--replicas must be at least 1")
    # Fail here, once, on a bad spec or a model that cannot be configured.
    served = load_served(args.spec, model=args.model, settings=model_options(args))
    if args.replicas > 1:
        run(_check_models_once(args, served))
        return _supervise(args)
    return run(_serve_agents(args, served))


def _to_check(served: list[Agent] | PopulationSpec) -> list[Agent]:
    return served if isinstance(served, list) else [served.sample()]


async def _check_models_once(args: argparse.Namespace, served: list[Agent] | PopulationSpec) -> int:
    """Check the models once before starting replicas (that would each fail)."""
    bus = await connect(args.nats, args.prefix)
    try:
        await _prepare_models(bus, _to_check(served))
    finally:
        await bus.close()
    return 0


MODEL_WAIT = float(os.environ.get("FLEETBUS_MODEL_WAIT", "10"))
"""Seconds ``fleetbus agent`` waits at start for a model worker of a ``bus:NAME``
model (``FLEETBUS_MODEL_WAIT``)."""


async def _prepare_models(bus: Bus, agents: list[Agent]) -> None:
    """Bind ``bus:NAME`` models (fallbacks too) to ``bus``, then check that
    each agent's own model can be reached: stop now rather than fail every reply.

    Each model is checked once, however many agents have it or one like it
    (the same model string: a factory's agents each built with their own).

    Raises:
        ConfigError: a model cannot be reached.
    """
    checked: set[str] = set()
    for agent in agents:
        for model in (agent.model, agent.model_config.fallback):
            if isinstance(model, BusModelRef) and model.bus is None:
                model.bind(bus)
        described = describe_model(agent.model)
        if described not in checked:
            checked.add(described)
            await check_model(agent.model, timeout=MODEL_WAIT)


LISTED = 20
"""Most agents ``fleetbus agent`` names one by one at start; more are counted."""


def _print_models(served: list[Agent] | PopulationSpec, sample: list[Agent]) -> None:
    """One line per agent's model (per distinct model for many agents)."""
    lines: dict[str, list[str]] = {}
    for agent in sample:
        fallback = agent.model_config.fallback
        also = f", fallback {describe_model(fallback)}" if fallback is not None else ""
        who = agent.name if isinstance(served, list) else f"population {served.name}"
        lines.setdefault(f"model {describe_model(agent.model)}{also}", []).append(who)
    for line, names in lines.items():
        if len(sample) <= LISTED:
            for name in names:
                console.print(f"{name}: {line}", highlight=False, soft_wrap=True)
        else:
            console.print(
                f"{len(names)} agents ({names[0]} … {names[-1]}): {line}",
                highlight=False,
                soft_wrap=True,
            )


async def _serve_agents(args: argparse.Namespace, served: list[Agent] | PopulationSpec) -> int:
    bus = await connect(args.nats, args.prefix, args.replica_id)
    try:
        sample = _to_check(served)
        await _prepare_models(bus, sample)
        _print_models(served, sample)
        await _add_offloader(bus, served)
        group = args.group or (None if isinstance(served, list) else served.name)
        label = group or (
            served[0].name if isinstance(served, list) and len(served) == 1 else "host"
        )
        if not args.no_remote_tools:
            await _add_remote_tools(bus, served, label)
        host = AgentHost(
            bus,
            served,
            group=group,
            replica_id=f"{label}@{args.replica_id}" if args.replica_id else None,
            topics=args.topic,
            durable_topics=args.durable_topics,
            lease_ttl=args.lease_ttl,
            concurrency=args.concurrency or (16 if group is None else 64),
            checkpoints=args.checkpoints,
            events=args.events,
        )
        on_stop_signals(host.stop)
        logs.bind_process(worker=host.replica_id)
        async with asyncio.TaskGroup() as tg:
            tg.create_task(host.run())
            await host.wait_ready(30)
            if isinstance(served, list) and len(served) > LISTED:
                names = f"{len(served)} agents ({served[0].name} … {served[-1].name})"
            elif isinstance(served, list):
                names = ", ".join(a.name for a in served)
            else:
                names = f"population {served.name} (group {group})"
            console.print(f"serving {names} on {bus.connected_url} (prefix {bus.prefix})")
        console.print("agents stopped")
    finally:
        await bus.close()
    return 0


async def _add_offloader(bus: Bus, served: list[Agent] | PopulationSpec) -> None:
    """Give the served agents that have no offloader the fleet's object store
    (one for the process): a tool result cut in the context is kept whole
    there, and the model reads the rest with ``read_offloaded``. Without
    the store (no JetStream, or not allowed), the rest of a cut result is
    dropped, as a warning says."""
    try:
        offloader = await ObjectStoreOffloader.open(bus)
    except FleetbusError as exc:  # no JetStream, or a role without the store
        err_console.print(f"[yellow]long tool results will be cut, not offloaded: {exc}[/]")
        return
    if isinstance(served, PopulationSpec):
        served.offloader = offloader
        return
    for agent in served:
        if agent.offloader is None:
            agent.offloader = offloader


async def _add_remote_tools(bus: Bus, served: list[Agent] | PopulationSpec, label: str) -> None:
    """Give the served agents the tools served on the bus, found by one
    discovery and called through one :class:`ToolClient` for the process
    (however many agents it serves: a discovery each made a factory of
    10,000 agents start at ten a second). The calls' ``sender`` is
    ``agent.<name>`` for one agent, else ``host.<label>``."""
    if isinstance(served, PopulationSpec):
        client = ToolClient(bus, sender=f"host.{served.name}")
        try:
            added = await served.with_remote_tools(client)
        except FleetbusError as exc:
            err_console.print(f"[yellow]no remote tools for {served.name}: {exc}[/]")
            return
        if added:
            console.print(f"population {served.name}: remote tools {', '.join(added)}")
        return
    sender = f"agent.{served[0].name}" if len(served) == 1 else f"host.{label}"
    client = ToolClient(bus, sender=sender)
    try:
        found = await client.discover(timeout=1.0)
    except FleetbusError as exc:
        err_console.print(f"[yellow]no remote tools for {label}: {exc}[/]")
        return
    # Not the memory worker's own tools: they reach any agent's memory, and
    # the model never gets them (it gets the long-term memory's). One proxy
    # of each tool, in the toolkit of every agent.
    proxies = [RemoteToolProxy(t, client) for name, t in found.items() if name not in STORE_TOOLS]
    given: dict[tuple[str, ...], list[str]] = {}
    for agent in served:
        if agent.toolkit is None:
            agent.toolkit = Toolkit()
        if not isinstance(agent.toolkit, Toolkit):
            continue
        added = []
        for proxy in proxies:
            if proxy.name not in agent.toolkit:  # its own tools win
                agent.toolkit.add(proxy, group="remote")
                added.append(proxy.name)
        if added:
            given.setdefault(tuple(added), []).append(agent.name)
    for added_names, names in given.items():
        tools = ", ".join(added_names)
        if len(served) <= LISTED:
            for name in names:
                console.print(f"{name}: remote tools {tools}")
        else:
            console.print(f"{len(names)} agents ({names[0]} … {names[-1]}): remote tools {tools}")


def _supervise(args: argparse.Namespace) -> int:
    """Run ``--replicas`` child processes; restart one that crashes."""
    base = [sys.executable, "-m", "fleetbus", *_child_args(args)]
    stopping = False
    children: dict[int, subprocess.Popen[bytes]] = {}
    starts: dict[int, int] = {}

    def start(index: int) -> None:
        # A restarted replica has an id of its own: one that took its dead
        # predecessor's id would take the sessions it left for its own.
        starts[index] = starts.get(index, 0) + 1
        again = f"-{starts[index]}" if starts[index] > 1 else ""
        replica = f"r{index}-{os.getpid()}{again}"
        children[index] = subprocess.Popen(
            [*base, "--replica-id", replica], env=child_environment()
        )

    def on_signal(signum: int, _frame: Any) -> None:
        nonlocal stopping
        stopping = True
        for child in children.values():
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    for index in range(1, args.replicas + 1):
        start(index)
    console.print(f"supervising {args.replicas} replicas of {args.spec}")
    while True:
        for index, child in list(children.items()):
            code = child.poll()
            if code is None or stopping:
                continue
            err_console.print(f"[yellow]replica {index} exited with {code}; restarting[/]")
            time.sleep(1.0)
            start(index)
        if stopping:
            for child in children.values():
                try:
                    child.wait(60)
                except subprocess.TimeoutExpired:
                    child.kill()
            return 0
        time.sleep(0.2)


def _child_args(args: argparse.Namespace) -> list[str]:
    out = ["agent", args.spec, "--replicas", "1", "--lease-ttl", str(args.lease_ttl)]
    for topic in args.topic:
        out += ["--topic", topic]
    if args.group:
        out += ["--group", args.group]
    if args.durable_topics:
        out.append("--durable-topics")
    if args.concurrency:
        out += ["--concurrency", str(args.concurrency)]
    if args.events != "all":
        out += ["--events", args.events]
    if args.checkpoints != "step":
        out += ["--checkpoints", args.checkpoints]
    if args.no_remote_tools:
        out.append("--no-remote-tools")
    if args.model is not None:
        out += ["--model", args.model]
    out += model_option_args(model_options(args))
    if args.nats:
        out += ["--nats", args.nats]
    if args.prefix:
        out += ["--prefix", args.prefix]
    return out


# -- asking and watching -------------------------------------------------------------------


def cmd_ask(args: argparse.Namespace) -> int:
    """Ask an agent, streaming its reply; exit 1 when it ends in error.

    With ``--schema FILE`` the request carries that JSON Schema as its
    ``output_schema`` and the answer's ``structured`` object is printed;
    with ``--user ID``, ``metadata.user_id`` names who asks.

    Raises:
        ConfigError: an invalid session id, or a schema file that cannot be
            read or is not the JSON Schema of an object.
    """
    session = args.session or f"s-{new_id()[:12]}"
    check_name(session, what="session id")
    schema = None if args.schema is None else _read_output_schema(args.schema)
    request = UserRequest(
        sender="cli",
        session_id=session,
        content=args.text,
        output_schema=schema,
        metadata={"user_id": args.user} if args.user else {},
    )
    return run(_converse(args, args.agent, session, request))


def _read_output_schema(path: Path) -> dict[str, Any]:
    """The JSON Schema in ``path``, checked to describe an object (the answer
    is given as the arguments of a tool).

    Raises:
        ConfigError: the file cannot be read, is not JSON, or is not the
            schema of an object.
    """
    try:
        schema = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"cannot read the schema {path}: {exc.strerror or exc}") from exc
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError
        raise ConfigError(f"the schema {path} is not JSON: {exc}") from exc
    if not isinstance(schema, dict) or schema.get("type", "object") != "object":
        raise ConfigError(
            f'the schema {path} is not the JSON Schema of an object ("type": "object"): '
            "the answer is given as the arguments of a tool"
        )
    return schema


async def _converse(
    args: argparse.Namespace,
    agent: str,
    session: str,
    message: UserRequest | ConfirmResult | ExternalResult,
) -> int:
    """Stream the reply to ``message``: exit 1 when it ends in error (or is refused)."""
    from fleetbus.cli.render import ReplyPrinter

    bus = await connect(args.nats, args.prefix)
    printer = ReplyPrinter(console, session_id=session)
    try:
        if not args.json:
            console.print(f"[dim]session {session}[/]")
        outcome = await stream_reply(
            bus,
            agent,
            session,
            message,
            on_item=lambda item: _show(item, printer, args.json),
            timeout=args.timeout,
        )
    finally:
        if not args.json:
            printer.close()  # a line left open by a reply cut short
        await bus.close()
    if isinstance(outcome, ErrorMessage):
        return fail(outcome.message)
    return 1 if outcome.finished_reason == "error" else 0


async def stream_reply(
    bus: Bus,
    agent: str,
    session: str,
    message: Message,
    *,
    on_item: Callable[[AnyMessage], None],
    timeout: float,
) -> FinalAnswer | ErrorMessage:
    """Send ``message`` to an agent and hand each event of the reply to
    ``on_item`` as it is published, the final answer last (once).

    Streams through :meth:`RemoteAgent.reply_stream
    <fleetbus.agents.serving.remote.RemoteAgent.reply_stream>`, in ``session``;
    a reply left early (the caller cancelled) is interrupted.

    Args:
        bus: the connection.
        agent: the agent's name.
        session: the session to reply in.
        message: a ``user_request``, ``agent_message``, ``confirm_result`` or
            ``external_result``; its ``sender`` (``cli`` when empty) is kept.
        on_item: called with each event, then the final answer.
        timeout: seconds the whole reply may take.

    Returns:
        The final answer, or the ``error`` message the agent answered (its
        ``message`` a full sentence naming who could not handle what).

    Raises:
        CallTimeoutError: no answer within ``timeout`` seconds.
        NoRespondersError: the agent is not served.
        UnexpectedMessageError: the agent answered something else than a
            final answer.
        ConfigError: ``message`` is of another type, or ``session`` cannot be
            a subject token.
    """
    if not isinstance(message, UserRequest | AgentMessage | ConfirmResult | ExternalResult):
        raise ConfigError(
            f"an agent streams the reply to a user_request, agent_message, confirm_result or "
            f"external_result, not to a {type(message).__name__}"
        )
    remote = RemoteAgent(bus, agent, session_id=session, sender=message.sender or "cli")
    stream = remote.reply_stream(message, timeout=timeout)
    try:
        async with contextlib.aclosing(stream):
            async for item in stream:
                on_item(item)
                if isinstance(item, FinalAnswer):
                    return item
    except RemoteError as exc:
        return ErrorMessage(
            sender=exc.source_component,
            session_id=session,
            call_id=exc.call_id,
            code=exc.code,
            message=str(exc),
            source_component=exc.source_component,
        )
    raise AssertionError("a reply stream ends with a final answer or raises")


def _show(message: AnyMessage, printer: Any, as_json: bool) -> None:
    if as_json:
        print(json.dumps(to_builtins(message), ensure_ascii=False), flush=True)
    else:
        printer.handle(message)


def cmd_watch(args: argparse.Namespace) -> int:
    """Print live traffic until Ctrl-C."""
    from fleetbus.cli.watch import watch

    async def main() -> int:
        bus = await connect(args.nats, args.prefix)
        stop = asyncio.Event()
        on_stop_signals(stop.set)
        try:
            await watch(
                bus,
                session=args.session,
                agent=args.agent,
                json_output=args.json,
                console=console,
                stop=stop,
            )
        finally:
            await bus.close()
        return 0

    return run(main())


# -- sessions ----------------------------------------------------------------------------


def cmd_sessions(args: argparse.Namespace) -> int:
    """List sessions; or (``history``, ``fork``, ``migrate``) list a
    session's journal, fork it, or carry over the sessions of the old layout."""
    words: list[str] = args.words
    action = words[0] if words and words[0] in SESSION_SUBCOMMANDS else None
    problem = _sessions_misuse(args, action)
    if problem is not None:
        # As argparse tells a misuse: the usage, the problem, exit code 2.
        sys.stderr.write(f"{args.sessions_usage}fleetbus sessions: error: {problem}\n")
        return 2
    if action in ("history", "fork"):
        agent = check_name(words[1], what="agent name")
        session = check_name(words[2], what="session id")
        return run((_history if action == "history" else _fork)(args, agent, session))
    if action == "migrate":
        return run(_migrate(args))
    return run(_list_sessions(args, args.agent_option or (words[0] if words else None)))


def _sessions_misuse(args: argparse.Namespace, action: str | None) -> str | None:
    """What is wrong with the words and options of ``fleetbus sessions``, if anything."""
    words: list[str] = args.words
    wanted = {"history": 3, "fork": 3, "migrate": 1}.get(action or "", 1)
    if action is None and (len(words) > 1 or (words and args.agent_option)):
        return "give one AGENT (or --agent AGENT)"
    if action in ("history", "fork") and len(words) != wanted:
        return f"{action} takes AGENT SESSION"
    if action == "migrate" and len(words) != wanted:
        return "migrate takes no AGENT or SESSION"
    if action is not None and args.agent_option:
        return f"--agent is for the listing; {action} takes AGENT SESSION"
    if action == "fork" and args.at is None:
        return "fork needs --at N (the facts as history numbers them)"
    if action != "fork" and (args.at is not None or args.new_session is not None):
        return "--at and --as go with fork"
    if action != "migrate" and args.drop:
        return "--drop goes with migrate"
    return None


async def _list_sessions(args: argparse.Namespace, agent: str | None) -> int:
    bus = await connect(args.nats, args.prefix)
    try:
        records = await _from_store(lambda: _records(bus, agent), args.store_wait)
    finally:
        await bus.close()
    if args.json:
        print(json.dumps([_summary(r) for r in records], indent=2))
        return 0
    if not records:
        console.print("no sessions")
        return 0
    table = Table(title="sessions")
    for column in ("agent", "session", "status", "step", "age", "owner", "last answer"):
        table.add_column(column)
    now = time.time()
    for r in records:
        summary = _summary(r)
        table.add_row(
            r.agent,
            r.session_id,
            _status_style(r.status),
            str(r.step),
            _age(now - r.updated_at.timestamp()),
            r.owner or "",
            str(summary["last_answer"] or "")[:60],
        )
    console.print(table)
    return 0


async def _history(args: argparse.Namespace, agent: str, session: str) -> int:
    """Print the facts of a session's journal (``SessionNotFoundError``: none)."""
    bus = await connect(args.nats, args.prefix)
    try:
        facts = await _from_store(
            lambda: _open_store(bus, lambda store: store.history(agent, session)), args.store_wait
        )
    finally:
        await bus.close()
    if args.json:
        for fact in facts:
            print(json.dumps(fact.model_dump(mode="json"), ensure_ascii=False))
        return 0
    table = Table(title=f"session {session} of {agent}")
    for column in ("n", "time", "kind", "status", "added", "changed", "final answer"):
        table.add_column(column, overflow="fold")
    for fact in facts:
        status = Text.from_markup(_status_style(fact.status or ""))
        if fact.owner:
            status.append(f" {fact.owner}" if fact.status else fact.owner)
        table.add_row(
            str(fact.n),
            f"{fact.time.astimezone():%Y-%m-%d %H:%M:%S}" if fact.time is not None else "",
            fact.kind,
            status,
            Text(_describe_added(fact.added)),
            ", ".join(fact.changed),
            Text(_answer_text(fact.final)[:80]),
        )
    console.print(table)
    return 0


def _describe_added(messages: list[dict[str, Any]]) -> str:
    """The messages a fact added, in one short line."""
    parts = []
    for message in messages[:3]:
        blocks = []
        for block in message.get("content") or []:
            kind = block.get("type")
            if kind == "text":
                blocks.append(repr(_cut(str(block.get("text", "")), 40)))
            elif kind == "tool_use":
                arguments = json.dumps(block.get("input"), ensure_ascii=False)
                blocks.append(f"→ {block.get('name')}({_cut(arguments, 30)})")
            elif kind == "tool_result":
                blocks.append(f"← {block.get('name')}: {block.get('state', 'success')}")
            elif kind:
                blocks.append(f"[{kind}]")
        parts.append(f"{message.get('role')}: {' '.join(blocks)}")
    if len(messages) > 3:
        parts.append(f"+{len(messages) - 3} more")
    return "; ".join(parts)


def _cut(text: str, width: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 1] + "…"


def _answer_text(final: dict[str, Any] | None) -> str:
    """The text of a stored final answer."""
    content = (final or {}).get("content")
    if isinstance(content, list):
        return " ".join(str(b.get("text", "")) for b in content if isinstance(b, dict))
    return "" if content is None else str(content)


async def _fork(args: argparse.Namespace, agent: str, session: str) -> int:
    """Fork a session at fact ``--at`` into ``--as`` (or a new id); print its id."""
    new = check_name(args.new_session, what="session id") if args.new_session else None
    bus = await connect(args.nats, args.prefix)
    try:
        store = await _from_store(lambda: SessionStore.open(bus, owner="cli"), args.store_wait)
        facts = await _from_store(lambda: store.history(agent, session), args.store_wait)
        if not 1 <= args.at <= len(facts):
            raise ConfigError(
                f"--at {args.at}: session {session} of {agent} has facts 1 to {len(facts)} "
                f"(fleetbus sessions history {agent} {session} lists them)"
            )
        # Not retried: a fork that landed unacknowledged would be made twice.
        record = await store.fork(agent, session, at=args.at, new_session=new)
    finally:
        await bus.close()
    if args.json:
        print(json.dumps(_summary(record)))
    else:
        console.print(
            f"session {record.session_id}: {session} of {agent} up to fact {args.at} "
            f"({record.messages} messages, {record.status})",
            highlight=False,
        )
    return 0


async def _migrate(args: argparse.Namespace) -> int:
    """Carry the sessions of the layout before journals into the journal."""
    from fleetbus.agents.serving._legacy import migrate

    bus = await connect(args.nats, args.prefix)
    try:
        done = await _from_store(
            lambda: _open_store(bus, lambda store: migrate(bus, store, drop=args.drop)),
            args.store_wait,
        )
    finally:
        await bus.close()
    if args.json:
        print(json.dumps(dataclasses.asdict(done), indent=2))
    else:
        for key in done.carried:
            console.print(f"carried over {key}", highlight=False)
        for key in done.kept:
            console.print(f"kept {key}: its journal has facts already", highlight=False)
        for key, why in done.failed.items():
            err_console.print(Text(f"not carried over: {key}: {why}", style="red"))
        if not (done.carried or done.kept or done.failed):
            console.print("no sessions of the layout before journals")
        for bucket in done.dropped:
            console.print(f"removed {bucket}", highlight=False)
        if args.drop and done.failed:
            err_console.print("the old buckets are kept: some sessions could not be read")
    return 1 if done.failed else 0


async def _open_store(bus: Bus, call: Callable[[SessionStore], Awaitable[_T]]) -> _T:
    return await call(await SessionStore.open(bus, owner="cli"))


async def _records(bus: Bus, agent: str | None = None) -> list[SessionRecord]:
    store = await SessionStore.open(bus, owner="cli")
    return await store.records(agent)


async def _from_store(call: Callable[[], Awaitable[_T]], store_wait: float) -> _T:
    """``call()``, a reading of the session store, riding out a failure that
    may pass (a cluster electing the store's new leader after a node died)
    for up to ``store_wait`` seconds; said once on stderr.

    Raises:
        StoreError: a failure that does not pass, or one that lasted
            ``store_wait`` seconds.
    """

    def waiting(exc: StoreError) -> None:
        err_console.print(
            Text(f"waiting for the session store: {exc} (up to {store_wait:g} s)", style="yellow"),
            soft_wrap=True,
        )

    return await wait_for_store(call, timeout=store_wait, waiting=waiting)


def _summary(record: SessionRecord) -> dict[str, Any]:
    final = record.final or {}
    pending = record.state.reply.pending if record.state.reply else []
    return {
        "agent": record.agent,
        "session": record.session_id,
        "status": record.status,
        "step": record.step,
        "updated_at": record.updated_at.isoformat(),
        "owner": record.owner,
        "pending": [
            {**p.model_dump(), "suggested_rules": suggest_rules(p.tool_name, p.parameters)}
            if p.kind == "confirm"
            else p.model_dump()
            for p in pending
        ],
        "last_answer": final.get("content"),
    }


def _status_style(status: str) -> str:
    colour = {"running": "cyan", "paused": "yellow", "done": "green", "error": "red"}.get(status)
    return f"[{colour}]{status}[/]" if colour else status


def _age(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f}s"
    if seconds < 5400:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.1f}h"


async def _find_agent(bus: Bus, session: str, agent: str | None, store_wait: float) -> str:
    if agent:
        return agent
    records = await _from_store(lambda: _records(bus), store_wait)
    matches = [r.agent for r in records if r.session_id == session]
    if not matches:
        raise ConfigError(f"no session {session!r}; name the agent with --agent")
    if len(set(matches)) > 1:
        raise ConfigError(f"session {session!r} exists for {sorted(set(matches))}; use --agent")
    return matches[0]


def cmd_confirm(args: argparse.Namespace) -> int:
    """Confirm or deny pending calls (maybe edited, maybe accepting rules),
    then stream the resumed reply.

    Raises:
        ConfigError: no call named, a call both allowed and denied, an edit
            that is not a JSON object, or a rule that does not parse.
    """
    message = confirm_result(
        args.session,
        allow=args.allow,
        deny=args.deny,
        always=args.always,
        edits=[(call_id, _edited_parameters(call_id, text)) for call_id, text in args.edit],
        accept_rules=args.accept_rules,
        sender="cli",
    )
    return _resume_with(args, message)


def cmd_resume(args: argparse.Namespace) -> int:
    """Give a paused reply the results of calls run outside the agent, then
    stream the resumed reply.

    Raises:
        ConfigError: no result given, a call given twice, or a result that
            is not JSON.
    """
    message = external_result(
        args.session,
        results=[(call_id, _json_value(call_id, text)) for call_id, text in args.result],
        errors=args.error,
        sender="cli",
    )
    return _resume_with(args, message)


def _resume_with(args: argparse.Namespace, message: ConfirmResult | ExternalResult) -> int:
    """Send a paused session's resume input to the agent that serves it
    (found in the session store unless ``--agent`` names it), then stream
    the resumed reply."""

    async def main() -> int:
        bus = await connect(args.nats, args.prefix)
        try:
            agent = await _find_agent(bus, args.session, args.agent, args.store_wait)
        finally:
            await bus.close()
        return await _converse(args, agent, args.session, message)

    return run(main())


def external_result(
    session_id: str,
    *,
    results: Iterable[tuple[str, Any]] = (),
    errors: Iterable[tuple[str, str]] = (),
    sender: str = "cli",
) -> ExternalResult:
    """The ``external_result`` of ``fleetbus resume SESSION --result CALL_ID
    JSON … --error CALL_ID MESSAGE …``: each call's output (any JSON value),
    or the error message of a call that failed (the model sees it as a tool
    error).

    Raises:
        ConfigError: no call is named, or a call is named twice.
    """
    outputs: list[ExternalOutput] = []
    seen: set[str] = set()
    given = [(c, v, False) for c, v in results] + [(c, m, True) for c, m in errors]
    for call_id, value, failed in given:
        if not call_id:
            raise ConfigError("a call id is empty")
        if call_id in seen:
            raise ConfigError(f"the call {call_id!r} is given twice")
        seen.add(call_id)
        if failed:
            detail = ErrorDetail(code="tool_error", message=str(value))
            outputs.append(ExternalOutput(call_id=call_id, status="error", error_detail=detail))
        else:
            outputs.append(ExternalOutput(call_id=call_id, content=value))
    if not outputs:
        raise ConfigError(
            "give at least one result (--result CALL_ID JSON or --error CALL_ID TEXT)"
        )
    return ExternalResult(sender=sender, session_id=session_id, results=outputs)


def _json_value(call_id: str, text: str) -> Any:
    """The output of ``--result CALL_ID JSON``.

    Raises:
        ConfigError: the text is not JSON.
    """
    try:
        return json.loads(text)
    except ValueError as exc:
        raise ConfigError(
            f"--result {call_id}: the result is not JSON ({exc}); give a text as a JSON "
            f"string, in quotes: '{json.dumps(text[:40], ensure_ascii=False)}'"
        ) from None


def confirm_result(
    session_id: str,
    *,
    allow: Iterable[str] = (),
    deny: Iterable[str] = (),
    always: bool = False,
    edits: Iterable[tuple[str, dict[str, Any]]] = (),
    accept_rules: Iterable[str] = (),
    sender: str = "cli",
) -> ConfirmResult:
    """The ``confirm_result`` of ``fleetbus confirm SESSION --allow … --deny …
    --edit CALL_ID JSON … --accept-rules RULE …``.

    An edited call is allowed. The accepted rules go with the first allowed
    call (with the first call when all are denied): they are the agent's, for
    any call.

    Raises:
        ConfigError: no call is named, a call is both allowed and denied (or
            edited and denied, or edited twice), or a rule does not parse.
    """
    allowed, denied = list(dict.fromkeys(allow)), list(dict.fromkeys(deny))
    edited: dict[str, dict[str, Any]] = {}
    for call_id, parameters in edits:
        if call_id in edited:
            raise ConfigError(f"the call {call_id!r} is edited twice")
        edited[call_id] = parameters
        if call_id not in allowed:
            allowed.append(call_id)
    both = sorted(set(allowed) & set(denied))
    if both:
        raise ConfigError(f"allowed and denied at once: {', '.join(both)}")
    if not allowed and not denied:
        raise ConfigError("name at least one call to allow, deny or edit")
    rules = list(accept_rules)
    confirmations: list[Confirmation] = []
    for call_id, confirmed in [(c, True) for c in allowed] + [(c, False) for c in denied]:
        confirmations.append(
            checked_confirmation(
                call_id,
                allow=confirmed,
                always=always,
                parameters=edited.get(call_id),
                accept_rules=rules if not confirmations else (),
            )
        )
    return ConfirmResult(sender=sender, session_id=session_id, confirmations=confirmations)


def _edited_parameters(call_id: str, text: str) -> dict[str, Any]:
    """The input of ``--edit CALL_ID JSON``.

    Raises:
        ConfigError: the text is not JSON, or not an object.
    """
    try:
        parameters = json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"--edit {call_id}: the parameters are not JSON ({exc})") from None
    if not isinstance(parameters, dict):
        kind = {list: "an array", str: "a string", bool: "a boolean"}.get(
            type(parameters), "null" if parameters is None else "a number"
        )
        raise ConfigError(f"--edit {call_id}: the parameters must be a JSON object, not {kind}")
    return parameters


def cmd_cancel(args: argparse.Namespace) -> int:
    """Send a cancel to every replica of the session's agent."""

    async def main() -> int:
        bus = await connect(args.nats, args.prefix)
        try:
            agent = await _find_agent(bus, args.session, args.agent, args.store_wait)
            cancel = Cancel(sender="cli", session_id=args.session, reason=args.reason)
            await bus.publish(bus.subjects.agent_control(agent), cancel)
            await bus.flush()
        finally:
            await bus.close()
        console.print(f"cancel sent to {agent} for session {args.session}")
        return 0

    return run(main())


def commands() -> dict[str, Any]:
    """The fleet commands by name."""
    return {
        "agent": cmd_agent,
        "ask": cmd_ask,
        "sessions": cmd_sessions,
        "confirm": cmd_confirm,
        "resume": cmd_resume,
        "cancel": cmd_cancel,
        "watch": cmd_watch,
    }
