"""The offload capability: tool results too long for the context are kept
whole, and the model reads the rest with ``read_offloaded``.

Without it, a tool result longer than ``ContextConfig.tool_result_limit`` is
cut and the rest dropped (the model is told). The stores are in
:mod:`fleetbus.agents.offload`: ``DirectoryOffloader`` (a folder),
``ObjectStoreOffloader`` (the fleet's JetStream object store).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING

import msgspec
import pydantic

from fleetbus.agents.middleware import Middleware, ReplyContext
from fleetbus.agents.offload import READ_OFFLOADED_SPEC, Offloader, cut, read_offloaded
from fleetbus.agents.tools import error_text
from fleetbus.errors import FleetbusError
from fleetbus.protocol import ToolResultBlock, ToolSpec, ToolUseBlock

if TYPE_CHECKING:
    from fleetbus.agents.capability import AgentView
    from fleetbus.agents.state import AgentState

__all__ = ["Offloading"]


class Offloading:
    """Keep whole the tool results cut in the context, in ``offloader``, and
    give the model ``read_offloaded`` to read them.

    Its layer cuts each result as it comes back, before the layers outside
    it see it: list it last among the capabilities for every other layer to
    see results as the model will.
    """

    def __init__(self, offloader: Offloader) -> None:
        self.offloader = offloader

    def middlewares(self, agent: AgentView) -> Sequence[Middleware]:
        """The layer that cuts, offloads and reads, at the agent's ``tool_result_limit``."""
        return (_OffloadLayer(self.offloader, agent.settings.context.tool_result_limit),)

    def prepare_state(self, state: AgentState) -> None:
        """Nothing: results are kept by the offloader, not in the state."""


class _OffloadLayer(Middleware):
    def __init__(self, offloader: Offloader, limit: int) -> None:
        self.offloader = offloader
        self.limit = limit

    def tools(self, ctx: ReplyContext) -> Sequence[ToolSpec]:
        return (READ_OFFLOADED_SPEC,)

    async def on_tool_call(
        self,
        ctx: ReplyContext,
        call: ToolUseBlock,
        call_next: Callable[[ToolUseBlock], Awaitable[ToolResultBlock]],
    ) -> ToolResultBlock:
        if call.name == READ_OFFLOADED_SPEC.name:
            return await self._read(call)
        block = await call_next(call)
        output = block.output
        if block.state != "success" or output is None:
            return block
        text = output if isinstance(output, str) else json.dumps(output, ensure_ascii=False)
        if len(text) <= self.limit:
            return block
        shown, _ = await cut(text, self.limit, self.offloader, f"{ctx.reply_id}-{call.id}")
        return msgspec.structs.replace(block, output=shown)

    async def _read(self, call: ToolUseBlock) -> ToolResultBlock:
        # A read brings no more into the context than a tool result may.
        arguments = dict(call.input)
        limit = arguments.get("limit")
        arguments["limit"] = min(limit, self.limit) if isinstance(limit, int) else self.limit
        try:
            text = await read_offloaded(self.offloader, arguments)
        except (pydantic.ValidationError, FleetbusError, KeyError, OSError) as exc:
            return ToolResultBlock(
                id=call.id,
                name=call.name,
                output=f"read_offloaded failed: {error_text(exc)}",
                state="error",
            )
        return ToolResultBlock(id=call.id, name=call.name, output=text, state="success")
