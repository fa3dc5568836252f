"""Tool calls written as text, and tolerant JSON: what a model's text says.

Small local models often write their tool calls in the message text instead
of the server's ``tool_calls`` (the chat template or the server did not turn
them into native calls). :func:`read_calls` finds the shapes they write:

- a bare JSON object ``{"name": "calculator", "arguments": {…}}``: the name
  under ``name`` / ``tool`` / ``tool_name`` / ``function``, the arguments under
  ``arguments`` / ``parameters`` / ``args`` / ``input`` (an object, or an
  object encoded as a JSON string);
- OpenAI's own shape ``{"type": "function", "function": {"name": …,
  "arguments": "<json string>"}}``, and ``{"tool_calls": [...]}``;
- the same in a fenced code block, or a JSON list of such objects;
- Hermes / Qwen ``<tool_call>{…}</tool_call>`` tags, one or several;

with prose before, after or between them. An object counts as a call
when it names a tool on offer and has no other keys than the call's (so a
JSON answer or an object without a name stays the answer). An object to a
name *not* on offer counts only when it is plainly a call — nothing but a
name and an object of arguments — and inside ``<tool_call>`` tags any named
call counts: a call to an unknown tool then gets the agent's
``unknown_tool`` error, as a native one would, instead of being taken for
the answer. A tool's description the model echoed (name, description and a
JSON Schema as its parameters) is never a call.

It also finds an *invented observation* (:func:`find_observation`): the
model writing ``Observation from calculator: …`` (or a ``<tool_response>``
tag) as if a tool had answered. The adapter treats that as a format error
shown back to the model, never as the answer.

The tolerant JSON reader (:func:`loads_value`) takes code fences, prose
around the object, trailing commas, single quotes, bare keys and Python's
``True``/``False``/``None``. It is hand-written, not ``json-repair``: that
library turns any text into *some* JSON value (prose becomes a string), so it
cannot tell whether text holds an object at all, which is the question here.
Pure functions; no I/O.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from fleetbus.protocol import new_id

__all__ = [
    "TEXT_CALL_PREFIX",
    "CallGate",
    "ReadText",
    "TextCall",
    "find_observation",
    "json_spans",
    "loads_object",
    "loads_value",
    "new_call_id",
    "read_calls",
    "without_spans",
]

TEXT_CALL_PREFIX = "call_text_"
"""The id prefix of calls read from a model's text (native ids come from the
server): how a later request knows the model writes its calls as text."""

_NAME_KEYS = ("name", "tool", "tool_name", "function")
_ARGUMENT_KEYS = ("arguments", "parameters", "args", "input")
_CALL_EXTRAS = frozenset({"type", "id"})
"""Keys a call object may carry besides its name and arguments."""
_TAG = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)
_EMPTY_FENCE = re.compile(r"```[A-Za-z0-9_-]*\s*```")
_TOOL_NAME = re.compile(r"[A-Za-z_][\w.-]{0,63}")
_NAMED = re.compile(r"""["']?\b(?:name|tool|tool_name|function)\b["']?\s*:\s*["']([\w.-]+)["']""")
"""A name in an object that could not be read (is it an attempt at a call?)."""
_OBSERVATION = re.compile(
    r"^[ \t>*#_`]*(observation(?:[ \t]+from[ \t]+[\w.-]+)?[ \t]*(?:\([^)\n]*\))?[ \t*_]*:)"
    r"|(<tool_response>|<tool_result>)",
    re.IGNORECASE | re.MULTILINE,
)
_GATE_MARKERS = ("{", "```", "<tool_call", "<tool_response", "<tool_result", "observation")
_WORDS = {"True": "true", "False": "false", "None": "null"}


@dataclass(frozen=True, slots=True)
class TextCall:
    """One call found in the text.

    Attributes:
        name: the tool.
        arguments: its arguments (``{}`` when ``raw_arguments`` is set).
        raw_arguments: the arguments as written, when they are not an object.
    """

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    raw_arguments: str | None = None


@dataclass(frozen=True, slots=True)
class ReadText:
    """What a model's text says, read for tool calls.

    Attributes:
        calls: the calls found, in order (empty: none).
        prose: the text without the calls (all of it when there are none).
        error: the text tried to call a tool, or reported an observation
            no tool made, and cannot be used as it is (then ``calls`` is empty).
    """

    calls: list[TextCall] = field(default_factory=list)
    prose: str = ""
    error: str | None = None


def new_call_id() -> str:
    """A fresh id for a call read from text."""
    return f"{TEXT_CALL_PREFIX}{new_id()[:16]}"


def read_calls(text: str, offered: Collection[str]) -> ReadText:
    """The tool calls written in ``text`` to the tools ``offered``.

    Text after an invented observation is not read (a call before it still
    counts, and the observation is dropped: the real one comes when the tool
    runs); an invented observation with no call before it is an ``error``.
    """
    observed = find_observation(text)
    body = text[: observed[0]] if observed is not None else text
    calls: list[TextCall] = []
    spans: list[tuple[int, int]] = []
    error: str | None = None
    for start, end, value in _candidates(body, offered):
        if isinstance(value, str):
            error = error or value
            continue
        found = _as_calls(value, offered, tagged=body.startswith("<tool_call>", start))
        if found:
            calls.extend(found)
            spans.append((start, end))
        elif error is None and (echoed := _echoed(value, offered)) is not None:
            error = (
                f"it holds the description of the tool {echoed}, not a call of it. To call "
                f'it, write {{"name": "{echoed}", "arguments": {{...}}}} with the values '
                "its parameters describe"
            )
    if calls:
        return ReadText(calls=calls, prose=without_spans(body, spans))
    if error is not None:
        return ReadText(prose=text, error=error)
    if observed is not None:
        return ReadText(prose=text, error=invented(observed[1]))
    return ReadText(prose=text)


def invented(marker: str) -> str:
    """The error for a step that reports an observation no tool made."""
    return (
        f"it holds {marker!r}, a tool result you wrote yourself, but no tool ran. "
        "Call the tool and wait: its result comes in the next message"
    )


def find_observation(text: str) -> tuple[int, str] | None:
    """Where the model wrote a tool's result itself, and the marker it wrote
    (``Observation from calculator:``, ``<tool_response>``); ``None`` if it did not."""
    match = _OBSERVATION.search(text)
    if match is None:
        return None
    marker = re.sub(r"[*\s]+:", ":", match.group(1)) if match.group(1) else match.group(2)
    return match.start(1) if match.group(1) else match.start(2), marker


class CallGate:
    """Streams answer text until it may hold a call, then holds the rest back.

    ``feed`` returns what may be shown now; text from the first sign of a call
    (``{``, a fence, a ``<tool_call>`` tag, ``Observation``) is kept until the
    step is read, then given by ``rest`` if it was an answer after all.
    """

    def __init__(self) -> None:
        self._held: list[str] = []
        self._holding = False
        self._tail = ""

    def feed(self, piece: str) -> str:
        """Take a piece of text; the part that can be shown now."""
        if self._holding:
            self._held.append(piece)
            return ""
        text = self._tail + piece
        lower = text.lower()
        hits = [i for i in (lower.find(m) for m in _GATE_MARKERS) if i != -1]
        if hits:
            cut = min(hits)
            self._holding = True
            self._held.append(text[cut:])
            self._tail = ""
            return text[:cut]
        # A marker may be cut between two pieces: keep back what could start one.
        keep = max(
            (n for m in _GATE_MARKERS for n in range(1, len(m)) if lower.endswith(m[:n])),
            default=0,
        )
        self._tail = text[len(text) - keep :]
        return text[: len(text) - keep]

    def rest(self) -> str:
        """Everything held back."""
        return "".join(self._held) + self._tail


# -- finding calls ------------------------------------------------------------------


def _candidates(text: str, offered: Collection[str]) -> list[tuple[int, int, Any]]:
    """JSON values in ``text`` with their spans, in order: the contents of
    ``<tool_call>`` tags, then top-level objects and lists outside them. A
    value that cannot be read but is an attempt at a call is a ``str``: the error."""
    found: list[tuple[int, int, Any]] = []
    tags = list(_TAG.finditer(text))
    for match in tags:
        inner = match.group(1).strip()
        try:
            found.append((match.start(), match.end(), loads_value(inner)))
        except ValueError as exc:
            found.append((match.start(), match.end(), f"the <tool_call> is not valid JSON ({exc})"))
    outside = _TAG.sub(lambda m: " " * len(m.group(0)), text)
    found.extend(_values(outside, 0, offered))
    return sorted(found, key=lambda item: item[0])


def _values(text: str, offset: int, offered: Collection[str]) -> list[tuple[int, int, Any]]:
    found: list[tuple[int, int, Any]] = []
    for start, end in json_spans(text, "{["):
        candidate = text[start:end]
        try:
            value = loads_value(candidate)
        except ValueError as exc:
            if candidate.startswith("["):
                # Brackets in prose ([a link](…), [1]) may still hold a call object.
                found.extend(_values(candidate[1:], offset + start + 1, offered))
                continue
            names = [n for n in _NAMED.findall(candidate) if n in offered]
            if names:
                found.append(
                    (
                        offset + start,
                        offset + end,
                        f"the call to {names[0]} is not valid JSON ({exc})",
                    )
                )
            continue
        if isinstance(value, list) and _as_calls(value, offered, tagged=False) is None:
            found.extend(_values(candidate[1:], offset + start + 1, offered))
            continue
        found.append((offset + start, offset + end, value))
    return found


def _as_calls(value: Any, offered: Collection[str], *, tagged: bool) -> list[TextCall] | None:
    """The calls a JSON value stands for; ``None`` if it is not (only) calls."""
    if isinstance(value, dict) and isinstance(value.get("tool_calls"), list):
        value = value["tool_calls"]
    items = value if isinstance(value, list) else [value]
    if not items:
        return None
    calls = [_as_call(item, offered, tagged=tagged) for item in items]
    if any(call is None for call in calls):
        return None
    return [call for call in calls if call is not None]


def _as_call(value: Any, offered: Collection[str], *, tagged: bool) -> TextCall | None:
    if not isinstance(value, dict):
        return None
    function = value.get("function")
    if isinstance(function, dict):  # OpenAI's shape
        holder: dict[str, Any] = function
        name = function.get("name")
        own_keys = {"function"}
    else:
        holder = value
        name_key = next((k for k in _NAME_KEYS if isinstance(value.get(k), str)), None)
        name = value[name_key] if name_key is not None else None
        own_keys = {name_key} if name_key is not None else set()
    if not isinstance(name, str) or not name.strip():
        return None
    name = name.strip()
    argument_key = next((k for k in _ARGUMENT_KEYS if k in holder), None)
    arguments = holder.get(argument_key) if argument_key is not None else None
    if _is_schema(holder, arguments):
        return None  # a tool's description the model echoed, not a call of it
    if (
        name not in offered
        and not tagged
        and not (offered and _is_call_shaped(value, holder, argument_key, arguments, name))
    ):
        return None
    if holder is value:
        if argument_key is not None:
            own_keys.add(argument_key)
        elif value.keys() - own_keys - _CALL_EXTRAS:
            # {"name": "search", "results": […]} is data, not a call.
            return None
    return _with_arguments(name, arguments)


def _echoed(value: Any, offered: Collection[str]) -> str | None:
    """The tool on offer whose description ``value`` is (echoed by the model), if any."""
    for item in value if isinstance(value, list) else [value]:
        if not isinstance(item, dict):
            continue
        function = item.get("function")
        holder: dict[str, Any] = function if isinstance(function, dict) else item
        name = holder.get("name")
        arguments = next((holder[k] for k in _ARGUMENT_KEYS if k in holder), None)
        if isinstance(name, str) and name.strip() in offered and _is_schema(holder, arguments):
            return name.strip()
    return None


def _is_schema(holder: dict[str, Any], arguments: Any) -> bool:
    """Whether a would-be call is a tool's description (name, description,
    a JSON Schema of an object as its parameters), as the request offered it."""
    return (
        "description" in holder
        and isinstance(arguments, dict)
        and arguments.get("type") == "object"
        and isinstance(arguments.get("properties"), dict)
    )


def _is_call_shaped(
    value: dict[str, Any],
    holder: dict[str, Any],
    argument_key: str | None,
    arguments: Any,
    name: str,
) -> bool:
    """Whether an object to a tool *not* on offer is still plainly a call:
    only a name and arguments (an object, or one encoded as a string), the
    name a tool name could be. Then the agent's ``unknown_tool`` error goes
    back to the model, as for a native call, instead of the object being
    taken for the answer."""
    if argument_key is None or _TOOL_NAME.fullmatch(name) is None:
        return False
    if isinstance(arguments, str):
        try:
            loads_object(arguments)
        except ValueError:
            return False
    elif not isinstance(arguments, dict):
        return False
    if holder is value:
        return not (value.keys() - {"name", "tool", "tool_name", argument_key} - _CALL_EXTRAS)
    return not (value.keys() - {"function"} - _CALL_EXTRAS) and not (
        holder.keys() - {"name", argument_key}
    )


def _with_arguments(name: str, arguments: Any) -> TextCall:
    if arguments is None:
        return TextCall(name)
    if isinstance(arguments, dict):
        return TextCall(name, arguments)
    if isinstance(arguments, str):
        if not arguments.strip():
            return TextCall(name)
        try:  # arguments encoded twice, as a JSON string
            return TextCall(name, loads_object(arguments))
        except ValueError:
            return TextCall(name, raw_arguments=arguments)
    return TextCall(name, raw_arguments=json.dumps(arguments, ensure_ascii=False))


def without_spans(text: str, spans: list[tuple[int, int]]) -> str:
    """``text`` with ``spans`` cut out, with the braces right around each (a
    chat template that doubles them leaks ``{{…}}}``: the call is read from
    the inner object, and its extra braces are no prose), and the fences
    left empty by it."""
    parts: list[str] = []
    last = 0
    for start, end in sorted(spans):
        while start > last and text[start - 1] == "{":
            start -= 1
        while end < len(text) and text[end] == "}":
            end += 1
        parts.append(text[last:start])
        last = end
    parts.append(text[last:])
    prose = _EMPTY_FENCE.sub("", "".join(parts))
    return re.sub(r"\n{3,}", "\n\n", prose).strip()


# -- tolerant JSON ----------------------------------------------------------------------


def loads_value(text: str) -> Any:
    """A JSON value, read tolerantly (trailing commas, single quotes, bare
    keys, Python constants, closing brackets left out at the end).

    Raises:
        ValueError: no value could be read (the message says why).
    """
    problem = ""
    stripped = text.strip()
    if stripped.startswith("{{") and stripped.endswith("}}"):
        # Doubled braces, as a chat template's escaping leaks them: small
        # models write {{"name": …, "arguments": {…}}}.
        text = stripped[1:-1]
    strict = _to_json(text)
    for attempt in (text, strict, _closed(strict)):
        try:
            return json.loads(attempt, strict=False)
        except ValueError as exc:
            # Where the text as written went wrong: the repairs move the error.
            problem = problem or str(exc)
    raise ValueError(problem)


def loads_object(text: str) -> dict[str, Any]:
    """A JSON object, read tolerantly (the first object in ``text``).

    Raises:
        ValueError: no object could be read (the message says why).
    """
    spans = json_spans(text, "{")
    candidate = text[spans[0][0] : spans[0][1]] if spans else text
    try:
        value = loads_value(candidate)
    except ValueError as exc:
        raise ValueError(str(exc) or "not a JSON object") from None
    if not isinstance(value, dict):
        raise ValueError("not a JSON object")
    return value


def json_spans(text: str, openers: str) -> list[tuple[int, int]]:
    """Where the top-level values opened by one of ``openers`` (``{``, ``[``)
    are (the last one may run to the end)."""
    spans: list[tuple[int, int]] = []
    start = _next_opener(text, openers, 0)
    while start != -1:
        end = _closing(text, start)
        spans.append((start, end))
        start = _next_opener(text, openers, end)
    return spans


def _next_opener(text: str, openers: str, start: int) -> int:
    found = [i for i in (text.find(o, start) for o in openers) if i != -1]
    return min(found, default=-1)


def _closing(text: str, start: int) -> int:
    """The index after the bracket that closes the one at ``start`` (or the end)."""
    depth = 0
    quote = ""
    i = start
    while i < len(text):
        c = text[i]
        if quote:
            if c == "\\":
                i += 1
            elif c == quote:
                quote = ""
        elif c in "\"'":
            quote = c
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return len(text)


def _closed(text: str) -> str:
    """``text`` with the brackets it leaves open closed, when only closing
    brackets are missing (a model that stopped one brace short)."""
    stack: list[str] = []
    quote = False
    escaped = False
    for c in text:
        if quote:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                quote = False
        elif c == '"':
            quote = True
        elif c in "{[":
            stack.append("}" if c == "{" else "]")
        elif c in "}]" and stack:
            stack.pop()
    if quote or not text.rstrip().endswith(("}", "]")):
        # Cut off inside a value: closing it would make up arguments.
        return text
    return text + "".join(reversed(stack))


def _to_json(text: str) -> str:
    """Sloppy JSON made strict: single-quoted strings and bare keys
    double-quoted, trailing commas dropped, Python's ``True``/``False``/``None``
    spelled as JSON's."""
    out: list[str] = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c in "\"'":
            j = i + 1
            while j < n and text[j] != c:
                j += 2 if text[j] == "\\" else 1
            body = text[i + 1 : min(j, n)]
            if c == "'":
                body = body.replace("\\'", "'").replace('\\"', '"').replace('"', '\\"')
            out.append(f'"{body}"')
            i = j + 1
        elif c == ",":
            k = i + 1
            while k < n and text[k].isspace():
                k += 1
            if k >= n or text[k] not in "}]":
                out.append(c)
            i += 1
        elif c.isalpha() or c == "_":
            j = i
            while j < n and (text[j].isalnum() or text[j] == "_"):
                j += 1
            word = text[i:j]
            k = j
            while k < n and text[k].isspace():
                k += 1
            # A bare key ({tool: "add"}) is quoted; a bare value only if Python's.
            out.append(json.dumps(word) if k < n and text[k] == ":" else _WORDS.get(word, word))
            i = j
        else:
            out.append(c)
            i += 1
    return "".join(out)
