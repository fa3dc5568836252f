"""A :class:`~fleetbus.models.model.ChatModel` for any OpenAI-compatible endpoint.

OpenAI, DeepSeek, Qwen (DashScope compatible mode), vLLM, Ollama and the
llama.cpp server all speak Chat Completions; :class:`OpenAIChatModel` streams
from any of them::

    model = OpenAIChatModel("qwen2.5:7b", base_url="http://localhost:11434/v1")
    agent = Agent("helper", "You help.", model, toolkit=Toolkit([add]))

The model name comes from the argument or ``FLEETBUS_MODEL``; the endpoint and
key from the arguments or ``OPENAI_BASE_URL`` / ``OPENAI_API_KEY`` (a local
server that needs no key gets ``"not-needed"``).

Streaming: ``delta.content`` becomes :class:`TextDelta`; ``reasoning_content``
(DeepSeek, Qwen, vLLM; ``reasoning`` on some servers), which the SDK keeps as
an extra attribute, becomes :class:`ThinkingDelta`. Tool calls are assembled
from their pieces by ``index``; arguments that are not a JSON object become a
``ToolUseBlock`` with ``raw_arguments`` (the agent shows the model the error).

Structured output: with ``structured_output="response_format"`` and
``generate_response`` the only tool, the schema is sent as a ``json_schema``
response format and the JSON answer becomes the ``generate_response`` call.

Tool modes (``OpenAIConfig.native_tools``):

- ``"on"``: native ``tool_calls`` only; the text is the answer.
- ``"off"``: the text protocol of :mod:`fleetbus.models._text_protocol`, for
  models without tool calling: the tools and a JSON action format in the
  system prompt, the model's text parsed tolerantly (text with no JSON action
  in it at all is the final answer; the answer is streamed as one delta once
  it is read).
- ``"auto"`` (the default): tools are offered natively, and a response with no
  native calls whose text holds calls to offered tools (a JSON object, a
  fenced block, ``<tool_call>`` tags: :mod:`fleetbus.models._text_calls`) is
  taken as those calls, with ids starting ``call_text_``. The next request
  sends them back as ordinary ``tool_calls`` with their ``tool`` results. The
  answer text streams until it shows a sign of a call (``{``, a fence, a tag),
  then is held back until the step is read. Once ``text_switch_after`` steps
  of the conversation called tools in text and none natively, its requests use
  the text protocol: the state is the conversation itself (the ``call_text_``
  ids), so it holds for the rest of the conversation, restored sessions and
  model workers included, and costs the adapter no per-conversation memory.

In text and auto modes, a step that tried to act but cannot be read, or that
reports an observation no tool made (``Observation from calculator: …``
written by the model itself), is a tool call named ``format_error`` holding
the text in ``raw_arguments``; the agent answers it with an error result, so
the model's next request shows it what it wrote and a reminder with the
error. Counting those steps in the conversation (no state in the adapter, so
a restored session counts the same), a step that fails after
``format_retries`` reminders in a row raises ``ModelError(retryable=False)``
and the agent moves on to its fallback model or ends the reply with an error.
Why not raise a retryable error at once: the agent would retry the same
request, and the model would not learn what was wrong. Why not a text
answer: that would end the reply with garbage as the answer.

Errors: the openai SDK retries (``OpenAIConfig.max_retries``): 408, 409, 429,
5xx, timeouts and connection errors before the answer starts, with
exponential backoff and jitter, honouring ``Retry-After`` / ``retry-after-ms``
up to two minutes (a longer wait is not retried at all). What it raises once
it gives up becomes ``ModelError(retryable=False)``: the agent does not retry
on top of the SDK (that would multiply the attempts) but goes straight to its
fallback model. With ``max_retries=0`` nothing was retried, and these errors
stay retryable, so the agent's own retries apply. A timeout names its limit
and setting. Refusals (400, 401, 403, 404, 422 and other 4xx) raise
``ModelError(retryable=False)`` at once, with the server's message but never
the key. A stream that breaks, ends unfinished or has no choices raises a
retryable ``ModelError``: the agent asks again (the SDK retries only what
fails before the answer starts).

Streaming is the default; ``stream=False`` asks for each answer as one JSON
response (for servers or proxies that cannot stream tool calls) and yields
its text as one delta.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, replace
from types import TracebackType
from typing import Any, Literal, cast

import openai
from openai import AsyncOpenAI, AsyncStream
from openai.types.chat import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionMessageParam,
    ChatCompletionToolChoiceOptionParam,
    ChatCompletionToolUnionParam,
    completion_create_params,
)
from pydantic import BaseModel, ConfigDict, Field, field_validator

from fleetbus.errors import ConfigError
from fleetbus.models import _text_calls as tc
from fleetbus.models import _text_protocol as tp
from fleetbus.models._openai_format import (
    StreamAnswer,
    chat_messages,
    chat_tools,
    tool_choice,
)
from fleetbus.models.model import (
    FINISH_TOOL,
    ModelError,
    ModelRequest,
    ModelResponse,
    ModelStreamItem,
    TextDelta,
    ThinkingDelta,
)
from fleetbus.models.settings import ModelEnvironment
from fleetbus.protocol import (
    ChatMessage,
    ContentBlock,
    TextBlock,
    ThinkingBlock,
    ToolUseBlock,
    new_id,
)

__all__ = ["OpenAIChatModel", "OpenAIConfig", "ToolMode", "tool_mode"]

logger = logging.getLogger(__name__)

_NO_KEY = "not-needed"
"""The key sent to a local server when none is configured (the SDK wants one)."""
_RESERVED = frozenset({"model", "messages", "stream", "stream_options", "tools"})
"""Request fields the adapter owns: ``request.options`` cannot override them."""
_RETRY_COUNT = "x-stainless-retry-count"
"""The header in which the openai SDK tells the server how often it retried."""

ToolMode = Literal["auto", "on", "off"]
"""How tools reach the model: native calls read from text too, native only, text protocol."""
_Mode = Literal["native", "text", "json"]


def tool_mode(value: object) -> ToolMode:
    """``native_tools`` as a :data:`ToolMode`: ``"auto"``, ``"on"`` or ``"off"``
    (any case); the booleans of earlier versions, ``True`` and ``False``, mean
    ``"on"`` and ``"off"``.

    Raises:
        ValueError: anything else.
    """
    if value is True:
        return "on"
    if value is False:
        return "off"
    if isinstance(value, str):
        mode = value.strip().lower()
        if mode == "auto":
            return "auto"
        if mode == "on":
            return "on"
        if mode == "off":
            return "off"
    raise ValueError(
        f"native_tools must be 'auto', 'on' or 'off' (True and False mean 'on' and 'off'), "
        f"not {value!r}"
    )


class OpenAIConfig(BaseModel):
    """How :class:`OpenAIChatModel` talks to its endpoint."""

    model_config = ConfigDict(frozen=True)

    context_length: int = Field(default=128_000, gt=0)
    """Tokens the model's context holds (for compression settings)."""
    temperature: float | None = None
    max_tokens: int | None = Field(default=None, gt=0)
    parallel_tool_calls: bool | None = None
    """Sent only when set, and only with tools."""
    extra_body: dict[str, Any] = Field(default_factory=dict)
    """Extra request fields (``top_k``, ``enable_thinking``…); ``ModelRequest.options``
    are merged over them."""
    keep_thinking: bool = False
    """Send earlier thinking back as ``reasoning_content`` (some reasoning models
    want it with tool calls, others refuse it); dropped otherwise."""
    native_tools: ToolMode = "auto"
    """``"on"``: native tool calls only. ``"off"``: tools through the text
    protocol, for models without tool calling. ``"auto"``: native tool calls,
    and calls to offered tools written in the text are taken as calls too
    (``True`` / ``False`` are read as ``"on"`` / ``"off"``)."""
    text_switch_after: int | None = Field(default=2, ge=1)
    """``auto``: once this many steps of a conversation called tools in their
    text and none natively, it continues in the text protocol (``None``: never)."""
    required_tool_choice: bool = True
    """The endpoint honours ``tool_choice="required"`` (OpenAI, vLLM and
    llama.cpp do): the agent asks for it when a reply must end with a
    structured answer. ``False``: it asks for ``auto`` and reminds the model."""
    structured_output: Literal["tool", "response_format"] = "tool"
    """How a structured answer is asked for when ``generate_response`` is the only tool."""
    format_retries: int = Field(default=2, ge=0)
    """Text protocol and ``auto``: format reminders in a row before giving up on
    the model. (The agent's own ``max_repeated_failures`` also ends a reply
    whose steps fail the same way that many times in a row.)"""
    stream: bool = True
    """False: ask for each answer as one JSON response (for servers that cannot
    stream tool calls); its text then comes as one delta."""
    connect_timeout: float = Field(default=5.0, gt=0)
    read_timeout: float = Field(default=120.0, gt=0)
    """Seconds without a byte from the server, while waiting or streaming
    (``FLEETBUS_MODEL_TIMEOUT`` for a model built from a model string)."""
    max_retries: int = Field(default=3, ge=0)
    """Retries by the openai SDK of a rate-limited (408, 409, 429), failing (5xx),
    timed-out or unreachable endpoint, with jittered backoff and ``Retry-After``.
    0: none, and the agent's own retries (``ModelConfig.max_retries``) apply."""

    @field_validator("native_tools", mode="before")
    @classmethod
    def _tool_mode(cls, value: object) -> ToolMode:
        return tool_mode(value)


@dataclass(frozen=True, slots=True)
class _Plan:
    """One request as sent: the call's arguments and how to read the answer."""

    mode: _Mode
    arguments: dict[str, Any]
    offered: frozenset[str] = frozenset()
    """The tools the model may call in this step (none when ``tool_choice`` is ``none``)."""
    must_call: bool = False
    read_text: bool = False
    """Native mode, ``auto``: calls written in the text count."""


class OpenAIChatModel:
    """A model behind an OpenAI-compatible Chat Completions endpoint.

    Args:
        model: the model's name at the endpoint (default: ``FLEETBUS_MODEL``).
        base_url: the endpoint, e.g. ``http://localhost:8000/v1`` (default:
            ``OPENAI_BASE_URL``, else OpenAI's).
        api_key: the key (default: ``OPENAI_API_KEY``; ``"not-needed"`` when
            there is none and a base URL is set).
        config: timeouts, retries, options, how tools and structured answers work.
        client: a ready ``AsyncOpenAI`` client (then ``base_url`` and
            ``api_key`` must not be given); it is used with the retries and
            timeouts of ``config``, and not closed by :meth:`aclose`.

    Raises:
        ConfigError: no model name, no key for OpenAI's own endpoint, a
            client and connection settings both, or a ``native_tools`` that is
            not a tool mode.
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        base_url: str | None = None,
        api_key: str | None = None,
        config: OpenAIConfig | None = None,
        client: AsyncOpenAI | None = None,
    ) -> None:
        name = model or ModelEnvironment().model
        if not name:
            raise ConfigError(
                "no model name: pass OpenAIChatModel(model=...) or set FLEETBUS_MODEL"
            )
        self._model = name
        self.config = config or OpenAIConfig()
        try:
            # Read again: model_copy(update=…) does not validate.
            self._tools = tool_mode(self.config.native_tools)
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc
        if client is not None:
            if base_url is not None or api_key is not None:
                raise ConfigError("pass either client or base_url/api_key, not both")
            self._client = client.with_options(
                max_retries=self.config.max_retries, timeout=self._timeout()
            )
            self._owns_client = False
        else:
            self._client = self._make_client(base_url, api_key)
            self._owns_client = True
        self._base_url = str(self._client.base_url).rstrip("/")
        self._secret = self._client.api_key

    def _timeout(self) -> openai.Timeout:
        return openai.Timeout(self.config.read_timeout, connect=self.config.connect_timeout)

    def _make_client(self, base_url: str | None, api_key: str | None) -> AsyncOpenAI:
        env = ModelEnvironment()
        base_url = base_url or env.openai_base_url
        api_key = api_key or env.api_key
        if api_key is None:
            if base_url is None:
                raise ConfigError(
                    "no API key: set OPENAI_API_KEY, or set OPENAI_BASE_URL to a local "
                    "OpenAI-compatible server that needs no key"
                )
            api_key = _NO_KEY
        try:
            return AsyncOpenAI(
                api_key=api_key,
                base_url=base_url,
                max_retries=self.config.max_retries,
                timeout=self._timeout(),
            )
        except openai.OpenAIError as exc:
            raise ConfigError(f"cannot make an OpenAI client for {base_url}: {exc}") from exc

    @property
    def name(self) -> str:
        """The model's name at the endpoint."""
        return self._model

    @property
    def supports_required_tool_choice(self) -> bool:
        """Whether the agent may ask for ``tool_choice="required"``
        (``OpenAIConfig.required_tool_choice``)."""
        return self.config.required_tool_choice

    @property
    def base_url(self) -> str:
        """The endpoint, without a trailing slash."""
        return self._base_url

    @property
    def context_length(self) -> int:
        """Tokens the model's context holds."""
        return self.config.context_length

    async def aclose(self) -> None:
        """Close the HTTP connections (of a client this model made)."""
        if self._owns_client:
            await self._client.close()

    async def __aenter__(self) -> OpenAIChatModel:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    # -- a call --------------------------------------------------------------------

    async def stream(self, request: ModelRequest) -> AsyncIterator[ModelStreamItem]:
        """Send the request and stream the answer, ending with the ``ModelResponse``.

        Raises:
            ModelError: the endpoint refused the request or kept failing
                (``retryable=False``), the stream broke, ended unfinished or
                had no choices (``retryable=True``), or the model kept writing
                steps that cannot be read (``retryable=False``).
        """
        plan = self._plan(request)
        answer = StreamAnswer()
        gate = tc.CallGate() if plan.read_text else None
        if self.config.stream:
            stream = await self._open(plan)
            try:
                async for chunk in stream:
                    for delta in answer.add(chunk):
                        shown = _shown(plan, gate, delta)
                        if shown is not None:
                            yield shown
            except openai.APITimeoutError as exc:
                raise ModelError(
                    f"{self._base_url} sent nothing for {self.config.read_timeout:g} s "
                    "mid-answer (OpenAIConfig.read_timeout / FLEETBUS_MODEL_TIMEOUT)",
                    retryable=True,
                ) from exc
            except openai.APIConnectionError as exc:
                raise ModelError(
                    f"the connection to {self._base_url} broke mid-answer: {_cause(exc)}",
                    retryable=True,
                ) from exc
            except openai.APIError as exc:
                raise ModelError(
                    f"{self._base_url} reported an error mid-answer: {self._server_message(exc)}",
                    retryable=True,
                ) from exc
            except ValueError as exc:
                raise ModelError(
                    f"{self._base_url} sent a chunk that is not JSON: {exc}", retryable=True
                ) from exc
            finally:
                await stream.close()
        else:
            for delta in answer.add_completion(await self._complete(plan)):
                shown = _shown(plan, gate, delta)
                if shown is not None:
                    yield shown
        if not answer.choices:
            raise ModelError(
                f"{self._base_url} answered with no choices (model '{self._model}')",
                retryable=True,
            )
        if answer.finish_reason is None:
            raise ModelError(
                f"the stream from {self._base_url} ended before the answer was finished",
                retryable=True,
            )
        content = self._content(plan, answer, request.messages)
        text = "".join(b.text for b in content if isinstance(b, TextBlock))
        if plan.mode == "text" and text:
            yield TextDelta(text)
        elif gate is not None and not any(_read_from_text(b) for b in content):
            rest = gate.rest()
            if rest:
                yield TextDelta(rest)
        yield ModelResponse(
            content=content,
            usage=answer.usage,
            finish_reason=answer.finish_reason,
            model=answer.model or self._model,
        )

    def _plan(self, request: ModelRequest) -> _Plan:
        cfg = self.config
        tools = request.tools
        choice = request.tool_choice
        offered = frozenset(t.name for t in tools) if choice != "none" else frozenset()
        arguments: dict[str, Any] = {}
        read_text = False
        if (
            cfg.structured_output == "response_format"
            and len(tools) == 1
            and tools[0].name == FINISH_TOOL
            and choice != "none"
        ):
            mode: _Mode = "json"
            messages = tp.as_text_messages(
                request.messages,
                addendum=None,
                keep_thinking=cfg.keep_thinking,
                bare_tool=FINISH_TOOL,
            )
            arguments["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": FINISH_TOOL, "schema": tools[0].parameters},
            }
        elif self._tools == "off" or (self._tools == "auto" and self._switched(request.messages)):
            mode = "text"
            addendum = tp.instructions(tools, choice) if offered else None
            messages = tp.as_text_messages(
                request.messages, addendum=addendum, keep_thinking=cfg.keep_thinking
            )
        else:
            mode = "native"
            messages = tp.format_errors_as_text(request.messages, offered)
            read_text = self._tools == "auto" and bool(offered)
            if tools:
                # tool_choice and parallel_tool_calls without tools are a 400 at OpenAI.
                arguments["tools"] = chat_tools(tools)
                if choice is not None:
                    arguments["tool_choice"] = tool_choice(choice)
                if cfg.parallel_tool_calls is not None:
                    arguments["parallel_tool_calls"] = cfg.parallel_tool_calls
        if cfg.temperature is not None:
            arguments["temperature"] = cfg.temperature
        if cfg.max_tokens is not None:
            arguments["max_tokens"] = cfg.max_tokens
        extra = {**cfg.extra_body, **request.options}
        for key in _RESERVED & extra.keys():
            logger.warning("%s: option %r is set by the adapter; ignored", self._model, key)
            del extra[key]
        if extra:
            arguments["extra_body"] = extra
        arguments["messages"] = chat_messages(messages, keep_thinking=cfg.keep_thinking)
        must_call = mode == "text" and bool(offered) and choice not in (None, "auto")
        return _Plan(
            mode=mode,
            arguments=arguments,
            offered=offered if mode != "json" else frozenset(),
            must_call=must_call,
            read_text=read_text,
        )

    def _switched(self, messages: Sequence[ChatMessage]) -> bool:
        """``auto``: whether the conversation goes on in the text protocol."""
        after = self.config.text_switch_after
        steps = tp.text_call_steps(messages)
        if after is None or steps is None or steps < after:
            return False
        if steps == after:
            logger.info(
                "%s writes its tool calls as text (%d step(s), none native): "
                "tools go through the text protocol from now on in this conversation",
                self._model,
                steps,
            )
        return True

    async def _open(self, plan: _Plan) -> AsyncStream[ChatCompletionChunk]:
        """Start the stream (the SDK retries what may pass)."""
        try:
            stream = await self._client.chat.completions.create(
                **self._common(plan.arguments),
                stream=True,
                stream_options={"include_usage": True},
            )
        except openai.OpenAIError as exc:
            raise self._failed(exc) from exc
        # The keyword arguments are a dict: the overload is not picked by type.
        return cast("AsyncStream[ChatCompletionChunk]", stream)

    async def _complete(self, plan: _Plan) -> ChatCompletion:
        """The whole answer, not streamed (the SDK retries what may pass)."""
        try:
            completion = await self._client.chat.completions.create(
                **self._common(plan.arguments), stream=False
            )
        except openai.OpenAIError as exc:
            raise self._failed(exc) from exc
        except ValueError as exc:
            raise ModelError(
                f"{self._base_url} sent an answer that is not JSON: {exc}", retryable=True
            ) from exc
        if not isinstance(completion, ChatCompletion):
            # The SDK hands over whatever JSON came back, a string or a list too.
            raise ModelError(
                f"{self._base_url} sent an answer that is not a chat completion: "
                f"{self._scrub(str(completion)[:200])}",
                retryable=True,
            )
        return completion

    def _common(self, arguments: Mapping[str, Any]) -> dict[str, Any]:
        """The request's fields but ``stream``, as ``create`` takes them."""
        omit = openai.omit
        return {
            "model": self._model,
            "messages": cast("list[ChatCompletionMessageParam]", arguments["messages"]),
            "tools": cast("list[ChatCompletionToolUnionParam]", arguments.get("tools", omit)),
            "tool_choice": cast(
                "ChatCompletionToolChoiceOptionParam", arguments.get("tool_choice", omit)
            ),
            "parallel_tool_calls": arguments.get("parallel_tool_calls", omit),
            "response_format": cast(
                "completion_create_params.ResponseFormat", arguments.get("response_format", omit)
            ),
            "temperature": arguments.get("temperature", omit),
            "max_tokens": arguments.get("max_tokens", omit),
            "extra_body": arguments.get("extra_body"),
        }

    def _content(
        self, plan: _Plan, answer: StreamAnswer, messages: Sequence[ChatMessage]
    ) -> list[ContentBlock]:
        text = "".join(answer.text)
        thinking = "".join(answer.thinking)
        content: list[ContentBlock] = []
        if thinking and plan.mode != "text":
            content.append(ThinkingBlock(thinking=thinking))
        if plan.mode == "native":
            uses = answer.tool_uses()
            if plan.read_text and not uses:
                read = tc.read_calls(text, plan.offered)
                if read.error is not None:
                    content.append(self._format_error(text, read.error, messages))
                    return content
                if read.calls:
                    logger.debug("%s wrote %d tool call(s) as text", self._model, len(read.calls))
                    if read.prose:
                        content.append(TextBlock(text=read.prose))
                    content.extend(
                        ToolUseBlock(
                            id=tc.new_call_id(),
                            name=call.name,
                            input=call.arguments,
                            raw_arguments=call.raw_arguments,
                        )
                        for call in read.calls
                    )
                    return content
            if not uses and tp.echoes_reminder(text):
                content.append(self._format_error(text, tp.ECHOED_REMINDER, messages))
                return content
            if not uses and plan.offered and tp.echoes_request(text, messages):
                content.append(self._format_error(text, tp.ECHOED_REQUEST, messages))
                return content
            if text:
                content.append(TextBlock(text=text))
            content.extend(uses)
            return content
        if plan.mode == "json":
            try:
                value, raw = tp.loads_object(text), None
            except ValueError:
                value, raw = {}, text
            call_id = f"call_{new_id()[:16]}"
            content.append(
                ToolUseBlock(id=call_id, name=FINISH_TOOL, input=value, raw_arguments=raw)
            )
            return content
        return self._read_action(plan, text, thinking, messages)

    def _read_action(
        self, plan: _Plan, text: str, thinking: str, messages: Sequence[ChatMessage]
    ) -> list[ContentBlock]:
        """Text protocol: the step's text as an answer, a tool call or a format error."""
        content: list[ContentBlock] = []
        if not plan.offered:
            if thinking:
                content.append(ThinkingBlock(thinking=thinking))
            content.append(TextBlock(text=text))
            return content
        action = tp.parse_action(text, must_call=plan.must_call)
        thought = "\n".join(t for t in (thinking, action.prose) if t)
        if thought:
            content.append(ThinkingBlock(thinking=thought))
        if (
            action.error is None
            and action.tool is None
            and tp.echoes_request(action.answer or "", messages)
        ):
            action = replace(action, error=tp.ECHOED_REQUEST)
        if action.error is not None:
            content.append(self._format_error(text, action.error, messages))
        elif action.tool is not None:
            content.append(
                ToolUseBlock(id=tc.new_call_id(), name=action.tool, input=action.arguments)
            )
        else:
            content.append(TextBlock(text=action.answer or ""))
        return content

    def _format_error(self, text: str, error: str, messages: Sequence[ChatMessage]) -> ToolUseBlock:
        """The call that shows the model its unreadable step, unless it has had enough.

        Raises:
            ModelError: the last ``format_retries`` steps were format errors too.
        """
        failures = tp.format_errors_in_a_row(messages)
        if failures >= self.config.format_retries:
            raise ModelError(
                f"model '{self._model}' did not follow the tool-call text format "
                f"{failures + 1} time(s) in a row (last: {error})",
                retryable=False,
            )
        call_id = f"call_{new_id()[:16]}"
        return ToolUseBlock(
            id=call_id, name=tp.FORMAT_ERROR_TOOL, input={"error": error}, raw_arguments=text
        )

    # -- errors --------------------------------------------------------------------

    def _failed(self, exc: openai.OpenAIError) -> ModelError:
        """What the SDK raised before the answer started, as a :class:`ModelError`."""
        where = self._base_url
        # Retried by the SDK already (unless it was told not to): not by the agent too.
        retryable = self.config.max_retries == 0
        if isinstance(exc, openai.APIStatusError):
            if exc.status_code not in (408, 409, 429) and exc.status_code < 500:
                return self._refused(exc)
            wait = exc.response.headers.get("retry-after")
            asked = f" (Retry-After: {wait})" if wait else ""
            return ModelError(
                f"{where} failed {_attempts(exc)} time(s) for model '{self._model}'; last: "
                f"{exc.status_code} {self._server_message(exc)}{asked}",
                retryable=retryable,
            )
        if isinstance(exc, openai.APITimeoutError):
            cfg = self.config
            if type(exc.__cause__).__name__ == "ConnectTimeout":
                what = f"could not connect to {where} within {cfg.connect_timeout:g} s "
                setting = "OpenAIConfig.connect_timeout"
            else:
                what = f"model '{self._model}' at {where} did not answer within "
                what += f"{cfg.read_timeout:g} s "
                setting = "OpenAIConfig.read_timeout / FLEETBUS_MODEL_TIMEOUT"
            return ModelError(
                f"{what}({setting}), {_attempts(exc)} attempt(s)", retryable=retryable
            )
        if isinstance(exc, openai.APIConnectionError):
            return ModelError(
                f"cannot connect to {where} ({_cause(exc)}), {_attempts(exc)} attempt(s)",
                retryable=retryable,
            )
        return ModelError(
            f"the request to {where} failed: {self._scrub(str(exc))}", retryable=False
        )

    def _refused(self, exc: openai.APIStatusError) -> ModelError:
        """A request the endpoint will not serve, however often it is sent."""
        where = self._base_url
        if isinstance(exc, openai.AuthenticationError):
            # Never the server's message: some echo (part of) the key.
            return ModelError(
                f"the API key was refused by {where} (check OPENAI_API_KEY)", retryable=False
            )
        message = self._server_message(exc)
        if isinstance(exc, openai.PermissionDeniedError):
            text = f"{where} denied access to model '{self._model}' (403): {message}"
        elif isinstance(exc, openai.NotFoundError):
            text = f"model '{self._model}' not found at {where}: {message}"
        else:
            text = f"{where} rejected the request ({exc.status_code}): {message}"
        return ModelError(text, retryable=False)

    def _server_message(self, exc: openai.APIError) -> str:
        """What the server said, without the key."""
        body = exc.body
        if isinstance(body, Mapping):
            found = body.get("message") or body.get("error") or body.get("detail")
            message = found if isinstance(found, str) else str(body)
        elif isinstance(body, str) and body:
            message = body
        else:
            message = exc.message
        return self._scrub(message[:500])

    def _scrub(self, text: str) -> str:
        """``text`` without the API key (servers echo it in some messages)."""
        if self._secret and len(self._secret) >= 4 and self._secret != _NO_KEY:
            return text.replace(self._secret, "***")
        return text


def _shown(
    plan: _Plan, gate: tc.CallGate | None, delta: TextDelta | ThinkingDelta
) -> TextDelta | ThinkingDelta | None:
    """What of a delta is streamed now: text and JSON modes hold the text back
    (it is an action or JSON, to be read before anything is said), and ``auto``
    holds back what may be a call."""
    if isinstance(delta, ThinkingDelta):
        return delta
    if plan.mode != "native":
        return None
    if gate is None:
        return delta
    text = gate.feed(delta.text)
    return TextDelta(text) if text else None


def _read_from_text(block: ContentBlock) -> bool:
    """A call read from the model's text, or a format error."""
    return isinstance(block, ToolUseBlock) and (
        block.id.startswith(tc.TEXT_CALL_PREFIX) or block.name == tp.FORMAT_ERROR_TOOL
    )


def _attempts(exc: openai.APIError) -> int:
    """How many times the SDK sent the request (it numbers its retries in a header)."""
    try:
        return int(exc.request.headers.get(_RETRY_COUNT, "0")) + 1
    except ValueError:
        return 1


def _cause(exc: BaseException) -> str:
    cause = exc.__cause__ or exc
    text = str(cause)
    return f"{type(cause).__name__}: {text}" if text else type(cause).__name__
