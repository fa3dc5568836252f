"""The tools ``bench/seam.py`` serves with ``fleetbus worker``: a no-op and
one that takes a millisecond."""

from __future__ import annotations

import asyncio

from fleetbus.tools_workers import Toolkit, tool


@tool
async def noop() -> None:
    """Do nothing."""


@tool
async def one_ms() -> None:
    """Wait a millisecond."""
    await asyncio.sleep(0.001)


toolkit = Toolkit([noop, one_ms])
