"""Deadlines of many blocks and calls on one event loop, served by one timer.

``async with within(seconds):`` is ``async with asyncio.timeout(seconds):``
— the block's task is cancelled at the deadline and the block raises
``TimeoutError`` — for code that runs it for most of its awaits: a model
call of every reasoning step. ``asyncio.timeout`` arms a timer of the loop
for each block and cancels it at the block's end (with uvloop, a libuv
timer made, started, stopped and closed): a reply's two model calls spent
4 % of a fresh agent's reply on it, and 1.3 % of a population host's
(instructions counted by callgrind; ``bench/sim_host_instructions.py``).
Here the blocks of a loop share one timer, armed at the earliest deadline
and moved only when an earlier one comes; a block notes its deadline in a
heap, and whether it is over. ``later(seconds, callback)`` is
``loop.call_later`` on the same timer, for a call that is most often
cancelled before its time (a lease's first renewal, due a third of its TTL
after a reply starts, which most replies end before).

The bus's reply inbox (``fleetbus.bus._replies``) keeps a heap of its own,
of (deadline, token) pairs: a request there makes no object nor callback
and cancels nothing, its entry skipped once its token no longer waits. On
this module instead, a population host's reply took 1.0-1.5 % more
instructions (callgrind, ``bench/sim_host_instructions.py``).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
from collections.abc import Callable
from types import TracebackType

__all__ = ["Later", "Within", "later", "within"]


def within(delay: float) -> Within:
    """A block that must end within ``delay`` seconds (see the module)."""
    return Within(delay)


class Within:
    """One block under a deadline: ``async with``, once."""

    __slots__ = ("_cancelling", "_deadlines", "_delay", "_task", "done", "expired")

    def __init__(self, delay: float) -> None:
        self._delay = delay
        self._task: asyncio.Task[object] | None = None
        self._deadlines: _Deadlines | None = None
        self._cancelling = 0
        self.expired = False
        """The deadline came while the block ran: it cancelled the task."""
        self.done = False

    async def __aenter__(self) -> Within:
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("a deadline must be used inside a task")
        self._task = task
        self._cancelling = task.cancelling()
        loop = task.get_loop()
        deadlines = self._deadlines = _OF_LOOP.get(loop) or _deadlines_of(loop)
        deadlines.add(loop.time() + self._delay, self)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        task, deadlines = self._task, self._deadlines
        assert task is not None
        assert deadlines is not None
        self.done = True
        self._task = None  # (its entry may stay in the heap a while)
        deadlines.live -= 1
        # As asyncio.timeout: the cancel the deadline made is taken back; a
        # cancel from elsewhere meanwhile goes on as it is.
        if (
            self.expired
            and task.uncancel() <= self._cancelling
            and exc_type is not None
            and issubclass(exc_type, asyncio.CancelledError)
        ):
            raise TimeoutError from exc

    def _expire(self) -> None:
        if self._task is not None and not self.expired:
            self.expired = True
            self._task.cancel()


def later(delay: float, callback: Callable[[], object]) -> Later:
    """``callback()`` called from the running loop in ``delay`` seconds,
    unless :meth:`Later.cancel` comes first (see the module)."""
    loop = asyncio.get_running_loop()
    deadlines = _OF_LOOP.get(loop) or _deadlines_of(loop)
    call = Later(deadlines, callback)
    deadlines.add(loop.time() + delay, call)
    return call


class Later:
    """A call to make at a deadline (:func:`later`)."""

    __slots__ = ("_callback", "_deadlines", "done")

    def __init__(self, deadlines: _Deadlines, callback: Callable[[], object]) -> None:
        self._deadlines = deadlines
        self._callback: Callable[[], object] | None = callback
        self.done = False

    def cancel(self) -> None:
        """Do not make the call (nothing if it was made)."""
        if not self.done:
            self.done = True
            self._callback = None
            self._deadlines.live -= 1

    def _expire(self) -> None:
        callback = self._callback
        self.cancel()
        if callback is None:
            return
        try:
            callback()
        except Exception as exc:  # as the loop reports a timer's failure; the others still run
            self._deadlines.loop.call_exception_handler(
                {"message": f"exception in the deferred call {callback!r}", "exception": exc}
            )


class _Deadlines:
    """The deadlines of one loop's blocks: a heap, some of it blocks over
    (taken out when the timer finds them, or when they are most of it)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._heap: list[tuple[float, int, Within | Later]] = []
        self._order = itertools.count()
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = math.inf
        self.live = 0
        """Blocks entered and not left, calls neither made nor cancelled."""

    def add(self, deadline: float, block: Within | Later) -> None:
        heap = self._heap
        heapq.heappush(heap, (deadline, next(self._order), block))
        self.live += 1
        if len(heap) > 2 * self.live + 64:
            heap[:] = [entry for entry in heap if not entry[2].done]
            heapq.heapify(heap)
        if deadline < self._timer_at:
            self._arm(deadline)

    def _arm(self, when: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self.loop.call_at(when, self._fire)
        self._timer_at = when

    def _fire(self) -> None:
        """Expire the blocks, make the calls, whose deadline came; arm for
        the next one."""
        self._timer = None
        self._timer_at = math.inf
        now = self.loop.time()
        heap = self._heap
        while heap:
            deadline, _, block = heap[0]
            if not block.done:
                if deadline > now:
                    # uvloop keeps time in whole milliseconds and may fire up
                    # to half of one early: not again before the next one.
                    self._arm(max(deadline, now + 0.001))
                    return
                block._expire()
            heapq.heappop(heap)


_OF_LOOP: dict[asyncio.AbstractEventLoop, _Deadlines] = {}
"""The deadlines of each loop that has blocks (closed loops are dropped
when a new loop comes)."""


def _deadlines_of(loop: asyncio.AbstractEventLoop) -> _Deadlines:
    for old in list(_OF_LOOP):  # (a copy: other threads run loops of their own)
        if old.is_closed():
            _OF_LOOP.pop(old, None)
    deadlines = _OF_LOOP[loop] = _Deadlines(loop)
    return deadlines
