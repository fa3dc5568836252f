"""Parallel tool calls: concurrency-safe calls of a step run at once, others in turn."""

from __future__ import annotations

import asyncio

import pytest

from fleetbus import Agent, Toolkit, tool
from fleetbus.agents import AgentSettings
from fleetbus.protocol import Event
from fleetbus.testing import ScriptedModel

from ._support import unanswered

BOTH = ScriptedModel.calls(("left", {}, "L"), ("right", {}, "R"))


def _barrier_kit() -> Toolkit:
    """Two tools that can only both finish when they run at the same time."""
    left_in, right_in = asyncio.Event(), asyncio.Event()

    async def meet(mine: asyncio.Event, other: asyncio.Event, name: str) -> str:
        mine.set()
        try:
            # The deadline only keeps a broken agent from hanging the test.
            await asyncio.wait_for(other.wait(), timeout=10)
        except TimeoutError:
            return f"{name} waited alone"
        return f"{name} met the other"

    @tool
    async def left() -> str:
        """Wait for right."""
        return await meet(left_in, right_in, "left")

    @tool
    async def right() -> str:
        """Wait for left."""
        return await meet(right_in, left_in, "right")

    return Toolkit([left, right])


def _ordered_kit(order: list[str], *, right_safe: bool = True) -> Toolkit:
    """Two tools that record when they start and end, yielding in between."""

    @tool
    async def left() -> str:
        """Record left."""
        order.append("left>")
        await asyncio.sleep(0)
        order.append("left<")
        return "left done"

    @tool(concurrency_safe=right_safe)
    async def right() -> str:
        """Record right."""
        order.append("right>")
        await asyncio.sleep(0)
        order.append("right<")
        return "right done"

    return Toolkit([left, right])


async def test_parallel_calls_run_at_once_and_are_recorded_in_the_models_order() -> None:
    model = ScriptedModel([BOTH, "Both met."])
    agent = Agent(
        "a",
        "You wait.",
        model,
        toolkit=_barrier_kit(),
        settings=AgentSettings(parallel_tool_calls=True),
    )

    items = [item async for item in agent.reply_stream("Meet")]

    results = [(r.id, r.output) for m in agent.memory for r in m.tool_results]
    # right finishes first (left is already waiting), yet left's result comes first.
    assert results == [("L", "left met the other"), ("R", "right met the other")]
    reported = [
        e.data["call_id"] for e in items if isinstance(e, Event) and e.event == "tool_result"
    ]
    assert reported == ["L", "R"]
    assert unanswered(agent.memory) == []


async def test_calls_interleave_when_run_in_parallel() -> None:
    order: list[str] = []
    model = ScriptedModel([BOTH, "Done."])
    agent = Agent(
        "a",
        "You record.",
        model,
        toolkit=_ordered_kit(order),
        settings=AgentSettings(parallel_tool_calls=True),
    )

    await agent.reply("Record")

    assert order == ["left>", "right>", "left<", "right<"]


@pytest.mark.parametrize(
    ("parallel", "right_safe"),
    [
        pytest.param(False, True, id="parallel-off"),
        pytest.param(True, False, id="one-tool-not-concurrency-safe"),
    ],
)
async def test_calls_run_one_after_the_other_unless_all_may_run_in_parallel(
    parallel: bool, right_safe: bool
) -> None:
    order: list[str] = []
    model = ScriptedModel([BOTH, "Done."])
    agent = Agent(
        "a",
        "You record.",
        model,
        toolkit=_ordered_kit(order, right_safe=right_safe),
        settings=AgentSettings(parallel_tool_calls=parallel),
    )

    answer = await agent.reply("Record")

    assert answer.finished_reason == "completed"
    assert order == ["left>", "left<", "right>", "right<"]
    results = [(r.id, r.output) for m in agent.memory for r in m.tool_results]
    assert results == [("L", "left done"), ("R", "right done")]


async def test_results_follow_the_models_order_not_the_toolkits() -> None:
    order: list[str] = []
    model = ScriptedModel([ScriptedModel.calls(("right", {}, "R"), ("left", {}, "L")), "Done."])
    agent = Agent(
        "a",
        "You record.",
        model,
        toolkit=_ordered_kit(order),
        settings=AgentSettings(parallel_tool_calls=True),
    )

    await agent.reply("Record")

    assert order == ["right>", "left>", "right<", "left<"]
    assert [r.id for m in agent.memory for r in m.tool_results] == ["R", "L"]
    sent = model.requests[1].messages
    assert [m.role for m in sent[-2:]] == ["tool", "tool"]
