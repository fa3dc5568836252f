"""The tools served by ``fleetbus worker`` in ``bench/tracing.py``, tracing
as ``BENCH_TRACE`` says (``bench/_traced.py``): ``noop`` does nothing;
``work`` does about a millisecond of CPU (JSON round trips and a hash, as a
sync tool, run in a thread as fleetbus runs one); ``wait`` awaits 5 ms, as a
tool waiting on I/O does."""

from __future__ import annotations

import asyncio
import hashlib
import importlib
import json

from fleetbus.tools_workers import Toolkit, tool

importlib.import_module("bench._traced")  # tracing as BENCH_TRACE says, before any request

_DOCUMENT = [
    {"id": i, "name": f"item {i}", "tags": ["a", "b", "c"], "score": i * 0.5, "ok": i % 2 == 0}
    for i in range(100)
]
_ROUND_TRIPS = 7
"""JSON round trips of the document a ``work`` call makes: about 1 ms of CPU."""


@tool
async def noop() -> None:
    """Do nothing."""


@tool
def work() -> str:
    """Encode and decode a JSON document a few times, and hash it."""
    text = ""
    for _ in range(_ROUND_TRIPS):
        text = json.dumps(_DOCUMENT)
        json.loads(text)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@tool
async def wait() -> None:
    """Wait 5 ms, as a tool waiting on I/O does."""
    await asyncio.sleep(0.005)


toolkit = Toolkit([noop, work, wait])
