"""Long-term memory in SQLite: full-text search (FTS5) ranked by BM25.

:class:`SQLiteMemory` keeps what agents remember across conversations in one
SQLite file: each entry a text, kept under an agent's name and a key (a user,
a session: the agent chooses), found again by the words of a query, the most
relevant first (BM25, FTS5's ranking). It needs no model and no embeddings.

It is the default store of the agents' long-term memory
(:mod:`fleetbus.capabilities.memory`). In-process it is one itself: it has
the two methods of the ``LongTermMemory`` protocol, ``record`` and
``retrieve``. On the bus, every replica of an agent shares it::

    FLEETBUS_MEMORY_DB=/var/lib/fleet/memory.db fleetbus worker fleetbus.tools_workers.memory

serves :data:`toolkit`: the tools ``long_term_memory_record`` and
``long_term_memory_retrieve``, which ``fleetbus.agents.BusMemory`` calls. The
file is ``$FLEETBUS_MEMORY_DB``, else ``fleetbus-memory.db`` in the working
folder, created on first use (not at import). What is recorded is on disk
when the call returns: it survives a restart of the worker.

Concurrency: a store holds one connection; its calls take turns (a lock) and
run in a thread, so the event loop never waits for the disk. The journal is
WAL with a busy timeout, so several workers may serve one file.

Queries are never FTS5 syntax: the words of a query (letters and digits; at
most :data:`MAX_QUERY_TERMS` of its first :data:`MAX_QUERY_CHARS`
characters) are each quoted and joined with ``OR``, so no text — quotes,
``NEAR``, ``*``, a megabyte of it — makes a syntax error. Words are stemmed
(Porter), so "likes" finds "liked".

Bounds: a ``retrieve`` returns at most ``limit`` (≤ :data:`MAX_LIMIT`) texts
of at most ``max_chars`` (≤ :data:`MAX_CHARS`) characters together, the last
cut to fit; a ``record`` takes at most :data:`MAX_TEXTS` texts, each cut to
:data:`MAX_TEXT_CHARS` characters.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import sqlite3
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Annotated, Final, TypeVar

from pydantic import BaseModel, Field

from fleetbus.errors import ConfigError, StoreError
from fleetbus.tools_workers._fts import any_of, query_words
from fleetbus.tools_workers.settings import ToolSettings, check_ranges
from fleetbus.tools_workers.tool import tool
from fleetbus.tools_workers.toolkit import Toolkit

__all__ = [
    "DEFAULT_MEMORY_DB",
    "MAX_CHARS",
    "MAX_KEY_CHARS",
    "MAX_LIMIT",
    "MAX_NAME_CHARS",
    "MAX_QUERY_CHARS",
    "MAX_QUERY_TERMS",
    "MAX_TEXTS",
    "MAX_TEXT_CHARS",
    "MEMORY_DB_ENV",
    "RECORD_TOOL",
    "RETRIEVE_TOOL",
    "SQLiteMemory",
    "match_expression",
    "memory_tools",
    "toolkit",
]

logger = logging.getLogger(__name__)

MEMORY_DB_ENV: Final = "FLEETBUS_MEMORY_DB"
"""The variable of :attr:`~fleetbus.tools_workers.settings.ToolSettings.memory_db`."""

DEFAULT_MEMORY_DB: Final[str] = ToolSettings.model_fields["memory_db"].default
"""The file when ``FLEETBUS_MEMORY_DB`` is unset, in the working folder."""

RECORD_TOOL: Final = "long_term_memory_record"
"""The tool that records texts (its arguments: ``agent_name``, ``key``,
``texts``, ``record_id``)."""

RETRIEVE_TOOL: Final = "long_term_memory_retrieve"
"""The tool that retrieves texts (``agent_name``, ``key``, ``query``,
``limit``, ``max_chars``)."""

MAX_LIMIT: Final = 50
"""The most texts one retrieval returns."""

MAX_CHARS: Final = 20_000
"""The most characters one retrieval returns, its texts together."""

MAX_TEXTS: Final = 32
"""The most texts one record takes."""

MAX_TEXT_CHARS: Final = 8_000
"""Longest text kept; a longer one is cut to this (its end marked ``…``)."""

MAX_QUERY_CHARS: Final = 4_000
"""Characters of a query whose words are searched; the rest is ignored."""

MAX_QUERY_TERMS: Final = 64
"""The most distinct words of a query searched."""

MAX_NAME_CHARS: Final = 256
"""Longest agent name."""

MAX_KEY_CHARS: Final = 1_024
"""Longest key."""

_MAX_RECORD_ID_CHARS: Final = 512
_MIN_CUT_CHARS: Final = 40
"""A hit that would have to be cut below this many characters to fit is left out
(unless it is the first)."""
_BUSY_TIMEOUT: Final = 10.0
"""Seconds a call waits for another process's write to the file."""
_SCHEMA_VERSION: Final = 1

_SCHEMA: Final = """
CREATE TABLE IF NOT EXISTS memories (
    id INTEGER PRIMARY KEY,
    agent TEXT NOT NULL,
    key TEXT NOT NULL,
    scope TEXT NOT NULL,
    record_id TEXT UNIQUE,
    text TEXT NOT NULL,
    created REAL NOT NULL
);
CREATE VIRTUAL TABLE IF NOT EXISTS memories_fts USING fts5(
    scope, text, content='memories', content_rowid='id',
    tokenize='porter unicode61 remove_diacritics 2'
);
"""

_T = TypeVar("_T")


def match_expression(query: str) -> str | None:
    """The FTS5 query for the words of ``query`` (``None`` when it has none).

    Each distinct word (letters, digits; single letters left out) is quoted,
    so nothing in ``query`` is read as FTS5 syntax, and the words are joined
    with ``OR``: an entry matching any of them is found, ranked by how well
    it matches them all.
    """
    words = query_words(query, max_chars=MAX_QUERY_CHARS, max_terms=MAX_QUERY_TERMS)
    return any_of(words) if words else None


def _scope_token(agent_name: str, key: str) -> str:
    """One indexed word standing for (agent, key), digits only (no stemming
    changes it): a search looks only at that scope's entries."""
    digest = hashlib.sha256(f"{agent_name}\x00{key}".encode()).digest()
    return str(int.from_bytes(digest[:8], "big"))


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


class SQLiteMemory:
    """A long-term memory in one SQLite file (FTS5, BM25 ranking).

    Args:
        path: the file; ``$FLEETBUS_MEMORY_DB``, else ``fleetbus-memory.db``
            in the working folder, when ``None``. ``":memory:"`` keeps it in
            this process only. Its folder is created on first use.

    Raises:
        ConfigError: (on first use) SQLite here has no FTS5.
        StoreError: (on first use and on any call) the file cannot be opened,
            read or written.
    """

    def __init__(self, path: str | Path | None = None) -> None:
        if path is None:
            path = ToolSettings().memory_db
        self.path = (
            str(path) if str(path) == ":memory:" else str(Path(path).expanduser().absolute())
        )
        self._lock = threading.Lock()
        self._connection: sqlite3.Connection | None = None

    def __repr__(self) -> str:
        return f"SQLiteMemory({self.path!r})"

    async def record(
        self,
        agent_name: str,
        key: str,
        texts: Sequence[str],
        *,
        record_id: str | None = None,
    ) -> int:
        """Keep ``texts`` in ``agent_name``'s memory under ``key``.

        Blank texts are skipped; a text longer than :data:`MAX_TEXT_CHARS`
        is cut. With a ``record_id``, recording the same one again (a retry,
        a reply run again after a take-over) adds nothing.

        Returns:
            how many texts were added.

        Raises:
            ConfigError: an empty or too long agent name, key or record id,
                or more than :data:`MAX_TEXTS` texts.
            StoreError: the file cannot be written.
        """
        if isinstance(texts, str):
            texts = [texts]
        check_ranges(
            _Record,
            "SQLiteMemory.record",
            agent_name=agent_name,
            key=key,
            texts=len(texts),
            record_id=record_id,
        )
        kept = [_cut(t.strip(), MAX_TEXT_CHARS) for t in texts if t.strip()]
        if not kept:
            return 0
        return await self._run(self._record, agent_name, key, kept, record_id)

    async def retrieve(
        self,
        agent_name: str,
        key: str,
        query: str,
        *,
        limit: int = 5,
        max_chars: int = 2000,
    ) -> list[str]:
        """The texts of ``agent_name``'s memory under ``key`` that best match
        ``query``, the best first (BM25; the newest first among equals).

        At most ``limit`` texts of at most ``max_chars`` characters together:
        the last is cut to fit. A query with no words finds nothing.

        Raises:
            ConfigError: an empty or too long agent name or key, or a
                ``limit`` or ``max_chars`` out of range.
            StoreError: the file cannot be read.
        """
        check_ranges(
            _Retrieval,
            "SQLiteMemory.retrieve",
            agent_name=agent_name,
            key=key,
            limit=limit,
            max_chars=max_chars,
        )
        expression = match_expression(query)
        if expression is None:
            return []
        rows = await self._run(self._search, agent_name, key, expression, limit)
        hits: list[str] = []
        used = 0
        for text in rows:
            room = max_chars - used
            if room <= 0 or (len(text) > room and room < _MIN_CUT_CHARS and hits):
                break
            hits.append(_cut(text, room))
            used += len(hits[-1])
        return hits

    async def count(self, agent_name: str, key: str | None = None) -> int:
        """How many entries ``agent_name`` has (under ``key``, or all).

        Raises:
            StoreError: the file cannot be read.
        """
        return await self._run(self._count, agent_name, key)

    def close(self) -> None:
        """Close the file (it is opened again on the next call)."""
        with self._lock:
            if self._connection is not None:
                self._connection.close()
                self._connection = None

    # -- in the thread, under the lock -------------------------------------------

    async def _run(self, fn: Callable[..., _T], *args: object) -> _T:
        def locked() -> _T:
            with self._lock:
                try:
                    return fn(self._open(), *args)
                except sqlite3.Error as exc:
                    raise StoreError(f"long-term memory {self.path}: {exc}") from exc

        return await asyncio.to_thread(locked)

    def _open(self) -> sqlite3.Connection:
        if self._connection is not None:
            return self._connection
        if self.path != ":memory:":
            try:
                Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise StoreError(f"long-term memory {self.path}: {exc}") from exc
        connection = sqlite3.connect(self.path, timeout=_BUSY_TIMEOUT, check_same_thread=False)
        try:
            connection.execute("PRAGMA journal_mode=WAL")
            connection.execute("PRAGMA synchronous=NORMAL")
            with connection:
                connection.executescript(_SCHEMA)
                connection.execute(f"PRAGMA user_version={_SCHEMA_VERSION}")
        except sqlite3.OperationalError as exc:
            connection.close()
            if "fts5" in str(exc).lower():
                raise ConfigError(
                    f"the SQLite of this Python ({sqlite3.sqlite_version}) has no FTS5: "
                    "long-term memory needs it"
                ) from exc
            raise
        except BaseException:
            connection.close()
            raise
        self._connection = connection
        return connection

    @staticmethod
    def _record(
        connection: sqlite3.Connection,
        agent_name: str,
        key: str,
        texts: list[str],
        record_id: str | None,
    ) -> int:
        scope = _scope_token(agent_name, key)
        now = time.time()
        added = 0
        with connection:
            for index, text in enumerate(texts):
                entry_id = None if record_id is None else f"{record_id}#{index}"
                cursor = connection.execute(
                    "INSERT OR IGNORE INTO memories (agent, key, scope, record_id, text, created)"
                    " VALUES (?, ?, ?, ?, ?, ?)",
                    (agent_name, key, scope, entry_id, text, now),
                )
                if cursor.rowcount != 1:
                    continue  # recorded before
                connection.execute(
                    "INSERT INTO memories_fts (rowid, scope, text) VALUES (?, ?, ?)",
                    (cursor.lastrowid, scope, text),
                )
                added += 1
        return added

    @staticmethod
    def _search(
        connection: sqlite3.Connection, agent_name: str, key: str, expression: str, limit: int
    ) -> list[str]:
        scope = _scope_token(agent_name, key)
        rows = connection.execute(
            "SELECT m.text FROM memories_fts JOIN memories AS m ON m.id = memories_fts.rowid"
            " WHERE memories_fts MATCH ? AND m.agent = ? AND m.key = ?"
            " ORDER BY bm25(memories_fts, 0.0, 1.0), m.id DESC LIMIT ?",
            (f'scope : "{scope}" AND text : ({expression})', agent_name, key, limit),
        ).fetchall()
        return [str(row[0]) for row in rows]

    @staticmethod
    def _count(connection: sqlite3.Connection, agent_name: str, key: str | None) -> int:
        if key is None:
            row = connection.execute(
                "SELECT count(*) FROM memories WHERE agent = ?", (agent_name,)
            ).fetchone()
        else:
            row = connection.execute(
                "SELECT count(*) FROM memories WHERE agent = ? AND key = ?", (agent_name, key)
            ).fetchone()
        return int(row[0])


class _Scope(BaseModel):
    agent_name: str = Field(min_length=1, max_length=MAX_NAME_CHARS)
    key: str = Field(min_length=1, max_length=MAX_KEY_CHARS)


class _Record(_Scope):
    texts: int = Field(le=MAX_TEXTS)
    """How many texts."""
    record_id: str | None = Field(min_length=1, max_length=_MAX_RECORD_ID_CHARS)


class _Retrieval(_Scope):
    limit: int = Field(ge=1, le=MAX_LIMIT)
    max_chars: int = Field(ge=1, le=MAX_CHARS)


def memory_tools(store: SQLiteMemory | str | Path | None = None) -> Toolkit:
    """The tools serving ``store`` on the bus: ``long_term_memory_record`` and
    ``long_term_memory_retrieve``.

    They are the store's side of ``fleetbus.agents.BusMemory``, which calls
    them with the agent's name and the key it chose; an agent never offers
    them to its model (its model gets ``record_to_memory`` and
    ``retrieve_from_memory``, bound to the agent and the user).

    Args:
        store: the store, or its file (see :class:`SQLiteMemory`).
    """
    memory = store if isinstance(store, SQLiteMemory) else SQLiteMemory(store)

    @tool(name=RECORD_TOOL)
    async def record(
        agent_name: Annotated[str, Field(min_length=1, max_length=MAX_NAME_CHARS)],
        key: Annotated[str, Field(min_length=1, max_length=MAX_KEY_CHARS)],
        texts: Annotated[list[str], Field(max_length=MAX_TEXTS)],
        record_id: Annotated[str | None, Field(min_length=1, max_length=_MAX_RECORD_ID_CHARS)] = (
            None
        ),
    ) -> dict[str, int]:
        """Keep texts in an agent's long-term memory, under a key.

        Returns how many were added: a record_id recorded before adds nothing.

        Args:
            agent_name: whose memory.
            key: the scope within it (a user, a session).
            texts: what to keep, each text one entry (cut past 8,000 characters).
            record_id: makes the record idempotent.
        """
        return {"recorded": await memory.record(agent_name, key, texts, record_id=record_id)}

    @tool(name=RETRIEVE_TOOL)
    async def retrieve(
        agent_name: Annotated[str, Field(min_length=1, max_length=MAX_NAME_CHARS)],
        key: Annotated[str, Field(min_length=1, max_length=MAX_KEY_CHARS)],
        query: str,
        limit: Annotated[int, Field(ge=1, le=MAX_LIMIT)] = 5,
        max_chars: Annotated[int, Field(ge=1, le=MAX_CHARS)] = 2000,
    ) -> list[str]:
        """The texts of an agent's long-term memory under a key that best match a query.

        Ranked by BM25 over the query's words, the best first; at most limit
        texts of at most max_chars characters together.

        Args:
            agent_name: whose memory.
            key: the scope within it.
            query: any text: its words are searched.
            limit: the most texts returned.
            max_chars: the most characters returned, all texts together.
        """
        return await memory.retrieve(agent_name, key, query, limit=limit, max_chars=max_chars)

    return Toolkit([record, retrieve])


toolkit = memory_tools()
"""The memory tools on ``$FLEETBUS_MEMORY_DB``, served by
``fleetbus worker fleetbus.tools_workers.memory``."""
