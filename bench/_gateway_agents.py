"""The agents ``bench/gateway.py`` serves, with ``fleetbus agent
bench._gateway_agents:agents``:

- ``quick`` answers a short text at once (no tool, one model step);
- ``slow`` waits ``GATEWAY_BENCH_SLOW`` seconds (default 2), then writes its
  answer in ``GATEWAY_BENCH_CHUNKS`` pieces (default 4), each a
  ``text_delta`` event of the reply.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator

from fleetbus.agents import Agent
from fleetbus.models.model import ModelRequest, ModelResponse, ModelStreamItem, TextDelta
from fleetbus.protocol import TextBlock, Usage

QUICK_ANSWER = "Hello from the fleet."


class Quick:
    """Answers :data:`QUICK_ANSWER` at once."""

    name = "quick"

    async def stream(self, request: ModelRequest) -> AsyncIterator[ModelStreamItem]:
        yield ModelResponse(
            [TextBlock(text=QUICK_ANSWER)],
            model=self.name,
            usage=Usage(input_tokens=1, output_tokens=1),
        )


class Slow:
    """Waits ``delay`` seconds, then streams ``chunks`` pieces of text."""

    name = "slow"

    def __init__(self, delay: float, chunks: int) -> None:
        self.delay = delay
        self.chunks = chunks

    async def stream(self, request: ModelRequest) -> AsyncIterator[ModelStreamItem]:
        await asyncio.sleep(self.delay)
        pieces = [f"piece {n} " for n in range(self.chunks)]
        for piece in pieces:
            yield TextDelta(piece)
            await asyncio.sleep(0)  # each piece its own event, as a real model's arrive
        yield ModelResponse(
            [TextBlock(text="".join(pieces))],
            model=self.name,
            usage=Usage(input_tokens=1, output_tokens=self.chunks),
        )


def agents() -> list[Agent]:
    """``quick`` and ``slow``."""
    delay = float(os.environ.get("GATEWAY_BENCH_SLOW", "2"))
    chunks = int(os.environ.get("GATEWAY_BENCH_CHUNKS", "4"))
    return [
        Agent("quick", "You answer at once.", Quick(), description="Answers at once."),
        Agent("slow", "You take your time.", Slow(delay, chunks), description="Answers slowly."),
    ]
