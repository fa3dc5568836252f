"""Plain subscriptions for watchers: the messages of a subject as they
arrive, with fleetbus errors (:meth:`fleetbus.Bus.listen`).

A watcher (``fleetbus watch``, the dashboard, a model's streamed answer, a
journal followed live) reads every message of a subject and never answers:
what nats-py's subscription does, with nats-py's errors translated here, so
nothing outside ``fleetbus.bus`` handles the raw client. Serving requests
goes through :meth:`fleetbus.Bus.serve` instead.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from types import TracebackType
from typing import Self

import nats.errors
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from fleetbus.errors import BusError, CallTimeoutError, ConnectionClosedError

__all__ = ["Callback", "Heard", "Listener"]

Heard = Msg
"""A message a :class:`Listener` hands over: ``subject``, ``reply``,
``data`` (bytes) and ``headers`` (a dict, or ``None``)."""


class Listener:
    """The messages of one subject (wildcards allowed), as they arrive.

    Read them with ``async for`` or :meth:`next`, or give
    :meth:`fleetbus.Bus.listen` a callback; end with :meth:`unsubscribe` or
    ``async with``.
    """

    def __init__(self, sub: Subscription, subject: str) -> None:
        self._sub = sub
        self.subject = subject
        """The subject listened to."""

    async def next(self, timeout: float) -> Heard:
        """The next message, waiting at most ``timeout`` seconds.

        Raises:
            CallTimeoutError: none came in time.
            ConnectionClosedError: the bus closed.
            BusError: the subscription cannot deliver (it was given a callback).
        """
        try:
            return await self._sub.next_msg(timeout=timeout)
        except nats.errors.TimeoutError as exc:
            raise CallTimeoutError(
                f"nothing on {self.subject} within {timeout:g} s", subject=self.subject
            ) from exc
        except nats.errors.ConnectionClosedError as exc:
            raise ConnectionClosedError("the bus connection is closed") from exc
        except nats.errors.Error as exc:
            raise BusError(f"listening on {self.subject} failed: {exc}") from exc

    async def __aiter__(self) -> AsyncIterator[Heard]:
        """Each message until the subscription ends (unsubscribed, or the bus
        closed)."""
        async for msg in self._sub.messages:
            yield msg

    async def unsubscribe(self) -> None:
        """Stop listening. Never raises: on a closed bus there is nothing to stop."""
        try:
            await self._sub.unsubscribe()
        except (nats.errors.Error, OSError):
            pass

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.unsubscribe()


Callback = Callable[[Heard], Awaitable[None]]
"""Receives each message (must not raise: nats-py would hand the exception to
its error callback, where it vanishes)."""
