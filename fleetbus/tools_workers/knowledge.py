"""A knowledge base of text and Markdown files: chunked, indexed with SQLite
FTS5, ranked with BM25.

:class:`KnowledgeIndex` indexes a folder of ``.md``, ``.markdown`` and
``.txt`` files. Markdown is cut at its headings, then at blank lines, into
passages of at most ``chunk_chars`` characters; plain text at blank lines.
Each passage remembers its file, its first and last line, and the headings
above it. A file is indexed again when its modification time or size
changes (looked at, at most every ``refresh_interval`` seconds, before a
search), and forgotten when it is deleted. Any text is a valid query: its
words are searched for, never parsed as FTS5 syntax.

In an agent's own process it is a knowledge base as it is
(:class:`fleetbus.capabilities.KnowledgeBase`: its
:meth:`~KnowledgeIndex.retrieve` runs the SQLite work in a thread)::

    agent = Agent(
        "helper", "...", model, capabilities=[Knowledge([KnowledgeIndex("docs/")])]
    )

On the bus, ``fleetbus worker fleetbus.tools_workers.knowledge`` serves the
folder named by ``FLEETBUS_KNOWLEDGE_DIR`` as the tool ``knowledge_search``
(``FLEETBUS_KNOWLEDGE_TOOL`` names it otherwise; ``FLEETBUS_KNOWLEDGE_INDEX``
keeps the index in that SQLite file instead of in memory, so a restart only
indexes what changed); agents reach it with
:class:`fleetbus.agents.BusKnowledgeBase`. The module's ``toolkit`` is made
from those variables when it is first read, not at import.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import sqlite3
import stat
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from math import log
from pathlib import Path
from typing import Annotated, Any, Final

from pydantic import BaseModel, Field

from fleetbus.errors import ConfigError
from fleetbus.tools_workers._fts import any_of, query_words
from fleetbus.tools_workers._knowledge_chunks import DEFAULT_CHUNK_CHARS, Chunk, chunk_document
from fleetbus.tools_workers.settings import ToolSettings, check_ranges
from fleetbus.tools_workers.tool import Tool, tool
from fleetbus.tools_workers.toolkit import Toolkit

__all__ = [
    "DEFAULT_CHUNK_CHARS",
    "DEFAULT_LIMIT",
    "DEFAULT_TOOL_NAME",
    "KNOWLEDGE_DIR_ENV",
    "KNOWLEDGE_INDEX_ENV",
    "KNOWLEDGE_TOOL_ENV",
    "MAX_QUERY_TERMS",
    "MAX_RESULTS",
    "Chunk",
    "IndexHit",
    "IndexStats",
    "KnowledgeIndex",
    "chunk_document",
    "knowledge_toolkit",
    "knowledge_tools",
]

logger = logging.getLogger(__name__)

KNOWLEDGE_DIR_ENV: Final = "FLEETBUS_KNOWLEDGE_DIR"
"""The variable of :attr:`~fleetbus.tools_workers.settings.ToolSettings.knowledge_dir`."""

KNOWLEDGE_TOOL_ENV: Final = "FLEETBUS_KNOWLEDGE_TOOL"
"""The variable of :attr:`~fleetbus.tools_workers.settings.ToolSettings.knowledge_tool`."""

KNOWLEDGE_INDEX_ENV: Final = "FLEETBUS_KNOWLEDGE_INDEX"
"""The variable of :attr:`~fleetbus.tools_workers.settings.ToolSettings.knowledge_index`."""

DEFAULT_TOOL_NAME: Final[str] = ToolSettings.model_fields["knowledge_tool"].default
"""The tool's name when none is given."""

DEFAULT_LIMIT: Final = 5
"""Passages a search returns when it does not say."""

MAX_RESULTS: Final = 20
"""The most passages one search returns (a larger ``limit`` is cut to it)."""

MAX_QUERY_TERMS: Final = 64
"""Distinct words of a query searched for; the rest are ignored."""

DEFAULT_EXTENSIONS: Final = (".md", ".markdown", ".txt")
DEFAULT_MAX_FILE_BYTES: Final = 4 * 1024 * 1024
"""Larger files are skipped (and logged)."""

_MIN_CHUNK_CHARS: Final = 100
_MAX_CHUNK_CHARS: Final = 20_000
_MAX_QUERY_CHARS: Final = 8000


class _IndexLimits(BaseModel):
    chunk_chars: int = Field(ge=_MIN_CHUNK_CHARS, le=_MAX_CHUNK_CHARS)
    refresh_interval: float | None = Field(ge=0)
    max_file_bytes: int = Field(ge=1)


class _SearchLimits(BaseModel):
    limit: int = Field(ge=1)


"""Characters of a query read for words: a whole pasted document is not searched word by word."""
_SCHEMA_VERSION: Final = "1"
_MARKDOWN: Final = frozenset({".md", ".markdown"})
_WORD = re.compile(r"\w+")
_TOKENIZER: Final = "tokenize = 'porter unicode61 remove_diacritics 2'"
"""Porter stemming ("refunds" finds "refund"); case and diacritics do not matter."""
_WEIGHTS: Final = (2.0, 1.0)
"""BM25 weights of a passage's title (its file's path and its headings) and its body."""
_COMMON_WORDS: Final = (
    "a an and are as at be but by can do does for from had has have how i if in is it its me my"
    " no not of on or our so than that the their them then there these they this to was we were"
    " what when where which who why will with would you your"
)
_STOPWORDS: Final = frozenset(_COMMON_WORDS.split())
"""English words too common to search for, left out of a query that has others."""
_K1: Final = 1.2
_B: Final = 0.75
_CANDIDATES: Final = 100
"""Passages FTS5 finds (ranked by its own BM25) that are scored again."""


# -- the index -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class IndexHit:
    """A passage found by a search.

    Attributes:
        text: the passage.
        source: where it is: ``path:first-last``, and its headings in
            parentheses when it has some.
        score: its BM25 relevance (higher is more relevant; above 0).
        path: its file, relative to the folder, with ``/`` separators.
        first_line: its first line, from 1.
        last_line: its last line.
        heading: the headings above it, joined by `` > ``.
    """

    text: str
    source: str
    score: float
    path: str
    first_line: int
    last_line: int
    heading: str

    def as_dict(self) -> dict[str, Any]:
        """The hit as the tool returns it (a JSON object)."""
        return {
            "text": self.text,
            "source": self.source,
            "score": self.score,
            "path": self.path,
            "first_line": self.first_line,
            "last_line": self.last_line,
            "heading": self.heading,
        }


@dataclass(frozen=True, slots=True)
class IndexStats:
    """What a refresh did, and what the index holds after it.

    Attributes:
        indexed: files indexed (new or changed).
        removed: files forgotten (deleted, or no longer indexable).
        skipped: files too large or unreadable (logged).
        files: files the index knows.
        chunks: passages it holds.
    """

    indexed: int
    removed: int
    skipped: int
    files: int
    chunks: int


class KnowledgeIndex:
    """A folder of text and Markdown files, searchable by relevance.

    Nothing is read or indexed when it is made: the first search (or
    :meth:`refresh`) does it. Safe to share between threads and tasks (its
    work is serialized); several processes may share one ``index_path``.

    Args:
        folder: the folder; files in it and its subfolders are indexed, but
            not hidden ones (a name starting with ``.``), symlinks, nor
            files above ``max_file_bytes``.
        index_path: a SQLite file to keep the index in (made if missing); by
            default it lives in memory and the folder is indexed anew by
            each process.
        chunk_chars: the longest passage, in characters (100 to 20,000).
        refresh_interval: seconds between looks at the folder for changed
            files, before a search; ``0`` looks before every search, ``None``
            only when :meth:`refresh` is called.
        extensions: the file name endings indexed; ``.md`` and
            ``.markdown`` are read as Markdown, any other as plain text.
        max_file_bytes: larger files are skipped.

    Raises:
        ConfigError: the folder is not a directory, or a setting is out of range.
    """

    def __init__(
        self,
        folder: str | Path,
        *,
        index_path: str | Path | None = None,
        chunk_chars: int = DEFAULT_CHUNK_CHARS,
        refresh_interval: float | None = 1.0,
        extensions: Iterable[str] = DEFAULT_EXTENSIONS,
        max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
    ) -> None:
        root = Path(folder).expanduser()
        if not root.is_dir():
            raise ConfigError(f"knowledge folder {str(root)!r} is not a directory")
        check_ranges(
            _IndexLimits,
            "KnowledgeIndex",
            chunk_chars=chunk_chars,
            refresh_interval=refresh_interval,
            max_file_bytes=max_file_bytes,
        )
        self.folder = root.resolve()
        self.index_path = None if index_path is None else Path(index_path).expanduser()
        self.chunk_chars = chunk_chars
        self.refresh_interval = refresh_interval
        self.extensions = tuple(e.lower() for e in extensions)
        self.max_file_bytes = max_file_bytes
        self._lock = threading.Lock()
        self._db: sqlite3.Connection | None = None
        self._refreshed_at: float | None = None
        self._stats: tuple[int, float, float] | None = None

    def __repr__(self) -> str:
        return f"KnowledgeIndex({str(self.folder)!r})"

    async def retrieve(
        self, query: str, limit: int = DEFAULT_LIMIT, score_threshold: float | None = None
    ) -> list[IndexHit]:
        """:meth:`search`, in a thread (the event loop goes on meanwhile).

        Raises:
            ConfigError: as :meth:`search`.
        """
        return await asyncio.to_thread(self.search, query, limit, score_threshold)

    def search(
        self, query: str, limit: int = DEFAULT_LIMIT, score_threshold: float | None = None
    ) -> list[IndexHit]:
        """The passages most relevant to ``query``, most relevant first.

        Any text is a query: its first 64 distinct words (letters and
        digits; common English words such as "the" or "how" left out when
        there are others) are searched for, any of them matching, and the
        passages are scored with BM25; a query without words finds nothing.
        Refreshes first when ``refresh_interval`` has passed.

        Args:
            query: what to look for.
            limit: at most this many passages (cut to :data:`MAX_RESULTS`).
            score_threshold: leave out passages scoring below it.

        Raises:
            ConfigError: ``limit`` is below 1, or the folder is gone.
        """
        check_ranges(_SearchLimits, "KnowledgeIndex.search", limit=limit)
        expression = _match_expression(query)
        with self._lock, self._translated():
            db = self._open()
            interval = self.refresh_interval
            due = self._refreshed_at is None or (
                interval is not None and time.monotonic() - self._refreshed_at >= interval
            )
            if due:
                self._refresh(db)
            if expression is None:
                return []
            hits = self._ranked(db, expression)
        if score_threshold is not None:
            hits = [hit for hit in hits if hit.score >= score_threshold]
        return hits[: min(limit, MAX_RESULTS)]

    def refresh(self) -> IndexStats:
        """Index new and changed files, forget deleted ones, now.

        Raises:
            ConfigError: the folder is gone, or the index file cannot be used.
        """
        with self._lock, self._translated():
            return self._refresh(self._open())

    def close(self) -> None:
        """Close the index (an in-memory one is lost; a search opens it again)."""
        with self._lock:
            if self._db is not None:
                self._db.close()
                self._db = None
                self._refreshed_at = None
                self._stats = None

    def _ranked(self, db: sqlite3.Connection, expression: tuple[str, str]) -> list[IndexHit]:
        """The passages matching ``expression``, scored with BM25 and sorted.

        FTS5 finds the candidates (the best by its own BM25), which are
        scored again here with the IDF of Lucene's BM25,
        ``ln(1 + (N - n + 0.5) / (n + 0.5))``: FTS5 counts a word found in
        half the passages or more as nothing, which in a small folder is
        every word of the question. The query's words as the index has them
        (stemmed) come from a scratch table of the connection; their counts
        in the candidates, and in how many passages they are, from the
        index's vocabulary, which FTS5 keeps up to date: counting the
        candidates' words anew for each search is what made a search of a
        large folder slow.
        """
        match, words = expression
        rows = db.execute(
            "SELECT c.id, c.path, c.first_line, c.last_line, c.heading, c.text,"
            " c.title_words, c.body_words"
            " FROM passages JOIN chunks AS c ON c.id = passages.rowid"
            " WHERE passages MATCH ? ORDER BY bm25(passages, ?, ?) LIMIT ?",
            (match, *_WEIGHTS, _CANDIDATES),
        ).fetchall()
        if not rows:
            return []
        terms = _stemmed(db, words)
        marks = ",".join("?" * len(terms))
        ids = [row[0] for row in rows]
        counts = db.execute(
            "SELECT term, doc, col, count(*) FROM temp.passages_instances"
            f" WHERE term IN ({marks}) AND doc IN ({','.join('?' * len(ids))})"
            " GROUP BY term, doc, col",
            [*terms, *ids],
        ).fetchall()
        found = db.execute(
            f"SELECT term, doc FROM temp.passages_terms WHERE term IN ({marks})", terms
        ).fetchall()
        total, title_words, body_words = self._corpus(db)
        idf = {term: log(1 + (total - n + 0.5) / (n + 0.5)) for term, n in found}
        scores: dict[int, float] = {}
        lengths = {row[0]: (row[6] / title_words, row[7] / body_words) for row in rows}
        for term, doc, column, tf in counts:
            if term not in idf:
                continue
            col = 0 if column == "title" else 1
            norm = 1 - _B + _B * lengths[doc][col]
            gain = idf[term] * _WEIGHTS[col] * tf * (_K1 + 1) / (tf + _K1 * norm)
            scores[doc] = scores.get(doc, 0.0) + gain
        hits = [
            _hit(path, first, last, heading, text, scores.get(chunk_id, 0.0))
            for chunk_id, path, first, last, heading, text, _, _ in rows
        ]
        hits.sort(key=lambda hit: (-hit.score, hit.path, hit.first_line))
        return hits

    def _corpus(self, db: sqlite3.Connection) -> tuple[int, float, float]:
        """Passages, and the mean words of their titles and bodies (kept until a refresh)."""
        if self._stats is None:
            count, title, body = db.execute(
                "SELECT count(*), avg(title_words), avg(body_words) FROM chunks"
            ).fetchone()
            self._stats = (count, max(title or 0.0, 1.0), max(body or 0.0, 1.0))
        return self._stats

    @contextlib.contextmanager
    def _translated(self) -> Iterator[None]:
        """SQLite's failures (a locked, full or damaged index file) as a ConfigError."""
        try:
            yield
        except sqlite3.Error as exc:
            target = "in memory" if self.index_path is None else str(self.index_path)
            raise ConfigError(f"the knowledge index ({target}) failed: {exc}") from exc

    def _open(self) -> sqlite3.Connection:
        if self._db is not None:
            return self._db
        target = ":memory:" if self.index_path is None else str(self.index_path)
        db = sqlite3.connect(target, timeout=30.0, check_same_thread=False)
        try:
            db.isolation_level = None  # transactions are explicit
            if self.index_path is not None:
                db.execute("PRAGMA journal_mode=WAL")
            _ensure_schema(db, self._settings())
            # Per connection: the words of a query as the index has them, and
            # the index's vocabulary (which passage has which word, how often).
            db.execute(
                f"CREATE VIRTUAL TABLE temp.scratch USING fts5(body, content='', {_TOKENIZER})"
            )
            db.execute(
                "CREATE VIRTUAL TABLE temp.scratch_terms USING fts5vocab(temp, scratch, row)"
            )
            db.execute(
                "CREATE VIRTUAL TABLE temp.passages_terms USING fts5vocab(main, passages, row)"
            )
            db.execute(
                "CREATE VIRTUAL TABLE temp.passages_instances"
                " USING fts5vocab(main, passages, instance)"
            )
        except BaseException:
            db.close()
            raise
        self._db = db
        return db

    def _settings(self) -> str:
        return f"{_SCHEMA_VERSION}|{self.folder}|{self.chunk_chars}|{','.join(self.extensions)}"

    def _refresh(self, db: sqlite3.Connection) -> IndexStats:
        if not self.folder.is_dir():
            raise ConfigError(f"knowledge folder {str(self.folder)!r} is gone")
        seen = dict(self._scan())
        known = {path: (mtime, size) for path, mtime, size in db.execute("SELECT * FROM files")}
        gone = sorted(known.keys() - seen.keys())
        changed = sorted(path for path, stamp in seen.items() if known.get(path) != stamp)
        indexed = skipped = 0
        if gone or changed:
            db.execute("BEGIN IMMEDIATE")
            try:
                for path in gone:
                    _forget(db, path)
                for path in changed:
                    _forget(db, path)
                    chunks = self._read(path, seen[path][1])
                    if chunks is None:
                        skipped += 1
                    else:
                        indexed += 1
                        _insert(db, path, chunks)
                    db.execute("INSERT INTO files VALUES (?, ?, ?)", (path, *seen[path]))
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise
        self._refreshed_at = time.monotonic()
        self._stats = None  # another process sharing the file may have changed it too
        files, chunks = db.execute(
            "SELECT (SELECT count(*) FROM files), (SELECT count(*) FROM chunks)"
        ).fetchone()
        if gone or changed:
            logger.info(
                "knowledge %s: indexed %d file(s), removed %d; %d passage(s) in %d file(s)",
                self.folder,
                indexed,
                len(gone),
                chunks,
                files,
            )
        return IndexStats(indexed, len(gone), skipped, files, chunks)

    def _scan(self) -> Iterable[tuple[str, tuple[int, int]]]:
        """Every indexable file: its relative path, and (mtime in ns, size)."""
        for directory, dirs, files in os.walk(self.folder):
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))
            for name in files:
                if name.startswith(".") or not name.lower().endswith(self.extensions):
                    continue
                full = Path(directory, name)
                try:
                    info = full.lstat()
                except OSError:
                    continue  # deleted meanwhile
                if not stat.S_ISREG(info.st_mode):
                    continue  # a symlink (maybe to outside the folder), a fifo…
                yield full.relative_to(self.folder).as_posix(), (info.st_mtime_ns, info.st_size)

    def _read(self, path: str, size: int) -> list[Chunk] | None:
        if size > self.max_file_bytes:
            logger.warning(
                "knowledge %s: %s is %d bytes, above %d: skipped",
                self.folder,
                path,
                size,
                self.max_file_bytes,
            )
            return None
        try:
            data = (self.folder / path).read_bytes()[: self.max_file_bytes]
        except OSError as exc:
            logger.warning("knowledge %s: cannot read %s: %s", self.folder, path, exc)
            return None
        markdown = Path(path).suffix.lower() in _MARKDOWN
        text = data.decode("utf-8", errors="replace").replace("\x00", "")
        return chunk_document(text, markdown=markdown, max_chars=self.chunk_chars)


def _ensure_schema(db: sqlite3.Connection, settings: str) -> None:
    """Make the tables; start afresh when the index was made with other settings."""
    db.execute("CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT)")
    row = db.execute("SELECT value FROM meta WHERE key = 'settings'").fetchone()
    if row is not None and row[0] == settings:
        return
    db.execute("BEGIN IMMEDIATE")
    try:
        db.execute("DROP TABLE IF EXISTS passages")
        db.execute("DROP TABLE IF EXISTS chunks")
        db.execute("DROP TABLE IF EXISTS files")
        db.execute("CREATE TABLE files (path TEXT PRIMARY KEY, mtime_ns INTEGER, size INTEGER)")
        db.execute(
            "CREATE TABLE chunks (id INTEGER PRIMARY KEY, path TEXT NOT NULL,"
            " first_line INTEGER, last_line INTEGER, heading TEXT, text TEXT,"
            " title_words INTEGER, body_words INTEGER)"
        )
        db.execute("CREATE INDEX chunks_path ON chunks (path)")
        db.execute(f"CREATE VIRTUAL TABLE passages USING fts5(title, body, {_TOKENIZER})")
        db.execute("INSERT OR REPLACE INTO meta VALUES ('settings', ?)", (settings,))
        db.execute("COMMIT")
    except BaseException:
        db.execute("ROLLBACK")
        raise


def _forget(db: sqlite3.Connection, path: str) -> None:
    db.execute(
        "DELETE FROM passages WHERE rowid IN (SELECT id FROM chunks WHERE path = ?)", (path,)
    )
    db.execute("DELETE FROM chunks WHERE path = ?", (path,))
    db.execute("DELETE FROM files WHERE path = ?", (path,))


def _insert(db: sqlite3.Connection, path: str, chunks: list[Chunk]) -> None:
    for chunk in chunks:
        title = _title(path, chunk.heading)
        cursor = db.execute(
            "INSERT INTO chunks (path, first_line, last_line, heading, text, title_words,"
            " body_words) VALUES (?, ?, ?, ?, ?, ?, ?)",
            (
                path,
                chunk.first_line,
                chunk.last_line,
                chunk.heading,
                chunk.text,
                len(_WORD.findall(title)),
                len(_WORD.findall(chunk.text)),
            ),
        )
        db.execute(
            "INSERT INTO passages (rowid, title, body) VALUES (?, ?, ?)",
            (cursor.lastrowid, title, chunk.text),
        )


def _title(path: str, heading: str) -> str:
    """What a passage is searched by besides its text: its file's path and its headings."""
    return f"{path}\n{heading}"


def _stemmed(db: sqlite3.Connection, words: str) -> list[str]:
    """``words`` as the index's tokenizer makes them (stemmed, folded), each once."""
    db.execute("INSERT INTO temp.scratch (rowid, body) VALUES (1, ?)", (words,))
    try:
        return [term for (term,) in db.execute("SELECT term FROM temp.scratch_terms")]
    finally:
        db.execute("INSERT INTO temp.scratch (scratch) VALUES ('delete-all')")


def _match_expression(query: str) -> tuple[str, str] | None:
    """The FTS5 query matching any word of ``query``, each quoted (so nothing
    in it is FTS5 syntax), and those words; ``None`` when it has no words."""
    words = query_words(
        query, max_chars=_MAX_QUERY_CHARS, max_terms=MAX_QUERY_TERMS, stopwords=_STOPWORDS
    )
    return (any_of(words), " ".join(words)) if words else None


def _hit(path: str, first: int, last: int, heading: str, text: str, score: float) -> IndexHit:
    where = f"{path}:{first}-{last}"
    return IndexHit(
        text=text,
        source=f"{where} ({heading})" if heading else where,
        score=round(score, 4),
        path=path,
        first_line=first,
        last_line=last,
        heading=heading,
    )


# -- the tool ------------------------------------------------------------------------------


def knowledge_tools(
    index: KnowledgeIndex, *, name: str = DEFAULT_TOOL_NAME, description: str | None = None
) -> list[Tool]:
    """The search tool of ``index`` (what a worker serves, or a local toolkit holds).

    Args:
        index: the knowledge base.
        name: the tool's name.
        description: for the model; a sentence about the search by default.

    Raises:
        ToolDefinitionError: ``name`` cannot be a tool's name.
    """

    def search(
        query: str,
        limit: Annotated[int, Field(ge=1, le=MAX_RESULTS)] = DEFAULT_LIMIT,
        score_threshold: float | None = None,
    ) -> list[dict[str, Any]]:
        """Search the knowledge base: the passages of its documents most
        relevant to the query, most relevant first, each with its text, its
        source (file, lines and headings) and its score (BM25, higher is better).

        Args:
            query: what to look for, in words (a question is fine).
            limit: how many passages at most.
            score_threshold: leave out passages scoring below it.
        """
        return [hit.as_dict() for hit in index.search(query, limit, score_threshold)]

    return [tool(name=name, description=description)(search)]


def knowledge_toolkit(
    folder: str | Path | None = None,
    *,
    name: str | None = None,
    index_path: str | Path | None = None,
) -> Toolkit:
    """A toolkit of the search tool of a folder, indexed now.

    Args:
        folder: the folder; ``$FLEETBUS_KNOWLEDGE_DIR`` by default.
        name: the tool's name; ``$FLEETBUS_KNOWLEDGE_TOOL``, else ``knowledge_search``.
        index_path: a SQLite file for the index; ``$FLEETBUS_KNOWLEDGE_INDEX``,
            else in memory.

    Raises:
        ConfigError: no folder given nor set, or it cannot be indexed.
        ToolDefinitionError: the name cannot be a tool's name.
    """
    settings = ToolSettings()
    folder = folder or settings.knowledge_dir
    if not folder:
        raise ConfigError(
            f"set {KNOWLEDGE_DIR_ENV} to the folder of documents to serve (text and Markdown files)"
        )
    index = KnowledgeIndex(folder, index_path=index_path or settings.knowledge_index)
    stats = index.refresh()
    logger.info(
        "knowledge %s: %d passage(s) in %d file(s)", index.folder, stats.chunks, stats.files
    )
    tool_name = name or settings.knowledge_tool
    return Toolkit(knowledge_tools(index, name=tool_name))


def __getattr__(name: str) -> Toolkit:
    """``toolkit``: the folder of ``FLEETBUS_KNOWLEDGE_DIR``, made (and indexed)
    when first read, so that importing the module needs no folder."""
    if name != "toolkit":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    made = knowledge_toolkit()
    globals()["toolkit"] = made
    return made
