"""A host's per-session locks: one holder a session at a time, sessions
apart, and a session's lock forgotten once nobody holds or waits for it
(a cancelled wait included)."""

from __future__ import annotations

import asyncio

import pytest

from fleetbus.agents.serving._replies import SessionLocks


async def test_one_holder_a_session_and_none_kept_after() -> None:
    locks = SessionLocks()
    order: list[str] = []
    first_in = asyncio.Event()
    release = asyncio.Event()

    async def hold(who: str, key: str) -> None:
        async with locks(key):
            order.append(f"{who} in")
            if who == "first":
                first_in.set()
                await release.wait()
            order.append(f"{who} out")

    first = asyncio.create_task(hold("first", "a.s"))
    await first_in.wait()
    second = asyncio.create_task(hold("second", "a.s"))
    other = asyncio.create_task(hold("other", "a.t"))
    await other  # another session is not held up
    await asyncio.sleep(0)
    assert order == ["first in", "other in", "other out"]
    assert len(locks) == 1  # a.s: held, and waited for

    release.set()
    await asyncio.gather(first, second)
    assert order[3:] == ["first out", "second in", "second out"]
    assert len(locks) == 0


async def test_a_cancelled_wait_leaves_nothing_behind() -> None:
    locks = SessionLocks()
    entered = asyncio.Event()
    release = asyncio.Event()

    async def holder() -> None:
        async with locks("a.s"):
            entered.set()
            await release.wait()

    async def waiter() -> None:
        async with locks("a.s"):
            raise AssertionError("never entered")

    held = asyncio.create_task(holder())
    await entered.wait()
    waiting = asyncio.create_task(waiter())
    await asyncio.sleep(0)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    release.set()
    await held
    assert len(locks) == 0

    async with locks("a.s"):  # free again
        assert len(locks) == 1
    assert len(locks) == 0


async def test_an_error_inside_releases_the_session() -> None:
    locks = SessionLocks()
    with pytest.raises(RuntimeError):
        async with locks("a.s"):
            raise RuntimeError("the reply failed")
    assert len(locks) == 0
    async with asyncio.timeout(5):
        async with locks("a.s"):
            pass
