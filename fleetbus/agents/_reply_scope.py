"""What the parts of one reply share: :class:`ReplyScope`.

The loop (:mod:`fleetbus.agents._reply`) and its collaborators — model calls
(:mod:`~fleetbus.agents._model_calls`), tool running
(:mod:`~fleetbus.agents._tool_running`) and resume
(:mod:`~fleetbus.agents._resume`) — each take the one scope of the reply: the
frozen settings, the live state, the reply in progress, and how events go
out, how the reader is waited for, how the reply ends and how it is saved.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar, cast

import pydantic

from fleetbus.agents import events as ev
from fleetbus.agents._reply_settings import ReplySettings
from fleetbus.agents.messages import Msg
from fleetbus.agents.middleware import Middleware, ReplyContext, StopReply
from fleetbus.agents.state import AgentState, ReplyEnding, ReplyState
from fleetbus.models.model import FINISH_TOOL
from fleetbus.protocol import (
    Event,
    FinalAnswer,
    FinishedReason,
    Handoff,
    ToolResultBlock,
    ToolStatus,
    ToolUseBlock,
)

__all__ = ["FINISH_TOOL", "ReplyScope", "tool_result"]

logger = logging.getLogger(__name__)

_F = TypeVar("_F", bound=Callable[..., Awaitable[Any]])


class ReplyScope:
    """One reply in progress, as its parts see it.

    Args:
        settings: the agent's settings for this reply.
        state: the agent's live state (updated in place).
        reply: the reply in progress (already in ``state.reply``).
        structured_model: the pydantic model of a structured answer, if any.
        emit: receives every event as it happens (``None``: nobody reads
            them; they are made only for the middleware that watches them).
        demand: awaited before each model call and each tool call; returns
            once whoever reads the events has read them all and waits for
            more (a reader that left stops the reply from starting anything).
        checkpoint: hands the state to whoever saves it.
    """

    def __init__(
        self,
        settings: ReplySettings,
        state: AgentState,
        reply: ReplyState,
        *,
        structured_model: type[pydantic.BaseModel] | None,
        emit: Callable[[Event], None] | None,
        demand: Callable[[], Awaitable[Any]] | None,
        checkpoint: Callable[[], Awaitable[None]],
    ) -> None:
        self.settings = settings
        self.state = state
        self.reply = reply
        self.structured_model = structured_model
        self._emit = emit
        self._demand = demand
        self.checkpoint = checkpoint
        self.events = ev.EventFactory(settings.name, reply.reply_id, reply.session_id)
        self.ctx = ReplyContext(
            agent_name=settings.name,
            reply_id=reply.reply_id,
            session_id=reply.session_id,
            state=state,
            iteration=reply.iteration,
            input_tokens=reply.input_tokens,
            output_tokens=reply.output_tokens,
            tool_calls=reply.tool_calls,
            # Weakly: the scope holds the context, and a cycle between them
            # would leave each reply's objects to the cycle collector.
            sink=weakref.proxy(self),
        )
        # Only the middleware that watches events is called for each one, and
        # only the middleware that checks answers sees them: a reply of an
        # agent with no such layer awaits nothing more for its answer.
        self._watchers = [
            m
            for m in settings.middlewares
            if getattr(type(m), "on_event", Middleware.on_event) is not Middleware.on_event
        ]
        self.answer_checks: tuple[Middleware, ...] = (
            tuple(
                m
                for m in settings.middlewares
                if getattr(type(m), "on_answer", Middleware.on_answer) is not Middleware.on_answer
            )
            if settings.middlewares
            else ()
        )
        """The layers that see the answer before it is given (``on_answer``)."""

    @property
    def structured(self) -> bool:
        """Whether the reply must end with a structured answer."""
        return self.structured_model is not None or self.reply.structured_schema is not None

    def onion(self, hook: str, innermost: _F) -> _F:
        """``innermost`` wrapped in every middleware's ``hook``, the first
        outermost. A layer that keeps :class:`Middleware`'s own ``hook``,
        which only passes the call on, is left out: it would add a wrapper
        to the call and two frames to every wait inside it, and do nothing
        (a served agent's offload layer, say, has only ``on_tool_call``)."""
        call: Any = innermost
        passes = getattr(Middleware, hook)
        for middleware in reversed(self.settings.middlewares):
            method = getattr(middleware, hook)
            if getattr(method, "__func__", None) is passes:
                continue
            call = _layer(method, self.ctx, call)
        return cast(_F, call)

    async def wait_for_reader(self) -> None:
        """Await ``demand``, if any: nothing new starts for a reader that left."""
        if self._demand is not None:
            await self._demand()

    def event(self, name: str, /, **data: Any) -> None:
        """Emit one event of this reply, then show it to the middleware watching."""
        if self._emit is None and not self._watchers:
            return  # nobody would see it
        event = self.events(name, **data)
        if self._emit is not None:
            self._emit(event)
        for middleware in self._watchers:
            try:
                middleware.on_event(self.ctx, event)
            except Exception:  # a watcher's bug must not become the reply's failure
                logger.exception(
                    "%s: %s.on_event failed on %s",
                    self.settings.name,
                    type(middleware).__name__,
                    event.event,
                    extra={"session_id": self.reply.session_id, "call_id": self.reply.reply_id},
                )

    async def check_answer(
        self, content: str, structured: dict[str, Any] | None, given_by: Msg | None
    ) -> None:
        """Show the answer to :attr:`answer_checks`, in order, before it is given.

        Args:
            content: the answer's text (the JSON of a structured one).
            structured: the structured answer, if it is one.
            given_by: the message of memory that gave it, if it is there.

        Raises:
            StopReply: a layer refused the answer; ``given_by`` and the
                messages after it are taken out of memory first.
        """
        try:
            for middleware in self.answer_checks:
                await middleware.on_answer(self.ctx, content, structured)
        except StopReply:
            if given_by is not None:
                memory = self.state.memory
                for index in range(len(memory) - 1, -1, -1):
                    if memory[index] is given_by:
                        del memory[index:]
                        break
            raise

    def finish(
        self,
        finished_reason: FinishedReason,
        content: str,
        *,
        structured: dict[str, Any] | None = None,
        handoff: Handoff | None = None,
    ) -> FinalAnswer:
        """End the reply: ``reply_end``, and the state holds no reply unless paused."""
        if finished_reason != "paused":
            self.state.reply = None
        if handoff is None:
            self.event(ev.REPLY_END, finished_reason=finished_reason, content=content)
        else:
            self.event(
                ev.REPLY_END,
                finished_reason=finished_reason,
                content=content,
                handoff={"agent": handoff.agent, "reason": handoff.reason},
            )
        return FinalAnswer(
            sender=self.settings.name,
            session_id=self.reply.session_id,
            call_id=self.reply.request_id or self.reply.reply_id,
            content=content,
            structured=structured,
            finished_reason=finished_reason,
            handoff=handoff,
        )

    def end(self, ending: ReplyEnding) -> FinalAnswer:
        """End the reply as a layer said (:meth:`ReplyContext.end_after_step`):
        a handoff carries the whole conversation (the handoff's layer filters it)."""
        handoff = None
        if ending.handoff_to is not None:
            handoff = Handoff(
                agent=ending.handoff_to,
                by=self.settings.name,
                reason=ending.handoff_reason,
                messages=list(self.state.memory_index().chats),
            )
        reason = cast(FinishedReason, ending.finished_reason)
        return self.finish(reason, ending.content, handoff=handoff)


def tool_result(use: ToolUseBlock, state: ToolStatus, output: Any) -> ToolResultBlock:
    """The result block answering ``use``."""
    return ToolResultBlock(id=use.id, name=use.name, output=output, state=state)


def _layer(hook: Any, ctx: ReplyContext, call_next: Any) -> Any:
    """One onion layer: ``hook(ctx, *args, call_next)`` as a ``call_next`` itself."""

    async def call(*args: Any) -> Any:
        return await hook(ctx, *args, call_next)

    return call
