"""Content blocks: the parts of an LLM turn, an agent message, or memory.

Blocks are tagged on ``type`` like messages, so a list of them decodes to the
right classes.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

__all__ = [
    "ContentBlock",
    "DataBlock",
    "TextBlock",
    "ThinkingBlock",
    "ToolResultBlock",
    "ToolUseBlock",
]


class _Block(msgspec.Struct, frozen=True, kw_only=True, tag_field="type"):
    """Base of the content blocks."""


class TextBlock(_Block, frozen=True, kw_only=True, tag="text"):
    """Plain text."""

    text: str
    """The text."""


class ThinkingBlock(_Block, frozen=True, kw_only=True, tag="thinking"):
    """The model's reasoning, where the model shows it."""

    thinking: str
    """The reasoning text."""


class ToolUseBlock(_Block, frozen=True, kw_only=True, tag="tool_use"):
    """A tool call the model asked for."""

    id: str
    """The call's id; its ``tool_result`` block carries the same one."""
    name: str
    """The tool's name."""
    input: dict[str, Any]
    """The arguments, as a JSON object."""
    raw_arguments: str | None = None
    """The arguments exactly as the model wrote them, when they were not a JSON
    object (``input`` is then empty): the agent shows the model the parse error."""


class ToolResultBlock(_Block, frozen=True, kw_only=True, tag="tool_result"):
    """The outcome of a tool call, as the model will see it."""

    id: str
    """The id of the ``tool_use`` block this answers."""
    name: str
    """The tool's name."""
    output: Any
    """What the tool returned (JSON), or the error text."""
    state: Literal["success", "error", "timeout", "denied", "cancelled"] = "success"
    """How the call ended; the same values as ``tool_result.status``."""


class DataBlock(_Block, frozen=True, kw_only=True, tag="data"):
    """Data by reference: an image, a file, an offloaded tool result."""

    url: str
    """Where to read it: ``https://…``, ``data:…`` or ``nats-object://bucket/name``."""
    media_type: str = "application/octet-stream"
    """Its MIME type."""
    name: str | None = None
    """A display name."""
    size: int | None = None
    """Its size in bytes, when known."""


ContentBlock = TextBlock | ThinkingBlock | ToolUseBlock | ToolResultBlock | DataBlock
"""Any content block."""
