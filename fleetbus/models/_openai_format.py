"""Chat Completions wire format: fleetbus messages and tools in, content blocks out.

Pure functions used by :mod:`fleetbus.models.openai_model`; no I/O.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from openai.types import CompletionUsage
from openai.types.chat import ChatCompletion, ChatCompletionChunk, ChatCompletionMessage
from openai.types.chat.chat_completion_chunk import ChoiceDelta

from fleetbus.models.model import TextDelta, ThinkingDelta
from fleetbus.protocol import (
    ChatMessage,
    DataBlock,
    TextBlock,
    ThinkingBlock,
    ToolResultBlock,
    ToolSpec,
    ToolUseBlock,
    Usage,
    new_id,
)

__all__ = [
    "StreamAnswer",
    "chat_messages",
    "chat_tools",
    "output_text",
    "parse_arguments",
    "tool_choice",
]

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
"""What OpenAI accepts as a message's ``name``; others are left out, not refused."""
_FETCHABLE = ("http://", "https://", "data:")
_EMPTY_SCHEMA: dict[str, Any] = {"type": "object", "properties": {}}
_REASONING_FIELDS = ("reasoning_content", "reasoning")
"""Where servers put reasoning text (not in the SDK's types: read as extras)."""


def chat_messages(messages: Sequence[ChatMessage], *, keep_thinking: bool) -> list[dict[str, Any]]:
    """The conversation as Chat Completions messages.

    System and user text become ``content`` strings, images (by URL) become
    ``image_url`` parts, assistant tool calls become ``tool_calls`` and every
    tool result becomes its own ``tool`` message. Thinking is sent back as
    ``reasoning_content`` only when ``keep_thinking``.
    """
    out: list[dict[str, Any]] = []
    for message in messages:
        if message.role == "assistant":
            out.append(_assistant(message, keep_thinking=keep_thinking))
            continue
        results = [b for b in message.content if isinstance(b, ToolResultBlock)]
        if message.role in ("system", "user"):
            entry = _user_or_system(message)
            if entry is not None or not results:
                out.append(entry or {"role": message.role, "content": ""})
        out.extend(
            {"role": "tool", "tool_call_id": r.id, "content": output_text(r.output)}
            for r in results
        )
    return out


def chat_tools(specs: Sequence[ToolSpec]) -> list[dict[str, Any]]:
    """Tools as ``{"type": "function", "function": {…}}`` entries."""
    return [
        {
            "type": "function",
            "function": {
                "name": s.name,
                "description": s.description,
                "parameters": s.parameters or _EMPTY_SCHEMA,
            },
        }
        for s in specs
    ]


def tool_choice(choice: str) -> str | dict[str, Any]:
    """``auto`` / ``none`` / ``required`` as they are; a tool name as a function choice."""
    if choice in ("auto", "none", "required"):
        return choice
    return {"type": "function", "function": {"name": choice}}


def output_text(output: Any) -> str:
    """A tool result as the string a ``tool`` message holds (JSON unless a string)."""
    if isinstance(output, str):
        return output
    return json.dumps(output, ensure_ascii=False, default=str)


def parse_arguments(text: str) -> tuple[dict[str, Any], str | None]:
    """Tool arguments as the model wrote them: ``(input, None)`` for a JSON
    object (an empty string counts as ``{}``), else ``({}, text)``."""
    if not text.strip():
        return {}, None
    try:
        value = json.loads(text)
    except ValueError:
        return {}, text
    if isinstance(value, dict):
        return value, None
    return {}, text


def _user_or_system(message: ChatMessage) -> dict[str, Any] | None:
    texts: list[str] = []
    parts: list[dict[str, Any]] = []
    images = False
    for block in message.content:
        if isinstance(block, TextBlock):
            texts.append(block.text)
            parts.append({"type": "text", "text": block.text})
        elif isinstance(block, DataBlock):
            if (
                message.role == "user"
                and block.media_type.startswith("image/")
                and block.url.startswith(_FETCHABLE)
            ):
                images = True
                parts.append({"type": "image_url", "image_url": {"url": block.url}})
            else:
                # A URL the provider cannot fetch (or a file it cannot read):
                # the model still learns that it exists and where.
                label = f"[{block.name or 'attachment'} ({block.media_type}): {block.url}]"
                texts.append(label)
                parts.append({"type": "text", "text": label})
    if not parts:
        return None
    entry: dict[str, Any] = {"role": message.role}
    entry["content"] = parts if images else "\n".join(texts)
    if message.role == "user" and message.name and _NAME.match(message.name):
        entry["name"] = message.name
    return entry


def _assistant(message: ChatMessage, *, keep_thinking: bool) -> dict[str, Any]:
    text = "".join(b.text for b in message.content if isinstance(b, TextBlock))
    calls = [
        {
            "id": b.id,
            "type": "function",
            "function": {
                "name": b.name,
                "arguments": b.raw_arguments
                if b.raw_arguments is not None
                else json.dumps(b.input, ensure_ascii=False),
            },
        }
        for b in message.content
        if isinstance(b, ToolUseBlock)
    ]
    entry: dict[str, Any] = {"role": "assistant", "content": text or (None if calls else "")}
    if calls:
        entry["tool_calls"] = calls
    thinking = "".join(b.thinking for b in message.content if isinstance(b, ThinkingBlock))
    if keep_thinking and thinking:
        entry["reasoning_content"] = thinking
    return entry


@dataclass(slots=True)
class _Call:
    call_id: str = ""
    name: str = ""
    arguments: list[str] = field(default_factory=list)


@dataclass(slots=True)
class StreamAnswer:
    """What the stream said so far (or the whole answer, when not streamed)."""

    text: list[str] = field(default_factory=list)
    thinking: list[str] = field(default_factory=list)
    calls: dict[int, _Call] = field(default_factory=dict)
    choices: bool = False
    finish_reason: str | None = None
    usage: Usage | None = None
    model: str = ""

    def add(self, chunk: ChatCompletionChunk) -> list[TextDelta | ThinkingDelta]:
        """Take in one chunk; the deltas it carries."""
        self._add_usage(chunk.usage)
        self.model = chunk.model or self.model
        deltas: list[TextDelta | ThinkingDelta] = []
        for choice in chunk.choices or []:
            if choice.index not in (0, None):
                continue  # n=1: other choices are not ours
            self.choices = True
            if choice.finish_reason:
                self.finish_reason = choice.finish_reason
            # Some servers end with a choice that has no delta at all.
            delta = cast("ChoiceDelta | None", getattr(choice, "delta", None))
            if delta is None:
                continue
            extra = delta.model_extra or {}
            thinking = next((extra[k] for k in _REASONING_FIELDS if extra.get(k)), None)
            if isinstance(thinking, str):
                self.thinking.append(thinking)
                deltas.append(ThinkingDelta(thinking))
            for piece in (delta.content, delta.refusal):
                if piece:
                    self.text.append(piece)
                    deltas.append(TextDelta(piece))
            for call in delta.tool_calls or []:
                self._add_call(call.index, call.id, call.function)
        return deltas

    def add_completion(self, completion: ChatCompletion) -> list[TextDelta | ThinkingDelta]:
        """Take in a whole answer (not streamed); its thinking and text as one delta each."""
        self._add_usage(completion.usage)
        self.model = completion.model or self.model
        deltas: list[TextDelta | ThinkingDelta] = []
        for choice in completion.choices or []:
            if choice.index not in (0, None):
                continue
            self.choices = True
            # A whole answer is finished even when a server leaves out the reason.
            self.finish_reason = getattr(choice, "finish_reason", None) or "stop"
            message = cast("ChatCompletionMessage | None", getattr(choice, "message", None))
            if message is None:
                continue
            extra = message.model_extra or {}
            thinking = next((extra[k] for k in _REASONING_FIELDS if extra.get(k)), None)
            if isinstance(thinking, str):
                self.thinking.append(thinking)
                deltas.append(ThinkingDelta(thinking))
            for piece in (message.content, message.refusal):
                if piece:
                    self.text.append(piece)
                    deltas.append(TextDelta(piece))
            for index, call in enumerate(message.tool_calls or []):
                self._add_call(index, call.id, getattr(call, "function", None))
        return deltas

    def _add_usage(self, usage: CompletionUsage | None) -> None:
        if usage is not None:
            self.usage = Usage(
                input_tokens=usage.prompt_tokens or 0,
                output_tokens=usage.completion_tokens or 0,
            )

    def _add_call(self, index: int | None, call_id: str | None, function: Any) -> None:
        if not isinstance(index, int):
            # Some servers leave out the index: a new id starts a new call.
            known = {c.call_id for c in self.calls.values()}
            last = max(self.calls, default=-1)
            index = last + 1 if (call_id and call_id not in known) or last < 0 else last
        call = self.calls.setdefault(index, _Call())
        call.call_id = call.call_id or call_id or ""
        name = getattr(function, "name", None)
        if name and name != call.name:
            call.name += name
        arguments = getattr(function, "arguments", None)
        if arguments:
            call.arguments.append(arguments)

    def tool_uses(self) -> list[ToolUseBlock]:
        """The calls, in index order, arguments parsed."""
        uses = []
        for _, call in sorted(self.calls.items()):
            arguments, raw = parse_arguments("".join(call.arguments))
            call_id = call.call_id or f"call_{new_id()[:16]}"
            uses.append(
                ToolUseBlock(id=call_id, name=call.name, input=arguments, raw_arguments=raw)
            )
        return uses
