"""What an agent needs of its tools.

An agent does not import the tool workers package: it takes any object of
the :class:`ToolSource` shape — ``fleetbus.Toolkit`` is one, holding local
functions and tools served on the bus alike.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Collection
from typing import Any, Protocol

import pydantic

from fleetbus.protocol import ToolResult, ToolSpec

__all__ = [
    "StreamingToolSource",
    "SwitchableToolSource",
    "ToolSource",
    "error_text",
    "streaming",
    "switchable",
]


class ToolSource(Protocol):
    """Tools an agent may offer its model and run."""

    @property
    def names(self) -> list[str]:
        """Every tool's name."""
        ...

    def __contains__(self, name: object) -> bool: ...

    def specs(self, *groups: str) -> list[ToolSpec]:
        """The tools as offered to a model."""
        ...

    def is_concurrency_safe(self, name: str) -> bool:
        """Whether calls of the tool may run in parallel."""
        ...

    def is_external(self, name: str) -> bool:
        """Whether the tool runs outside the agent (the reply pauses for it)."""
        ...

    async def run(
        self,
        name: str,
        parameters: Any,
        *,
        timeout: float | None = None,
        call_id: str | None = None,
        session_id: str | None = None,
    ) -> ToolResult:
        """Run a tool and say how it ended, as a ``tool_result`` (the agent
        reads its ``status``, ``content`` and ``error_detail``); never raises
        for what the tool does."""
        ...


class SwitchableToolSource(ToolSource, Protocol):
    """A :class:`ToolSource` whose groups the model switches on and off
    (``fleetbus.Toolkit`` is one): what the agent needs besides to offer only
    the active groups' tools and the ``switch_tool_groups`` meta-tool."""

    @property
    def group_descriptions(self) -> dict[str, str]:
        """The switchable groups with their descriptions (empty: none)."""
        ...

    @property
    def active_groups(self) -> list[str]:
        """The switchable groups active at the start of a session."""
        ...

    def group_of(self, name: str) -> str | None:
        """The group of the tool ``name`` (``None``: no such tool)."""
        ...

    def active_specs(self, active: Collection[str]) -> list[ToolSpec]:
        """The tools offered when the switchable groups in ``active`` are on."""
        ...


def switchable(tools: ToolSource | None) -> SwitchableToolSource | None:
    """``tools`` if it has groups the model may switch, else ``None``.

    A source without the :class:`SwitchableToolSource` methods (an older or
    hand-written one) has none: every tool is offered.
    """
    if tools is None or not getattr(tools, "group_descriptions", None):
        return None
    return tools  # type: ignore[return-value]  # checked above, as far as a Protocol can be


class StreamingToolSource(ToolSource, Protocol):
    """A :class:`ToolSource` with tools that yield their results in chunks
    (``fleetbus.Toolkit`` is one): the agent streams each chunk as a
    ``tool_result_delta`` event."""

    def is_streaming(self, name: str) -> bool:
        """Whether the tool ``name`` yields its result in chunks."""
        ...

    async def run(
        self,
        name: str,
        parameters: Any,
        *,
        timeout: float | None = None,
        call_id: str | None = None,
        session_id: str | None = None,
        on_chunk: Callable[[Any], Awaitable[None]] | None = None,
    ) -> ToolResult:
        """Run a tool, each chunk of a streaming one to ``on_chunk``."""
        ...


def streaming(tools: ToolSource, name: str) -> StreamingToolSource | None:
    """``tools`` if its tool ``name`` streams its result, else ``None``."""
    is_streaming = getattr(tools, "is_streaming", None)
    if is_streaming is None or not is_streaming(name):
        return None
    return tools  # type: ignore[return-value]  # checked above, as far as a Protocol can be


def error_text(exc: BaseException) -> str:
    """An exception as the model is told it: each field of a validation error
    with its message (``limit: Input should be a valid integer``), else the
    exception's text (its type's name when it has none)."""
    if isinstance(exc, pydantic.ValidationError):
        return "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or 'arguments'}: {err['msg']}"
            for err in exc.errors(include_url=False)
        )
    return str(exc) or type(exc).__name__
