"""One agent served on the bus: :class:`AgentService`.

An :class:`~fleetbus.agents.serving.host.AgentHost` of a single agent, on
that agent's own subjects: ``<prefix>.agent.<name>.inbox`` in queue group
``agent.<name>``, so its replicas share the work. What the inbox takes, how
sessions are written and taken over: see :mod:`fleetbus.agents.serving.host`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from fleetbus.agents.agent import Agent
from fleetbus.agents.serving.host import AgentHost
from fleetbus.bus import Bus

__all__ = ["AgentService"]


class AgentService(AgentHost):
    """Serves one agent on the bus, on its own subjects.

    Args:
        bus: the connection.
        agent: the agent's definition; each session runs on a clone of it
            holding that session's state.
        replica_id: this replica's id (the lease owner); ``<name>@host-pid``
            by default.

    The other arguments are :class:`AgentHost`'s (16 replies at once by
    default, where a host runs 64).
    """

    def __init__(
        self,
        bus: Bus,
        agent: Agent,
        *,
        replica_id: str | None = None,
        topics: Sequence[str] = (),
        durable_topics: bool = False,
        lease_ttl: float = 10.0,
        concurrency: int = 16,
        busy_wait: float = 60.0,
        store_wait: float = 30.0,
        recover_interval: float = 2.0,
        drain_timeout: float = 30.0,
        checkpoints: Literal["step", "reply"] = "step",
        events: Literal["all", "final", "none"] = "all",
    ) -> None:
        super().__init__(
            bus,
            [agent],
            replica_id=replica_id,
            topics=topics,
            durable_topics=durable_topics,
            lease_ttl=lease_ttl,
            concurrency=concurrency,
            busy_wait=busy_wait,
            store_wait=store_wait,
            recover_interval=recover_interval,
            drain_timeout=drain_timeout,
            checkpoints=checkpoints,
            events=events,
        )
        self.agent = agent
        self.name = agent.name
