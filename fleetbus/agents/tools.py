"""What an agent needs of its tools.

An agent does not import the tool workers package: it takes any object of
the :class:`ToolSource` shape — ``fleetbus.Toolkit`` is one, holding local
functions and tools served on the bus alike.
"""

from __future__ import annotations

from typing import Any, Protocol

from fleetbus.protocol import ErrorDetail, ToolSpec

__all__ = ["ToolOutcomeLike", "ToolSource"]


class ToolOutcomeLike(Protocol):
    """How a tool run ended."""

    @property
    def status(self) -> str: ...

    @property
    def content(self) -> Any: ...

    @property
    def error_detail(self) -> ErrorDetail | None: ...


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
    ) -> ToolOutcomeLike:
        """Run a tool; never raises for what the tool does."""
        ...
