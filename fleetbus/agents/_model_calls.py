"""The model calls of one reply: the prompt and the tools offered, retries
with jittered backoff and the fallback model, the streaming of one call under
its timeout, the last words without tools, and compression before a step.

Nothing here goes over the whole memory at every step: the prompt, the token
count compression checks and the tool call ids come from the state's
:class:`~fleetbus.agents.state.MemoryIndex`, which works on each message once.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import time
from collections.abc import Container, Iterator
from typing import Any

import msgspec

from fleetbus import tracing
from fleetbus._deadlines import within
from fleetbus._retry import Retry
from fleetbus.agents import events as ev
from fleetbus.agents._reply_scope import FINISH_TOOL, ReplyScope
from fleetbus.agents._tool_groups import active_groups, switch_spec
from fleetbus.agents.compression import compress, summarize_with_model
from fleetbus.agents.long_term_memory import STORE_TOOLS
from fleetbus.agents.messages import Msg, made_message
from fleetbus.agents.middleware import StopReply
from fleetbus.agents.tools import switchable
from fleetbus.models.model import (
    ChatModel,
    ModelError,
    ModelRequest,
    ModelResponse,
    TextDelta,
    ThinkingDelta,
    supports_required_tool_choice,
)
from fleetbus.protocol import ChatMessage, TextBlock, ToolSpec, ToolUseBlock, new_id

__all__ = ["ModelCalls", "ModelFailedError", "layer_tools", "tool_specs"]

logger = logging.getLogger(__name__)

_TIMEOUT_SETTING = "ModelConfig.timeout / FLEETBUS_MODEL_TIMEOUT"
"""Where the limit of one model call is set, as its timeout error names it."""


class ModelFailedError(Exception):
    """Every attempt at every model failed (internal to the loop)."""


def tool_specs(scope: ReplyScope) -> list[ToolSpec]:
    """The tools offered to the model in this reply, the internal ones too.

    With switchable tool groups: only the tools of the groups on in this
    session, and the ``switch_tool_groups`` meta-tool. Then the tools the
    middleware answers itself (a capability's: the plan's, the long-term
    memory's), which hide the toolkit's of the same names.

    Never the memory worker's own tools (``STORE_TOOLS``, which ``fleetbus
    agent`` finds on the bus with the others): they reach any agent's and any
    user's memory; a long-term memory gives the model its own tools instead,
    bound to this agent and this user.
    """
    settings = scope.settings
    state = scope.state
    own = layer_tools(scope)
    hidden = STORE_TOOLS | {s.name for s in own} if own else STORE_TOOLS
    toolkit = settings.toolkit
    grouped = switchable(toolkit)
    if grouped is not None:
        offered = grouped.active_specs(active_groups(grouped, state))
        specs = [s for s in offered if s.name not in hidden]
        specs.append(switch_spec(grouped))
    else:
        specs = [s for s in toolkit.specs() if s.name not in hidden] if toolkit is not None else []
    specs.extend(own)
    if scope.structured:
        schema = scope.reply.structured_schema or {}
        specs.append(
            ToolSpec(
                name=FINISH_TOOL,
                description="Give the final answer, in the required structure. "
                "Call it once, when you are done.",
                parameters=schema,
            )
        )
    return specs


def layer_tools(scope: ReplyScope) -> list[ToolSpec]:
    """The tools the reply's middleware offers and answers itself, now."""
    ctx = scope.ctx
    return [spec for layer in scope.settings.middlewares for spec in layer.tools(ctx)]


class ModelCalls:
    """Calls the model for one reply (``scope``)."""

    def __init__(self, scope: ReplyScope) -> None:
        self.scope = scope
        self.settings = scope.settings
        self.state = scope.state
        self.reply = scope.reply

    def prompt(self, *extra: Msg) -> list[ChatMessage]:
        """The messages of the next model call: system prompt, memory, ``extra``."""
        system = self.settings.system_prompt
        for middleware in self.settings.middlewares:
            system = middleware.system_prompt(system, self.scope.ctx)
        messages = [ChatMessage(role="system", content=[TextBlock(text=system)])] if system else []
        messages += self.state.memory_index().chats
        messages.extend(m.to_chat() for m in extra)
        return messages

    async def reason(self) -> Msg:
        """One reasoning step: the model's next message (not yet in memory).

        Raises:
            ModelFailedError: every attempt at every model failed.
        """
        await self.scope.wait_for_reader()

        async def step() -> Msg:
            # The tools offered, made once: memory is compressed first if
            # they, the system prompt and memory are past the threshold.
            tools = tool_specs(self.scope)
            await self.maybe_compress(tools)
            # A structured reply ends only with a tool call: forced where the
            # model can be forced, else asked for (and reminded, _reply.py).
            required = self.scope.structured and supports_required_tool_choice(self.settings.model)
            request = ModelRequest(
                messages=self.prompt(),
                tools=tools,
                tool_choice="required" if required else "auto",
                options=dict(self.settings.model_config.options),
                session_id=self.reply.session_id,
            )
            response = await self.call_model(request)
            used = self.state.memory_index().call_ids
            return made_message("assistant", _fix_ids(response, used), self.settings.name)

        call = self.scope.onion("on_reasoning", step)
        return await call()

    async def call_model(self, request: ModelRequest) -> ModelResponse:
        """The model's response, after retries and the fallback.

        Each model gets ``max_retries`` retries after its first attempt, with
        jittered exponential backoff (``backoff`` up to ``max_backoff``
        seconds); a failure that says trying again cannot help moves on to
        the fallback at once.

        Raises:
            ModelFailedError: every attempt at every model failed.
        """
        settings = self.settings
        config = settings.model_config
        models = [settings.model] + ([config.fallback] if config.fallback is not None else [])
        retry = _model_retry(config.max_retries + 1, config.backoff, config.max_backoff)
        failures: list[str] = []
        for model in models:
            numbers = itertools.count(1)
            asked = request
            if request.tool_choice == "required" and not supports_required_tool_choice(model):
                asked = dataclasses.replace(request, tool_choice="auto")  # a fallback that cannot
            try:
                return await retry.call(self._model_attempt, model, asked, numbers, failures)
            except StopReply:
                raise
            except Exception:  # logged and in failures: on to the fallback
                continue
        raise ModelFailedError(_summary(failures))

    async def _model_attempt(
        self,
        model: ChatModel,
        request: ModelRequest,
        numbers: Iterator[int],
        failures: list[str],
    ) -> ModelResponse:
        number = next(numbers)

        async def attempt(req: ModelRequest) -> ModelResponse:
            with tracing.span(
                "fleetbus model call",
                kind=tracing.SpanKind.CLIENT,
                attributes={"fleetbus.model": model.name, "fleetbus.attempt": number},
            ) as span:
                response = await self._stream(model, req)
                if span is not None and response.usage is not None:
                    span.set_attribute("gen_ai.usage.input_tokens", response.usage.input_tokens)
                    span.set_attribute("gen_ai.usage.output_tokens", response.usage.output_tokens)
                return response

        call = self.scope.onion("on_model_call", attempt)
        try:
            return await call(request)
        except StopReply:
            raise
        except Exception as exc:
            failures.append(f"{model.name}: {_describe(exc)}")
            logger.warning(
                "%s: model %s failed (attempt %d/%d): %s",
                self.settings.name,
                model.name,
                number,
                self.settings.model_config.max_retries + 1,
                _describe(exc),
                extra={"session_id": self.reply.session_id, "call_id": self.reply.reply_id},
            )
            raise

    async def _stream(self, model: ChatModel, request: ModelRequest) -> ModelResponse:
        scope = self.scope
        ctx = scope.ctx
        scope.event(ev.MODEL_CALL_START, model=model.name, iteration=ctx.iteration)
        started = time.perf_counter()
        final: ModelResponse | None = None
        limit = self.settings.model_config.timeout
        deadline = within(limit)
        try:
            async with deadline:
                async for item in model.stream(request):
                    if isinstance(item, TextDelta):
                        scope.event(ev.TEXT_DELTA, text=item.text)
                    elif isinstance(item, ThinkingDelta):
                        scope.event(ev.THINKING_DELTA, thinking=item.thinking)
                    elif isinstance(item, ModelResponse):
                        final = item
        except TimeoutError as exc:
            if not deadline.expired:
                raise  # the model's own TimeoutError, retried as it is
            raise ModelError(
                f"the model did not answer within {limit:g} s ({_TIMEOUT_SETTING})",
                retryable=True,
            ) from exc
        if final is None:
            raise ModelError(f"{model.name} ended its stream without a response")
        usage = final.usage
        if usage is not None:
            ctx.input_tokens += usage.input_tokens
            ctx.output_tokens += usage.output_tokens
            self.reply.input_tokens = ctx.input_tokens
            self.reply.output_tokens = ctx.output_tokens
        scope.event(
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

    async def final_words(self, instruction: str) -> str:
        """One last model call without tools; '' if it fails."""
        prompt = Msg.text_message("user", instruction, marks={"hint"})
        request = ModelRequest(
            messages=self.prompt(prompt),
            tools=[],
            tool_choice="none",
            options=dict(self.settings.model_config.options),
            session_id=self.reply.session_id,
        )
        try:
            response = await self.call_model(request)
        except (ModelFailedError, StopReply) as exc:
            logger.warning("%s: no final words: %s", self.settings.name, exc)
            return ""
        text = response.text
        if text:
            self.state.memory.append(Msg.text_message("assistant", text, name=self.settings.name))
        return text

    async def maybe_compress(self, tools: list[ToolSpec]) -> None:
        """Compress memory if it is over the context's threshold, with
        ``tools`` offered (the step's, which are counted with the system
        prompt).

        Memory's tokens come from the state's index: the sum of its messages'
        counts, each message counted once — what :func:`compress` counts
        first, counts adding up (see
        :class:`~fleetbus.agents.compression.TokenCounter`). Only past the
        threshold does :func:`compress` go over memory.
        """
        settings = self.settings
        config = settings.context
        counter = settings.token_counter
        system_tokens = counter.count_text(settings.system_prompt) + _tools_tokens(counter, tools)
        try:
            tokens = self.state.memory_index().tokens(counter)
        except Exception:  # compress() counts again, and logs why it cannot
            tokens = None
        if tokens is not None and system_tokens + tokens <= config.trigger_tokens:
            return
        model = settings.model

        async def summarize(messages: list[Msg]) -> Any:
            return await summarize_with_model(model, messages)

        result = await compress(
            self.state.memory, config, counter, summarize, system_tokens=system_tokens
        )
        if result.method == "none":
            return
        logger.info(
            "%s: compressed %d message(s) by %s",
            settings.name,
            result.removed,
            result.method,
            extra={"session_id": self.reply.session_id},
        )
        self.state.memory[:] = result.messages
        if result.summary is not None:
            self.state.summary = result.summary


def _tools_tokens(counter: Any, specs: list[ToolSpec]) -> int:
    """The tokens of the tool specs on offer (counted again only when they change)."""
    # Most specs are the same objects from step to step (a tool makes its
    # spec once): those, with the same counter, are known by their
    # identities alone. The entry keeps them alive, so no id is reused.
    seen = (id(counter), *map(id, specs))
    known = _SPECS_SEEN.get(seen)
    if known is not None:
        return known[2]
    # Else a spec's parameters are its tool's own schema, the same object
    # from reply to reply: name, description and that object's identity
    # tell a spec list counted before. Counters that count alike are equal
    # (a population's agents each have one); one that cannot be hashed is
    # told by its identity.
    try:
        hash(counter)
        who: Any = counter
    except TypeError:
        who = id(counter)
    key = (who, *((s.name, s.description, id(s.parameters)) for s in specs))
    known = _SPECS_TOKENS.get(key)
    if known is None:
        # msgspec's encoder: it encodes the structs directly, where
        # json.dumps needs them turned into builtins first.
        text = msgspec.json.encode(specs).decode()
        known = (specs, counter, counter.count_text(text))
        _keep(_SPECS_TOKENS, key, known)
    _keep(_SPECS_SEEN, seen, (specs, counter, known[2]))
    tokens: int = known[2]
    return tokens


def _keep(kept: dict[tuple[Any, ...], _Counted], key: tuple[Any, ...], entry: _Counted) -> None:
    if len(kept) >= _SPECS_KEPT:
        kept.clear()
    kept[key] = entry


_Counted = tuple[list[ToolSpec], Any, int]
"""A spec list, the counter that counted it, its tokens."""
_SPECS_KEPT = 256
"""Tool spec lists whose tokens are kept (all agents of a population offer one)."""
_SPECS_TOKENS: dict[tuple[Any, ...], _Counted] = {}
"""The tokens of the tool spec lists counted, by counter, names, descriptions
and parameter objects."""
_SPECS_SEEN: dict[tuple[Any, ...], _Counted] = {}
"""The same, by the identities of the counter and of the specs (each entry
keeps them alive)."""


@functools.lru_cache(maxsize=32)
def _model_retry(attempts: int, backoff: float, max_backoff: float) -> Retry:
    """The retry policy of a model call (made once for each setting: every
    step of every reply calls a model)."""
    return Retry(on=_retryable, attempts=attempts, backoff=backoff, max_backoff=max_backoff)


def _fix_ids(response: ModelResponse, used: Container[str]) -> list[Any]:
    """Give every tool call an id unique in the conversation (``used``: the
    ids in memory) and in the response: some models omit ids or reuse them
    across turns."""
    content: list[Any] = []
    taken: set[str] = set()
    for block in response.content:
        if isinstance(block, ToolUseBlock):
            if not block.id or block.id in used or block.id in taken:
                block = msgspec.structs.replace(block, id=f"call_{new_id()[:16]}")
            taken.add(block.id)
        content.append(block)
    return content


def _retryable(exc: Exception) -> bool:
    """Whether another attempt at the same model may help: not for a reply
    being stopped, nor for a model error that says it cannot."""
    if isinstance(exc, StopReply):
        return False
    return not (isinstance(exc, ModelError) and not exc.retryable)


def _summary(failures: list[str]) -> str:
    """The last three different failures, each once, with how often it came
    in a row (a model past its timeout fails the same way every attempt)."""
    runs = [(text, len(list(same))) for text, same in itertools.groupby(failures)]
    return "; ".join(text if n == 1 else f"{text} ({n} attempts)" for text, n in runs[-3:])


def _describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
