"""The agent ``bench/tracing.py`` serves with ``fleetbus agent``: each
reply asks a model that takes 50 ms (``BENCH_MODEL_DELAY``) a call, calls
the no-op tool a worker serves, and answers after a second model call;
tracing as ``BENCH_TRACE`` says (:mod:`bench._traced`)."""

from __future__ import annotations

import asyncio
import importlib
import os
from collections.abc import AsyncIterator

from fleetbus.agents import Agent
from fleetbus.models.model import ModelRequest, ModelResponse, ModelStreamItem
from fleetbus.testing import ScriptedModel

importlib.import_module("bench._traced")  # tracing as BENCH_TRACE says, before any request

DELAY = float(os.environ.get("BENCH_MODEL_DELAY", "0.05"))


def _turn(request: ModelRequest) -> ModelResponse:
    if request.messages and request.messages[-1].role == "tool":
        return ScriptedModel.text("done")
    return ScriptedModel.call("noop", {})


class SlowModel(ScriptedModel):
    """A scripted model whose every call takes :data:`DELAY` seconds first."""

    async def stream(self, request: ModelRequest) -> AsyncIterator[ModelStreamItem]:
        await asyncio.sleep(DELAY)
        async for item in super().stream(request):
            yield item
        self.requests.clear()  # a long run keeps nothing


def agents() -> list[Agent]:
    """The one agent of the benchmark."""
    model = SlowModel([_turn], name="slow", repeat_last=True)
    return [Agent("replier", "You call noop, then answer.", model)]
