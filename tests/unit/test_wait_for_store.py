"""``wait_for_store``, the one way the agent host, the commands and the
dashboard ride out a session store that fails for a while (a cluster
electing a stream's new leader): transient failures are retried within the
bound and reported once; others pass through at once."""

from __future__ import annotations

import time

import pytest

from fleetbus.bus.store import transient, wait_for_store
from fleetbus.errors import ConnectionClosedError, KeyNotFoundError, StoreError


class Store:
    """Fails with ``failures`` (in turn), then answers ``"records"``."""

    def __init__(self, *failures: Exception) -> None:
        self.failures = list(failures)
        self.calls = 0

    async def __call__(self) -> str:
        self.calls += 1
        if self.failures:
            raise self.failures.pop(0)
        return "records"


def test_only_a_store_error_marked_transient_is_transient() -> None:
    assert transient(StoreError("no leader", transient=True))
    assert not transient(StoreError("bucket missing"))
    assert not transient(KeyNotFoundError("no key"))
    assert not transient(ConnectionClosedError("closed"))
    assert not transient(TimeoutError())


async def test_transient_failures_are_waited_out_and_said_once() -> None:
    store = Store(*(StoreError(f"timeout {i}", transient=True) for i in range(3)))
    said: list[StoreError] = []
    assert await wait_for_store(store, timeout=30, waiting=said.append) == "records"
    assert store.calls == 4
    assert [str(e) for e in said] == ["timeout 0"]


async def test_a_failure_that_does_not_pass_is_raised_at_once() -> None:
    store = Store(StoreError("the bucket does not exist"))
    said: list[StoreError] = []
    with pytest.raises(StoreError, match="does not exist"):
        await wait_for_store(store, timeout=30, waiting=said.append)
    assert store.calls == 1
    assert said == []


async def test_the_wait_is_bounded() -> None:
    store = Store(*(StoreError("no leader", transient=True) for _ in range(1000)))
    started = time.monotonic()
    with pytest.raises(StoreError, match="no leader"):
        await wait_for_store(store, timeout=0.5)
    assert time.monotonic() - started < 5
    assert 1 < store.calls < 1000
    store = Store(StoreError("no leader", transient=True))
    with pytest.raises(StoreError):
        await wait_for_store(store, timeout=0)  # no retry
    assert store.calls == 1
