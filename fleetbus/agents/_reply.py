"""One reply of an agent: the ReAct loop, with every failure made an
observation or a clear ending.

:class:`ReplyRun` is created by :class:`fleetbus.agents.Agent` for each call to
``reply``; it reads and updates the agent's :class:`AgentState` in place, so
that the state after any step is enough to continue.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar, cast

import msgspec
import pydantic

from fleetbus.agents import events as ev
from fleetbus.agents.compression import compress, summarize_with_model
from fleetbus.agents.messages import Msg
from fleetbus.agents.middleware import ReplyContext, StopReply
from fleetbus.agents.model import (
    ChatModel,
    ModelError,
    ModelRequest,
    ModelResponse,
    TextDelta,
    ThinkingDelta,
)
from fleetbus.agents.offload import READ_OFFLOADED_SPEC, cut, read_offloaded
from fleetbus.agents.state import PendingCall, ReplyState
from fleetbus.errors import FleetbusError
from fleetbus.protocol import (
    TOOL_STATUSES,
    ChatMessage,
    ConfirmResult,
    Event,
    ExternalResult,
    FinalAnswer,
    FinishedReason,
    TextBlock,
    ToolResultBlock,
    ToolSpec,
    ToolStatus,
    ToolUseBlock,
    new_id,
)

if TYPE_CHECKING:
    from fleetbus.agents.agent import Agent

__all__ = ["FINISH_TOOL", "ReplyRun"]

logger = logging.getLogger(__name__)

FINISH_TOOL = "generate_response"
"""The tool a model calls to give a structured answer."""

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


_F = TypeVar("_F", bound=Callable[..., Awaitable[Any]])


class _ModelFailedError(Exception):
    """Every attempt at every model failed (internal to the loop)."""


class ReplyRun:
    """Runs one reply of ``agent``.

    Args:
        agent: the agent replying (its state is updated in place).
        reply: the reply in progress (already in ``agent.state.reply``).
        structured_model: the pydantic model of a structured answer, if any.
        emit: receives every event as it happens.
        demand: awaited before each model call and each tool call; returns
            once whoever reads the events has read them all and waits for
            more (a reader that left stops the reply from starting anything).
    """

    def __init__(
        self,
        agent: Agent,
        reply: ReplyState,
        *,
        structured_model: type[pydantic.BaseModel] | None,
        emit: Callable[[Event], None],
        demand: Callable[[], Awaitable[Any]] | None = None,
    ) -> None:
        self.agent = agent
        self.state = agent.state
        self.reply = reply
        self.structured_model = structured_model
        self._emit = emit
        self._demand = demand
        self.events = ev.EventFactory(agent.name, reply.reply_id, reply.session_id)
        self._started: set[str] = set()
        """Tool calls this run started (a call cut short ran, in part)."""
        self.ctx = ReplyContext(
            agent_name=agent.name,
            reply_id=reply.reply_id,
            session_id=reply.session_id,
            state=agent.state,
            iteration=reply.iteration,
            input_tokens=reply.input_tokens,
            output_tokens=reply.output_tokens,
            tool_calls=reply.tool_calls,
        )

    @functools.cached_property
    def _used_ids(self) -> set[str]:
        """Every tool call id of the conversation (updated as calls are added)."""
        return {u.id for m in self.state.memory for u in m.tool_uses}

    def _onion(self, hook: str, innermost: _F) -> _F:
        """``innermost`` wrapped in every middleware's ``hook``, the first outermost."""
        call: Any = innermost
        for middleware in reversed(self.agent.middlewares):
            call = _layer(getattr(middleware, hook), self.ctx, call)
        return cast(_F, call)

    # -- events and endings ---------------------------------------------------

    def event(self, name: str, **data: Any) -> None:
        """Emit one event of this reply."""
        self._emit(self.events(name, **data))

    def finish(
        self,
        finished_reason: FinishedReason,
        content: str,
        *,
        structured: dict[str, Any] | None = None,
    ) -> FinalAnswer:
        """End the reply: ``reply_end``, and the state holds no reply unless paused."""
        if finished_reason != "paused":
            self.state.reply = None
        self.event(ev.REPLY_END, finished_reason=finished_reason, content=content)
        return FinalAnswer(
            sender=self.agent.name,
            session_id=self.reply.session_id,
            call_id=self.reply.reply_id,
            content=content,
            structured=structured,
            finished_reason=finished_reason,
        )

    # -- the loop ---------------------------------------------------------------

    async def run(self, resume: ConfirmResult | ExternalResult | None) -> FinalAnswer:
        """Run the reply to its end (or its pause) through the middleware."""

        async def innermost() -> FinalAnswer:
            return await self._guarded(resume)

        call = self._onion("on_reply", innermost)
        return await call()

    async def _guarded(self, resume: ConfirmResult | ExternalResult | None) -> FinalAnswer:
        try:
            return await self._loop(resume)
        except StopReply as stop:
            self._close_open_calls("cancelled", f"not run: the reply was stopped ({stop.reason})")
            if stop.summarize:
                text = await self._final_words(_STOPPED_PROMPT.format(reason=stop.reason))
                return self.finish(stop.finished_reason, text or f"Stopped: {stop.reason}.")
            return self.finish(stop.finished_reason, f"Stopped: {stop.reason}.")
        except _ModelFailedError as exc:
            self._close_open_calls("cancelled", "not run: the model failed")
            return self.finish("error", f"The model failed: {exc}")
        except asyncio.CancelledError:
            self._close_open_calls("cancelled", "not run: the reply was interrupted")
            raise

    async def _loop(self, resume: ConfirmResult | ExternalResult | None) -> FinalAnswer:
        if resume is not None:
            ended = await self._resume(resume)
            if ended is not None:
                return ended
        else:
            # Restored mid-step (a crash between the model's answer and its
            # results): run what was asked and never answered.
            missing = self._unanswered_uses()
            if missing:
                ended = await self._act(missing)
                if ended is not None:
                    return ended
        while self.reply.iteration < self.agent.max_iters:
            self.ctx.iteration = self.reply.iteration
            await self._maybe_compress()
            message = await self._reason()
            self.state.memory.append(message)
            self.reply.iteration += 1
            uses = message.tool_uses
            if not uses:
                if self._structured:
                    ended = self._remind_structured()
                    if ended is not None:
                        return ended
                    await self.agent.checkpoint()
                    continue
                return self.finish("completed", message.text)
            # Write-ahead: the calls (and their ids) are durable before they are
            # sent, so a take-over sends them again with the same call_id.
            await self.agent.checkpoint()
            ended = await self._act(uses)
            if ended is not None:
                return ended
            await self.agent.checkpoint()
        text = await self._final_words(_EXCEEDED_PROMPT.format(steps=self.agent.max_iters))
        return self.finish(
            "exceed_max_iters",
            text or f"Stopped after {self.agent.max_iters} steps without a final answer.",
        )

    # -- reasoning ----------------------------------------------------------------

    @property
    def _structured(self) -> bool:
        return self.structured_model is not None or self.reply.structured_schema is not None

    def _tool_specs(self) -> list[ToolSpec]:
        specs = list(self.agent.toolkit.specs()) if self.agent.toolkit is not None else []
        if self.state.plan is not None:
            specs.extend(self.state.plan.tool_specs())
        if self.agent.offloader is not None:
            specs.append(READ_OFFLOADED_SPEC)
        if self._structured:
            schema = self.reply.structured_schema or {}
            specs.append(
                ToolSpec(
                    name=FINISH_TOOL,
                    description="Give the final answer, in the required structure. "
                    "Call it once, when you are done.",
                    parameters=schema,
                )
            )
        return specs

    def _prompt(self, *extra: Msg) -> list[ChatMessage]:
        system = self.agent.system_prompt
        for middleware in self.agent.middlewares:
            system = middleware.system_prompt(system, self.ctx)
        messages = [ChatMessage(role="system", content=[TextBlock(text=system)])] if system else []
        messages.extend(m.to_chat() for m in self.state.memory if "hint" not in m.marks)
        if self.state.plan is not None:
            hint = self.state.plan.hint()
            if hint:
                # Injected for this step only: never stored in memory.
                messages.append(Msg.text_message("user", hint, marks={"hint"}).to_chat())
        messages.extend(m.to_chat() for m in extra)
        return messages

    async def _wait_for_reader(self) -> None:
        if self._demand is not None:
            await self._demand()

    async def _reason(self) -> Msg:
        await self._wait_for_reader()

        async def step() -> Msg:
            request = ModelRequest(
                messages=self._prompt(),
                tools=self._tool_specs(),
                tool_choice="auto",
                options=dict(self.agent.model_config.options),
            )
            response = await self._call_model(request)
            return Msg(
                role="assistant", name=self.agent.name, content=_fix_ids(response, self._used_ids)
            )

        call = self._onion("on_reasoning", step)
        return await call()

    async def _call_model(self, request: ModelRequest) -> ModelResponse:
        config = self.agent.model_config
        models = [self.agent.model] + ([config.fallback] if config.fallback is not None else [])
        failures: list[str] = []
        for model in models:
            delay = config.backoff
            for attempt in range(config.max_retries + 1):
                try:
                    return await self._model_attempt(model, request)
                except (StopReply, asyncio.CancelledError):
                    raise
                except Exception as exc:
                    retryable = not (isinstance(exc, ModelError) and not exc.retryable)
                    failures.append(f"{model.name}: {_describe(exc)}")
                    logger.warning(
                        "%s: model %s failed (attempt %d): %s",
                        self.agent.name,
                        model.name,
                        attempt + 1,
                        _describe(exc),
                        extra={"session_id": self.reply.session_id, "call_id": self.reply.reply_id},
                    )
                    if not retryable:
                        break
                    if attempt < config.max_retries:
                        await asyncio.sleep(delay)
                        delay = min(delay * 2, config.max_backoff)
        raise _ModelFailedError("; ".join(failures[-3:]))

    async def _model_attempt(self, model: ChatModel, request: ModelRequest) -> ModelResponse:
        async def attempt(req: ModelRequest) -> ModelResponse:
            return await self._stream(model, req)

        call = self._onion("on_model_call", attempt)
        return await call(request)

    async def _stream(self, model: ChatModel, request: ModelRequest) -> ModelResponse:
        self.event(ev.MODEL_CALL_START, model=model.name, iteration=self.ctx.iteration)
        started = time.perf_counter()
        final: ModelResponse | None = None
        async with asyncio.timeout(self.agent.model_config.timeout):
            async for item in model.stream(request):
                if isinstance(item, TextDelta):
                    self.event(ev.TEXT_DELTA, text=item.text)
                elif isinstance(item, ThinkingDelta):
                    self.event(ev.THINKING_DELTA, thinking=item.thinking)
                elif isinstance(item, ModelResponse):
                    final = item
        if final is None:
            raise ModelError(f"{model.name} ended its stream without a response")
        usage = final.usage
        if usage is not None:
            self.ctx.input_tokens += usage.input_tokens
            self.ctx.output_tokens += usage.output_tokens
            self.reply.input_tokens = self.ctx.input_tokens
            self.reply.output_tokens = self.ctx.output_tokens
        self.event(
            ev.MODEL_CALL_END,
            model=final.model or model.name,
            input_tokens=usage.input_tokens if usage else None,
            output_tokens=usage.output_tokens if usage else None,
            finish_reason=final.finish_reason,
            seconds=round(time.perf_counter() - started, 6),
        )
        if not final.text.strip() and not final.tool_uses:
            raise ModelError(f"{model.name} answered with neither text nor a tool call")
        return final

    async def _final_words(self, instruction: str) -> str:
        """One last model call without tools; '' if it fails."""
        prompt = Msg.text_message("user", instruction, marks={"hint"})
        request = ModelRequest(
            messages=self._prompt(prompt),
            tools=[],
            tool_choice="none",
            options=dict(self.agent.model_config.options),
        )
        try:
            response = await self._call_model(request)
        except (_ModelFailedError, StopReply) as exc:
            logger.warning("%s: no final words: %s", self.agent.name, exc)
            return ""
        text = response.text
        if text:
            self.state.memory.append(Msg.text_message("assistant", text, name=self.agent.name))
        return text

    def _remind_structured(self) -> FinalAnswer | None:
        self.reply.structured_failures += 1
        if self.reply.structured_failures > self.agent.structured_retries:
            return self.finish(
                "error", f"The model did not call {FINISH_TOOL} with a valid structured answer."
            )
        self.state.memory.append(
            Msg.text_message("user", _STRUCTURED_REMINDER.format(tool=FINISH_TOOL))
        )
        return None

    async def _maybe_compress(self) -> None:
        config = self.agent.context
        counter = self.agent.token_counter
        specs = json.dumps([msgspec.to_builtins(s) for s in self._tool_specs()])
        system_tokens = counter.count_text(self.agent.system_prompt) + counter.count_text(specs)
        model = self.agent.model

        async def summarize(messages: list[Msg]) -> Any:
            return await summarize_with_model(model, messages)

        result = await compress(
            self.state.memory, config, counter, summarize, system_tokens=system_tokens
        )
        if result.method == "none":
            return
        logger.info(
            "%s: compressed %d message(s) by %s",
            self.agent.name,
            result.removed,
            result.method,
            extra={"session_id": self.reply.session_id},
        )
        self.state.memory[:] = result.messages
        if result.summary is not None:
            self.state.summary = result.summary

    # -- acting ---------------------------------------------------------------------

    async def _act(self, uses: list[ToolUseBlock]) -> FinalAnswer | None:
        """Run a step's tool calls; record every result; maybe end or pause."""
        results: dict[str, ToolResultBlock] = {}
        pending: list[PendingCall] = []
        runnable: list[ToolUseBlock] = []
        structured: dict[str, Any] | None = None
        arrived = {b.id: b for m in self.reply.arrived for b in m.tool_results}
        for use in uses:
            if use.id in arrived:  # ran before a take-over; its result is stored
                results[use.id] = arrived[use.id]
                continue
            self.event(ev.TOOL_CALL, call_id=use.id, tool_name=use.name, parameters=use.input)
            checked = self._check(use)
            if isinstance(checked, ToolResultBlock):
                results[use.id] = checked
            elif isinstance(checked, PendingCall):
                pending.append(checked)
            elif use.name == FINISH_TOOL and self._structured:
                block, structured = self._finish_tool(use)
                results[use.id] = block
            else:
                runnable.append(use)
        toolkit = self.agent.toolkit
        parallel = (
            self.agent.parallel_tool_calls
            and len(runnable) > 1
            and all(toolkit is not None and toolkit.is_concurrency_safe(u.name) for u in runnable)
        )
        try:
            await self._run_tools(runnable, results, parallel=parallel)
        except StopReply:
            # What ran is recorded as it ran; the rest is closed as not run.
            self._record([u for u in uses if u.id in results], results, watch=False)
            raise
        ended = self._record([u for u in uses if u.id in results], results)
        if ended is not None:
            return ended
        if structured is not None:
            return self.finish("completed", json.dumps(structured), structured=structured)
        if self._structured and self.reply.structured_failures > self.agent.structured_retries:
            return self.finish(
                "error", f"The model did not call {FINISH_TOOL} with a valid structured answer."
            )
        if pending:
            return self._pause(pending)
        return None

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
                results[use.id] = await self._arrive(use, await self._run_tool(use))
            return

        async def one(use: ToolUseBlock) -> None:
            results[use.id] = await self._arrive(use, await self._run_tool(use))

        try:
            async with asyncio.TaskGroup() as tg:
                for use in uses:
                    tg.create_task(one(use))
        except* StopReply as group:
            raise group.exceptions[0] from None

    async def _arrive(self, use: ToolUseBlock, block: ToolResultBlock) -> ToolResultBlock:
        """Make a result durable as it arrives (before the step's other calls end)."""
        self.reply.arrived.append(Msg(role="tool", name=use.name, content=[block]))
        await self.agent.checkpoint()
        return block

    def _check(self, use: ToolUseBlock) -> ToolResultBlock | PendingCall | None:
        """What happens to a call before it runs: a result now, a pause, or None (run it)."""
        if use.raw_arguments is not None:
            preview = use.raw_arguments[:300]
            return _result(
                use,
                "error",
                f"invalid_parameters: the arguments of {use.name} are not a JSON object "
                f"({preview!r}). Call it again with a JSON object that fits its schema.",
            )
        if self._is_internal(use.name):
            return None
        toolkit = self.agent.toolkit
        if toolkit is None or use.name not in toolkit:
            names = [s.name for s in self._tool_specs()]
            available = ", ".join(names) or "none"
            return _result(
                use, "error", f"unknown_tool: there is no tool {use.name!r}. Tools: {available}."
            )
        decision = self.state.permissions.check(use.name, use.input)
        if decision.action == "deny":
            rule = f" by the rule {decision.rule}" if decision.rule else ""
            return _result(use, "denied", f"denied: this call is not allowed{rule}.")
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
        if name == FINISH_TOOL and self._structured:
            return True
        if self.state.plan is not None and self.state.plan.handles(name):
            return True
        return name == READ_OFFLOADED_SPEC.name and self.agent.offloader is not None

    def _finish_tool(self, use: ToolUseBlock) -> tuple[ToolResultBlock, dict[str, Any] | None]:
        try:
            if self.structured_model is not None:
                value = self.structured_model.model_validate(use.input).model_dump(mode="json")
            else:
                value = _check_required(use.input, self.reply.structured_schema or {})
        except (pydantic.ValidationError, ValueError) as exc:
            self.reply.structured_failures += 1
            return _result(use, "error", f"invalid_parameters: {_brief(exc)}. Call it again."), None
        return _result(use, "success", "Answer recorded."), value

    async def _run_tool(self, use: ToolUseBlock) -> ToolResultBlock:
        await self._wait_for_reader()

        async def execute(call: ToolUseBlock) -> ToolResultBlock:
            self._started.add(call.id)
            self.ctx.tool_calls += 1
            self.reply.tool_calls = self.ctx.tool_calls
            return await self._execute(call)

        call = self._onion("on_tool_call", execute)
        return await call(use)

    async def _execute(self, use: ToolUseBlock) -> ToolResultBlock:
        plan = self.state.plan
        if plan is not None and plan.handles(use.name):
            done = plan.call(use.name, use.input)
            return _result(use, "success" if done.ok else "error", done.text)
        offloader = self.agent.offloader
        if use.name == READ_OFFLOADED_SPEC.name and offloader is not None:
            # A read brings no more into the context than a tool result may.
            arguments = dict(use.input)
            limit = arguments.get("limit")
            cap = self.agent.context.tool_result_limit
            arguments["limit"] = min(limit, cap) if isinstance(limit, int) else cap
            try:
                return _result(use, "success", await read_offloaded(offloader, arguments))
            except (pydantic.ValidationError, FleetbusError, KeyError, OSError) as exc:
                return _result(use, "error", f"read_offloaded failed: {_brief(exc)}")
        toolkit = self.agent.toolkit
        assert toolkit is not None  # _check let only known tools through
        outcome = await toolkit.run(
            use.name,
            use.input,
            timeout=self.agent.tool_timeout,
            call_id=self.call_id_of(use),
            session_id=self.reply.session_id,
        )
        status = outcome.status if outcome.status in TOOL_STATUSES else "error"
        if status != "success":
            detail = outcome.error_detail
            text = f"{detail.code}: {detail.message}" if detail else f"{status}"
            return _result(use, cast(ToolStatus, status), text)
        content = outcome.content
        text = content if isinstance(content, str) else json.dumps(content, ensure_ascii=False)
        limit = self.agent.context.tool_result_limit
        if len(text) <= limit:
            return _result(use, "success", content)
        shown, _ = await cut(text, limit, offloader, f"{self.reply.reply_id}-{use.id}")
        return _result(use, "success", shown)

    def _record(
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
            self.state.memory.append(Msg(role="tool", name=use.name, content=[block]))
            self.reply.answered.append(use.id)
            self.event(
                ev.TOOL_RESULT,
                call_id=use.id,
                tool_name=use.name,
                status=block.state,
                output=block.output,
            )
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
        limit = self.agent.max_repeated_failures
        if self.reply.repeat_count < limit:
            return None
        args = json.dumps(use.input, ensure_ascii=False, default=str)
        return self.finish(
            "repeated_action",
            f"Stopped: {use.name}({args}) failed {limit} times in a row, "
            f"the last time with: {block.output}",
        )

    # -- pause and resume ---------------------------------------------------------------

    def _pause(self, pending: list[PendingCall]) -> FinalAnswer:
        self.reply.pending = pending
        confirm = [p for p in pending if p.kind == "confirm"]
        external = [p for p in pending if p.kind == "external"]
        if confirm:
            self.event(ev.REQUIRE_USER_CONFIRM, calls=[p.model_dump() for p in confirm])
        if external:
            self.event(ev.REQUIRE_EXTERNAL_EXECUTION, calls=[p.model_dump() for p in external])
        names = ", ".join(f"{p.tool_name} ({p.kind})" for p in pending)
        return self.finish("paused", f"Waiting before running: {names}.")

    async def _resume(self, resume: ConfirmResult | ExternalResult) -> FinalAnswer | None:
        pending = {p.call_id: p for p in self.reply.pending}
        uses = {
            p.call_id: ToolUseBlock(id=p.call_id, name=p.tool_name, input=p.parameters)
            for p in self.reply.pending
        }
        results: dict[str, ToolResultBlock] = {}
        matched = False
        if isinstance(resume, ConfirmResult):
            for decision in resume.confirmations:
                waiting = pending.get(decision.call_id)
                if waiting is None or waiting.kind != "confirm":
                    logger.warning(
                        "%s: nothing waits to confirm %s", self.agent.name, decision.call_id
                    )
                    continue
                matched = True
                if decision.always:
                    self._remember_decision(waiting, decision.confirmed)
                del pending[decision.call_id]
                use = uses[decision.call_id]
                if not decision.confirmed:
                    results[use.id] = _result(use, "denied", "denied: the user refused this call.")
                elif self.agent.toolkit is not None and self.agent.toolkit.is_external(use.name):
                    pending[use.id] = PendingCall(
                        call_id=use.id, tool_name=use.name, parameters=use.input, kind="external"
                    )
                else:
                    results[use.id] = await self._run_tool(use)
        else:
            for output in resume.results:
                waiting = pending.get(output.call_id)
                if waiting is None or waiting.kind != "external":
                    logger.warning("%s: no external call %s waits", self.agent.name, output.call_id)
                    continue
                matched = True
                del pending[output.call_id]
                use = uses[output.call_id]
                if output.status == "success":
                    results[use.id] = _result(use, "success", output.content)
                else:
                    detail = output.error_detail
                    text = f"{detail.code}: {detail.message}" if detail else output.status
                    results[use.id] = _result(use, output.status, text)
        self.reply.pending = list(pending.values())
        if not results and self.reply.pending:
            if not matched:
                logger.warning("%s: the resume message matched no pending call", self.agent.name)
            return self._pause(self.reply.pending)
        ordered = [uses[c] for c in uses if c in results]
        ended = self._record(ordered, results)
        if ended is not None:
            return ended
        if self.reply.pending:
            return self._pause(self.reply.pending)
        await self.agent.checkpoint()
        return None

    def _remember_decision(self, waiting: PendingCall, confirmed: bool) -> None:
        """``always``: a rule so that calls of this tool are not asked again."""
        permissions = self.state.permissions
        if not confirmed:
            permissions.deny(waiting.tool_name)
            return
        # Ask outranks allow, so the ask rule that named exactly this tool
        # gives way; a glob that also covers other tools stays and still asks.
        permissions.rules = [
            r
            for r in permissions.rules
            if not (r.action == "ask" and r.tool == waiting.tool_name and not r.params)
        ]
        permissions.allow(waiting.tool_name)
        if permissions.check(waiting.tool_name, waiting.parameters).action == "ask":
            logger.warning(
                "%s: 'always' for %s cannot lift the broader ask rule %s",
                self.agent.name,
                waiting.tool_name,
                waiting.rule,
            )

    def _unanswered_uses(self) -> list[ToolUseBlock]:
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

    def _close_open_calls(self, state: ToolStatus, text: str) -> None:
        """Give every unanswered tool call a result, so memory stays consistent
        and tells what happened: a call that finished keeps its result, a call
        cut short while running says so, a call never started is ``text``."""
        open_uses = self._unanswered_uses()
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
                block = _result(use, state, output)
            self.state.memory.append(Msg(role="tool", name=use.name, content=[block]))
            self.reply.answered.append(use.id)
            self.event(
                ev.TOOL_RESULT,
                call_id=use.id,
                tool_name=use.name,
                status=block.state,
                output=block.output,
            )


def _result(use: ToolUseBlock, state: ToolStatus, output: Any) -> ToolResultBlock:
    return ToolResultBlock(id=use.id, name=use.name, output=output, state=state)


def _fix_ids(response: ModelResponse, used: set[str]) -> list[Any]:
    """Give every tool call an id unique in the conversation (adding it to
    ``used``): some models omit ids or reuse them across turns."""
    content: list[Any] = []
    for block in response.content:
        if isinstance(block, ToolUseBlock) and (not block.id or block.id in used):
            block = msgspec.structs.replace(block, id=f"call_{new_id()[:16]}")
        if isinstance(block, ToolUseBlock):
            used.add(block.id)
        content.append(block)
    return content


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


def _describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _layer(hook: Any, ctx: ReplyContext, call_next: Any) -> Any:
    """One onion layer: ``hook(ctx, *args, call_next)`` as a ``call_next`` itself."""

    async def call(*args: Any) -> Any:
        return await hook(ctx, *args, call_next)

    return call
