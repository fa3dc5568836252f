"""Cutting text and Markdown documents into passages, for
:mod:`fleetbus.tools_workers.knowledge`."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final

from pydantic import BaseModel, Field

from fleetbus.tools_workers.settings import check_ranges

__all__ = ["DEFAULT_CHUNK_CHARS", "Chunk", "chunk_document"]

DEFAULT_CHUNK_CHARS: Final = 1500
"""Longest passage, in characters, unless the index is told otherwise."""

_HEADING = re.compile(r"^ {0,3}(#{1,6})(?:[ \t]+(.*?))?(?:[ \t]+#+)?[ \t]*$")
_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")


@dataclass(frozen=True, slots=True)
class Chunk:
    """One passage of a document.

    Attributes:
        text: the passage, as written in the file.
        first_line: its first line in the file, from 1.
        last_line: its last line.
        heading: the headings above it, outermost first, joined by `` > ``
            (``""`` in plain text and before a Markdown file's first heading).
    """

    text: str
    first_line: int
    last_line: int
    heading: str = ""


class _Limits(BaseModel):
    max_chars: int = Field(ge=1)


def chunk_document(
    text: str, *, markdown: bool = True, max_chars: int = DEFAULT_CHUNK_CHARS
) -> list[Chunk]:
    """Cut a document into passages of at most ``max_chars`` characters.

    Markdown starts a passage at every ATX heading (``#`` to ``######``,
    outside fenced code) and keeps the headings above it; within a section,
    paragraphs (blocks between blank lines; a fenced code block is one) are
    put together while they fit. A paragraph too long alone is cut at line
    ends, and a line too long at ``max_chars``. A heading with nothing under
    it before the next is no passage of its own.

    Raises:
        ConfigError: ``max_chars`` is below 1.
    """
    check_ranges(_Limits, "chunk_document", max_chars=max_chars)
    lines = [line.rstrip("\r") for line in text.split("\n")]
    chunks: list[Chunk] = []
    for heading, blocks in _sections(lines, markdown):
        _pack(lines, heading, blocks, max_chars, chunks)
    return chunks


def _sections(lines: list[str], markdown: bool) -> list[tuple[str, list[tuple[int, int, bool]]]]:
    """The sections of a document: each its heading path and its blocks
    (first line, last line, whether the block is the heading line), 0-based."""
    sections: list[tuple[str, list[tuple[int, int, bool]]]] = [("", [])]
    titles: list[tuple[int, str]] = []
    start: int | None = None
    fence: str | None = None

    def close(end: int) -> None:
        nonlocal start
        if start is not None:
            sections[-1][1].append((start, end, False))
            start = None

    for i, line in enumerate(lines):
        if fence is not None:
            if line.strip().startswith(fence) and not line.strip().strip(fence[0]):
                fence = None
            continue
        opening = _FENCE.match(line) if markdown else None
        if opening is not None:
            fence = opening.group(1)
            if start is None:
                start = i
            continue
        heading = _HEADING.match(line) if markdown else None
        if heading is not None:
            close(i - 1)
            level = len(heading.group(1))
            titles = [t for t in titles if t[0] < level]
            titles.append((level, (heading.group(2) or "").strip()))
            path = " > ".join(title for _, title in titles if title)
            sections.append((path, [(i, i, True)]))
        elif not line.strip():
            close(i - 1)
        elif start is None:
            start = i
    close(len(lines) - 1)
    return sections


def _pack(
    lines: list[str],
    heading: str,
    blocks: list[tuple[int, int, bool]],
    max_chars: int,
    out: list[Chunk],
) -> None:
    """Put a section's blocks together into chunks that fit."""
    first: int | None = None
    last = 0
    has_text = False

    def emit() -> None:
        if first is not None and has_text:
            out.append(_chunk(lines, first, last, heading))

    for block_first, block_last, is_heading in blocks:
        if first is not None and _size(lines, first, block_last) > max_chars:
            emit()
            first, has_text = None, False
        if _size(lines, block_first, block_last) > max_chars:
            emit()
            first, has_text = None, False
            out.extend(_split(lines, block_first, block_last, heading, max_chars))
            continue
        if first is None:
            first = block_first
        last = block_last
        has_text = has_text or not is_heading
    emit()


def _size(lines: list[str], first: int, last: int) -> int:
    return sum(len(line) + 1 for line in lines[first : last + 1]) - 1


def _chunk(lines: list[str], first: int, last: int, heading: str) -> Chunk:
    return Chunk("\n".join(lines[first : last + 1]).strip(), first + 1, last + 1, heading)


def _split(lines: list[str], first: int, last: int, heading: str, max_chars: int) -> list[Chunk]:
    """A block too long for one chunk, cut at line ends (and long lines at ``max_chars``)."""
    pieces: list[Chunk] = []
    start: int | None = None
    for i in range(first, last + 1):
        if len(lines[i]) > max_chars:
            if start is not None:
                pieces.append(_chunk(lines, start, i - 1, heading))
                start = None
            line = lines[i]
            for at in range(0, len(line), max_chars):
                pieces.append(Chunk(line[at : at + max_chars], i + 1, i + 1, heading))
            continue
        if start is not None and _size(lines, start, i) > max_chars:
            pieces.append(_chunk(lines, start, i - 1, heading))
            start = None
        if start is None:
            start = i
    if start is not None:
        pieces.append(_chunk(lines, start, last, heading))
    return [p for p in pieces if p.text]
