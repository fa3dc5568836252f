"""``within``: ``asyncio.timeout`` with one timer for every block of a loop.

The same outcomes as ``asyncio.timeout``: a block past its deadline is
cancelled and raises ``TimeoutError``, the task's cancel count as it was; a
cancel from elsewhere goes on as a cancel; a block that ended is never
cancelled later; blocks of different lengths each end at their own
deadline."""

from __future__ import annotations

import asyncio

import pytest

from fleetbus import _deadlines
from fleetbus._deadlines import later, within


async def test_a_block_that_ends_in_time_is_left_alone() -> None:
    async with within(5) as block:
        await asyncio.sleep(0)
    assert block.done
    assert not block.expired
    await asyncio.sleep(0.05)  # nothing fires later into the task
    assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]


async def test_a_block_past_its_deadline_raises_timeout_error() -> None:
    loop = asyncio.get_running_loop()
    started = loop.time()
    block = within(0.05)
    with pytest.raises(TimeoutError):
        async with block:
            await asyncio.sleep(10)
    assert block.expired
    assert loop.time() - started < 5
    assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]
    await asyncio.sleep(0)  # the task is not cancelled any more


async def test_its_own_timeout_error_is_not_the_deadline() -> None:
    block = within(5)
    with pytest.raises(TimeoutError):
        async with block:
            raise TimeoutError("the model's own")
    assert not block.expired


async def test_a_cancel_from_elsewhere_stays_a_cancel() -> None:
    entered = asyncio.Event()

    async def work() -> None:
        async with within(5):
            entered.set()
            await asyncio.sleep(10)

    task = asyncio.create_task(work())
    await entered.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_a_cancel_from_elsewhere_as_the_deadline_comes_stays_a_cancel() -> None:
    async def work() -> None:
        async with within(0.05):
            try:
                await asyncio.sleep(10)
            finally:
                current = asyncio.current_task()
                assert current is not None
                current.cancel()  # a cancel of its own, beside the deadline's
                await asyncio.sleep(0)

    task = asyncio.create_task(work())
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_blocks_end_at_their_own_deadlines_with_one_timer() -> None:
    loop = asyncio.get_running_loop()
    ended: dict[str, float] = {}

    async def hold(name: str, limit: float) -> None:
        started = loop.time()
        try:
            async with within(limit):
                await asyncio.sleep(10)
        except TimeoutError:
            ended[name] = loop.time() - started

    async with asyncio.timeout(10):
        # The long one first: the short one, added later, moves the timer earlier.
        await asyncio.gather(hold("long", 0.3), hold("short", 0.05), hold("middle", 0.15))
    assert set(ended) == {"long", "short", "middle"}
    assert ended["short"] < ended["middle"] < ended["long"]
    assert ended["short"] >= 0.05 - 0.002  # (uvloop's clock: whole milliseconds)


async def test_blocks_that_ended_leave_the_heap_bounded() -> None:
    for _ in range(1_000):
        async with within(60):
            pass
    deadlines = _deadlines._OF_LOOP[asyncio.get_running_loop()]
    assert deadlines.live == 0
    assert len(deadlines._heap) <= 64 + 1


def test_each_loop_has_its_own_timer() -> None:
    async def late() -> bool:
        try:
            async with within(0.02):
                await asyncio.sleep(5)
        except TimeoutError:
            return True
        return False

    assert asyncio.run(late())
    assert asyncio.run(late())  # a new loop: the closed one's timer is not used
    # A closed loop's deadlines are dropped when a new loop makes its own.
    assert sum(loop.is_closed() for loop in _deadlines._OF_LOOP) == 1


async def test_a_later_call_is_made_at_its_time_unless_cancelled() -> None:
    loop = asyncio.get_running_loop()
    made: list[str] = []
    both = asyncio.Event()
    started = loop.time()

    def make(name: str) -> None:
        made.append(name)
        if len(made) == 2:
            both.set()

    later(0.1, lambda: make("second"))
    cancelled = later(0.02, lambda: make("cancelled"))
    later(0.05, lambda: make("first"))
    cancelled.cancel()
    async with asyncio.timeout(10):
        await both.wait()
    assert made == ["first", "second"]
    assert loop.time() - started >= 0.1 - 0.002
    await asyncio.sleep(0.05)
    assert made == ["first", "second"]  # the cancelled one never comes


async def test_a_later_call_that_raises_is_reported_and_the_others_run() -> None:
    loop = asyncio.get_running_loop()
    reported: list[dict[str, object]] = []
    loop.set_exception_handler(lambda _, context: reported.append(context))
    ran = asyncio.Event()

    def fail() -> None:
        raise RuntimeError("broken")

    later(0.01, fail)
    later(0.02, ran.set)
    try:
        async with asyncio.timeout(10):
            await ran.wait()
    finally:
        loop.set_exception_handler(None)
    assert isinstance(reported[0]["exception"], RuntimeError)
