"""The session store as the commands read it: riding out a failure that may
pass, and finding which agent serves a session."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

from rich.text import Text

from fleetbus.agents.serving.sessions import SessionRecord, SessionStore
from fleetbus.bus import Bus
from fleetbus.bus.store import wait_for_store
from fleetbus.cli._common import err_console
from fleetbus.errors import ConfigError, StoreError

__all__ = ["find_agent", "from_store", "open_store", "session_records"]

_T = TypeVar("_T")


async def open_store(bus: Bus, call: Callable[[SessionStore], Awaitable[_T]]) -> _T:
    """``call`` of the session store, opened for this command."""
    return await call(await SessionStore.open(bus, owner="cli"))


async def session_records(bus: Bus, agent: str | None = None) -> list[SessionRecord]:
    """The sessions in the store (of ``agent``)."""
    store = await SessionStore.open(bus, owner="cli")
    return await store.records(agent)


async def from_store(call: Callable[[], Awaitable[_T]], store_wait: float) -> _T:
    """``call()``, a reading of the session store, riding out a failure that
    may pass (a cluster electing the store's new leader after a node died)
    for up to ``store_wait`` seconds; said once on stderr.

    Raises:
        StoreError: a failure that does not pass, or one that lasted
            ``store_wait`` seconds.
    """

    def waiting(exc: StoreError) -> None:
        err_console.print(
            Text(f"waiting for the session store: {exc} (up to {store_wait:g} s)", style="yellow"),
            soft_wrap=True,
        )

    return await wait_for_store(call, timeout=store_wait, waiting=waiting)


async def find_agent(bus: Bus, session: str, agent: str | None, store_wait: float) -> str:
    """``agent`` if given, else the one agent the store has ``session`` of.

    Raises:
        ConfigError: no agent has the session, or several do.
        StoreError: the store cannot be read (within ``store_wait`` seconds).
    """
    if agent:
        return agent
    records = await from_store(lambda: session_records(bus), store_wait)
    matches = [r.agent for r in records if r.session_id == session]
    if not matches:
        raise ConfigError(f"no session {session!r}; name the agent with --agent")
    if len(set(matches)) > 1:
        raise ConfigError(f"session {session!r} exists for {sorted(set(matches))}; use --agent")
    return matches[0]
