"""What the SQLite FTS5 stores (the long-term memory, the knowledge index)
search for: the words of any text, each quoted, so that nothing a user or a
model writes is read as FTS5 syntax (``NEAR(``, ``*``, ``col:``, quotes)."""

from __future__ import annotations

import re
from collections.abc import Collection

__all__ = ["any_of", "query_words"]

_WORD = re.compile(r"\w+")
_MAX_TERM_CHARS = 64
"""A longer word is searched by its beginning."""


def query_words(
    text: str, *, max_chars: int, max_terms: int, stopwords: Collection[str] = ()
) -> list[str]:
    """The distinct words of the first ``max_chars`` characters of ``text``,
    folded to lower case, at most ``max_terms`` of them, in order; single
    letters left out (not single digits), and ``stopwords`` too unless
    nothing else is left."""
    words: dict[str, None] = {}
    for found in _WORD.finditer(text[:max_chars]):
        word = found.group().lower()[:_MAX_TERM_CHARS]
        if len(word) < 2 and not word.isdigit():
            continue
        words.setdefault(word, None)
        if len(words) == max_terms:
            break
    kept = [word for word in words if word not in stopwords]
    return kept or list(words)


def any_of(words: list[str]) -> str:
    """The FTS5 query matching any of ``words`` (each quoted)."""
    return " OR ".join(f'"{word}"' for word in words)
