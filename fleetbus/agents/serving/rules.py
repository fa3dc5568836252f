"""The rules a person accepted for an agent served on the bus, in JetStream.

A person confirming a paused call may accept allow rules (a ``confirm_result``'s
``accept_rules``). They belong to the agent, not to the session: the KV bucket
``<prefix>_agent_rules`` holds one key per agent, its name, whose value is::

    {"format": 1, "allow": ["write_file(path=notes/*)", "Bash(command=git *)"],
     "updated_at": "2026-11-29T19:00:00+00:00"}

Every replica reads the key when a session's reply starts or resumes (only for
an agent whose permissions can ask: accepted rules answer asks, nothing else),
and adds to it by compare-and-set, so replicas accepting rules at once lose
none. The session that accepted a rule also keeps it in its own state.

To see or take back an agent's rules::

    rules = stored_rules(bus, "careful")
    await rules.load()                       # [PermissionRule(...), ...]
    await rules.remove("write_file(path=notes/*)")

(or ``nats kv get <prefix>_agent_rules careful``).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Sequence
from typing import Final

import orjson

from fleetbus.agents.agent import Agent
from fleetbus.agents.permissions import PermissionRule, RuleBook, parse_accepted
from fleetbus.bus import Bus, Entry, KeyValueStore, key_value
from fleetbus.bus.subjects import check_name
from fleetbus.errors import ConfigError, FleetbusError, RevisionMismatchError, StoreError
from fleetbus.protocol import utc_now

__all__ = ["BUCKET", "MAX_RULES", "StoredRules", "serve_rules", "stored_rules"]

logger = logging.getLogger(__name__)

BUCKET: Final = "agent_rules"
"""The KV bucket's short name (the fleet prefix is added)."""

MAX_RULES: Final = 500
"""Accepted rules an agent keeps at most (each at most ``MAX_RULE_TEXT`` characters)."""

_FORMAT = 1
_ATTEMPTS = 8
"""Compare-and-set attempts before an update gives up (others kept writing)."""

_Change = Callable[[list[PermissionRule]], list[PermissionRule]]
"""What an update does to the kept rules."""

_buckets: weakref.WeakKeyDictionary[Bus, KeyValueStore] = weakref.WeakKeyDictionary()
"""The bucket opened on each connection (opened once, on first use)."""


async def _bucket(bus: Bus) -> KeyValueStore:
    store = _buckets.get(bus)
    if store is None:
        store = _buckets[bus] = await key_value(bus, BUCKET)
    return store


class StoredRules:
    """An agent's accepted rules in JetStream: a :class:`RuleBook`.

    Args:
        bus: the connection.
        agent: the agent's name (its key).
        base: rules the agent's definition holds besides (its own
            ``accepted_rules``): loaded with the stored ones, never written.

    Raises:
        InvalidSubjectError: ``agent`` cannot be a key.
    """

    def __init__(self, bus: Bus, agent: str, base: RuleBook | None = None) -> None:
        self.bus = bus
        self.agent = check_name(agent, what="agent name")
        self.base = base

    async def _read(self) -> tuple[Entry | None, list[PermissionRule]]:
        """The stored entry and its rules.

        Raises:
            StoreError: the bucket failed, or the value is not the agent's rules.
        """
        entry = await (await _bucket(self.bus)).get_or_none(self.agent)
        if entry is None:
            return None, []
        try:
            document = orjson.loads(entry.value)
            texts = document["allow"]
            return entry, parse_accepted(texts)
        except (orjson.JSONDecodeError, KeyError, TypeError, ConfigError) as exc:
            raise StoreError(
                f"the accepted rules of {self.agent!r} in {BUCKET} are unreadable: {exc}"
            ) from None

    async def load(self) -> list[PermissionRule]:
        """The agent's accepted rules: the definition's, then the stored ones.

        A store that fails is logged and read as no stored rule: the calls
        they would allow are asked about instead.
        """
        rules = await self.base.load() if self.base is not None else []
        try:
            _, stored = await self._read()
        except FleetbusError as exc:
            logger.warning("%s: accepted rules not read: %s", self.agent, exc)
            return rules
        return rules + [rule for rule in stored if rule not in rules]

    async def add(self, rules: Sequence[PermissionRule]) -> None:
        """Keep ``rules`` with the agent (those not kept yet).

        Raises:
            ConfigError: a rule does not allow, or the agent would keep more
                than :data:`MAX_RULES`.
            StoreError: the bucket failed, or others kept writing the key.
        """
        new = parse_accepted(rules)
        await self._update(lambda kept: kept + [rule for rule in new if rule not in kept])

    async def remove(self, *rules: PermissionRule | str) -> None:
        """Take rules back (sessions that accepted one themselves keep it).

        Raises:
            ConfigError: a text is malformed.
            StoreError: the bucket failed, or others kept writing the key.
        """
        gone = parse_accepted(rules)
        await self._update(lambda kept: [rule for rule in kept if rule not in gone])

    async def _update(self, change: _Change) -> None:
        store = await _bucket(self.bus)
        for _ in range(_ATTEMPTS):
            entry, kept = await self._read()
            wanted = change(kept)
            if wanted == kept:
                return
            if len(wanted) > MAX_RULES:
                raise ConfigError(
                    f"agent {self.agent!r} keeps at most {MAX_RULES} accepted rules; "
                    f"remove some first (StoredRules.remove)"
                )
            value = orjson.dumps(
                {
                    "format": _FORMAT,
                    "allow": [str(rule) for rule in wanted],
                    "updated_at": utc_now().isoformat(),
                }
            )
            try:
                if entry is None:
                    await store.create(self.agent, value)
                else:
                    await store.update(self.agent, value, revision=entry.revision)
                return
            except RevisionMismatchError:
                continue  # another replica wrote meanwhile: merge with what it wrote
        raise StoreError(
            f"the accepted rules of {self.agent!r} kept changing; not updated after "
            f"{_ATTEMPTS} attempts"
        )


def stored_rules(bus: Bus, agent: str, base: RuleBook | None = None) -> StoredRules:
    """The accepted rules of ``agent`` in the fleet's JetStream (see :class:`StoredRules`)."""
    return StoredRules(bus, agent, base)


def serve_rules(bus: Bus, agent: Agent) -> Agent:
    """Make a session's agent keep its accepted rules in JetStream, where every
    replica reads them; its definition's own stay with them. Returns ``agent``."""
    if not isinstance(agent.accepted_rules, StoredRules):
        agent.accepted_rules = StoredRules(bus, agent.name, agent.accepted_rules)
    return agent
