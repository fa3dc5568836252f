"""The plan capability: a plan notebook the model keeps while it works.

The model gets the notebook's tools (``create_plan``, ``finish_subtask``, …)
and, with each model call, a hint of where the plan stands. The notebook is
part of the agent's state (:attr:`fleetbus.agents.AgentState.plan`, see
:mod:`fleetbus.agents.plan`), saved and restored with the session; this
module is what lets the model use it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING

from fleetbus.agents.messages import Msg
from fleetbus.agents.middleware import Middleware, ReplyContext
from fleetbus.agents.plan import PlanNotebook
from fleetbus.models.model import ModelRequest, ModelResponse
from fleetbus.protocol import ToolResultBlock, ToolSpec, ToolStatus, ToolUseBlock

if TYPE_CHECKING:
    from fleetbus.agents.capability import AgentView
    from fleetbus.agents.state import AgentState

__all__ = ["Planning"]


class Planning:
    """Give the agent a plan notebook (a new session starts with an empty
    one; a state that has one keeps it: ``AgentState(plan=…)`` to start from
    a notebook of your own)."""

    def middlewares(self, agent: AgentView) -> Sequence[Middleware]:
        """The layer offering the notebook's tools and showing its hint."""
        return (_PlanLayer(),)

    def prepare_state(self, state: AgentState) -> None:
        """An empty notebook in a state that has none."""
        if state.plan is None:
            state.plan = PlanNotebook()


class _PlanLayer(Middleware):
    def tools(self, ctx: ReplyContext) -> Sequence[ToolSpec]:
        plan = ctx.state.plan
        return plan.tool_specs() if plan is not None else ()

    async def on_tool_call(
        self,
        ctx: ReplyContext,
        call: ToolUseBlock,
        call_next: Callable[[ToolUseBlock], Awaitable[ToolResultBlock]],
    ) -> ToolResultBlock:
        plan = ctx.state.plan
        if plan is None or not plan.handles(call.name):
            return await call_next(call)
        done = plan.call(call.name, call.input)
        state: ToolStatus = "success" if done.ok else "error"
        return ToolResultBlock(id=call.id, name=call.name, output=done.text, state=state)

    async def on_model_call(
        self,
        ctx: ReplyContext,
        request: ModelRequest,
        call_next: Callable[[ModelRequest], Awaitable[ModelResponse]],
    ) -> ModelResponse:
        plan = ctx.state.plan
        hint = plan.hint() if plan is not None else None
        if hint:
            # Shown with this call only: never stored in memory.
            chat = Msg.text_message("user", hint, marks={"hint"}).to_chat()
            request = dataclasses.replace(request, messages=[*request.messages, chat])
        return await call_next(request)
