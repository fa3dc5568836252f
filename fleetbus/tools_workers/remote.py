"""A tool served by workers on the bus, usable like a local tool."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

from fleetbus.bus import RemoteTool, ToolClient
from fleetbus.errors import BusError, FleetbusError
from fleetbus.protocol import AGENT_TOOL_PARAMETERS, ToolResult, ToolSpec
from fleetbus.tools_workers.tool import tool_failure

__all__ = ["AgentTool", "RemoteToolProxy"]


class RemoteToolProxy:
    """Calls a discovered tool through a :class:`~fleetbus.bus.ToolClient`.

    Its :meth:`run` has the contract of a local tool's: never raises for
    what happens to the call. Its result is the worker's answer as it came
    (``sender`` the worker's id); a call no worker answers (after the
    client's retries) is an ``error`` result saying so, sent by nobody
    (``sender`` empty). The ``call_id`` is passed through, so a retry of
    the same call is answered from the worker's record.
    The tool was served when it was discovered: a call that finds no worker
    waits for one (a worker restarting) for the client's ``worker_wait``
    seconds before it fails. A call that names no timeout waits as long as
    the tool may run: the timeout it declared when discovered, else the one
    the client learns from its workers (:meth:`ToolClient.declared_timeout`).

    Args:
        remote: the tool as discovered.
        client: the client that calls it.
        group: the toolkit group it joins by default.
    """

    def __init__(self, remote: RemoteTool, client: ToolClient, *, group: str = "remote") -> None:
        self.remote = remote
        self.client = client
        self.name = remote.name
        self.description = remote.description
        self.parameters: dict[str, Any] = remote.parameters
        self.timeout: float | None = remote.timeout
        self.concurrency_safe = remote.metadata.get("concurrency_safe", "true") == "true"
        self.streams = remote.metadata.get("streams") == "true"
        """Its workers send its result in chunks before the final one."""
        self.external = False
        self.group = group

    def __repr__(self) -> str:
        return f"RemoteToolProxy({self.name!r}, workers={self.remote.workers})"

    def spec(self) -> ToolSpec:
        """The tool as offered to a model."""
        return self.remote.spec()

    async def run(
        self,
        parameters: Any,
        *,
        timeout: float | None = None,
        call_id: str | None = None,
        session_id: str | None = None,
        on_chunk: Callable[[Any], Awaitable[None]] | None = None,
    ) -> ToolResult:
        """Call the tool on the bus and say how it ended (the worker's answer).

        A tool that :attr:`streams` hands each chunk of its result to
        ``on_chunk``, in order, before the call returns.
        """
        failed = partial(tool_failure, self.name, call_id=call_id, session_id=session_id)
        if not isinstance(parameters, dict):
            return failed("error", "invalid_parameters", "parameters must be a JSON object")
        call = partial(
            self.client.call,
            self.name,
            parameters,
            call_id=call_id,
            session_id=session_id,
            timeout=timeout if timeout is not None else self.timeout,
            worker_wait=self.client.worker_wait,
        )
        try:
            if on_chunk is not None and self.streams:
                result = await _streamed(call, on_chunk)
            else:
                result = await call()
        except BusError as exc:
            message = f"{self.name} could not be called: {exc}"
            if isinstance(exc, TimeoutError):
                return failed("timeout", "timeout", message)
            return failed("error", "tool_error", message)
        except FleetbusError as exc:  # a reply that is not a valid tool_result
            return failed("error", "tool_error", f"{self.name}: {exc}")
        return result


async def _streamed(
    call: Callable[..., Awaitable[ToolResult]], on_chunk: Callable[[Any], Awaitable[None]]
) -> ToolResult:
    """``call``'s final result, its deltas handed to ``on_chunk`` in order
    meanwhile (they arrive in the connection's read loop, which must not
    wait: a queue hands them over)."""
    chunks: asyncio.Queue[tuple[Any] | None] = asyncio.Queue()

    async def hand_over() -> None:
        while (item := await chunks.get()) is not None:
            await on_chunk(item[0])

    async with asyncio.TaskGroup() as tg:
        handing = tg.create_task(hand_over())
        try:
            return await call(on_delta=lambda delta: chunks.put_nowait((delta.content,)))
        finally:
            chunks.put_nowait(None)  # the chunks that came are all handed over first
            await asyncio.wait([handing])


class AgentTool:
    """Another agent, served on the bus, used as a tool.

    The call is a ``tool_call`` with ``{"request": "…"}`` sent to the agent's
    inbox; the agent runs a reply in a session of that call and answers a
    ``tool_result`` with its final answer. A retry of the call (same
    ``call_id``) is answered from that session instead of replying again.

    Args:
        client: the client that calls it (its ``sender`` identifies the caller).
        agent_name: the agent to ask.
        description: what to tell the model about the agent.
        timeout: seconds the agent may take to answer.
    """

    def __init__(
        self,
        client: ToolClient,
        agent_name: str,
        *,
        description: str = "",
        timeout: float = 300.0,
        group: str = "agents",
    ) -> None:
        self.client = client
        self.name = agent_name
        self.description = description or f"Ask the agent {agent_name!r}; it answers in text."
        self.parameters: dict[str, Any] = AGENT_TOOL_PARAMETERS
        self.timeout: float | None = timeout
        self.concurrency_safe = True
        self.external = False
        self.group = group

    def __repr__(self) -> str:
        return f"AgentTool({self.name!r})"

    def spec(self) -> ToolSpec:
        """The agent as a tool offered to a model."""
        return ToolSpec(name=self.name, description=self.description, parameters=self.parameters)

    async def run(
        self,
        parameters: Any,
        *,
        timeout: float | None = None,
        call_id: str | None = None,
        session_id: str | None = None,
    ) -> ToolResult:
        """Ask the agent and say how it ended (its host's answer); never
        raises for what happens to the call."""
        failed = partial(tool_failure, self.name, call_id=call_id, session_id=session_id)
        request = parameters.get("request") if isinstance(parameters, dict) else None
        if not isinstance(request, str) or not request.strip():
            return failed("error", "invalid_parameters", "'request' must be a non-empty string")
        try:
            result = await self.client.call(
                self.name,
                {"request": request},
                call_id=call_id,
                timeout=timeout if timeout is not None else self.timeout,
                agent=True,
            )
        except BusError as exc:
            message = f"the agent {self.name} could not be asked: {exc}"
            if isinstance(exc, TimeoutError):
                return failed("timeout", "timeout", message)
            return failed("error", "tool_error", message)
        except FleetbusError as exc:
            return failed("error", "tool_error", f"{self.name}: {exc}")
        return result
