"""The agent's side of a store served by a tool worker (the long-term
memory, a knowledge base): its tools called over the bus it was given, or
bound to, else over the bus of the host serving the reply.

A spec builds its agent before there is a bus (``fleetbus agent`` imports it
first), so a store's client made there has none; the reply's host is found
when a call is made (:func:`fleetbus.agents.talk.served_on`).
"""

from __future__ import annotations

from typing import Any

from fleetbus.agents import talk
from fleetbus.bus import Bus, ToolClient
from fleetbus.errors import ConfigError, RemoteError

__all__ = ["WorkerTools"]


class WorkerTools:
    """Calls the tools of one kind of worker.

    Args:
        what: what the worker serves, as messages name it (``BusMemory``).
        bus: the bus, or a :class:`~fleetbus.bus.ToolClient` of it; ``None``:
            bound later, or the serving host's.
        timeout: seconds a call may take, each attempt.
        attempts: how many times a call is sent (the worker answers the
            retries of a call it ran from its record).

    Raises:
        ConfigError: the timeout is not positive, or no attempt is allowed.
    """

    def __init__(
        self, what: str, bus: Bus | ToolClient | None, *, timeout: float, attempts: int
    ) -> None:
        if not timeout > 0 or attempts < 1:
            raise ConfigError(f"{what} needs a positive timeout and at least one attempt")
        self.what = what
        self.timeout = timeout
        self.attempts = attempts
        self._client: ToolClient | None = None
        self._served: tuple[Bus, str, ToolClient] | None = None
        """The client last made for a serving host's bus, and the agent's name."""
        if bus is not None:
            self.bind(bus)

    @property
    def bound(self) -> bool:
        """Whether it was given a bus (else it uses the serving host's)."""
        return self._client is not None

    def bind(self, bus: Bus | ToolClient) -> None:
        """Call the worker over ``bus`` from now on."""
        if isinstance(bus, ToolClient):
            self._client = bus
        else:
            self._client = ToolClient(bus, timeout=self.timeout, attempts=self.attempts)

    async def call(self, tool_name: str, parameters: dict[str, Any]) -> Any:
        """The content of the tool's successful result.

        Raises:
            ConfigError: no bus: none given, and no host serves the reply.
            RemoteError: the worker answered an error (its code and message).
            BusError: no worker answered (``NoRespondersError``,
                ``CallTimeoutError``…).
        """
        client = self._client or self._host_client()
        result = await client.call(tool_name, parameters, timeout=self.timeout)
        if result.status != "success":
            detail = result.error_detail
            code = detail.code if detail else result.status
            message = detail.message if detail else result.status
            raise RemoteError(
                f"{self.what} ({tool_name}): {code}: {message}",
                code=code,
                source_component=result.sender,
                call_id=result.call_id,
            )
        return result.content

    def _host_client(self) -> ToolClient:
        served = talk.served_on()
        if served is None:
            raise ConfigError(
                f"{self.what} has no bus: give it one, call bind(bus), "
                "or serve the agent with fleetbus agent / AgentHost"
            )
        bus, name = served
        kept = self._served
        if kept is not None and kept[0] is bus and kept[1] == name:
            return kept[2]
        client = ToolClient(
            bus, sender=f"agent.{name}", timeout=self.timeout, attempts=self.attempts
        )
        self._served = (bus, name, client)
        return client
