"""Sentences in streamed text: :class:`SentenceSplitter` cuts the pieces a
model streams into sentences as they arrive, deciding each end once the
character after it has come (what :class:`~fleetbus.agents.SpeakReply` speaks,
one at a time)."""

from __future__ import annotations

from fleetbus.errors import ConfigError

__all__ = ["SentenceSplitter"]

_ENDINGS = ".!?…"
_CLOSERS = "\"')]}\u00bb\u201d\u2019"
_OPENERS = "\"'([{\u00ab\u201c\u2018"
_ABBREVIATIONS = frozenset(
    {
        *("mr", "mrs", "ms", "mx", "dr", "prof", "sr", "jr", "st", "mt"),
        *("rev", "capt", "lt", "sgt", "gov", "e.g", "i.e", "vs", "cf", "approx"),
        *("fig", "vol", "pp", "inc", "ltd", "corp", "dept", "univ"),
    }
)
"""Words that a period follows without ending the sentence (``Dr. Smith``)."""


class SentenceSplitter:
    """Cuts streamed text into sentences as the pieces arrive.

    A sentence ends at ``.``, ``!``, ``?`` or ``…`` (and the closing quotes or
    brackets after them) followed by a space and not by a lowercase letter,
    and at every line break. A period does not end one inside a number
    (``3.5``), after an abbreviation or a title (``e.g.``, ``Dr.``), an
    initial (``J. Smith``) or a list number (``1. First``). Whether a
    sentence has ended is decided once the next character has come, so a
    piece that stops at ``3.`` waits for the next. A sentence longer than
    ``max_chars`` is cut at its last space before that.

    Args:
        max_chars: the longest sentence given out in one piece.
    """

    def __init__(self, max_chars: int = 400) -> None:
        if max_chars < 20:
            raise ConfigError(f"SentenceSplitter: max_chars must be >= 20, not {max_chars}")
        self.max_chars = max_chars
        self._buffer = ""
        self._pos = 0
        """Where to look next in the buffer: what comes before it is decided."""

    @property
    def pending(self) -> str:
        """The text given that is not yet part of a sentence given out."""
        return self._buffer

    def feed(self, text: str) -> list[str]:
        """Add a piece of text; the sentences it completes, in order."""
        self._buffer += text
        return self._split()

    def flush(self) -> list[str]:
        """The sentences of the text not yet given out (the text has ended)."""
        found = self._split()
        rest, self._buffer, self._pos = self._buffer.strip(), "", 0
        return [*found, rest] if rest else found

    def discard(self) -> None:
        """Forget the text not yet given out."""
        self._buffer, self._pos = "", 0

    def _split(self) -> list[str]:
        found: list[str] = []
        text, i = self._buffer, self._pos

        def cut(end: int, start: int) -> None:
            nonlocal text, i
            sentence = text[:end].strip()
            if sentence:
                found.append(sentence)
            text, i = text[start:], 0

        while i < len(text):
            if i >= self.max_chars:
                space = text.rfind(" ", 0, i)
                cut(space if space > 0 else i, space + 1 if space > 0 else i)
                continue
            char = text[i]
            if char == "\n":
                cut(i, i + 1)
                continue
            if char not in _ENDINGS:
                i += 1
                continue
            end = i
            while end < len(text) and text[end] in _ENDINGS:
                end += 1
            while end < len(text) and text[end] in _CLOSERS:
                end += 1
            if end == len(text):
                break  # "3." or "Hi!": the next piece decides
            if not text[end].isspace():
                i = end  # 3.5, e.g.x, U.S.A.
                continue
            after = end
            while after < len(text) and text[after] in " \t":
                after += 1
            if after == len(text):
                break
            if _ends_sentence(text, i, end, after):
                cut(end, after)
            else:
                i = after
        self._buffer, self._pos = text, i
        return found


def _ends_sentence(text: str, mark: int, end: int, after: int) -> bool:
    """Whether the marks ``text[mark:end]``, followed by ``text[after]`` after
    spaces, end a sentence."""
    if text[after].islower():
        return False
    if text[mark:end].rstrip(_CLOSERS) != ".":
        return True
    before = text[:mark]
    words = before.split()
    word = words[-1].lstrip(_OPENERS) if words else ""
    if word.lower() in _ABBREVIATIONS:
        return False
    if len(word) == 1 and word.isalpha() and word.isupper():
        return False  # an initial
    return not (word.isdigit() and len(words) == 1)  # a list number
