"""Middleware: onion hooks around a reply, each reasoning step, each model
call and each tool call, and a transformer of the system prompt.

Order: the first middleware in ``Agent(middlewares=[a, b])`` is the
outermost layer — ``a`` sees a call first and its result last::

    a.on_reply( b.on_reply( the reply ) )

Inside one reply the hooks nest as the loop runs: ``on_reply`` around the
whole reply; ``on_reasoning`` around each step's model call (with the
compression of memory that may come before it) and its recording;
``on_model_call`` around each attempt at the model (retries and
the fallback included, so it sees them all); ``on_tool_call`` around each
tool call, after the permission check. ``system_prompt`` is applied in list
order before each model call. ``on_event`` sees each event of the reply as it
is emitted (the ``text_delta`` pieces while the model streams, among others),
in list order. ``tools`` names the tools a layer offers the model and
answers itself in ``on_tool_call`` (a plan notebook's, a long-term memory's):
they are offered with the toolkit's, and a call to one skips the toolkit and
its permission rules. ``on_answer`` sees the reply's answer before it is
given, in list order, and may refuse it. A layer emits events of its own
with :meth:`ReplyContext.event`.

A middleware ends a reply early by raising :class:`StopReply` — a signal,
not an error.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from fleetbus.agents.state import ReplyEnding
from fleetbus.models.model import ModelRequest, ModelResponse
from fleetbus.protocol import (
    Event,
    FinalAnswer,
    FinishedReason,
    ToolResultBlock,
    ToolSpec,
    ToolUseBlock,
)

if TYPE_CHECKING:
    from fleetbus.agents.messages import Msg
    from fleetbus.agents.state import AgentState

__all__ = [
    "BudgetLimit",
    "EventSink",
    "Middleware",
    "ReplyContext",
    "StepLogger",
    "StopReply",
    "ToolLayer",
]


class StopReply(Exception):
    """Raised by a middleware to end the reply now.

    Args:
        reason: said to the caller, in the final answer.
        finished_reason: the reply's ``finished_reason``.
        summarize: make one last model call without tools so the caller gets
            an answer from what was done so far.
    """

    def __init__(
        self, reason: str, *, finished_reason: FinishedReason = "error", summarize: bool = False
    ) -> None:
        super().__init__(reason)
        self.reason = reason
        self.finished_reason: FinishedReason = finished_reason
        self.summarize = summarize


class EventSink(Protocol):
    """Where :meth:`ReplyContext.event` sends a layer's events: the reply's
    own stream (the reply's scope is one)."""

    def event(self, name: str, /, **data: Any) -> None:
        """Emit the event ``name`` of the reply, with ``data``."""
        ...


@dataclass
class ReplyContext:
    """What the hooks of one reply see.

    Attributes:
        agent_name: the agent replying.
        reply_id: the reply's id (the ``call_id`` of its events).
        session_id: its session.
        state: the agent's live state (memory, plan, the reply in progress).
        iteration: the current reasoning step, from 0.
        input_tokens: tokens sent to models so far in this reply.
        output_tokens: tokens received so far.
        tool_calls: tool calls run so far.
        extra: free room for middleware to keep per-reply data.
        sink: where :meth:`event` sends events (``None``: nowhere; the
            reply sets it).
    """

    agent_name: str
    reply_id: str
    session_id: str | None
    state: AgentState
    iteration: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    tool_calls: int = 0
    extra: dict[str, Any] = field(default_factory=dict)
    sink: EventSink | None = field(default=None, repr=False, compare=False)

    def event(self, name: str, /, **data: Any) -> None:
        """Emit an event of this reply (``name``, with ``data``: JSON values):
        it goes where the reply's events go, numbered with them, and the
        middleware watching events sees it. Nothing happens when nobody
        reads the reply's events."""
        if self.sink is not None:
            try:
                self.sink.event(name, **data)
            except ReferenceError:  # the reply is over: nobody reads its events
                self.sink = None

    def end_after_step(
        self,
        finished_reason: FinishedReason,
        content: str,
        *,
        handoff_to: str | None = None,
        handoff_reason: str = "",
    ) -> bool:
        """End the reply once the current step's tool calls are all answered
        and recorded (from a layer's ``on_tool_call``: the call's own result
        is kept, unlike :class:`StopReply`), with ``finished_reason`` and
        ``content``; ``handoff_to`` (with ``handed_off``) names the agent the
        conversation goes on with (the final answer's ``handoff``). The end
        is saved with the step's results: a replica that takes the reply
        over ends it the same way.

        Returns ``False`` (and changes nothing) when an end was already set
        in this step, or when no reply runs.
        """
        reply = self.state.reply
        if reply is None or reply.ending is not None:
            return False
        reply.ending = ReplyEnding(
            finished_reason=finished_reason,
            content=content,
            handoff_to=handoff_to,
            handoff_reason=handoff_reason,
        )
        return True


class Middleware:
    """Base class: every hook passes through. Override the ones you need."""

    async def on_reply(
        self, ctx: ReplyContext, call_next: Callable[[], Awaitable[FinalAnswer]]
    ) -> FinalAnswer:
        """Around a whole reply."""
        return await call_next()

    async def on_reasoning(self, ctx: ReplyContext, call_next: Callable[[], Awaitable[Msg]]) -> Msg:
        """Around one reasoning step; returns the model's message."""
        return await call_next()

    async def on_model_call(
        self,
        ctx: ReplyContext,
        request: ModelRequest,
        call_next: Callable[[ModelRequest], Awaitable[ModelResponse]],
    ) -> ModelResponse:
        """Around one model call (each retry and the fallback too)."""
        return await call_next(request)

    async def on_tool_call(
        self,
        ctx: ReplyContext,
        call: ToolUseBlock,
        call_next: Callable[[ToolUseBlock], Awaitable[ToolResultBlock]],
    ) -> ToolResultBlock:
        """Around one tool call that the permission rules let through."""
        return await call_next(call)

    async def on_answer(
        self, ctx: ReplyContext, content: str, structured: dict[str, Any] | None
    ) -> None:
        """See the reply's answer before it is given: the model's last text
        (``content``), or its structured answer (``structured``, with
        ``content`` its JSON); an answer the model gave without tools after
        the reply ran out of steps or was stopped too.

        Raise :class:`StopReply` to refuse it: the reply ends with the stop
        instead, and the answer is neither given nor kept in memory (the
        model's message that gave it, and what was recorded after it in its
        step, are taken out). Only the layers that override this hook are
        called, in list order.
        """

    def system_prompt(self, prompt: str, ctx: ReplyContext) -> str:
        """Transform the system prompt before a model call."""
        return prompt

    def tools(self, ctx: ReplyContext) -> Sequence[ToolSpec]:
        """The tools this layer offers the model now and answers itself, in
        ``on_tool_call`` without calling ``call_next``. A toolkit's tool of
        the same name is not offered; permission rules do not apply to them.
        Asked at every step: return at once."""
        return ()

    def on_event(self, ctx: ReplyContext, event: Event) -> None:
        """See one event of the reply, just after it is emitted.

        Called in the reply's own flow, for every event (each ``text_delta``
        piece of a streaming model too): return at once. Work that takes
        time goes to a task the middleware owns (started and awaited in
        ``on_reply``). An exception raised here is logged and does not reach
        the reply.
        """


class ToolLayer(Middleware):
    """A layer that offers tools of its own (``specs``) and answers a call
    of one with :meth:`answer`; every other call goes on down the onion."""

    def __init__(self, specs: Sequence[ToolSpec]) -> None:
        self.specs = tuple(specs)
        self._names = frozenset(spec.name for spec in self.specs)

    def tools(self, ctx: ReplyContext) -> Sequence[ToolSpec]:
        return self.specs

    async def on_tool_call(
        self,
        ctx: ReplyContext,
        call: ToolUseBlock,
        call_next: Callable[[ToolUseBlock], Awaitable[ToolResultBlock]],
    ) -> ToolResultBlock:
        if call.name not in self._names:
            return await call_next(call)
        return await self.answer(ctx, call)

    async def answer(self, ctx: ReplyContext, call: ToolUseBlock) -> ToolResultBlock:
        """The result of a call of one of this layer's tools."""
        raise NotImplementedError


class BudgetLimit(Middleware):
    """Ends a reply that uses more than its budget.

    Args:
        max_tool_calls: tool calls per reply; the call over the budget is
            not run, and the reply ends with one last answer from the model
            (``finished_reason="error"``).
        max_tokens: input + output tokens per reply; the reply ends once they
            are spent (no further model call).
    """

    def __init__(self, *, max_tool_calls: int | None = None, max_tokens: int | None = None) -> None:
        self.max_tool_calls = max_tool_calls
        self.max_tokens = max_tokens

    async def on_tool_call(
        self,
        ctx: ReplyContext,
        call: ToolUseBlock,
        call_next: Callable[[ToolUseBlock], Awaitable[ToolResultBlock]],
    ) -> ToolResultBlock:
        if self.max_tool_calls is not None and ctx.tool_calls >= self.max_tool_calls:
            raise StopReply(
                f"the budget of {self.max_tool_calls} tool calls per reply is spent",
                summarize=True,
            )
        return await call_next(call)

    async def on_model_call(
        self,
        ctx: ReplyContext,
        request: ModelRequest,
        call_next: Callable[[ModelRequest], Awaitable[ModelResponse]],
    ) -> ModelResponse:
        used = ctx.input_tokens + ctx.output_tokens
        if self.max_tokens is not None and used >= self.max_tokens:
            raise StopReply(
                f"the budget of {self.max_tokens} tokens per reply is spent ({used} used)"
            )
        return await call_next(request)


class StepLogger(Middleware):
    """Logs each reply, model call and tool call, with timings and usage.

    Args:
        logger: where to log (``fleetbus.agents.steps`` by default).
        level: the level of the step records.
    """

    def __init__(self, logger: logging.Logger | None = None, level: int = logging.INFO) -> None:
        self.logger = logger or logging.getLogger("fleetbus.agents.steps")
        self.level = level

    async def on_reply(
        self, ctx: ReplyContext, call_next: Callable[[], Awaitable[FinalAnswer]]
    ) -> FinalAnswer:
        started = time.perf_counter()
        extra = {"session_id": ctx.session_id, "call_id": ctx.reply_id}
        self.logger.log(
            self.level, "%s: reply %s started", ctx.agent_name, ctx.reply_id, extra=extra
        )
        final = await call_next()
        self.logger.log(
            self.level,
            "%s: reply %s %s after %d step(s), %d tool call(s), %d+%d tokens, %.3fs",
            ctx.agent_name,
            ctx.reply_id,
            final.finished_reason,
            ctx.iteration + 1,
            ctx.tool_calls,
            ctx.input_tokens,
            ctx.output_tokens,
            time.perf_counter() - started,
            extra=extra,
        )
        return final

    async def on_model_call(
        self,
        ctx: ReplyContext,
        request: ModelRequest,
        call_next: Callable[[ModelRequest], Awaitable[ModelResponse]],
    ) -> ModelResponse:
        started = time.perf_counter()
        response = await call_next(request)
        usage = response.usage
        self.logger.log(
            self.level,
            "%s: step %d: model %s answered %d tool call(s) in %.3fs (%s tokens)",
            ctx.agent_name,
            ctx.iteration,
            response.model or "?",
            len(response.tool_uses),
            time.perf_counter() - started,
            f"{usage.input_tokens}+{usage.output_tokens}" if usage else "?",
            extra={"session_id": ctx.session_id, "call_id": ctx.reply_id},
        )
        return response

    async def on_tool_call(
        self,
        ctx: ReplyContext,
        call: ToolUseBlock,
        call_next: Callable[[ToolUseBlock], Awaitable[ToolResultBlock]],
    ) -> ToolResultBlock:
        started = time.perf_counter()
        result = await call_next(call)
        self.logger.log(
            self.level,
            "%s: step %d: tool %s -> %s in %.3fs",
            ctx.agent_name,
            ctx.iteration,
            call.name,
            result.state,
            time.perf_counter() - started,
            extra={"session_id": ctx.session_id, "call_id": call.id},
        )
        return result
