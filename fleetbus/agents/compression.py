"""Memory compression: summarizing the older part of a conversation.

When a conversation nears the model's context length, the older messages are
replaced by one structured :class:`Summary` and the most recent ones are kept
verbatim. :func:`split_for_compression` decides where to cut (pure),
:func:`compress` does it (never failing: a summarizer error falls back to
plain truncation), and :func:`summarize_with_model` is the default summarizer.

The cut never separates a ``tool_use`` block from its ``tool_result``: the
kept part starts at a message that no kept message depends on, and never with
a ``tool`` message.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, Self, runtime_checkable

import msgspec
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from fleetbus.agents.messages import Msg
from fleetbus.models.model import ChatModel, ModelRequest, complete
from fleetbus.protocol import (
    ChatMessage,
    DataBlock,
    TextBlock,
    ThinkingBlock,
    ToolResultBlock,
    ToolSpec,
    ToolUseBlock,
)

__all__ = [
    "SUMMARY_HEADER",
    "TRUNCATION_HEADER",
    "ApproxTokenCounter",
    "CompressionResult",
    "ContextConfig",
    "Summary",
    "TokenCounter",
    "compress",
    "split_for_compression",
    "summarize_with_model",
]

logger = logging.getLogger(__name__)

SUMMARY_HEADER = "<summary of earlier conversation>"
"""The first line of a summary message's text."""

TRUNCATION_HEADER = "<earlier conversation truncated>"
"""The first line of the note that replaces messages that could not be summarized."""


@runtime_checkable
class TokenCounter(Protocol):
    """Counts the tokens messages take in a model's context.

    Compression assumes counts add up: the count of a list is about the sum of
    the counts of its messages.
    """

    def count(self, messages: Sequence[Msg]) -> int:
        """The tokens ``messages`` take."""
        ...


def _json_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if value is None:
        return "null"
    try:
        return msgspec.json.encode(value).decode()
    except (TypeError, msgspec.EncodeError):
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"), default=str)


def _block_chars(block: object) -> int:
    if isinstance(block, TextBlock):
        return len(block.text)
    if isinstance(block, ThinkingBlock):
        return len(block.thinking)
    if isinstance(block, ToolUseBlock):
        arguments = block.raw_arguments if block.raw_arguments is not None else block.input
        return len(block.name) + len(_json_text(arguments))
    if isinstance(block, ToolResultBlock):
        return len(block.name) + len(_json_text(block.output))
    if isinstance(block, DataBlock):
        return len(block.url) + len(block.media_type)
    return 0


class ApproxTokenCounter:
    """A tokenizer-free estimate: about ``chars_per_token`` characters a token.

    Counts text, thinking, tool names with their JSON arguments, and tool
    results as JSON, plus ``message_overhead`` tokens a message for roles and
    separators. Good enough to decide when to compress; not a billing count.

    Args:
        chars_per_token: characters per token (about 4 for English text).
        message_overhead: tokens added for each message.
    """

    _CACHE_SIZE = 1024
    """Counts kept (a served agent makes new message objects at each turn,
    so old keys never come back: the cache must stay small)."""

    def __init__(self, chars_per_token: float = 4.0, message_overhead: int = 4) -> None:
        if chars_per_token <= 0 or message_overhead < 0:
            raise ValueError("chars_per_token must be > 0 and message_overhead >= 0")
        self.chars_per_token = chars_per_token
        self.message_overhead = message_overhead
        # Messages are immutable: each is counted once (an agent counts its
        # whole memory before every step).
        self._counts: dict[tuple[str, int], int] = {}

    def __eq__(self, other: object) -> bool:
        """Counters with the same settings count alike (their caches aside)."""
        if not isinstance(other, ApproxTokenCounter):
            return NotImplemented
        return (self.chars_per_token, self.message_overhead) == (
            other.chars_per_token,
            other.message_overhead,
        )

    def __hash__(self) -> int:
        return hash((ApproxTokenCounter, self.chars_per_token, self.message_overhead))

    def count_text(self, text: str) -> int:
        """The tokens a piece of text takes."""
        return math.ceil(len(text) / self.chars_per_token)

    def count(self, messages: Sequence[Msg]) -> int:
        """The tokens ``messages`` take, overhead included."""
        total = 0
        counts = self._counts
        for message in messages:
            key = (message.msg_id, id(message.content))
            tokens = counts.get(key)
            if tokens is None:
                tokens = self.count_message(message)
                if len(counts) >= self._CACHE_SIZE:
                    counts.clear()
                counts[key] = tokens
            total += tokens
        return total

    def count_message(self, message: Msg) -> int:
        """The tokens one message takes, overhead included, counted afresh
        (for a caller that counts each message once and keeps the count, as
        an agent's memory index does: a loaded session's every message is new
        to the count cache, which only cost it)."""
        chars = 0
        for block in message.content:
            chars += _block_chars(block)
        return math.ceil(chars / self.chars_per_token) + self.message_overhead


class ContextConfig(BaseModel):
    """How much of the context an agent fills before it compresses its memory.

    ``reserve_ratio`` must be below ``trigger_ratio``, so that a compression
    always frees room.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    context_length: int = Field(default=128_000, gt=0)
    """Tokens the model accepts."""
    trigger_ratio: float = Field(default=0.8, gt=0, lt=1)
    """Compress when the context (system prompt included) passes this share."""
    reserve_ratio: float = Field(default=0.25, gt=0, lt=1)
    """Keep about this share of ``context_length`` of the newest messages verbatim."""
    tool_result_limit: int = Field(default=20_000, gt=0)
    """Characters of one tool result kept in the context; the rest is offloaded."""

    @model_validator(mode="after")
    def _reserve_below_trigger(self) -> Self:
        if self.reserve_ratio >= self.trigger_ratio:
            raise ValueError("reserve_ratio must be smaller than trigger_ratio")
        return self

    @property
    def trigger_tokens(self) -> int:
        """The context size above which memory is compressed."""
        return int(self.trigger_ratio * self.context_length)

    @property
    def reserve_tokens(self) -> int:
        """The token budget of the messages kept verbatim."""
        return int(self.reserve_ratio * self.context_length)


class Summary(BaseModel):
    """A structured summary of older messages, written by a model."""

    task: str = Field(
        description="What the user wants overall, with every requirement and constraint stated."
    )
    current_state: str = Field(description="What has been done so far and where the work stands.")
    discoveries: list[str] = Field(
        default_factory=list,
        description=(
            "Facts learned that are still needed: names, paths, ids, numbers, decisions, "
            "errors and their causes, approaches that failed."
        ),
    )
    next_steps: list[str] = Field(
        default_factory=list, description="What remains to be done, in order."
    )

    def render(self) -> str:
        """The summary as readable text, for the summary message."""
        lines = [f"Task: {self.task}", f"Current state: {self.current_state}"]
        if self.discoveries:
            lines += ["Discoveries:", *(f"- {item}" for item in self.discoveries)]
        if self.next_steps:
            lines += ["Next steps:", *(f"- {item}" for item in self.next_steps)]
        return "\n".join(lines)


@dataclass(frozen=True)
class CompressionResult:
    """What :func:`compress` did.

    Attributes:
        messages: the new memory: a ``compressed`` message then the kept
            messages (the same objects as in the input), or the input
            unchanged when ``method`` is ``none``.
        method: ``none`` (nothing done), ``summary``, or ``truncation`` (the
            summarizer failed and the older messages were dropped).
        summary: the summary, when ``method`` is ``summary``.
        removed: how many input messages were replaced.
        error: why summarizing failed, when it did.
    """

    messages: list[Msg]
    method: Literal["none", "summary", "truncation"]
    summary: Summary | None = None
    removed: int = 0
    error: str | None = None


def _pair_closed_start(messages: Sequence[Msg], start: int) -> int:
    """Move ``start`` earlier until no kept tool_result lacks its tool_use."""
    # needs[k]: the earliest message that must be kept if message k is kept.
    last_use: dict[str, int] = {}
    needs: list[int] = []
    for index, message in enumerate(messages):
        earliest = index
        for result in message.tool_results:
            owner = last_use.get(result.id)
            if owner is not None:
                earliest = min(earliest, owner)
        for use in message.tool_uses:
            last_use[use.id] = index
        needs.append(earliest)
    suffix_min = needs[:]
    for index in range(len(needs) - 2, -1, -1):
        suffix_min[index] = min(suffix_min[index], suffix_min[index + 1])
    while start > 0:
        new_start = suffix_min[start]
        if messages[start].role == "tool":
            new_start = min(new_start, start - 1)
        if new_start >= start:
            break
        start = new_start
    return start


def split_for_compression(
    messages: Sequence[Msg],
    config: ContextConfig,
    counter: TokenCounter,
    *,
    system_tokens: int = 0,
    force: bool = False,
) -> int | None:
    """Where to cut the memory: ``messages[:i]`` is summarized, ``messages[i:]`` kept.

    The kept part is the longest suffix within ``config.reserve_tokens``, then
    extended backwards so that every kept ``tool_result`` keeps its
    ``tool_use`` and the kept part does not start with a ``tool`` message. The
    last message is always kept, even when it alone exceeds the budget (bound
    tool results with :func:`fleetbus.agents.offload.cut` to avoid that).

    Args:
        messages: the memory, oldest first, without the system prompt.
        config: the context limits.
        counter: counts tokens.
        system_tokens: tokens of the system prompt (and tool specs) sent along.
        force: cut even if the context is below the trigger.

    Returns:
        The index ``i``; ``None`` when no compression is needed (below the
        trigger, unless ``force``) or nothing can be compressed (everything
        fits the reserve, or the older part is only a previous summary).
    """
    if not messages:
        return None
    if not force and system_tokens + counter.count(messages) <= config.trigger_tokens:
        return None
    budget = config.reserve_tokens
    start = len(messages) - 1
    used = counter.count(messages[start:])
    while start > 0:
        size = counter.count(messages[start - 1 : start])
        if used + size > budget:
            break
        used += size
        start -= 1
    start = _pair_closed_start(messages, start)
    if start == 0 or (start == 1 and "compressed" in messages[0].marks):
        return None
    return start


def _summary_message(summary: Summary) -> Msg:
    text = f"{SUMMARY_HEADER}\n{summary.render()}"
    return Msg(role="user", content=[TextBlock(text=text)], marks=frozenset({"compressed"}))


def _truncation_message(dropped: Sequence[Msg]) -> Msg:
    text = (
        f"{TRUNCATION_HEADER}\n{len(dropped)} earlier messages were removed to fit the "
        "context window; they could not be summarized, so their details are lost."
    )
    previous = next((m for m in reversed(dropped) if "compressed" in m.marks), None)
    if previous is not None and previous.text:
        text += f"\nWhat was known before them:\n{previous.text}"
    return Msg(role="user", content=[TextBlock(text=text)], marks=frozenset({"compressed"}))


async def compress(
    messages: Sequence[Msg],
    config: ContextConfig,
    counter: TokenCounter,
    summarize: Callable[[list[Msg]], Awaitable[Summary]],
    *,
    system_tokens: int = 0,
    force: bool = False,
) -> CompressionResult:
    """Replace the older messages by a summary when the context is too full.

    The new memory is one ``compressed`` user message (:data:`SUMMARY_HEADER`
    then :meth:`Summary.render`) followed by the kept messages, unchanged. If
    ``summarize`` raises or returns something else than a :class:`Summary`,
    the older messages are dropped instead and a ``compressed`` note says so
    (keeping the text of the last previous summary among them).

    Args:
        messages: the memory, oldest first, without the system prompt.
        config: the context limits.
        counter: counts tokens.
        summarize: turns the older messages into a :class:`Summary`, e.g.
            ``lambda older: summarize_with_model(model, older)``.
        system_tokens: tokens of the system prompt (and tool specs) sent along.
        force: compress even if the context is below the trigger.

    Returns:
        What was done. Never raises (but for cancellation): failures are in
        ``error``; a failing ``counter`` gives ``method="none"``.
    """
    try:
        cut = split_for_compression(
            messages, config, counter, system_tokens=system_tokens, force=force
        )
    except Exception as exc:
        logger.warning("cannot measure the context for compression: %r", exc)
        return CompressionResult(messages=list(messages), method="none", error=repr(exc))
    if cut is None:
        return CompressionResult(messages=list(messages), method="none")
    older, kept = list(messages[:cut]), list(messages[cut:])
    try:
        summary = await summarize(older)
        if not isinstance(summary, Summary):
            raise TypeError(f"the summarizer returned {type(summary).__name__}, not a Summary")
    except Exception as exc:
        error = str(exc) or type(exc).__name__
        logger.warning("summarizing %d messages failed, truncating instead: %s", cut, error)
        return CompressionResult(
            messages=[_truncation_message(older), *kept],
            method="truncation",
            removed=cut,
            error=error,
        )
    return CompressionResult(
        messages=[_summary_message(summary), *kept], method="summary", summary=summary, removed=cut
    )


_SUMMARIZER_PROMPT = """\
You compress the history of an AI agent's conversation. The agent will continue \
its work with your summary in place of the messages you are shown, so keep \
everything it still needs and drop the rest.

Call the tool write_summary exactly once:
- task: what the user wants overall, with every requirement and constraint they stated;
- current_state: what has been done and where the work stands;
- discoveries: facts learned that are still needed (exact names, paths, ids, numbers, \
decisions, errors and their causes, approaches that failed);
- next_steps: what remains to be done, in order.

Be specific and concise; copy identifiers exactly. If the transcript starts with an \
earlier summary, fold it in: keep what it says unless later messages superseded it."""

_WRITE_SUMMARY = ToolSpec(
    name="write_summary",
    description="Record the summary of the conversation.",
    parameters=Summary.model_json_schema(),
)

_FENCE = re.compile(r"```(?:json)?\s*(.*?)```", re.DOTALL)


def _shorten(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    return f"{text[:limit]}… [{len(text) - limit} more characters]"


def _transcript(messages: Sequence[Msg], result_chars: int) -> str:
    lines: list[str] = []
    for message in messages:
        who = message.role if not message.name else f"{message.role} {message.name}"
        if "compressed" in message.marks:
            who = "earlier summary"
        for block in message.content:
            if isinstance(block, TextBlock) and block.text:
                lines.append(f"[{who}] {block.text}")
            elif isinstance(block, ToolUseBlock):
                arguments = block.raw_arguments if block.raw_arguments is not None else block.input
                call = _shorten(_json_text(arguments), result_chars)
                lines.append(f"[{who} calls {block.name} #{block.id}] {call}")
            elif isinstance(block, ToolResultBlock):
                output = _shorten(_json_text(block.output), result_chars)
                lines.append(f"[result of {block.name} #{block.id}, {block.state}] {output}")
            elif isinstance(block, DataBlock):
                lines.append(f"[{who} attaches {block.media_type}] {block.name or block.url}")
    return "\n".join(lines)


def _parse_text(text: str) -> Summary:
    candidates = [match.group(1) for match in _FENCE.finditer(text)]
    start, end = text.find("{"), text.rfind("}")
    if 0 <= start < end:
        candidates.append(text[start : end + 1])
    for candidate in candidates:
        try:
            return Summary.model_validate_json(candidate)
        except ValidationError:
            continue
    raise ValueError(f"the model answered no summary: {_shorten(text, 200)!r}")


async def summarize_with_model(
    model: ChatModel,
    messages: list[Msg],
    *,
    timeout: float = 60.0,
    result_chars: int = 2_000,
    options: Mapping[str, Any] | None = None,
) -> Summary:
    """Summarize ``messages`` with one model call.

    The model is shown the messages as a transcript (tool arguments and
    results shortened to ``result_chars``) and asked to call the tool
    ``write_summary``; an answer in text holding the JSON object is accepted too.

    Args:
        model: the model that writes the summary.
        messages: the messages to summarize.
        timeout: seconds the call may take.
        result_chars: characters of each tool argument or result shown.
        options: model options for the request.

    Raises:
        ValueError: the model's answer holds no valid summary.
        TimeoutError: the call took longer than ``timeout``.
        ModelError: the model call failed.
    """
    transcript = _transcript(messages, result_chars)
    request = ModelRequest(
        messages=[
            ChatMessage(role="system", content=[TextBlock(text=_SUMMARIZER_PROMPT)]),
            ChatMessage(
                role="user",
                content=[TextBlock(text=f"<transcript>\n{transcript}\n</transcript>")],
            ),
        ],
        tools=[_WRITE_SUMMARY],
        tool_choice=_WRITE_SUMMARY.name,
        options=dict(options or {}),
    )
    async with asyncio.timeout(timeout):
        response = await complete(model, request)
    for use in response.tool_uses:
        if use.name != _WRITE_SUMMARY.name:
            continue
        try:
            if use.raw_arguments is not None and not use.input:
                return Summary.model_validate_json(use.raw_arguments)
            return Summary.model_validate(use.input)
        except ValidationError as exc:
            raise ValueError(f"the model wrote an invalid summary: {exc}") from exc
    return _parse_text(response.text)
