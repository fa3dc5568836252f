"""Jittered retries, each policy declared in one line: the one retry helper of
fleetbus.

Every loop in fleetbus that tries again — a bus request nobody answered, a
prompt no model worker took, a failed model call, a session save the store
refused — goes through :class:`Retry`, a thin layer over stamina_ rather than a
loop of its own. Why stamina and not another hand-written loop:

- it is maintained, small (on top of tenacity) and typed;
- its exponential backoff has *jitter*: a fleet whose calls fail together (a
  429, a worker restart, an outage) does not retry in lock-step, as the
  hand-written loops it replaces all did;
- it has a testing mode: ``stamina.set_testing(True, attempts=n, cap=True)``
  removes every wait (and caps attempts) for a whole test run, and
  ``stamina.set_active(False)`` turns retries off; its instrumentation hooks
  (standard logging on the ``stamina`` logger, structlog, Prometheus) see
  every scheduled retry.

The wait before retry *n* is stamina's
``min(max_backoff, backoff * 2 ** (n - 1) + uniform(0, jitter))``, with
``jitter`` defaulting to ``backoff``. Waits that reach ``max_backoff`` no
longer vary, but callers stay apart by the jitter of their earlier waits.

Use::

    retry = Retry(on=StoreError, attempts=None, backoff=0.05, max_backoff=1.0, timeout=30)
    await retry.call(store.save, lease)

If every attempt fails, the last exception propagates unchanged; an exception
``on`` does not accept propagates at once. stamina's ``timeout`` only stops
scheduling retries, so a wait begun just before it could end well past it;
:meth:`Retry.call` cuts that wait at the deadline.

.. _stamina: https://stamina.hynek.me
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import ParamSpec, TypeAlias, TypeVar

import stamina

__all__ = ["Retry", "RetryOn"]

_P = ParamSpec("_P")
_T = TypeVar("_T")

RetryOn: TypeAlias = type[Exception] | tuple[type[Exception], ...] | Callable[[Exception], bool]
"""What is retried: exception types, or a predicate on the exception."""

_scheduling: ContextVar[bool] = ContextVar("fleetbus_retry_scheduling", default=False)
"""Set while :class:`Retry` asks stamina for its next attempt (when stamina's
instrumentation hooks run)."""


class _OwnRetries(logging.Filter):
    """Keeps stamina's warning about each retry fleetbus schedules (a request
    nobody answered yet, a store write refused) out of the logs of a program
    that uses fleetbus, unless the ``fleetbus`` logger is at debug level:
    fleetbus logs the failures that matter itself. Without this, a program
    that configures no logging got ``stamina.retry_scheduled`` lines on its
    stderr (Python's last-resort handler) whenever a worker restarted.
    stamina's lines about the program's own retries are left alone."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not _scheduling.get() or logging.getLogger("fleetbus").isEnabledFor(logging.DEBUG)


logging.getLogger("stamina").addFilter(_OwnRetries())


@dataclass(frozen=True, slots=True, kw_only=True)
class Retry:
    """A retry policy: what to retry, how often, how long to wait between.

    Attributes:
        on: the exception types to retry, or a predicate deciding from the
            exception (``True``: retry). Anything else, and every
            ``BaseException`` that is not an ``Exception`` (cancellation),
            propagates at once.
        attempts: the most attempts, at least 1, the first included;
            ``None``: as many as ``timeout`` allows.
        backoff: seconds to wait before the first retry (before jitter),
            doubling for each next one.
        max_backoff: the longest wait.
        timeout: seconds from the first attempt by which retrying ends: no
            retry is scheduled after it, and a wait that would end past it
            is cut short (the last failure is raised then); an attempt under
            way is not cut (bound it yourself). ``None``: no limit but
            ``attempts``; zero or less: no retries.
        jitter: the random seconds (uniform from 0) added to each wait;
            ``None``: ``backoff``.

    Raises:
        ValueError: a setting is out of range, or neither ``attempts`` nor
            ``timeout`` bounds the retries.
    """

    on: RetryOn
    attempts: int | None
    backoff: float
    max_backoff: float = 5.0
    timeout: float | None = None
    jitter: float | None = None

    def __post_init__(self) -> None:
        if self.attempts is None and self.timeout is None:
            raise ValueError("retries need a limit: attempts, timeout or both")
        if self.attempts is not None and self.attempts < 1:
            raise ValueError("attempts must be at least 1")
        if self.backoff < 0 or self.max_backoff < 0 or (self.jitter or 0) < 0:
            raise ValueError("backoff, max_backoff and jitter must not be negative")

    async def call(
        self, fn: Callable[_P, Awaitable[_T]], /, *args: _P.args, **kwargs: _P.kwargs
    ) -> _T:
        """``await fn(*args, **kwargs)``, retried as this policy says.

        Raises:
            Exception: the last attempt's exception, once retries are spent
                (or the deadline comes), or the first one ``on`` does not
                retry.
        """
        # The first attempt runs outside stamina: setting up its retry
        # context costs more than a fast call (a store write), and most
        # first attempts succeed. A failure it would retry is replayed as
        # stamina's first attempt, so the schedule is stamina's all the same.
        started = asyncio.get_running_loop().time()
        try:
            return await fn(*args, **kwargs)
        except Exception as exc:
            if not self._retries(exc):
                raise
            first: BaseException = exc
        return await self._retry(fn, args, kwargs, first, started)

    async def after(self, fn: Callable[[], Awaitable[_T]], first: Exception, started: float) -> _T:
        """Go on as :meth:`call` would after ``await fn()`` failed with
        ``first``, that attempt begun at ``started`` (the event loop's time):
        for a caller that makes its first attempt itself and builds the
        policy only when that attempt fails.

        Raises:
            Exception: as :meth:`call` (``first`` when ``on`` does not retry it).
        """
        if not self._retries(first):
            raise first
        return await self._retry(fn, (), {}, first, started)

    def _retries(self, exc: Exception) -> bool:
        on = self.on
        if isinstance(on, type | tuple):
            return isinstance(exc, on)
        return bool(on(exc))

    async def _retry(
        self,
        fn: Callable[..., Awaitable[_T]],
        args: tuple[object, ...],
        kwargs: dict[str, object],
        first: BaseException,
        started: float,
    ) -> _T:
        attempts, timeout = self.attempts, self.timeout
        if timeout is not None and timeout <= 0:
            raise first  # no retries
        on = self.on
        if not isinstance(on, type | tuple):
            on = _only_exceptions(on)
        retrying = stamina.retry_context(
            on,
            attempts=attempts,
            timeout=timeout,
            wait_initial=self.backoff,
            wait_max=self.max_backoff,
            wait_jitter=self.backoff if self.jitter is None else self.jitter,
        ).__aiter__()
        # stamina schedules no retry past its timeout, but lets a wait begun
        # before it run on; the deadline cuts that wait short.
        deadline = None if timeout is None else started + timeout
        failure: BaseException | None = None
        replay: BaseException | None = first
        while True:
            scheduling = _scheduling.set(True)
            try:
                async with asyncio.timeout_at(deadline):
                    attempt = await anext(retrying)  # waits before each retry
            except TimeoutError:
                if failure is None:
                    raise
                last = failure
                break
            finally:
                _scheduling.reset(scheduling)
            with attempt:
                try:
                    if replay is not None:  # the first attempt, made in call()
                        replayed, replay = replay, None
                        raise replayed
                    return await fn(*args, **kwargs)
                except BaseException as exc:
                    failure = exc
                    raise
        raise last  # raised outside the except: its own context stays


def _only_exceptions(predicate: Callable[[Exception], bool]) -> Callable[[Exception], bool]:
    # tenacity hands the hook whatever ended the attempt, CancelledError too.
    def on(exc: BaseException) -> bool:
        return isinstance(exc, Exception) and bool(predicate(exc))

    return on
