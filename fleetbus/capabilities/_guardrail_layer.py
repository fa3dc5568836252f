"""The layer that runs a reply's guardrails (see
:mod:`fleetbus.capabilities.guardrails`): one for each reply."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Final

import msgspec

from fleetbus.agents import events as ev
from fleetbus.agents.messages import Msg
from fleetbus.agents.middleware import Middleware, ReplyContext, StopReply
from fleetbus.capabilities._guardrail_types import (
    Checked,
    Guardrail,
    GuardrailContext,
    GuardrailResult,
    GuardrailStage,
)
from fleetbus.protocol import FinalAnswer, GuardrailTrip, ToolResultBlock, ToolUseBlock

__all__ = ["CheckFailedError", "GuardrailLayer", "text_of"]

_REASON_LIMIT: Final = 1000
"""Characters of a reason kept in an event, a final answer and memory."""
_INFO_LIMIT: Final = 4096
"""Bytes of a result's ``info`` (as JSON) shown in its event."""
_WHAT: Final[dict[str, str]] = {
    "input": "the input",
    "output": "the answer",
    "tool_input": "the call of {tool}",
    "tool_output": "the result of {tool}",
}


class CheckFailedError(Exception):
    """A check that could not be made, saying why in its message (shown as it
    is in the reason of the trip)."""


class GuardrailLayer(Middleware):
    """Runs one reply's checks (made for each reply).

    Args:
        input: the input guardrails.
        output: the output guardrails.
        tool_input: those run before each tool call, in order.
        tool_output: those run on each result, in order.
    """

    def __init__(
        self,
        input: Sequence[Guardrail],
        output: Sequence[Guardrail],
        tool_input: Sequence[Guardrail],
        tool_output: Sequence[Guardrail],
    ) -> None:
        self.input = input
        self.output = output
        self.tool_input = tool_input
        self.tool_output = tool_output
        self.trip: GuardrailTrip | None = None
        """The trip that stopped this reply, once one did."""
        self._input_checked = False

    async def on_reply(
        self, ctx: ReplyContext, call_next: Callable[[], Awaitable[FinalAnswer]]
    ) -> FinalAnswer:
        final = await call_next()
        trip = self.trip
        if trip is None or final.finished_reason != "guardrail_tripped":
            return final
        # Kept in memory, where the session's journal records it and the
        # model sees next time why this reply ended.
        ctx.state.memory.append(
            Msg.text_message(
                "assistant",
                text_of(final.content),
                name=ctx.agent_name,
                metadata={"guardrail": msgspec.to_builtins(trip)},
            )
        )
        return msgspec.structs.replace(final, guardrail=trip)

    async def on_reasoning(self, ctx: ReplyContext, call_next: Callable[[], Awaitable[Msg]]) -> Msg:
        if self._input_checked or ctx.iteration != 0 or not self.input:
            return await call_next()
        self._input_checked = True
        messages = _new_input(ctx.state.memory)
        if not messages:
            return await call_next()
        checked = Checked(
            text="\n".join(m.text for m in messages if m.text), messages=tuple(messages)
        )
        where = _context(ctx, "input")
        blocking = [g for g in self.input if not g.run_in_parallel]
        beside = [g for g in self.input if g.run_in_parallel]
        if blocking:
            found = await self._first_trip(ctx, blocking, checked, where)
            if found is not None:
                raise self._stop(found[0], "input", found[1].reason, None)
        if not beside:
            return await call_next()
        # The model call runs in a task of its own beside the checks, which a
        # trip cancels; its message is used only once they all passed.
        async with asyncio.TaskGroup() as tg:
            step = tg.create_task(_outcome(call_next))
            found = await self._first_trip(ctx, beside, checked, where)
            if found is not None:
                step.cancel()
        if found is not None:
            raise self._stop(found[0], "input", found[1].reason, None)
        outcome = step.result()
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    async def on_answer(
        self, ctx: ReplyContext, content: str, structured: dict[str, Any] | None
    ) -> None:
        if not self.output:
            return
        checked = Checked(text=content, structured=structured)
        found = await self._first_trip(ctx, self.output, checked, _context(ctx, "output"))
        if found is not None:
            raise self._stop(found[0], "output", found[1].reason, None)

    async def on_tool_call(
        self,
        ctx: ReplyContext,
        call: ToolUseBlock,
        call_next: Callable[[ToolUseBlock], Awaitable[ToolResultBlock]],
    ) -> ToolResultBlock:
        before, after = self.tool_input, self.tool_output
        if before:
            checked = Checked(text=_json(call.input), call=call)
            where = _context(ctx, "tool_input")
            for rail in before:
                result = await self._run(ctx, rail, checked, where)
                if result.tripped:
                    raise self._stop(rail, "tool_input", result.reason, call)
                if result.rejected:
                    return ToolResultBlock(
                        id=call.id,
                        name=call.name,
                        output=f"rejected by the guardrail {rail.name!r}: {result.reason} "
                        "(the call was not run)",
                        state="denied",
                    )
        block = await call_next(call)
        if after:
            where = _context(ctx, "tool_output")
            for rail in after:
                checked = Checked(text=_json(block.output), call=call, result=block)
                result = await self._run(ctx, rail, checked, where)
                if result.tripped:
                    raise self._stop(rail, "tool_output", result.reason, call)
                if result.replaced:
                    block = msgspec.structs.replace(block, output=result.output)
        return block

    async def _first_trip(
        self,
        ctx: ReplyContext,
        rails: Sequence[Guardrail],
        checked: Checked,
        where: GuardrailContext,
    ) -> tuple[Guardrail, GuardrailResult] | None:
        """Run ``rails`` at once; the first that trips (the others cancelled), if any."""
        if len(rails) == 1:
            result = await self._run(ctx, rails[0], checked, where)
            return (rails[0], result) if result.tripped else None

        async def one(rail: Guardrail) -> tuple[Guardrail, GuardrailResult]:
            return rail, await self._run(ctx, rail, checked, where)

        found: tuple[Guardrail, GuardrailResult] | None = None
        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(one(rail)) for rail in rails]
            for done in asyncio.as_completed(tasks):
                rail, result = await done
                if result.tripped:
                    found = (rail, result)
                    for task in tasks:
                        task.cancel()
                    break
        return found

    async def _run(
        self, ctx: ReplyContext, rail: Guardrail, checked: Checked, where: GuardrailContext
    ) -> GuardrailResult:
        """One check, its failure made a trip (or a pass, failing open), and its event."""
        failure: str | None = None
        try:
            if rail.timeout is None:
                result = await rail.check(checked, where)
            else:
                deadline = asyncio.timeout(rail.timeout)
                try:
                    async with deadline:
                        result = await rail.check(checked, where)
                except TimeoutError:
                    if not deadline.expired():
                        raise
                    raise CheckFailedError(f"no result within {rail.timeout:g} s") from None
            if not isinstance(result, GuardrailResult):
                raise CheckFailedError(f"it gave {type(result).__name__}, not a GuardrailResult")
            if (result.rejected and where.stage != "tool_input") or (
                result.replaced and where.stage != "tool_output"
            ):
                # Nothing else can be done with it here: stopping is the safe side.
                result = GuardrailResult.trip(
                    f"it asked to {result.action} at the {where.stage} stage"
                    + (f": {result.reason}" if result.reason else ""),
                    info=result.info,
                )
        except StopReply as stop:  # raised by the check itself: its reason trips
            result = GuardrailResult.trip(stop.reason)
        except Exception as exc:  # the check's failure is its result, not the reply's
            text = str(exc)
            if isinstance(exc, CheckFailedError):
                failure = text
            else:
                failure = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
            if rail.fail_open:
                result = GuardrailResult(reason=f"the check failed and lets through: {failure}")
            else:
                result = GuardrailResult.trip(f"the check failed: {failure}")
        data: dict[str, Any] = {
            "name": rail.name,
            "stage": where.stage,
            "tripped": result.tripped,
            "reason": _short(result.reason),
            "action": result.action,
        }
        if checked.call is not None:
            data["call_id"] = checked.call.id
            data["tool_name"] = checked.call.name
        if failure is not None:
            data["failed"] = True
        if result.info is not None:
            data["info"] = _shown_info(result.info)
        ctx.event(ev.GUARDRAIL, **data)
        return result

    def _stop(
        self, rail: Guardrail, stage: GuardrailStage, reason: str, call: ToolUseBlock | None
    ) -> StopReply:
        """The stop of a trip, kept as the reply's."""
        reason = _short(reason.strip() or "it tripped")
        self.trip = GuardrailTrip(name=rail.name, stage=stage, reason=reason)
        what = _WHAT[stage].format(tool=repr(call.name) if call is not None else "?")
        return StopReply(
            f"the guardrail {rail.name!r} tripped on {what}: {reason.rstrip('.')}",
            finished_reason="guardrail_tripped",
        )


async def _outcome(step: Callable[[], Awaitable[Msg]]) -> Msg | Exception:
    """The step's message, or what it raised (kept for the caller to raise:
    raised in the task, it would cancel the checks beside it). The step
    starts in the task: a trip before the task runs starts none."""
    try:
        return await step()
    except Exception as exc:
        return exc


def _context(ctx: ReplyContext, stage: GuardrailStage) -> GuardrailContext:
    return GuardrailContext(
        agent_name=ctx.agent_name, session_id=ctx.session_id, reply_id=ctx.reply_id, stage=stage
    )


def _new_input(memory: Sequence[Msg]) -> list[Msg]:
    """The user messages memory got since the model last spoke (hints aside)."""
    found: list[Msg] = []
    for message in reversed(memory):
        if message.role == "assistant":
            break
        if message.role == "user" and "hint" not in message.marks:
            found.append(message)
    found.reverse()
    return found


def _json(value: Any) -> str:
    """``value`` as text: itself if it is a string, else its JSON."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False, default=str)
    except ValueError:
        return str(value)


def text_of(content: Any) -> str:
    """The text of a final answer's content (a string, or blocks)."""
    if isinstance(content, str):
        return content
    return "\n".join(getattr(b, "text", "") for b in content if getattr(b, "text", ""))


def _short(text: str) -> str:
    return text if len(text) <= _REASON_LIMIT else text[: _REASON_LIMIT - 1] + "…"


def _shown_info(info: dict[str, Any]) -> Any:
    """``info`` as JSON values for an event, if it is not too large."""
    try:
        encoded = msgspec.json.encode(info)
    except (TypeError, ValueError, msgspec.EncodeError):
        return repr(info)[:_INFO_LIMIT]
    if len(encoded) > _INFO_LIMIT:
        return f"({len(encoded)} bytes of JSON, not shown)"
    return msgspec.json.decode(encoded)
