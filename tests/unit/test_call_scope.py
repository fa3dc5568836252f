"""CallScope: when the tool calls made in it are abandoned (left running)
rather than cancelled on the workers. The calls themselves, over a real
server: ``tests/integration/test_session_loss_calls.py``."""

from __future__ import annotations

import asyncio

from fleetbus.bus import CallScope


async def test_a_scope_is_abandoned_only_once_told_so() -> None:
    scope = CallScope()
    assert not scope.abandoned
    scope.abandon()
    assert scope.abandoned


async def test_tasks_started_in_a_scope_are_in_it_and_it_ends_with_the_block() -> None:
    assert CallScope.current() is None
    with CallScope() as scope:
        assert CallScope.current() is scope

        async def which() -> CallScope | None:
            return CallScope.current()

        async with asyncio.TaskGroup() as tg:
            inner = tg.create_task(which())
    assert inner.result() is scope
    assert CallScope.current() is None


async def test_a_call_cut_short_by_its_owner_being_cancelled_is_abandoned() -> None:
    # The owner (a host's reply) cancelled from outside: its calls, cancelled
    # in turn, see the scope abandoned. The agent interrupting its own reply
    # task (a user's cancel) does not cancel the owner: not abandoned.
    seen: list[bool] = []
    started = asyncio.Event()

    async def call() -> None:
        try:
            started.set()
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            scope = CallScope.current()
            assert scope is not None
            seen.append(scope.abandoned)
            raise

    async def owner(interrupt: bool) -> None:
        with CallScope(asyncio.current_task()):
            reply = asyncio.create_task(call())
            try:
                await started.wait()
                if interrupt:
                    reply.cancel()
                await asyncio.wait({reply})
            finally:  # cancelled: stop the reply (as a host's reply stream does)
                reply.cancel()
                await asyncio.wait({reply})

    cancelled = asyncio.create_task(owner(interrupt=False))
    await started.wait()
    cancelled.cancel()
    await asyncio.wait({cancelled})
    started.clear()
    await owner(interrupt=True)
    assert seen == [True, False]
