"""The no-op tool served by ``fleetbus worker`` in ``bench/tracing.py``,
tracing as ``BENCH_TRACE`` says (``bench/_traced.py``)."""

from __future__ import annotations

import importlib

from fleetbus.tools_workers import Toolkit, tool

importlib.import_module("bench._traced")  # tracing as BENCH_TRACE says, before any request


@tool
async def noop() -> None:
    """Do nothing."""


toolkit = Toolkit([noop])
