"""The tool calls of one reply: each checked (arguments, unknown tools,
permissions, external tools, the internal ones), run one by one or at once,
made durable as each result arrives, recorded in the model's order, watched
for the same call failing again and again, and, when the reply ends early,
closed with a result that tells what happened."""

from __future__ import annotations

import asyncio
import json
from typing import Any, cast

import pydantic

from fleetbus.agents import events as ev
from fleetbus.agents._model_calls import tool_specs
from fleetbus.agents._reply_scope import FINISH_TOOL, ReplyScope, tool_result
from fleetbus.agents.messages import Msg
from fleetbus.agents.middleware import StopReply
from fleetbus.agents.offload import READ_OFFLOADED_SPEC, cut, read_offloaded
from fleetbus.agents.state import PendingCall
from fleetbus.errors import FleetbusError
from fleetbus.protocol import (
    TOOL_STATUSES,
    FinalAnswer,
    ToolResultBlock,
    ToolStatus,
    ToolUseBlock,
)

__all__ = ["ToolRunner"]


class ToolRunner:
    """Runs the tool calls of one reply (``scope``)."""

    def __init__(self, scope: ReplyScope) -> None:
        self.scope = scope
        self.settings = scope.settings
        self.state = scope.state
        self.reply = scope.reply
        self._started: set[str] = set()
        """Tool calls this run started (a call cut short ran, in part)."""

    async def act(self, uses: list[ToolUseBlock]) -> FinalAnswer | list[PendingCall] | None:
        """Run a step's tool calls; record every result; maybe end.

        Returns:
            the reply's end, the calls to pause for (none of them run), or
            ``None`` to go on.
        """
        scope = self.scope
        results: dict[str, ToolResultBlock] = {}
        pending: list[PendingCall] = []
        runnable: list[ToolUseBlock] = []
        structured: dict[str, Any] | None = None
        arrived = {b.id: b for m in self.reply.arrived for b in m.tool_results}
        for use in uses:
            if use.id in arrived:  # ran before a take-over; its result is stored
                results[use.id] = arrived[use.id]
                continue
            scope.event(ev.TOOL_CALL, call_id=use.id, tool_name=use.name, parameters=use.input)
            checked = self._check(use)
            if isinstance(checked, ToolResultBlock):
                results[use.id] = checked
            elif isinstance(checked, PendingCall):
                pending.append(checked)
            elif use.name == FINISH_TOOL and scope.structured:
                block, structured = self._finish_tool(use)
                results[use.id] = block
            else:
                runnable.append(use)
        toolkit = self.settings.toolkit
        parallel = (
            self.settings.parallel_tool_calls
            and len(runnable) > 1
            and all(toolkit is not None and toolkit.is_concurrency_safe(u.name) for u in runnable)
        )
        try:
            await self._run_tools(runnable, results, parallel=parallel)
        except StopReply:
            # What ran is recorded as it ran; the rest is closed as not run.
            self.record([u for u in uses if u.id in results], results, watch=False)
            raise
        ended = self.record([u for u in uses if u.id in results], results)
        if ended is not None:
            return ended
        if structured is not None:
            return scope.finish("completed", json.dumps(structured), structured=structured)
        if scope.structured and self.reply.structured_failures > self.settings.structured_retries:
            return scope.finish(
                "error", f"The model did not call {FINISH_TOOL} with a valid structured answer."
            )
        return pending or None

    def call_id_of(self, use: ToolUseBlock) -> str:
        """The ``call_id`` a tool call travels with: the reply's id and the
        model's call id, unique across agents (models reuse ids like
        ``call_0``) and the same when a restored reply runs the call again,
        so a worker that answered it replays its result."""
        return f"{self.reply.reply_id}.{use.id}"

    async def _run_tools(
        self, uses: list[ToolUseBlock], results: dict[str, ToolResultBlock], *, parallel: bool
    ) -> None:
        """Run calls, putting each result in ``results`` as soon as it exists."""
        if not parallel:
            for use in uses:
                results[use.id] = await self._arrive(use, await self.run_tool(use))
            return

        async def one(use: ToolUseBlock) -> None:
            results[use.id] = await self._arrive(use, await self.run_tool(use))

        try:
            async with asyncio.TaskGroup() as tg:
                for use in uses:
                    tg.create_task(one(use))
        except* StopReply as group:
            raise group.exceptions[0] from None

    async def _arrive(self, use: ToolUseBlock, block: ToolResultBlock) -> ToolResultBlock:
        """Make a result durable as it arrives (before the step's other calls end)."""
        self.reply.arrived.append(Msg(role="tool", name=use.name, content=[block]))
        await self.scope.checkpoint()
        return block

    def _check(self, use: ToolUseBlock) -> ToolResultBlock | PendingCall | None:
        """What happens to a call before it runs: a result now, a pause, or None (run it)."""
        if use.raw_arguments is not None:
            preview = use.raw_arguments[:300]
            return tool_result(
                use,
                "error",
                f"invalid_parameters: the arguments of {use.name} are not a JSON object "
                f"({preview!r}). Call it again with a JSON object that fits its schema.",
            )
        if self._is_internal(use.name):
            return None
        toolkit = self.settings.toolkit
        if toolkit is None or use.name not in toolkit:
            names = [s.name for s in tool_specs(self.scope)]
            available = ", ".join(names) or "none"
            return tool_result(
                use, "error", f"unknown_tool: there is no tool {use.name!r}. Tools: {available}."
            )
        decision = self.state.permissions.check(use.name, use.input)
        if decision.action == "deny":
            rule = f" by the rule {decision.rule}" if decision.rule else ""
            return tool_result(use, "denied", f"denied: this call is not allowed{rule}.")
        if decision.action == "ask":
            return PendingCall(
                call_id=use.id,
                tool_name=use.name,
                parameters=use.input,
                kind="confirm",
                rule=str(decision.rule) if decision.rule else None,
            )
        if toolkit.is_external(use.name):
            return PendingCall(
                call_id=use.id, tool_name=use.name, parameters=use.input, kind="external"
            )
        return None

    def _is_internal(self, name: str) -> bool:
        if name == FINISH_TOOL and self.scope.structured:
            return True
        if self.state.plan is not None and self.state.plan.handles(name):
            return True
        return name == READ_OFFLOADED_SPEC.name and self.settings.offloader is not None

    def _finish_tool(self, use: ToolUseBlock) -> tuple[ToolResultBlock, dict[str, Any] | None]:
        structured_model = self.scope.structured_model
        try:
            if structured_model is not None:
                value = structured_model.model_validate(use.input).model_dump(mode="json")
            else:
                value = _check_required(use.input, self.reply.structured_schema or {})
        except (pydantic.ValidationError, ValueError) as exc:
            self.reply.structured_failures += 1
            return tool_result(
                use, "error", f"invalid_parameters: {_brief(exc)}. Call it again."
            ), None
        return tool_result(use, "success", "Answer recorded."), value

    async def run_tool(self, use: ToolUseBlock) -> ToolResultBlock:
        """Run one checked call through the ``on_tool_call`` middleware."""
        await self.scope.wait_for_reader()

        async def execute(call: ToolUseBlock) -> ToolResultBlock:
            self._started.add(call.id)
            ctx = self.scope.ctx
            ctx.tool_calls += 1
            self.reply.tool_calls = ctx.tool_calls
            return await self._execute(call)

        call = self.scope.onion("on_tool_call", execute)
        return await call(use)

    async def _execute(self, use: ToolUseBlock) -> ToolResultBlock:
        settings = self.settings
        plan = self.state.plan
        if plan is not None and plan.handles(use.name):
            done = plan.call(use.name, use.input)
            return tool_result(use, "success" if done.ok else "error", done.text)
        offloader = settings.offloader
        if use.name == READ_OFFLOADED_SPEC.name and offloader is not None:
            # A read brings no more into the context than a tool result may.
            arguments = dict(use.input)
            limit = arguments.get("limit")
            cap = settings.context.tool_result_limit
            arguments["limit"] = min(limit, cap) if isinstance(limit, int) else cap
            try:
                return tool_result(use, "success", await read_offloaded(offloader, arguments))
            except (pydantic.ValidationError, FleetbusError, KeyError, OSError) as exc:
                return tool_result(use, "error", f"read_offloaded failed: {_brief(exc)}")
        toolkit = settings.toolkit
        assert toolkit is not None  # _check let only known tools through
        outcome = await toolkit.run(
            use.name,
            use.input,
            timeout=settings.tool_timeout,
            call_id=self.call_id_of(use),
            session_id=self.reply.session_id,
        )
        status = outcome.status if outcome.status in TOOL_STATUSES else "error"
        if status != "success":
            detail = outcome.error_detail
            text = f"{detail.code}: {detail.message}" if detail else f"{status}"
            return tool_result(use, cast(ToolStatus, status), text)
        content = outcome.content
        text = content if isinstance(content, str) else json.dumps(content, ensure_ascii=False)
        limit = settings.context.tool_result_limit
        if len(text) <= limit:
            return tool_result(use, "success", content)
        shown, _ = await cut(text, limit, offloader, f"{self.reply.reply_id}-{use.id}")
        return tool_result(use, "success", shown)

    def record(
        self, uses: list[ToolUseBlock], results: dict[str, ToolResultBlock], *, watch: bool = True
    ) -> FinalAnswer | None:
        """Put results in memory (the model's order), emit them, watch for repeats."""
        ended: FinalAnswer | None = None
        recorded = {use.id for use in uses}
        if self.reply.arrived:
            self.reply.arrived = [
                m for m in self.reply.arrived if not recorded & {b.id for b in m.tool_results}
            ]
        for use in uses:
            block = results[use.id]
            self._remember(use, block)
            if ended is None and watch:
                ended = self._watch_repeats(use, block)
        return ended

    def _watch_repeats(self, use: ToolUseBlock, block: ToolResultBlock) -> FinalAnswer | None:
        if block.state == "success":
            self.reply.last_failure = None
            self.reply.repeat_count = 0
            return None
        key = f"{use.name}:{json.dumps(use.input, sort_keys=True, default=str)}"
        if key == self.reply.last_failure:
            self.reply.repeat_count += 1
        else:
            self.reply.last_failure = key
            self.reply.repeat_count = 1
        limit = self.settings.max_repeated_failures
        if self.reply.repeat_count < limit:
            return None
        args = json.dumps(use.input, ensure_ascii=False, default=str)
        return self.scope.finish(
            "repeated_action",
            f"Stopped: {use.name}({args}) failed {limit} times in a row, "
            f"the last time with: {block.output}",
        )

    def unanswered_uses(self) -> list[ToolUseBlock]:
        """Tool calls of the last assistant message that have no result."""
        answered = {b.id for m in self.state.memory for b in m.tool_results}
        waiting = {p.call_id for p in self.reply.pending}
        for message in reversed(self.state.memory):
            if message.role == "assistant":
                return [
                    u for u in message.tool_uses if u.id not in answered and u.id not in waiting
                ]
            if message.role == "user":
                return []
        return []

    def close_open_calls(self, state: ToolStatus, text: str) -> None:
        """Give every unanswered tool call a result, so memory stays consistent
        and tells what happened: a call that finished keeps its result, a call
        cut short while running says so, a call never started is ``text``."""
        open_uses = self.unanswered_uses()
        arrived = {b.id: b for m in self.reply.arrived for b in m.tool_results}
        self.reply.arrived = []
        for use in open_uses:
            block = arrived.get(use.id)
            if block is None:
                output = text
                if use.id in self._started:
                    output = (
                        f"{state}: the call was stopped while it ran ({text.split(': ', 1)[-1]}); "
                        "it may have had effects"
                    )
                block = tool_result(use, state, output)
            self._remember(use, block)

    def _remember(self, use: ToolUseBlock, block: ToolResultBlock) -> None:
        """One result into memory, and its event."""
        self.state.memory.append(Msg(role="tool", name=use.name, content=[block]))
        self.reply.answered.append(use.id)
        self.scope.event(
            ev.TOOL_RESULT,
            call_id=use.id,
            tool_name=use.name,
            status=block.state,
            output=block.output,
        )


def _check_required(value: dict[str, Any], schema: dict[str, Any]) -> dict[str, Any]:
    missing = [k for k in schema.get("required", []) if k not in value]
    if missing:
        raise ValueError(f"missing required field(s): {', '.join(missing)}")
    return value


def _brief(exc: BaseException) -> str:
    if isinstance(exc, pydantic.ValidationError):
        parts = []
        for err in exc.errors(include_url=False):
            where = ".".join(str(p) for p in err["loc"]) or "arguments"
            parts.append(f"{where}: {err['msg']}")
        return "; ".join(parts)
    return str(exc) or type(exc).__name__
