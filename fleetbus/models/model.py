"""The model seam: what an agent needs from an LLM.

A :class:`ChatModel` takes a :class:`ModelRequest` (messages, the tools on
offer, a tool choice) and streams :class:`TextDelta` / :class:`ThinkingDelta`
items, ending with the complete :class:`ModelResponse`. Test doubles
(:class:`fleetbus.testing.ScriptedModel`) and real adapters implement the same
protocol.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field

from fleetbus.errors import FleetbusError
from fleetbus.protocol import (
    ChatMessage,
    ContentBlock,
    TextBlock,
    ThinkingBlock,
    ToolSpec,
    ToolUseBlock,
    Usage,
)

__all__ = [
    "FINISH_TOOL",
    "ChatModel",
    "ModelConfig",
    "ModelError",
    "ModelRequest",
    "ModelResponse",
    "ModelStreamItem",
    "TextDelta",
    "ThinkingDelta",
    "complete",
    "supports_required_tool_choice",
]

FINISH_TOOL = "generate_response"
"""The tool a model calls to give a structured answer (offered by the agent
when a reply wants one; adapters that support ``response_format`` use it)."""

FORMAT_ERROR_TOOL = "format_error"
"""The call an adapter makes of a step the model wrote that could be used
neither as a call nor as an answer (``raw_arguments``: the text; ``input``:
``{"error": why}``). No tool runs: the agent answers it with an error result
and the next request shows the model what it wrote, with a reminder."""


class ModelError(FleetbusError):
    """A model call failed (the adapter's error, translated).

    Attributes:
        retryable: whether trying again may help (rate limits, 5xx, timeouts).
    """

    def __init__(self, message: str, *, retryable: bool = True) -> None:
        super().__init__(message)
        self.retryable = retryable


@dataclass(frozen=True, slots=True)
class ModelRequest:
    """One model call.

    Attributes:
        messages: the conversation, system prompt first.
        tools: the tools the model may call.
        tool_choice: ``auto``, ``none``, ``required``, or a tool name.
        options: model options (temperature, max tokens…), adapter-specific.
        session_id: the session the call is made for, if any: a model on the
            bus sends it with the ``llm_prompt``, so the model worker's spans
            and log lines name it.
    """

    messages: list[ChatMessage]
    tools: list[ToolSpec] = field(default_factory=list)
    tool_choice: str | None = None
    options: dict[str, Any] = field(default_factory=dict)
    session_id: str | None = None


@dataclass(frozen=True, slots=True)
class ModelResponse:
    """A model's complete answer.

    Attributes:
        content: text, thinking and tool_use blocks, in the model's order.
        usage: token counts, when the model reports them.
        finish_reason: as the model said (``stop``, ``tool_calls``…).
        model: which model answered.
    """

    content: list[ContentBlock]
    usage: Usage | None = None
    finish_reason: str | None = None
    model: str = ""

    @property
    def text(self) -> str:
        """The text blocks, joined."""
        return "".join(b.text for b in self.content if isinstance(b, TextBlock))

    @property
    def tool_uses(self) -> list[ToolUseBlock]:
        """The tool calls asked for."""
        return [b for b in self.content if isinstance(b, ToolUseBlock)]

    @property
    def thinking(self) -> str:
        """The reasoning text, joined."""
        return "".join(b.thinking for b in self.content if isinstance(b, ThinkingBlock))


@dataclass(frozen=True, slots=True)
class TextDelta:
    """A piece of answer text, while it streams."""

    text: str


@dataclass(frozen=True, slots=True)
class ThinkingDelta:
    """A piece of reasoning text, while it streams."""

    thinking: str


ModelStreamItem = TextDelta | ThinkingDelta | ModelResponse
"""What a model streams; the last item is the :class:`ModelResponse`."""


@runtime_checkable
class ChatModel(Protocol):
    """An LLM, as an agent uses it.

    ``stream`` yields deltas as the answer is produced and ends with exactly
    one :class:`ModelResponse` holding the whole answer. It raises
    :class:`ModelError` (or ``TimeoutError``/``ConnectionError``) when the
    call fails.

    A model may also have a ``supports_required_tool_choice`` attribute
    (``True``: it honours ``tool_choice="required"``, a call of some tool
    forced). Without it (or ``False``) the agent never asks for ``required``:
    it asks for ``auto`` and reminds the model in words (see
    :func:`supports_required_tool_choice`).
    """

    @property
    def name(self) -> str:
        """The model's name, for logs and usage records."""
        ...

    def stream(self, request: ModelRequest) -> AsyncIterator[ModelStreamItem]:
        """Run the call, streaming."""
        ...


def supports_required_tool_choice(model: ChatModel) -> bool:
    """Whether ``model`` declares it honours ``tool_choice="required"``
    (``False`` for a model that does not say)."""
    return getattr(model, "supports_required_tool_choice", False) is True


async def complete(model: ChatModel, request: ModelRequest) -> ModelResponse:
    """Run a model call to the end and return its response.

    Raises:
        ModelError: the model failed, or its stream ended without a response.
    """
    final: ModelResponse | None = None
    async for item in model.stream(request):
        if isinstance(item, ModelResponse):
            final = item
    if final is None:
        raise ModelError(f"model {model.name} ended its stream without a response")
    return final


class ModelConfig(BaseModel):
    """How an agent calls its model: retries, backoff, deadline, fallback.

    A failed call is retried ``max_retries`` times with exponential backoff
    (``backoff`` doubling up to ``max_backoff`` seconds); then the
    ``fallback`` model gets the same treatment; then the reply ends with
    ``finished_reason="error"``.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True, frozen=True)

    max_retries: int = Field(default=2, ge=0)
    backoff: float = Field(default=0.5, ge=0)
    max_backoff: float = Field(default=8.0, ge=0)
    timeout: float = Field(default=120.0, gt=0)
    """Seconds one model call may take."""
    fallback: ChatModel | None = None
    options: dict[str, Any] = Field(default_factory=dict)
    """Passed to every call as ``ModelRequest.options``."""
