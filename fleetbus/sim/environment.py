"""The environment of a simulation: shared state on the bus.

An :class:`Environment` is a JetStream KV bucket (``<prefix>_sim_<name>``)
of JSON values. Every process of the simulation reaches the same state: the
runner (which sets it up, applies each round's replies and snapshots it), the
tool workers (whose environment tools let agents read and change it), and any
other client. Writes that must not lose a race are compare-and-set on the
revision last read::

    env = await Environment.open(bus, "market")
    entry = await env.entry("price")                       # value and revision
    await env.compare_and_set("price", 11, revision=entry.revision)  # or RevisionMismatchError
    await env.update("volume", lambda v: (v or 0) + 1)     # read, change, retry on conflict

:func:`environment_tools` are the tools agents use on it (``env_get``,
``env_set``, ``env_add``), served by the simulation's tool workers.
"""

from __future__ import annotations

import asyncio
import random
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from fleetbus.bus import Bus, KeyValueStore, check_name, key_value
from fleetbus.errors import ConfigError, InvalidSubjectError, RevisionMismatchError
from fleetbus.tools_workers import Tool

__all__ = ["ENVIRONMENT_TOOLS", "Environment", "Versioned", "environment_tools"]

ENVIRONMENT_TOOLS = ("env_get", "env_set", "env_add")
"""The names of the tools :func:`environment_tools` makes."""

_KEY = re.compile(r"[-/_=a-zA-Z0-9]+(?:\.[-/_=a-zA-Z0-9]+)*")
_READS_AT_ONCE = 64
_MAX_VALUE = 256 * 1024


@dataclass(frozen=True, slots=True)
class Versioned:
    """A value of the environment with the revision to compare-and-set on.

    Attributes:
        value: the JSON value (``None`` when the key does not exist).
        revision: its revision; 0 when the key does not exist.
    """

    value: Any
    revision: int


def check_key(key: str) -> str:
    """``key`` if it can be an environment key.

    Raises:
        ConfigError: it is not letters, digits and ``-_/=``, in dot-separated parts.
    """
    if not isinstance(key, str) or len(key) > 256 or not _KEY.fullmatch(key):
        raise ConfigError(
            f"invalid environment key {key!r}: use letters, digits, '-', '_', '/', '=' "
            "(parts joined by single dots)"
        )
    return key


class Environment:
    """Shared state of a simulation: JSON values by key, with compare-and-set.

    Make one with :meth:`open`.

    Args:
        store: the KV bucket.
        name: the simulation's name.
    """

    def __init__(self, store: KeyValueStore, name: str) -> None:
        self.store = store
        self.name = name

    @classmethod
    async def open(cls, bus: Bus, name: str) -> Environment:
        """The environment of simulation ``name`` (its bucket made if missing).

        Raises:
            ConfigError: ``name`` cannot be a subject token.
            StoreError: JetStream is not available.
        """
        try:
            check_name(name, what="simulation name")
        except InvalidSubjectError as exc:
            raise ConfigError(str(exc)) from exc
        return cls(await key_value(bus, f"sim_{name}"), name)

    async def entry(self, key: str) -> Versioned:
        """The value of ``key`` and its revision (``None`` and 0 when absent).

        Raises:
            ConfigError: an invalid key.
            StoreError: the read failed.
        """
        found = await self.store.get_or_none(check_key(key))
        if found is None or not found.value:
            return Versioned(None, 0)
        return Versioned(orjson.loads(found.value), found.revision)

    async def get(self, key: str, default: Any = None) -> Any:
        """The value of ``key``, or ``default`` when absent.

        Raises:
            ConfigError: an invalid key.
            StoreError: the read failed.
        """
        entry = await self.entry(key)
        return default if entry.revision == 0 else entry.value

    async def set(self, key: str, value: Any) -> int:
        """Write ``value`` whatever the current revision; the new revision.

        Raises:
            ConfigError: an invalid key, or a value that is not JSON or is too large.
            StoreError: the write failed.
        """
        return await self.store.put(check_key(key), _encode(key, value))

    async def compare_and_set(self, key: str, value: Any, *, revision: int) -> int:
        """Write ``value`` only if ``key`` is still at ``revision`` (0: only if
        it does not exist); the new revision.

        Raises:
            RevisionMismatchError: someone wrote the key since (or it exists,
                for ``revision=0``).
            ConfigError: an invalid key or value.
            StoreError: the write failed.
        """
        data = _encode(key, value)
        if revision == 0:
            return await self.store.create(check_key(key), data)
        return await self.store.update(check_key(key), data, revision=revision)

    async def update(
        self,
        key: str,
        change: Callable[[Any], Any],
        *,
        default: Any = None,
        attempts: int = 64,
    ) -> Versioned:
        """Read ``key``, write ``change(value)`` by compare-and-set, and try
        again when another writer came first; the value written and its revision.

        Args:
            key: the key.
            change: the new value from the current one (``default`` when absent).
            default: the value of an absent key.
            attempts: compare-and-set attempts before giving up.

        Raises:
            RevisionMismatchError: every attempt lost its race.
            ConfigError: an invalid key or value.
            StoreError: a read or write failed.
        """
        lost: RevisionMismatchError | None = None
        for attempt in range(max(1, attempts)):
            entry = await self.entry(key)
            value = change(default if entry.revision == 0 else entry.value)
            try:
                revision = await self.compare_and_set(key, value, revision=entry.revision)
            except RevisionMismatchError as exc:
                lost = exc
                await asyncio.sleep(random.uniform(0, 0.002 * min(attempt + 1, 10)))
                continue
            return Versioned(value, revision)
        assert lost is not None
        raise lost

    async def delete(self, key: str) -> None:
        """Remove ``key`` (nothing happens when it is absent).

        Raises:
            ConfigError: an invalid key.
            StoreError: the delete failed.
        """
        await self.store.delete(check_key(key))

    async def snapshot(self) -> dict[str, Any]:
        """Every key and its value, sorted by key.

        Raises:
            StoreError: a read failed.
        """
        limiter = asyncio.Semaphore(_READS_AT_ONCE)

        async def read(key: str) -> tuple[str, Versioned]:
            async with limiter:
                return key, await self.entry(key)

        keys = await self.store.subjects()
        found = await asyncio.gather(*(read(k) for k in keys))
        return {k: e.value for k, e in sorted(found) if e.revision}

    async def restore(self, values: Mapping[str, Any]) -> None:
        """Make the environment hold exactly ``values``.

        Raises:
            ConfigError: an invalid key or value.
            StoreError: a read or write failed.
        """
        encoded = {check_key(k): _encode(k, v) for k, v in values.items()}
        current = await self.snapshot()
        limiter = asyncio.Semaphore(_READS_AT_ONCE)

        async def put(key: str, data: bytes) -> None:
            async with limiter:
                await self.store.put(key, data)

        async def delete(key: str) -> None:
            async with limiter:
                await self.store.delete(key)

        await asyncio.gather(
            *(delete(k) for k in current if k not in encoded),
            *(put(k, d) for k, d in encoded.items()),
        )


def _encode(key: str, value: Any) -> bytes:
    try:
        data = orjson.dumps(value)
    except TypeError as exc:
        raise ConfigError(f"the value of {key!r} is not JSON: {exc}") from exc
    if len(data) > _MAX_VALUE:
        raise ConfigError(
            f"the value of {key!r} is {len(data)} bytes; an environment value holds at most "
            f"{_MAX_VALUE}: split it over several keys"
        )
    return data


def environment_tools(environment: Environment) -> list[Tool]:
    """The tools agents read and change ``environment`` with:

    - ``env_get(key)``: the value and its revision;
    - ``env_set(key, value, revision=None)``: write it; with ``revision``,
      only if the key is still at that revision (0: only if absent) — a
      lost race is a tool error saying the current revision;
    - ``env_add(key, amount=1)``: add to a number, atomically.
    """

    async def env_get(key: str) -> dict[str, Any]:
        """Read a value of the shared environment, with its revision (0: absent).

        Args:
            key: the key (letters, digits, '-', '_', '/', '=' and dots).
        """
        entry = await environment.entry(key)
        return {"key": key, "value": entry.value, "revision": entry.revision}

    async def env_set(key: str, value: Any, revision: int | None = None) -> dict[str, Any]:
        """Write a value of the shared environment. With revision, write only if the
        key is still at that revision (compare-and-set; 0: only if it does not exist).

        Args:
            key: the key (letters, digits, '-', '_', '/', '=' and dots).
            value: any JSON value.
            revision: the revision read with env_get, to write only if nobody changed it since.
        """
        if revision is None:
            return {"key": key, "revision": await environment.set(key, value)}
        try:
            written = await environment.compare_and_set(key, value, revision=revision)
        except RevisionMismatchError:
            now = await environment.entry(key)
            raise RevisionMismatchError(
                f"conflict: {key!r} is at revision {now.revision}, not {revision}; "
                "read it again with env_get and decide anew",
                key=key,
                expected=revision,
            ) from None
        return {"key": key, "revision": written}

    async def env_add(key: str, amount: float = 1) -> dict[str, Any]:
        """Add an amount to a number of the shared environment (0 when absent), atomically.

        Args:
            key: the key (letters, digits, '-', '_', '/', '=' and dots).
            amount: what to add (negative to subtract).
        """

        def add(value: Any) -> Any:
            if not isinstance(value, int | float) or isinstance(value, bool):
                raise ConfigError(f"{key!r} holds {type(value).__name__}, not a number")
            total = value + amount
            return int(total) if isinstance(total, float) and total.is_integer() else total

        entry = await environment.update(key, add, default=0)
        return {"key": key, "value": entry.value, "revision": entry.revision}

    return [Tool(env_get), Tool(env_set), Tool(env_add)]
