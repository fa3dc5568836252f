"""The processes of a simulation besides the runner: hosts and tool workers.

:class:`PopulationHost` serves a simulation's whole population from one
process: an :class:`~fleetbus.agents.serving.host.AgentHost` in the host
group named after the simulation, so its subscriptions do not grow with the
agents and every host process of the simulation shares the load.
:class:`SimulationToolWorker` serves the simulation's tools, the environment
tools among them. ``fleetbus sim host`` and ``fleetbus sim tools`` run them;
``fleetbus sim run`` starts them as child processes.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Literal

from fleetbus.agents.serving.host import AgentHost
from fleetbus.bus import Bus, Lifecycle
from fleetbus.sim.environment import Environment
from fleetbus.sim.population import TOOL_WAIT
from fleetbus.sim.simulation import Simulation
from fleetbus.tools_workers import ToolWorker

__all__ = ["PopulationHost", "SimulationToolWorker"]

logger = logging.getLogger(__name__)

READY_TIMEOUT = 60.0
"""Seconds a host or worker may take to subscribe once its tools are found."""


class PopulationHost(Lifecycle):
    """Serves a simulation's population on the bus (one host process).

    Args:
        bus: the connection.
        simulation: whose agents to serve.
        replica_id: this host's id (the sessions' lease owner).
        model: a model string for every agent (wins over the template's).
        concurrency: replies run at once by this host (more than about 64
            on one core only adds latency and per-reply overhead).
        lease_ttl: seconds a session lease lasts unrenewed.
        checkpoints: ``"reply"`` (the default here: a session is written
            when a round's prompt is taken and when it is answered; a host
            that dies mid-reply has the reply run again) or ``"step"``.
        events: what of each reply is published on its events subject
            (``"final"`` by default here: no event; watchers see the answers
            on the session journals).
        cache_size: agent definitions kept built.
        drain_timeout: seconds running replies get to finish on stop.
        tool_wait: seconds to wait for the simulation's tools to be served.
    """

    def __init__(
        self,
        bus: Bus,
        simulation: Simulation,
        *,
        replica_id: str | None = None,
        model: str | None = None,
        concurrency: int = 64,
        lease_ttl: float = 10.0,
        cache_size: int = 64,
        drain_timeout: float = 30.0,
        tool_wait: float = TOOL_WAIT,
        checkpoints: Literal["step", "reply"] = "reply",
        events: Literal["all", "final", "none"] = "final",
    ) -> None:
        super().__init__()
        self.bus = bus
        self.simulation = simulation
        self.replica_id = replica_id
        self.model = model
        self.concurrency = concurrency
        self.lease_ttl = lease_ttl
        self.cache_size = cache_size
        self.drain_timeout = drain_timeout
        self.tool_wait = tool_wait
        self.checkpoints: Literal["step", "reply"] = checkpoints
        self.events: Literal["all", "final", "none"] = events
        self.host: AgentHost | None = None
        self.tools: list[str] = []
        """The tools the agents use (known once ready)."""

    async def run(self) -> None:
        """Find the tools, then serve until :meth:`stop`.

        Raises:
            ConfigError: a tool is not served in time, or a model cannot be
                configured or reached.
            StoreError: JetStream is not available for the sessions.
        """
        sim = self.simulation
        self.tools = await sim.population.bind(
            self.bus, tools=sim.tool_names(), model=self.model, wait=self.tool_wait
        )
        if self._stop.is_set():
            return
        host = AgentHost(
            self.bus,
            sim.population,
            group=sim.name,
            replica_id=self.replica_id,
            concurrency=self.concurrency,
            lease_ttl=self.lease_ttl,
            cache_size=self.cache_size,
            drain_timeout=self.drain_timeout,
            checkpoints=self.checkpoints,
            events=self.events,
        )
        self.host = host
        async with asyncio.TaskGroup() as tg:
            tg.create_task(host.run())
            tg.create_task(_forward_stop(self._stop, host))
            await host.wait_ready(READY_TIMEOUT)
            self._ready.set()
            logger.info("serving %d agents of %s", len(sim.population), sim.name)


class SimulationToolWorker(Lifecycle):
    """Serves a simulation's tools (and its environment tools) on the bus.

    Args:
        bus: the connection.
        simulation: whose tools to serve.
        worker_id: this worker's id.
        concurrency: calls run at once.
        drain_timeout: seconds in-flight calls get to finish on stop.
    """

    def __init__(
        self,
        bus: Bus,
        simulation: Simulation,
        *,
        worker_id: str | None = None,
        concurrency: int = 256,
        drain_timeout: float = 30.0,
    ) -> None:
        super().__init__()
        self.bus = bus
        self.simulation = simulation
        self.worker_id = worker_id
        self.concurrency = concurrency
        self.drain_timeout = drain_timeout
        self.worker: ToolWorker | None = None

    async def run(self) -> None:
        """Serve until :meth:`stop`, then drain.

        Raises:
            ConfigError: a tool spec cannot be loaded.
            StoreError: the environment's bucket cannot be opened.
        """
        environment = await Environment.open(self.bus, self.simulation.name)
        toolkit = self.simulation.toolkit(environment)
        if not len(toolkit):
            self._ready.set()
            await self._stop.wait()
            return
        worker = ToolWorker(
            self.bus,
            toolkit,
            worker_id=self.worker_id,
            concurrency=self.concurrency,
            drain_timeout=self.drain_timeout,
        )
        self.worker = worker
        async with asyncio.TaskGroup() as tg:
            tg.create_task(worker.run())
            tg.create_task(_forward_stop(self._stop, worker))
            await worker.wait_ready(READY_TIMEOUT)
            self._ready.set()


async def _forward_stop(stop: asyncio.Event, target: Lifecycle) -> None:
    await stop.wait()
    target.stop()
