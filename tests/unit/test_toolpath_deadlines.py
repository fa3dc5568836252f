"""A tool's deadline on the worker's hot path: the timer is armed only once the
tool suspends, yet the deadline counts from the start, and a tool resumed
after its first step gets what it awaited (values, errors, cancellation)."""

from __future__ import annotations

import asyncio
import time

import pytest

from fleetbus.tools_workers import tool


async def test_a_tool_that_returns_at_once_succeeds_under_a_deadline() -> None:
    @tool
    async def instant(x: int) -> int:
        """Returns without awaiting anything."""
        return x * 2

    outcome = await instant.run({"x": 21}, timeout=0.001)
    assert (outcome.status, outcome.content) == ("success", 42)


async def test_the_deadline_counts_from_the_start_not_from_the_first_suspension() -> None:
    @tool
    async def hog() -> str:
        """Blocks the loop past its deadline, then waits."""
        time.sleep(0.3)  # noqa: ASYNC251 - the point: a first step that overruns
        await asyncio.sleep(5)
        return "late"

    started = time.monotonic()
    outcome = await hog.run({}, timeout=0.2)
    elapsed = time.monotonic() - started
    assert outcome.status == "timeout"
    # Counted from the first suspension the deadline would end near 0.5 s.
    assert elapsed < 0.45


async def test_a_resumed_tool_gets_the_values_and_errors_it_awaits() -> None:
    loop = asyncio.get_running_loop()
    value: asyncio.Future[int] = loop.create_future()
    failure: asyncio.Future[int] = loop.create_future()

    @tool
    async def waits() -> dict[str, object]:
        """Awaits a value, a failure, and bare yields."""
        got = await value
        try:
            await failure
        except KeyError as exc:
            error = str(exc)
        for _ in range(3):
            await asyncio.sleep(0)
        return {"value": got, "error": error}

    running = asyncio.create_task(waits.run({}, timeout=5))
    await asyncio.sleep(0)
    value.set_result(7)
    await asyncio.sleep(0)
    failure.set_exception(KeyError("missing"))
    outcome = await running
    assert outcome.status == "success"
    assert outcome.content == {"value": 7, "error": "'missing'"}


async def test_cancelling_a_suspended_tool_reaches_inside_it() -> None:
    cleaned_up = asyncio.Event()

    @tool
    async def patient() -> None:
        """Waits, and cleans up when cancelled."""
        try:
            await asyncio.sleep(5)
        finally:
            cleaned_up.set()

    running = asyncio.create_task(patient.run({}, timeout=10))
    await asyncio.sleep(0.01)
    running.cancel()
    with pytest.raises(asyncio.CancelledError):
        await running
    assert cleaned_up.is_set()


async def test_a_suspended_tool_that_swallows_its_deadline_leaves_the_task_clean() -> None:
    @tool
    async def stubborn() -> str:
        """Returns anyway when its deadline cancels it."""
        try:
            await asyncio.sleep(5)
        except asyncio.CancelledError:
            return "ignored"
        return "slept"

    for _ in range(3):  # the timer armed at the suspension, each time
        outcome = await stubborn.run({}, timeout=0.01)
        assert outcome.content == "ignored"
    current = asyncio.current_task()
    assert current is not None
    assert current.cancelling() == 0
