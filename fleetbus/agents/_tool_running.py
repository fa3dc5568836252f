"""The tool calls of one reply: each checked (arguments, unknown tools,
permissions, external tools, the internal ones), run one by one or at once,
made durable as each result arrives, recorded in the model's order, watched
for loops — the same call failing again and again, a call repeated after it
succeeded, a short cycle of calls — and, when the reply ends early, closed
with a result that tells what happened.

A structured answer asked for with a raw JSON Schema (no pydantic model) is
checked with the ``jsonschema`` library (the dialect the schema names, else
the latest); what does not fit is told to the model in a few short lines
(the field, what it should be), the first five problems. A ``$ref`` to
another document is not fetched: the answer is taken unchecked.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any, NamedTuple, cast

import jsonschema  # type: ignore[import-untyped]
import msgspec
import orjson
import pydantic
import referencing
import referencing.exceptions

from fleetbus import tracing
from fleetbus.agents import events as ev
from fleetbus.agents._model_calls import layer_tools, tool_specs
from fleetbus.agents._reply_scope import FINISH_TOOL, ReplyScope, tool_result
from fleetbus.agents._tool_groups import SWITCH_TOOL, inactive_group, switch
from fleetbus.agents.long_term_memory import STORE_TOOLS
from fleetbus.agents.messages import made_message
from fleetbus.agents.middleware import StopReply
from fleetbus.agents.offload import cut, was_cut
from fleetbus.agents.state import PendingCall, RecentCall
from fleetbus.agents.tools import error_text, streaming, switchable
from fleetbus.models.model import FORMAT_ERROR_TOOL
from fleetbus.protocol import (
    TOOL_STATUSES,
    FinalAnswer,
    ToolResult,
    ToolResultBlock,
    ToolStatus,
    ToolUseBlock,
)

__all__ = ["ToolRunner"]

_LOOK_BACK = 20
"""Calls loop detection looks back at, at least (twice ``max_repeated_calls``
when that is more): what the reply's saved state keeps of its calls."""
_CYCLE_PERIODS = (2, 3)
"""The cycles detected: A, B, A, B and A, B, C, A, B, C."""
_LOOPS_KEPT = 8
"""Loops shown to the model that the reply remembers."""


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
            content = json.dumps(structured)
            if scope.answer_checks:
                given_by = next(
                    (m for m in reversed(self.state.memory) if m.role == "assistant"), None
                )
                await scope.check_answer(content, structured, given_by)
            return scope.finish("completed", content, structured=structured)
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
        self.reply.arrived.append(made_message("tool", [block], use.name))
        await self.scope.checkpoint()
        return block

    def _check(self, use: ToolUseBlock) -> ToolResultBlock | PendingCall | None:
        """What happens to a call before it runs: a result now, a pause, or None (run it)."""
        if use.name == FORMAT_ERROR_TOOL:  # no tool: the model's step could not be used
            why = use.input.get("error") if isinstance(use.input, dict) else None
            return tool_result(
                use,
                "error",
                f"format_error: the model's step could not be used ({why or 'unreadable'}); "
                "the model is shown what it wrote, with a reminder",
            )
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
        if toolkit is None or use.name not in toolkit or use.name in STORE_TOOLS:
            names = [s.name for s in tool_specs(self.scope)]
            available = ", ".join(names) or "none"
            return tool_result(
                use, "error", f"unknown_tool: there is no tool {use.name!r}. Tools: {available}."
            )
        grouped = switchable(toolkit)
        if grouped is not None:
            off = inactive_group(grouped, self.state, use.name)
            if off is not None:
                return tool_result(use, "error", off)
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
        if name == SWITCH_TOOL and switchable(self.settings.toolkit) is not None:
            return True
        return self._answered_by_layer(name)

    def _answered_by_layer(self, name: str) -> bool:
        """Whether a middleware offers the tool ``name`` and answers it itself."""
        if not self.settings.middlewares:
            return False
        return any(spec.name == name for spec in layer_tools(self.scope))

    def _finish_tool(self, use: ToolUseBlock) -> tuple[ToolResultBlock, dict[str, Any] | None]:
        structured_model = self.scope.structured_model
        try:
            if structured_model is not None:
                value = structured_model.model_validate(use.input).model_dump(mode="json")
            else:
                value = _check_schema(use.input, self.reply.structured_schema or {})
        except (pydantic.ValidationError, ValueError) as exc:
            self.reply.structured_failures += 1
            return tool_result(
                use, "error", f"invalid_parameters: {error_text(exc)}. Call it again."
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
            with tracing.span(
                "fleetbus tool call",
                kind=tracing.SpanKind.CLIENT,
                attributes={"fleetbus.tool": call.name, "fleetbus.call_id": self.call_id_of(call)},
            ) as span:
                result = await self._execute(call)
                if span is not None:
                    span.set_attribute("fleetbus.tool_status", result.state)
                return result

        call = self.scope.onion("on_tool_call", execute)
        result = await call(use)
        if self._answered_by_layer(use.name):
            return result  # a layer's own tool: its result is what it says
        return await self._within_limit(result)

    async def _within_limit(self, block: ToolResultBlock) -> ToolResultBlock:
        """A successful result cut to the context's limit (a middleware that
        keeps the whole of it, as the offloading capability's does, has cut
        it already)."""
        output = block.output
        if block.state != "success" or output is None:
            return block
        text = output if isinstance(output, str) else json.dumps(output, ensure_ascii=False)
        limit = self.settings.context.tool_result_limit
        if len(text) <= limit or was_cut(text, limit):
            return block
        shown, _ = await cut(text, limit, None, f"{self.reply.reply_id}-{block.id}")
        return msgspec.structs.replace(block, output=shown)

    async def _execute(self, use: ToolUseBlock) -> ToolResultBlock:
        settings = self.settings
        if self._answered_by_layer(use.name):  # its layer called on instead of answering
            return tool_result(use, "error", f"tool_error: {use.name} was not answered")
        grouped = switchable(settings.toolkit) if use.name == SWITCH_TOOL else None
        if grouped is not None:
            switched, text = switch(grouped, self.state, use.input)
            return tool_result(use, "success" if switched else "error", text)
        toolkit = settings.toolkit
        assert toolkit is not None  # _check let only known tools through
        run: Callable[..., Awaitable[ToolResult]] = toolkit.run
        streamed = streaming(toolkit, use.name)
        if streamed is not None:
            scope = self.scope

            async def chunk(content: Any) -> None:
                scope.event(
                    ev.TOOL_RESULT_DELTA, call_id=use.id, tool_name=use.name, content=content
                )

            run = partial(streamed.run, on_chunk=chunk)
        ran = await run(
            use.name,
            use.input,
            timeout=settings.tool_timeout,
            call_id=self.call_id_of(use),
            session_id=self.reply.session_id,
        )
        status = ran.status if ran.status in TOOL_STATUSES else "error"
        if status != "success":
            detail = ran.error_detail
            text = f"{detail.code}: {detail.message}" if detail else f"{status}"
            return tool_result(use, cast(ToolStatus, status), text)
        return tool_result(use, "success", ran.content)

    def record(
        self, uses: list[ToolUseBlock], results: dict[str, ToolResultBlock], *, watch: bool = True
    ) -> FinalAnswer | None:
        """Put results in memory (the model's order), emit them, watch for
        repeated failures and loops; the reply's end if one ends it."""
        ended: FinalAnswer | None = None
        recorded = {use.id for use in uses}
        if self.reply.arrived:
            self.reply.arrived = [
                m for m in self.reply.arrived if not recorded & {b.id for b in m.tool_results}
            ]
        for use in uses:
            block = shown = results[use.id]
            loop_end: str | None = None
            if ended is None and watch:
                shown, loop_end = self._watch_loops(use, block)
            self._remember(use, shown)
            if ended is None and watch:
                ended = self._watch_repeats(use, block)
                if ended is None and loop_end is not None:
                    ended = self.scope.finish("repeated_action", loop_end)
        return ended

    def _watch_loops(
        self, use: ToolUseBlock, block: ToolResultBlock
    ) -> tuple[ToolResultBlock, str | None]:
        """Keep the call among the reply's recent calls and look for a loop.

        Returns:
            the result to record — with a note showing the model its loop the
            first time one is found — and, when a loop it was shown goes on,
            the text the reply ends with.
        """
        limit = self.settings.max_repeated_calls
        if limit is None or use.name == FINISH_TOOL:  # the finish tool has its own retries
            return block, None
        reply = self.reply
        recent = reply.recent_calls
        recent.append(RecentCall(signature=_signature(use), ok=block.state == "success"))
        del recent[: -max(_LOOK_BACK, 2 * limit)]
        # Fewer calls than the shortest loop takes (a cycle gone round twice,
        # or the same call made ``limit`` times): none to look for.
        if len(recent) < min(2 * _CYCLE_PERIODS[0], limit):
            return block, None
        loop = _find_loop(recent, limit)
        if loop is None:
            return block, None
        call = _describe(use)
        if loop.key in reply.loops_shown:
            if len(loop.names) == 1:
                return block, (
                    f"Stopped: {call} was called {loop.times} times with the same arguments "
                    "in this reply, and again after the model was told it repeats itself."
                )
            return block, (
                f"Stopped: the calls {' → '.join(loop.names)} went round in a loop with the "
                f"same arguments, and on after the model was told (the last: {call})."
            )
        reply.loops_shown = [*reply.loops_shown, loop.key][-_LOOPS_KEPT:]
        if len(loop.names) == 1:
            note = (
                f"Loop warning: you have made this same call, {call}, {loop.times} times in this "
                "reply, and it already succeeded: you have its result. Do not call it again "
                "with these arguments: use what you found, do something else, or give your "
                "final answer. Calling it again ends the reply."
            )
        else:
            note = (
                f"Loop warning: your last calls go round in a loop: {' → '.join(loop.names)}, "
                f"{loop.times} times with the same arguments. Going round again brings nothing "
                "new: use what you found, do something else, or give your final answer. "
                "Another round ends the reply."
            )
        return _with_note(block, note), None

    def _watch_repeats(self, use: ToolUseBlock, block: ToolResultBlock) -> FinalAnswer | None:
        if block.state == "success":
            reply = self.reply
            if reply.last_failure is not None or reply.repeat_count:  # (a model's setattr)
                reply.last_failure = None
                reply.repeat_count = 0
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
        """Tool calls of the last assistant message that have no result.

        Only the messages after it are read: a result comes after its call,
        and call ids are unique in memory (the model calls make them so).
        """
        answered: set[str] = set()
        for message in reversed(self.state.memory):
            if message.role == "assistant":
                waiting = {p.call_id for p in self.reply.pending}
                return [
                    u for u in message.tool_uses if u.id not in answered and u.id not in waiting
                ]
            if message.role == "user":
                return []
            answered.update(b.id for b in message.tool_results)
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
        self.state.memory.append(made_message("tool", [block], use.name))
        self.reply.answered.append(use.id)
        self.scope.event(
            ev.TOOL_RESULT,
            call_id=use.id,
            tool_name=use.name,
            status=block.state,
            output=block.output,
        )


class _Loop(NamedTuple):
    key: str
    """The same for every call of the loop, however far round it is."""
    names: list[str]
    """The tool names of one round (one name: the same call repeated)."""
    times: int
    """How many times the call was made, or the cycle went round."""


def _signature(use: ToolUseBlock) -> str:
    """The call's tool and canonical arguments, in a few bytes: ``name:digest``
    (the arguments as orjson writes them with sorted keys; what it cannot
    write, as text)."""
    canonical = orjson.dumps(
        use.input, option=orjson.OPT_SORT_KEYS | orjson.OPT_NON_STR_KEYS, default=str
    )
    return f"{use.name}:{hashlib.sha256(canonical).hexdigest()[:16]}"


def _tool_of(signature: str) -> str:
    return signature.rsplit(":", 1)[0]


def _find_loop(recent: list[RecentCall], limit: int) -> _Loop | None:
    """The loop the last call of ``recent`` closes, if any: a short cycle gone
    round twice (A, B, A, B), or the same call made ``limit`` times after it
    succeeded."""
    signatures = [c.signature for c in recent]
    for period in _CYCLE_PERIODS:
        last = signatures[-period:]
        if len(signatures) < 2 * period or len(set(last)) == 1:
            continue
        if signatures[-2 * period : -period] != last:
            continue
        times = 2
        while signatures[-(times + 1) * period : -times * period] == last:
            times += 1
        first = min(last[i:] + last[:i] for i in range(period))  # the same from any call
        return _Loop("cycle:" + ",".join(first), [_tool_of(s) for s in last], times)
    current = recent[-1]
    same = [c for c in recent if c.signature == current.signature]
    if len(same) >= limit and any(c.ok for c in same[:-1]):
        return _Loop("call:" + current.signature, [_tool_of(current.signature)], len(same))
    return None


def _describe(use: ToolUseBlock) -> str:
    args = json.dumps(use.input, ensure_ascii=False, default=str)
    return f"{use.name}({args if len(args) <= 200 else args[:200] + '…'})"


def _with_note(block: ToolResultBlock, note: str) -> ToolResultBlock:
    """The result with ``note`` after it (the output becomes text)."""
    output = block.output
    text = (
        output if isinstance(output, str) else json.dumps(output, ensure_ascii=False, default=str)
    )
    return msgspec.structs.replace(block, output=f"{text}\n\n{note}")


_JSON_TYPES: dict[str, Callable[[Any], bool]] = {
    "null": lambda v: v is None,
    "boolean": lambda v: isinstance(v, bool),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
    "string": lambda v: isinstance(v, str),
    "array": lambda v: isinstance(v, list),
    "object": lambda v: isinstance(v, dict),
}
"""JSON types by name, the most specific first (to name what a value is)."""


@functools.lru_cache(maxsize=64)
def _validator(schema_json: str) -> Any:
    """A validator of the schema (given as canonical JSON), built once per
    schema: a reply checks every answer it is given against the same one."""
    schema = json.loads(schema_json)
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    return cls(schema, registry=referencing.Registry())


def _check_schema(value: dict[str, Any], schema: dict[str, Any]) -> dict[str, Any]:
    """``value`` if it fits ``schema``.

    Raises:
        ValueError: it does not; the message lists the first problems.
    """
    try:
        validator = _validator(json.dumps(schema, sort_keys=True, default=str))
        problems: list[str] = []
        for error in validator.iter_errors(value):
            problem = _problem(error)
            if problem not in problems:
                problems.append(problem)
    except (jsonschema.SchemaError, referencing.exceptions.Unresolvable):
        return value  # a schema it cannot read, or a part elsewhere: not checked
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise ValueError("; ".join(problems[:5]) + more)
    return value


def _problem(error: Any) -> str:
    """One ``jsonschema`` error as the model is told it: where, then what."""
    where = ""
    for part in error.absolute_path:
        where += f"[{part}]" if isinstance(part, int) else f".{part}" if where else str(part)
    at = f"{where}: " if where else ""
    keyword = error.validator
    instance = error.instance
    if keyword == "required" and isinstance(instance, dict):
        missing = [k for k in error.validator_value if k not in instance]
        return f"{at}missing required field(s): {', '.join(map(str, missing))}"
    if keyword == "type":
        types = error.validator_value
        names = [types] if isinstance(types, str) else list(types)
        return f"{at}should be {' or '.join(names)}, not {_json_type(instance)}"
    if keyword == "enum":
        return f"{at}should be one of {json.dumps(error.validator_value, default=str)}"
    if keyword == "const":
        return f"{at}should be {json.dumps(error.validator_value, default=str)}"
    if keyword in ("anyOf", "oneOf"):
        return f"{at}fits none of the allowed shapes"
    if keyword == "additionalProperties" and isinstance(instance, dict):
        known = error.schema.get("properties") or {}
        extra = [k for k in instance if k not in known]
        return f"{at}unexpected field(s): {', '.join(extra)}"
    return f"{at}{error.message}"


def _json_type(value: Any) -> str:
    for name, fits in _JSON_TYPES.items():
        if fits(value):
            return name
    return type(value).__name__
