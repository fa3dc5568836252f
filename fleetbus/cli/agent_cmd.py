"""``fleetbus agent SPEC``: serve the agents of a spec (see
:mod:`fleetbus.cli.fleet_file`) on the bus; with ``--replicas N``, supervise
N processes doing so (:mod:`fleetbus.cli.supervisor`)."""

from __future__ import annotations

import argparse
import asyncio

from fleetbus import logs
from fleetbus.agents import Agent
from fleetbus.agents.long_term_memory import STORE_TOOLS
from fleetbus.agents.offload import ObjectStoreOffloader
from fleetbus.agents.serving.host import AgentHost
from fleetbus.bus import Bus, ToolClient
from fleetbus.cli._common import (
    connect,
    console,
    err_console,
    model_options,
    on_stop_signals,
    run,
)
from fleetbus.cli.fleet_file import PopulationSpec, bind_guardrails, load_served, offload_to
from fleetbus.cli.settings import cli_settings
from fleetbus.cli.supervisor import supervise
from fleetbus.errors import FleetbusError
from fleetbus.models.strings import BusModelRef, check_model, describe_model
from fleetbus.tools_workers import RemoteToolProxy, Toolkit

__all__ = ["LISTED", "cmd"]


def cmd(args: argparse.Namespace) -> int:
    """Serve agents; with ``--replicas N``, supervise N processes doing so."""
    # Fail here, once, on a bad spec or a model that cannot be configured.
    served = load_served(args.spec, model=args.model, settings=model_options(args))
    if args.replicas > 1:
        run(_check_models_once(args, served))
        return supervise(args)
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


async def _prepare_models(bus: Bus, agents: list[Agent]) -> None:
    """Bind ``bus:NAME`` models (fallbacks too) to ``bus``, then check that
    each agent's own model can be reached: stop now rather than fail every reply.

    Each model is checked once, however many agents have it or one like it
    (the same model string: a factory's agents each built with their own).

    Raises:
        ConfigError: a model cannot be reached (within ``FLEETBUS_MODEL_WAIT``
            seconds, for a ``bus:NAME`` model), or ``FLEETBUS_MODEL_WAIT`` is
            not a positive number.
    """
    wait = cli_settings().model_wait
    checked: set[str] = set()
    for agent in agents:
        for model in (agent.model, agent.model_config.fallback):
            if isinstance(model, BusModelRef) and model.bus is None:
                model.bind(bus)
        described = describe_model(agent.model)
        if described not in checked:
            checked.add(described)
            await check_model(agent.model, timeout=wait)


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
        bind_guardrails(served, bus)
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
            # Ready once serving; run() bounds the wait for the session store
            # (store_wait) and raises if it never comes: no deadline here.
            await host.wait_ready(float("inf"))
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
        offload_to(agent, offloader)


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
