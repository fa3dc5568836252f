"""Who a reply running here speaks as, when a host serves it: the bus, the
agent's name, the session and the host's slot.

The host sets it around each reply (:func:`speaking`); what talks from the
reply's own loop reads it — the talk tools of
:mod:`fleetbus.capabilities.talk`, the clients of a store served on the bus
(:func:`served_on`).
"""

from __future__ import annotations

import asyncio
import contextvars
from dataclasses import dataclass

from fleetbus.bus import Bus

__all__ = ["Speaker", "hush", "served_on", "speaker", "speaking"]


@dataclass(frozen=True, slots=True)
class Speaker:
    """Who the reply running here speaks as."""

    bus: Bus
    """The bus its host serves it on."""
    name: str
    """The agent's name."""
    session: str
    """The reply's session."""
    slot: asyncio.Semaphore | None
    """The host's bound on running replies, which this reply holds a place
    of: given back while it waits for another agent's answer."""


_speaker: contextvars.ContextVar[Speaker | None] = contextvars.ContextVar(
    "fleetbus_speaker", default=None
)


def speaking(
    bus: Bus, name: str, session: str, slot: asyncio.Semaphore | None = None
) -> contextvars.Token[Speaker | None]:
    """Let the talk tools of the reply about to run speak as ``name`` in
    ``session`` (the host calls this; tasks started later inherit it).
    ``slot``: the semaphore bounding the host's replies, of which the reply
    holds a place; it is given back while the reply waits for an answer from
    another agent, who may need a place in the same host to give it."""
    return _speaker.set(Speaker(bus, name, session, slot))


def hush(token: contextvars.Token[Speaker | None]) -> None:
    """Undo :func:`speaking`."""
    _speaker.reset(token)


def served_on() -> tuple[Bus, str] | None:
    """The bus and the agent's name of the reply running here, when a host
    serves it (see :func:`speaking`); ``None`` elsewhere."""
    speaker = _speaker.get()
    return None if speaker is None else (speaker.bus, speaker.name)


def speaker() -> Speaker | None:
    """Who the reply running here speaks as; ``None`` when no host serves it."""
    return _speaker.get()
