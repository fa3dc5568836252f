"""Calling tools over the bus, and finding out which tools the fleet serves.

This is the client side of the tool protocol; the serving side is
``fleetbus.tools_workers.ToolWorker``. Agents and programs in any language
reach tools the same way: a ``tool_call`` request on ``<prefix>.tool.<name>``.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field, replace
from typing import Any

from fleetbus.bus.connection import Bus
from fleetbus.bus.micro import EndpointInfo, discover
from fleetbus.errors import ConfigError, RemoteError, UnexpectedMessageError
from fleetbus.protocol import ErrorMessage, ToolCall, ToolResult, ToolSpec, new_id

__all__ = ["SERVICE_NAME", "RemoteTool", "ToolClient"]

logger = logging.getLogger(__name__)

SERVICE_NAME = "fleetbus"
"""The NATS micro service name tool workers register under."""


@dataclass(frozen=True, slots=True)
class RemoteTool:
    """A tool served on the bus, as discovered.

    Attributes:
        name: the tool's name.
        description: what it does (from its docstring).
        parameters: JSON Schema of its arguments.
        subject: where calls go.
        workers: how many worker instances serve it.
        worker_ids: the ids of those workers.
        timeout: its default timeout in seconds, if it declares one.
    """

    name: str
    description: str
    parameters: dict[str, Any]
    subject: str
    workers: int = 1
    worker_ids: tuple[str, ...] = ()
    timeout: float | None = None
    metadata: dict[str, str] = field(default_factory=dict)

    def spec(self) -> ToolSpec:
        """The tool as offered to a model."""
        return ToolSpec(name=self.name, description=self.description, parameters=self.parameters)


class ToolClient:
    """Calls tools served by workers on the bus, with retries.

    A call that gets no reply within its deadline (the worker died, the
    network dropped it) or finds no worker is sent again with the same
    ``call_id``; a worker that already answered it returns its record instead
    of running the tool twice.

    Args:
        bus: the connection.
        sender: the ``sender`` of the calls (the bus's client name by default).
        timeout: seconds to wait for a reply to a call that sets no
            ``timeout`` of its own (the worker then applies the tool's own
            timeout, or its default).
        attempts: how many times a call is sent at most.
        reply_grace: seconds added to the tool's timeout to wait for the reply
            (the worker needs a moment to answer a timeout itself).
    """

    def __init__(
        self,
        bus: Bus,
        *,
        sender: str | None = None,
        timeout: float = 30.0,
        attempts: int = 3,
        reply_grace: float = 1.0,
    ) -> None:
        self._bus = bus
        self.sender = sender or bus.client_name
        self.timeout = timeout
        self.attempts = attempts
        self.reply_grace = reply_grace

    async def call(
        self,
        tool_name: str,
        parameters: dict[str, Any] | None = None,
        *,
        call_id: str | None = None,
        session_id: str | None = None,
        timeout: float | None = None,
        attempts: int | None = None,
        agent: bool = False,
    ) -> ToolResult:
        """Call a tool and return its ``tool_result``.

        With ``agent=True`` the "tool" is an agent: the call goes to its inbox
        (``<prefix>.agent.<tool_name>.inbox``) with ``{"request": "…"}``.

        ``timeout`` is how long the tool may run (sent with the call); when
        ``None`` the worker applies the tool's own timeout, or its default,
        and the reply is awaited for the client's ``timeout``.

        A tool that fails, times out or rejects its parameters is a result
        with that ``status``, not an exception.

        Raises:
            CallTimeoutError: no worker answered any attempt in time.
            NoRespondersError: no worker serves the tool.
            RemoteError: the worker could not handle the call at all
                (answered an ``error`` message).
            PayloadTooLargeError: the parameters exceed the server's limit.
            ProtocolError: the reply was not a valid ``tool_result`` for this call.
            ConfigError: the timeout is not positive, or the tool name cannot
                be a subject token.
        """
        if timeout is not None and not timeout > 0:
            raise ConfigError(f"timeout must be positive, got {timeout}")
        call = ToolCall(
            sender=self.sender,
            session_id=session_id,
            call_id=call_id or new_id(),
            tool_name=tool_name,
            parameters=parameters or {},
            timeout=timeout,
        )
        subjects = self._bus.subjects
        reply = await self._bus.request(
            subjects.agent_inbox(tool_name) if agent else subjects.tool(tool_name),
            call,
            timeout=(self.timeout if timeout is None else timeout) + self.reply_grace,
            attempts=self.attempts if attempts is None else attempts,
        )
        if isinstance(reply, ErrorMessage):
            raise RemoteError(
                f"{reply.source_component or 'worker'} could not handle the call: "
                f"{reply.code}: {reply.message}",
                code=reply.code,
                source_component=reply.source_component,
                call_id=reply.call_id,
            )
        if not isinstance(reply, ToolResult):
            raise UnexpectedMessageError(
                f"expected a 'tool_result' reply, got {type(reply).__name__}",
                call_id=reply.call_id,
            )
        if reply.call_id != call.call_id:
            raise UnexpectedMessageError(
                f"reply carries call_id {reply.call_id!r}, the call was {call.call_id!r}",
                call_id=call.call_id,
                message_type="tool_result",
            )
        return reply

    async def discover(self, *, timeout: float = 0.5) -> dict[str, RemoteTool]:
        """The tools served in this fleet, by name, with their worker counts.

        Asks every fleetbus worker for its INFO (``$SRV.INFO.fleetbus``) and
        keeps those of this bus's prefix.

        Raises:
            BusError: the request could not be sent.
        """
        services = await discover(self._bus, SERVICE_NAME, timeout=timeout)
        tools: dict[str, RemoteTool] = {}
        for service in services:
            if service.metadata.get("fleetbus_prefix") != self._bus.prefix:
                continue
            worker_id = service.metadata.get("worker_id", service.id)
            for endpoint in service.endpoints:
                known = tools.get(endpoint.name)
                if known is None:
                    tools[endpoint.name] = _remote_tool(endpoint, worker_id)
                else:
                    tools[endpoint.name] = replace(
                        known,
                        workers=known.workers + 1,
                        worker_ids=(*known.worker_ids, worker_id),
                    )
        return dict(sorted(tools.items()))


def _remote_tool(endpoint: EndpointInfo, worker_id: str) -> RemoteTool:
    name, metadata = endpoint.name, endpoint.metadata
    try:
        parameters = json.loads(metadata.get("schema", "{}"))
    except ValueError:
        logger.warning("tool %s advertises an unreadable schema; using {}", name)
        parameters = {}
    try:
        timeout: float | None = float(metadata["timeout"]) if metadata.get("timeout") else None
    except ValueError:
        timeout = None
    return RemoteTool(
        name=name,
        description=metadata.get("description", ""),
        parameters=parameters if isinstance(parameters, dict) else {},
        subject=endpoint.subject,
        workers=1,
        worker_ids=(worker_id,),
        timeout=timeout,
        metadata=metadata,
    )
