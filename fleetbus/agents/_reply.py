"""One reply of an agent: the ReAct loop, with every failure made an
observation or a clear ending.

:class:`ReplyRun` is created by :class:`fleetbus.agents.Agent` for each call to
``reply``; it reads and updates the agent's :class:`AgentState` in place, so
that the state after any step is enough to continue. It runs the loop and
hands the rest to its collaborators, which share the reply's
:class:`~fleetbus.agents._reply_scope.ReplyScope`: model calls
(:mod:`~fleetbus.agents._model_calls`), tool running
(:mod:`~fleetbus.agents._tool_running`), pause and resume
(:mod:`~fleetbus.agents._resume`).
"""

from __future__ import annotations

import asyncio

from fleetbus import tracing
from fleetbus.agents._model_calls import ModelCalls, ModelFailedError
from fleetbus.agents._reply_scope import FINISH_TOOL, ReplyScope
from fleetbus.agents._resume import Resumer
from fleetbus.agents._tool_running import ToolRunner
from fleetbus.agents.messages import Msg
from fleetbus.agents.middleware import StopReply
from fleetbus.protocol import (
    ConfirmResult,
    ExternalResult,
    FinalAnswer,
    ToolUseBlock,
)

__all__ = ["FINISH_TOOL", "ReplyRun"]

_EXCEEDED_PROMPT = (
    "You have used all {steps} reasoning steps of this reply. Do not call tools. "
    "Answer now, as well as you can from what you found so far, and say what is left undone."
)
_STOPPED_PROMPT = (
    "The reply must end now: {reason}. Do not call tools. Answer with what you have "
    "found so far, and say what is left undone."
)
_STRUCTURED_REMINDER = (
    "Give your final answer by calling the tool `{tool}` with arguments that fit its schema."
)


class ReplyRun:
    """Runs one reply of an agent.

    Args:
        scope: the reply in progress, its settings, state and callbacks (see
            :class:`ReplyScope`).
    """

    def __init__(self, scope: ReplyScope) -> None:
        self.scope = scope
        self.settings = scope.settings
        self.state = scope.state
        self.reply = scope.reply
        self.models = ModelCalls(scope)
        self.tools = ToolRunner(scope)
        self.resumer = Resumer(scope, self.tools)

    # -- the loop ---------------------------------------------------------------

    async def run(self, resume: ConfirmResult | ExternalResult | None) -> FinalAnswer:
        """Run the reply to its end (or its pause) through the middleware."""

        async def innermost() -> FinalAnswer:
            return await self._guarded(resume)

        call = self.scope.onion("on_reply", innermost)
        return await call()

    async def _guarded(self, resume: ConfirmResult | ExternalResult | None) -> FinalAnswer:
        tools = self.tools
        try:
            return await self._loop(resume)
        except StopReply as stop:
            tools.close_open_calls("cancelled", f"not run: the reply was stopped ({stop.reason})")
            if stop.summarize:
                text = await self.models.final_words(_STOPPED_PROMPT.format(reason=stop.reason))
                if text and self.scope.answer_checks:
                    try:
                        await self.scope.check_answer(text, None, self.state.memory[-1])
                    except StopReply as refused:
                        return self.scope.finish(
                            refused.finished_reason, f"Stopped: {refused.reason}."
                        )
                return self.scope.finish(stop.finished_reason, text or f"Stopped: {stop.reason}.")
            return self.scope.finish(stop.finished_reason, f"Stopped: {stop.reason}.")
        except ModelFailedError as exc:
            tools.close_open_calls("cancelled", "not run: the model failed")
            return self.scope.finish("error", f"The model failed: {exc}")
        except asyncio.CancelledError:
            tools.close_open_calls("cancelled", "not run: the reply was interrupted")
            raise

    async def _loop(self, resume: ConfirmResult | ExternalResult | None) -> FinalAnswer:
        settings = self.settings
        reply = self.reply
        checkpoint = self.scope.checkpoint
        if resume is not None:
            ended = await self.resumer.resume(resume)
            if ended is not None:
                return ended
        else:
            # Restored mid-step (a crash between the model's answer and its
            # results): run what was asked and never answered.
            missing = self.tools.unanswered_uses()
            if missing:
                ended = await self._act(missing)
                if ended is not None:
                    return ended
            elif reply.ending is not None:  # restored after the step that ended it
                return self.scope.end(reply.ending)
        while reply.iteration < settings.max_iters:
            self.scope.ctx.iteration = reply.iteration
            with tracing.span("fleetbus step", attributes={"fleetbus.step": reply.iteration}):
                message = await self.models.reason()
                self.state.memory.append(message)
                reply.iteration += 1
                reply.answered.clear()  # kept per step: the saved state stays bounded
                uses = message.tool_uses
                if not uses:
                    if self.scope.structured:
                        ended = self._remind_structured()
                        if ended is not None:
                            return ended
                        await checkpoint()
                        continue
                    if self.scope.answer_checks:
                        await self.scope.check_answer(message.text, None, message)
                    return self.scope.finish("completed", message.text)
                # Write-ahead: the calls (and their ids) are durable before they
                # are sent, so a take-over sends them again with the same call_id.
                await checkpoint()
                ended = await self._act(uses)
                if ended is not None:
                    return ended
                await checkpoint()
        text = await self.models.final_words(_EXCEEDED_PROMPT.format(steps=settings.max_iters))
        if text and self.scope.answer_checks:
            await self.scope.check_answer(text, None, self.state.memory[-1])
        return self.scope.finish(
            "exceed_max_iters",
            text or f"Stopped after {settings.max_iters} steps without a final answer.",
        )

    async def _act(self, uses: list[ToolUseBlock]) -> FinalAnswer | None:
        """Run a step's tool calls; record every result; maybe end or pause."""
        outcome = await self.tools.act(uses)
        if isinstance(outcome, list):
            return self.resumer.pause(outcome)
        if outcome is None and self.reply.ending is not None:  # a layer ended it
            return self.scope.end(self.reply.ending)
        return outcome

    def _remind_structured(self) -> FinalAnswer | None:
        self.reply.structured_failures += 1
        if self.reply.structured_failures > self.settings.structured_retries:
            return self.scope.finish(
                "error", f"The model did not call {FINISH_TOOL} with a valid structured answer."
            )
        self.state.memory.append(
            Msg.text_message("user", _STRUCTURED_REMINDER.format(tool=FINISH_TOOL))
        )
        return None
