"""The no-op tool the benchmarks serve with ``fleetbus worker``."""

from __future__ import annotations

from fleetbus.tools_workers import Toolkit, tool


@tool
async def noop() -> None:
    """Do nothing."""


toolkit = Toolkit([noop])
