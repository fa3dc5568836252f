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

Models without native tool calls (``native_tools=False``) get the text
protocol of :mod:`fleetbus.models._text_protocol`: the tools and a JSON action
format in the system prompt, the model's text parsed tolerantly (text with no
JSON action in it at all is the final answer; the answer is streamed as one
delta once it is read). When a step tried to act but cannot be read, the
response is a tool call named ``format_error`` holding the text in
``raw_arguments``; the agent answers it with an error result, so
the model's next request shows it what it wrote and a reminder of the format
with the parse error. Counting those steps in the conversation (no state in
the adapter, so a restored session counts the same), a step that fails after
``format_retries`` reminders in a row raises ``ModelError(retryable=False)``
and the agent moves on to its fallback model or ends the reply with an error.
Why not raise a retryable error at once: the agent would retry the same
request, and the model would not learn what was wrong. Why not a text
answer: that would end the reply with garbage as the answer.

Errors: the SDK does not retry (``max_retries=0``); the adapter retries rate
limits (429), 408, server errors (5xx), timeouts and connection errors before the
stream starts, with exponential backoff that honours ``Retry-After``, then
raises ``ModelError(retryable=False)`` so the agent goes straight to its
fallback. Refusals (400, 401, 403, 404, 422 and other 4xx) raise
``ModelError(retryable=False)`` at once, with the server's message but never
the key. A stream that breaks, ends unfinished or has no choices raises a
retryable ``ModelError``: the agent asks again.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from email.utils import parsedate_to_datetime
from types import TracebackType
from typing import Any, Literal, cast

import openai
from openai import AsyncOpenAI, AsyncStream
from openai.types.chat import (
    ChatCompletionChunk,
    ChatCompletionMessageParam,
    ChatCompletionToolChoiceOptionParam,
    ChatCompletionToolUnionParam,
    completion_create_params,
)
from pydantic import BaseModel, ConfigDict, Field

from fleetbus.errors import ConfigError
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
from fleetbus.protocol import (
    ChatMessage,
    ContentBlock,
    TextBlock,
    ThinkingBlock,
    ToolUseBlock,
    new_id,
)

__all__ = ["OpenAIChatModel", "OpenAIConfig"]

logger = logging.getLogger(__name__)

_NO_KEY = "not-needed"
"""The key sent to a local server when none is configured (the SDK wants one)."""
_RESERVED = frozenset({"model", "messages", "stream", "stream_options", "tools"})
"""Request fields the adapter owns: ``request.options`` cannot override them."""

_Mode = Literal["native", "text", "json"]


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
    native_tools: bool = True
    """False: tools through the text protocol, for models without tool calling."""
    structured_output: Literal["tool", "response_format"] = "tool"
    """How a structured answer is asked for when ``generate_response`` is the only tool."""
    format_retries: int = Field(default=2, ge=0)
    """Text protocol: format reminders in a row before giving up on the model.
    (The agent's own ``max_repeated_failures`` also ends a reply whose steps
    fail the same way that many times in a row.)"""
    connect_timeout: float = Field(default=5.0, gt=0)
    read_timeout: float = Field(default=120.0, gt=0)
    """Seconds without a byte from the server, while waiting or streaming."""
    max_retries: int = Field(default=3, ge=0)
    """Retries of a rate-limited, failing or unreachable endpoint."""
    backoff: float = Field(default=0.5, ge=0)
    """Seconds before the first retry, doubling after each."""
    max_backoff: float = Field(default=30.0, ge=0)
    """The longest wait between retries, ``Retry-After`` included."""


@dataclass(frozen=True, slots=True)
class _Plan:
    """One request as sent: the call's arguments and how to read the answer."""

    mode: _Mode
    arguments: dict[str, Any]
    offered: bool = False
    """Text mode: tools are on offer, so the text is read as an action."""
    must_call: bool = False


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
            ``api_key`` must not be given); it is used without SDK retries and
            not closed by :meth:`aclose`.

    Raises:
        ConfigError: no model name, no key for OpenAI's own endpoint, or a
            client and connection settings both.
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
        name = model or os.environ.get("FLEETBUS_MODEL")
        if not name:
            raise ConfigError(
                "no model name: pass OpenAIChatModel(model=...) or set FLEETBUS_MODEL"
            )
        self._model = name
        self.config = config or OpenAIConfig()
        if client is not None:
            if base_url is not None or api_key is not None:
                raise ConfigError("pass either client or base_url/api_key, not both")
            self._client = client.with_options(max_retries=0)
            self._owns_client = False
        else:
            self._client = self._make_client(base_url, api_key)
            self._owns_client = True
        self._base_url = str(self._client.base_url).rstrip("/")
        self._secret = self._client.api_key

    def _make_client(self, base_url: str | None, api_key: str | None) -> AsyncOpenAI:
        base_url = base_url or os.environ.get("OPENAI_BASE_URL") or None
        api_key = api_key or os.environ.get("OPENAI_API_KEY") or None
        if api_key is None:
            if base_url is None:
                raise ConfigError(
                    "no API key: set OPENAI_API_KEY, or set OPENAI_BASE_URL to a local "
                    "OpenAI-compatible server that needs no key"
                )
            api_key = _NO_KEY
        timeout = openai.Timeout(self.config.read_timeout, connect=self.config.connect_timeout)
        try:
            return AsyncOpenAI(api_key=api_key, base_url=base_url, max_retries=0, timeout=timeout)
        except openai.OpenAIError as exc:
            raise ConfigError(f"cannot make an OpenAI client for {base_url}: {exc}") from exc

    @property
    def name(self) -> str:
        """The model's name at the endpoint."""
        return self._model

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
                (``retryable=False``), or the stream broke, ended unfinished or
                had no choices (``retryable=True``).
        """
        plan = self._plan(request)
        stream = await self._open(plan)
        answer = StreamAnswer()
        try:
            async for chunk in stream:
                for delta in answer.add(chunk):
                    # Text and JSON modes hold the text back: it is an action
                    # or JSON, to be read before anything is said.
                    if plan.mode == "native" or isinstance(delta, ThinkingDelta):
                        yield delta
        except openai.APITimeoutError as exc:
            raise ModelError(
                f"{self._base_url} sent nothing for {self.config.read_timeout}s mid-answer",
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
        if plan.mode == "text":
            text = "".join(b.text for b in content if isinstance(b, TextBlock))
            if text:
                yield TextDelta(text)
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
        arguments: dict[str, Any] = {}
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
        elif not cfg.native_tools:
            mode = "text"
            addendum = tp.instructions(tools, choice) if tools and choice != "none" else None
            messages = tp.as_text_messages(
                request.messages, addendum=addendum, keep_thinking=cfg.keep_thinking
            )
        else:
            mode = "native"
            messages = list(request.messages)
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
        offered = mode == "text" and bool(tools) and choice != "none"
        must_call = offered and choice not in (None, "auto")
        return _Plan(mode=mode, arguments=arguments, offered=offered, must_call=must_call)

    async def _open(self, plan: _Plan) -> AsyncStream[ChatCompletionChunk]:
        """Start the stream, retrying what may pass (408, 429, 5xx, timeouts, no connection)."""
        cfg = self.config
        error: openai.APIError
        for attempt in range(cfg.max_retries + 1):
            try:
                return await self._create(plan.arguments)
            except openai.APIStatusError as exc:
                if exc.status_code not in (408, 429) and exc.status_code < 500:
                    raise self._refused(exc) from exc
                error = exc
            except openai.APIConnectionError as exc:
                error = exc
            except openai.OpenAIError as exc:
                raise ModelError(
                    f"the request to {self._base_url} failed: {self._scrub(str(exc))}",
                    retryable=False,
                ) from exc
            if attempt == cfg.max_retries:
                raise ModelError(
                    f"{self._base_url} failed {attempt + 1} time(s) for model '{self._model}'; "
                    f"last: {self._describe(error)}",
                    retryable=False,
                ) from error
            delay = self._delay(attempt, error)
            logger.warning(
                "%s at %s: %s; retry %d of %d in %.2fs",
                self._model,
                self._base_url,
                self._describe(error),
                attempt + 1,
                cfg.max_retries,
                delay,
            )
            await asyncio.sleep(delay)
        raise AssertionError("unreachable")  # pragma: no cover

    async def _create(self, arguments: Mapping[str, Any]) -> AsyncStream[ChatCompletionChunk]:
        omit = openai.omit
        return await self._client.chat.completions.create(
            model=self._model,
            messages=cast("list[ChatCompletionMessageParam]", arguments["messages"]),
            stream=True,
            stream_options={"include_usage": True},
            tools=cast("list[ChatCompletionToolUnionParam]", arguments.get("tools", omit)),
            tool_choice=cast(
                "ChatCompletionToolChoiceOptionParam", arguments.get("tool_choice", omit)
            ),
            parallel_tool_calls=arguments.get("parallel_tool_calls", omit),
            response_format=cast(
                "completion_create_params.ResponseFormat", arguments.get("response_format", omit)
            ),
            temperature=arguments.get("temperature", omit),
            max_tokens=arguments.get("max_tokens", omit),
            extra_body=arguments.get("extra_body"),
        )

    def _content(
        self, plan: _Plan, answer: StreamAnswer, messages: Sequence[ChatMessage]
    ) -> list[ContentBlock]:
        text = "".join(answer.text)
        thinking = "".join(answer.thinking)
        content: list[ContentBlock] = []
        if plan.mode == "native":
            if thinking:
                content.append(ThinkingBlock(thinking=thinking))
            if text:
                content.append(TextBlock(text=text))
            content.extend(answer.tool_uses())
            return content
        if plan.mode == "json":
            if thinking:
                content.append(ThinkingBlock(thinking=thinking))
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
        call_id = f"call_{new_id()[:16]}"
        if action.error is not None:
            failures = tp.format_errors_in_a_row(messages)
            if failures >= self.config.format_retries:
                raise ModelError(
                    f"model '{self._model}' did not follow the tool-call text format "
                    f"{failures + 1} time(s) in a row (last: {action.error})",
                    retryable=False,
                )
            content.append(
                ToolUseBlock(id=call_id, name=tp.FORMAT_ERROR_TOOL, input={}, raw_arguments=text)
            )
        elif action.tool is not None:
            content.append(ToolUseBlock(id=call_id, name=action.tool, input=action.arguments))
        else:
            content.append(TextBlock(text=action.answer or ""))
        return content

    # -- errors --------------------------------------------------------------------

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

    def _describe(self, error: openai.APIError) -> str:
        if isinstance(error, openai.APIStatusError):
            return f"{error.status_code} {self._server_message(error)}"
        if isinstance(error, openai.APITimeoutError):
            return f"no answer within {self.config.read_timeout}s"
        return f"cannot connect ({_cause(error)})"

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

    def _delay(self, attempt: int, error: openai.APIError) -> float:
        delay = self.config.backoff * 2.0**attempt
        if isinstance(error, openai.APIStatusError):
            after = _retry_after(error.response.headers)
            if after is not None:
                delay = after
        return min(max(delay, 0.0), self.config.max_backoff)


def _retry_after(headers: Mapping[str, str]) -> float | None:
    """Seconds the server asks to wait: ``retry-after-ms``, or ``Retry-After``
    as seconds or an HTTP date."""
    millis = headers.get("retry-after-ms")
    if millis:
        try:
            return float(millis) / 1000
        except ValueError:
            pass
    value = headers.get("retry-after")
    if not value:
        return None
    try:
        return float(value)
    except ValueError:
        pass
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return when.timestamp() - time.time()


def _cause(exc: BaseException) -> str:
    cause = exc.__cause__ or exc
    text = str(cause)
    return f"{type(cause).__name__}: {text}" if text else type(cause).__name__
