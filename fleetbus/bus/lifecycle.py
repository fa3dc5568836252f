"""What every serving process shares: a stop signal and a readiness signal."""

from __future__ import annotations

import asyncio

__all__ = ["Lifecycle"]


class Lifecycle:
    """Stop and readiness for a class whose ``run()`` serves until stopped.

    ``run()`` passes ``self._stop`` to its serving loops and calls
    :meth:`_announce_ready` with their readiness events.
    """

    def __init__(self) -> None:
        self._stop = asyncio.Event()
        self._ready = asyncio.Event()

    def stop(self) -> None:
        """Ask ``run()`` to stop taking work, finish what is in flight, and
        return (safe from a signal handler)."""
        self._stop.set()

    @property
    def stopping(self) -> bool:
        """Whether :meth:`stop` was called."""
        return self._stop.is_set()

    async def wait_ready(self, timeout: float = 10.0) -> None:
        """Wait until every subscription is live on the server.

        Raises:
            TimeoutError: not ready within ``timeout`` seconds.
        """
        async with asyncio.timeout(timeout):
            await self._ready.wait()

    async def _announce_ready(self, *events: asyncio.Event) -> None:
        # Every serving loop sets its event once subscribed, even when stopped early.
        for event in events:
            await event.wait()
        self._ready.set()
