"""The async context manager of objects that are opened and closed."""

from __future__ import annotations

from types import TracebackType
from typing import Self

__all__ = ["Opening"]


class Opening:
    """``async with x:`` opens ``x`` (its ``open()``) and closes it (its
    ``close()``) however the block ends."""

    async def open(self) -> None:
        """Open; the subclass says how."""
        raise NotImplementedError

    async def close(self) -> None:
        """Close; the subclass says how."""
        raise NotImplementedError

    async def __aenter__(self) -> Self:
        await self.open()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()
