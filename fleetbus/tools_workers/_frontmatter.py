"""The YAML front matter that opens a Markdown file (a skill's ``SKILL.md``).

PyYAML is not a dependency of fleetbus, and front matter uses little of
YAML: a handful of top-level keys with text values. This reader takes that
subset and refuses the rest with the line it stopped at:

- ``key: value`` pairs at the top level (a key is letters, digits, ``_``,
  ``-`` and ``.``), each key once;
- plain values, continued on more-indented lines (folded with spaces);
  ``'single'`` and ``"double"`` quoted values on one line; block values
  ``|`` (lines kept) and ``>`` (lines folded), with ``-`` / ``+`` chomping;
- ``[a, "b"]``: a list of values on one line;
- one level of nesting: a key without a value followed by more-indented
  ``key: value`` lines (a mapping) or ``- item`` lines (a list);
- blank lines and ``#`` comments.

Values are kept as text (``version: 1.0`` is ``"1.0"``); a key without a
value is ``None``. Anchors, aliases, tags, flow mappings and deeper nesting
are refused.
"""

from __future__ import annotations

import re
from typing import Any, Final

__all__ = ["FrontMatterError", "parse_front_matter"]

MAX_FRONT_MATTER_LINES: Final = 400
"""Lines the front matter may take, its closing ``---`` included."""

_KEY = re.compile(r"([A-Za-z0-9_][A-Za-z0-9_.-]*)[ \t]*:(?:[ \t]+(.*))?\Z")
_BLOCK_HEADER = re.compile(r"([|>])([+-]?)[ \t]*(?:#.*)?\Z")
_ESCAPES: Final = {
    "0": "\0",
    "a": "\a",
    "b": "\b",
    "t": "\t",
    "\t": "\t",
    "n": "\n",
    "v": "\v",
    "f": "\f",
    "r": "\r",
    "e": "\x1b",
    " ": " ",
    '"': '"',
    "/": "/",
    "\\": "\\",
    "N": "\x85",
    "_": "\xa0",
}
_HEX_ESCAPES: Final = {"x": 2, "u": 4, "U": 8}


class FrontMatterError(ValueError):
    """Front matter that is missing, unclosed, or outside the subset read here.

    Attributes:
        line: the line of the file (from 1) where reading stopped.
    """

    def __init__(self, message: str, line: int) -> None:
        super().__init__(f"line {line}: {message}")
        self.line = line


def parse_front_matter(text: str) -> tuple[dict[str, Any], int]:
    """The front matter of ``text`` and where the rest begins.

    ``text`` must open (after a byte-order mark, if any) with a ``---`` line;
    the front matter ends at the next ``---`` (or ``...``) line.

    Returns:
        The keys and values, and the index in ``text`` of the first character
        after the closing line.

    Raises:
        FrontMatterError: no front matter, no closing line within
            ``MAX_FRONT_MATTER_LINES``, or a line outside the subset.
    """
    start = 1 if text.startswith("\ufeff") else 0
    lines = text[start:].split("\n", MAX_FRONT_MATTER_LINES + 1)
    if lines[0].rstrip() != "---":
        raise FrontMatterError("the file does not open with front matter (a line '---')", 1)
    for index in range(1, min(len(lines), MAX_FRONT_MATTER_LINES + 1)):
        if lines[index].rstrip() in ("---", "..."):
            if index == len(lines) - 1:
                end = len(text)  # the closing line is the last one, without a newline
            else:
                end = start + sum(len(line) + 1 for line in lines[: index + 1])
            body = [(number, line.rstrip("\r")) for number, line in enumerate(lines[1:index], 2)]
            return _mapping(body), end
    raise FrontMatterError(
        f"the front matter is not closed by a line '---' within {MAX_FRONT_MATTER_LINES} lines",
        min(len(lines), MAX_FRONT_MATTER_LINES),
    )


def _mapping(lines: list[tuple[int, str]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    i = 0
    while i < len(lines):
        number, line = lines[i]
        i += 1
        if _blank(line):
            continue
        if line[0] in " \t":
            raise FrontMatterError("unexpected indentation", number)
        found = _KEY.match(line.rstrip())
        if found is None:
            raise FrontMatterError(f"expected 'key: value', found {_show(line)}", number)
        key, raw = found.group(1), found.group(2) or ""
        if key in result:
            raise FrontMatterError(f"the key {key!r} is given twice", number)
        block = []
        while i < len(lines) and (not lines[i][1].strip() or lines[i][1][0] in " \t"):
            block.append(lines[i])
            i += 1
        result[key] = _value(raw.strip(), block, number)
    return result


def _value(raw: str, block: list[tuple[int, str]], number: int) -> Any:
    header = _BLOCK_HEADER.match(raw)
    if header is not None:
        return _block_scalar(header.group(1), header.group(2), block, number)
    filled = [(n, line) for n, line in block if not _blank(line)]
    if not raw or raw.startswith("#"):
        if not filled:
            return None
        return _nested(filled)
    if raw[0] in "\"'[":
        if filled:
            raise FrontMatterError("a quoted value or a [list] must stay on one line", filled[0][0])
        return _flow_sequence(raw, number) if raw[0] == "[" else _scalar(raw, number)
    # A plain value goes on over the more-indented lines that follow.
    lines = [_scalar(raw, number)]
    lines += ["" if _blank(line) else _plain(line.strip(), n) for n, line in block]
    while lines and not lines[-1]:
        lines.pop()
    return _fold(lines)


def _block_scalar(style: str, chomp: str, block: list[tuple[int, str]], number: int) -> str:
    content = [line for _, line in block]
    filled = [line for line in content if line.strip()]
    if not filled:
        return ""
    indent = min(len(line) - len(line.lstrip(" ")) for line in filled)
    if indent == 0:
        raise FrontMatterError(
            "the lines of a block value must be indented with spaces", number + 1
        )
    texts = [line[indent:] if line.strip() else "" for line in content]
    trailing = 0
    while texts and not texts[-1]:
        texts.pop()
        trailing += 1
    text = "\n".join(texts) if style == "|" else _fold(texts)
    if chomp == "-":
        return text
    return text + "\n" * (trailing + 1 if chomp == "+" else 1)


def _fold(lines: list[str]) -> str:
    """Lines joined with spaces; an empty line stands for a line break."""
    text = ""
    for line in lines:
        if not line:
            text += "\n"
        elif text and not text.endswith("\n"):
            text += " " + line
        else:
            text += line
    return text


def _nested(filled: list[tuple[int, str]]) -> list[str] | dict[str, str]:
    indent = len(filled[0][1]) - len(filled[0][1].lstrip(" \t"))
    items: list[str] = []
    pairs: dict[str, str] = {}
    is_list = filled[0][1].strip().startswith("-")
    for n, line in filled:
        here = len(line) - len(line.lstrip(" \t"))
        stripped = line.strip()
        if here != indent:
            raise FrontMatterError("values nested more than one level are not read", n)
        if is_list:
            if not (stripped == "-" or stripped.startswith("- ")):
                raise FrontMatterError(f"expected '- item', found {_show(stripped)}", n)
            item = stripped[1:].strip()
            items.append(_flow_sequence_item(item, n))
            continue
        found = _KEY.match(stripped)
        if found is None:
            raise FrontMatterError(f"expected 'key: value', found {_show(stripped)}", n)
        key, raw = found.group(1), (found.group(2) or "").strip()
        if key in pairs:
            raise FrontMatterError(f"the key {key!r} is given twice", n)
        if not raw or raw.startswith("#") or raw[0] in "[|>":
            raise FrontMatterError(f"{key}: values nested more than one level are not read", n)
        pairs[key] = _scalar(raw, n)
    return items if is_list else pairs


def _flow_sequence(raw: str, number: int) -> list[str]:
    inner, _, rest = raw[1:].partition("]")
    if not _blank(rest.strip()) or "[" in inner or "{" in inner:
        raise FrontMatterError(f"a [list] of plain or quoted values, not {_show(raw)}", number)
    if not inner.strip():
        return []
    return [_flow_sequence_item(item.strip(), number) for item in _split_commas(inner, number)]


def _flow_sequence_item(item: str, number: int) -> str:
    if not item:
        return ""
    if item[0] in "[{" or (item[0] not in "\"'" and _KEY.match(item)):
        raise FrontMatterError(
            f"values nested more than one level are not read: {_show(item)}", number
        )
    return _scalar(item, number)


def _split_commas(inner: str, number: int) -> list[str]:
    items, current, quote = [], "", ""
    for char in inner:
        if quote:
            current += char
            if char == quote:
                quote = ""
        elif char in "\"'":
            quote = char
            current += char
        elif char == ",":
            items.append(current)
            current = ""
        else:
            current += char
    if quote:
        raise FrontMatterError("a quoted value is not closed", number)
    if current.strip() or items:
        items.append(current)
    return items


def _scalar(raw: str, number: int) -> str:
    if raw.startswith('"'):
        return _double_quoted(raw, number)
    if raw.startswith("'"):
        return _single_quoted(raw, number)
    return _plain(raw, number)


def _plain(raw: str, number: int) -> str:
    if raw[0] in "&*!%@`{":
        raise FrontMatterError(
            f"anchors, aliases, tags and {{mappings}} are not read: {_show(raw)}", number
        )
    comment = re.search(r"[ \t]#", raw)
    return (raw[: comment.start()] if comment else raw).strip()


def _single_quoted(raw: str, number: int) -> str:
    text, i = "", 1
    while i < len(raw):
        if raw[i] == "'":
            if raw[i + 1 : i + 2] == "'":
                text += "'"
                i += 2
                continue
            _after_quote(raw[i + 1 :], number)
            return text
        text += raw[i]
        i += 1
    raise FrontMatterError("a quoted value is not closed on its line", number)


def _double_quoted(raw: str, number: int) -> str:
    text, i = "", 1
    while i < len(raw):
        char = raw[i]
        if char == '"':
            _after_quote(raw[i + 1 :], number)
            return text
        if char != "\\":
            text += char
            i += 1
            continue
        code = raw[i + 1 : i + 2]
        if code in _ESCAPES:
            text += _ESCAPES[code]
            i += 2
        elif code in _HEX_ESCAPES:
            digits = raw[i + 2 : i + 2 + _HEX_ESCAPES[code]]
            if len(digits) != _HEX_ESCAPES[code] or not re.fullmatch(r"[0-9A-Fa-f]+", digits):
                raise FrontMatterError(f"a bad escape \\{code}{digits}", number)
            try:
                text += chr(int(digits, 16))
            except ValueError:
                raise FrontMatterError(f"a bad escape \\{code}{digits}", number) from None
            i += 2 + len(digits)
        else:
            raise FrontMatterError(f"an unknown escape \\{code}", number)
    raise FrontMatterError("a quoted value is not closed on its line", number)


def _after_quote(rest: str, number: int) -> None:
    if rest.strip() and not rest.lstrip().startswith("#"):
        raise FrontMatterError(f"text after a closing quote: {_show(rest)}", number)


def _blank(line: str) -> bool:
    stripped = line.strip()
    return not stripped or stripped.startswith("#")


def _show(text: str) -> str:
    return repr(text if len(text) <= 60 else text[:60] + "…")
