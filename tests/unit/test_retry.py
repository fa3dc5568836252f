"""The one retry helper (stamina underneath): jittered, growing, capped waits;
retries stop at the attempt limit and at the deadline (a wait is cut at it);
what is not retried passes through at once; stamina's testing mode removes
the waits."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest
import stamina
from stamina.instrumentation import RetryDetails, set_on_retry_hooks

from fleetbus._retry import Retry


class Failing:
    """An async callable that fails every time, with a new exception each time."""

    def __init__(self, exc: type[Exception] = ConnectionError) -> None:
        self.exc = exc
        self.raised: list[Exception] = []

    async def __call__(self) -> str:
        error = self.exc(f"failure {len(self.raised) + 1}")
        self.raised.append(error)
        raise error


@pytest.fixture
def waits() -> Iterator[list[float]]:
    """The wait stamina schedules before each retry, as its hooks see it
    (a difference of running sums: compare with ``approx``)."""
    seen: list[float] = []

    def record(details: RetryDetails) -> None:
        seen.append(details.wait_for)

    set_on_retry_hooks([record])
    try:
        yield seen
    finally:
        set_on_retry_hooks(None)  # back to stamina's defaults


async def test_waits_are_jittered_grow_and_are_capped(waits: list[float]) -> None:
    retry = Retry(on=ConnectionError, attempts=6, backoff=0.001, max_backoff=0.004)
    runs = []
    for _ in range(2):
        waits.clear()
        with pytest.raises(ConnectionError):
            await retry.call(Failing())
        runs.append(list(waits))
    first, second = runs
    assert first != second  # the same policy, different waits: callers do not move in step
    for run in runs:
        assert len(run) == 5  # one wait between each two of the six attempts
        assert 0.001 <= run[0] <= 0.002  # backoff plus up to backoff of jitter
        assert 0.002 <= run[1] <= 0.003
        assert run[0] < run[1] < run[2]
        assert run[2:] == pytest.approx([0.004, 0.004, 0.004])  # capped at max_backoff


async def test_retries_stop_at_the_attempt_limit_with_the_last_failure() -> None:
    failing = Failing()
    with pytest.raises(ConnectionError) as caught:
        await Retry(on=ConnectionError, attempts=3, backoff=0.0).call(failing)
    assert len(failing.raised) == 3
    assert caught.value is failing.raised[-1]


async def test_retries_stop_at_the_deadline() -> None:
    failing = Failing()
    retry = Retry(on=ConnectionError, attempts=None, backoff=0.01, max_backoff=0.01, timeout=0.1)
    started = time.monotonic()
    with pytest.raises(ConnectionError):
        await retry.call(failing)
    elapsed = time.monotonic() - started
    assert 0.1 <= elapsed < 1.0  # no retry scheduled past 0.1 s (one wait may end past it)
    assert 3 <= len(failing.raised) <= 11  # each wait 0.01-0.02 s


async def test_a_deadline_of_zero_means_one_attempt() -> None:
    failing = Failing()
    retry = Retry(on=ConnectionError, attempts=None, backoff=0.0, timeout=0.0)
    with pytest.raises(ConnectionError):
        await retry.call(failing)  # and no warning from stamina (warnings are errors here)
    assert len(failing.raised) == 1


async def test_an_exception_not_retried_passes_through_at_once() -> None:
    failing = Failing(ValueError)
    with pytest.raises(ValueError, match="failure 1"):
        await Retry(on=ConnectionError, attempts=5, backoff=10.0).call(failing)
    assert len(failing.raised) == 1


async def test_a_predicate_decides_and_never_retries_a_cancellation() -> None:
    failing = Failing(ValueError)
    retry = Retry(on=lambda exc: "1" in str(exc), attempts=5, backoff=0.0)
    with pytest.raises(ValueError, match="failure 2"):
        await retry.call(failing)  # retried the first failure, not the second
    assert len(failing.raised) == 2

    calls = 0

    async def cancelled() -> None:
        nonlocal calls
        calls += 1
        raise asyncio.CancelledError

    with pytest.raises(asyncio.CancelledError):
        await Retry(on=lambda exc: True, attempts=5, backoff=10.0).call(cancelled)
    assert calls == 1


async def test_success_ends_the_retries() -> None:
    calls = 0

    async def third_time_lucky(greeting: str, *, name: str) -> str:
        nonlocal calls
        calls += 1
        if calls < 3:
            raise ConnectionError("not yet")
        return f"{greeting}, {name}"

    retry = Retry(on=ConnectionError, attempts=5, backoff=0.0)
    assert await retry.call(third_time_lucky, "hello", name="fleet") == "hello, fleet"
    assert calls == 3


async def test_after_goes_on_from_a_first_attempt_made_by_the_caller() -> None:
    failing = Failing()
    retry = Retry(on=ConnectionError, attempts=3, backoff=0.0)
    started = asyncio.get_running_loop().time()
    try:
        await failing()
    except ConnectionError as first:
        with pytest.raises(ConnectionError) as caught:
            await retry.after(failing, first, started)
    assert len(failing.raised) == 3  # the caller's attempt counts as the first
    assert caught.value is failing.raised[-1]

    # Not retried: the first failure itself, at once.
    other = ValueError("not retried")
    with pytest.raises(ValueError, match="not retried") as caught_other:
        await retry.after(failing, other, started)
    assert caught_other.value is other
    assert len(failing.raised) == 3

    # Its deadline counts from the caller's first attempt.
    timed = Retry(on=ConnectionError, attempts=None, backoff=0.01, timeout=0.05)
    late = asyncio.get_running_loop().time() - 1.0  # that attempt began a second ago
    with pytest.raises(ConnectionError):
        await timed.after(failing, ConnectionError("first"), late)
    assert len(failing.raised) == 3  # past its deadline already: no retry


async def test_a_wait_that_would_end_past_the_deadline_is_cut_short() -> None:
    failing = Failing()
    retry = Retry(on=ConnectionError, attempts=3, backoff=10.0, timeout=0.1)
    started = time.monotonic()
    with pytest.raises(ConnectionError) as caught:
        await retry.call(failing)  # the first wait (10-20 s) would end far past 0.1 s
    assert 0.1 <= time.monotonic() - started < 1.0
    assert len(failing.raised) == 1
    assert caught.value is failing.raised[0]
    assert caught.value.__context__ is None  # not chained to the cut wait's TimeoutError


async def test_stamina_testing_mode_removes_the_waits_and_caps_attempts() -> None:
    failing = Failing()
    retry = Retry(on=ConnectionError, attempts=5, backoff=30.0, max_backoff=60.0)
    started = time.monotonic()
    with stamina.set_testing(True, attempts=2, cap=True), pytest.raises(ConnectionError):
        await retry.call(failing)
    assert time.monotonic() - started < 1.0
    assert len(failing.raised) == 2


def test_a_policy_without_a_limit_or_with_bad_values_is_refused() -> None:
    with pytest.raises(ValueError, match="need a limit"):
        Retry(on=ConnectionError, attempts=None, backoff=0.1)
    with pytest.raises(ValueError, match="at least 1"):
        Retry(on=ConnectionError, attempts=0, backoff=0.1)
    with pytest.raises(ValueError, match="negative"):
        Retry(on=ConnectionError, attempts=2, backoff=-1.0)


_PROGRAM = """
import asyncio, logging, sys
import stamina
from fleetbus._retry import Retry

async def main():
    failures = [OSError("one"), OSError("two")]

    async def flaky():
        if failures:
            raise failures.pop()
        return "ok"

    print(await Retry(on=OSError, attempts=3, backoff=0.001).call(flaky))
    async for attempt in stamina.retry_context(on=OSError, attempts=2, wait_initial=0.001):
        with attempt:
            if attempt.num == 1:
                raise OSError("the program's own")

if sys.argv[1] == "debug":
    logging.basicConfig(level=logging.DEBUG)
asyncio.run(main())
"""


@pytest.mark.parametrize("logging_set_up", ["none", "debug"])
def test_a_program_sees_fleetbus_retries_only_when_it_asks_for_fleetbus_debug_logs(
    logging_set_up: str,
) -> None:
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", _PROGRAM, logging_set_up],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )

    assert done.stdout == "ok\n"
    lines = [line for line in done.stderr.splitlines() if "stamina.retry_scheduled" in line]
    # One line for the program's own retry; with debug logs, the two of fleetbus too.
    assert len(lines) == (1 if logging_set_up == "none" else 3), done.stderr
