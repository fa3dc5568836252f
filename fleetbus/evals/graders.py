"""What each grader checks, on what an agent answered (:class:`Reply`).

:func:`grade` runs one grader that needs nobody else (all but ``judge``) and
says whether it passed and why. The rules:

- ``exact``: the text equals ``value``; ``ignore_case`` compares them
  case-folded, ``ignore_whitespace`` without leading and trailing whitespace
  and with each inner run of it as one space.
- ``regex``: ``re.search(pattern, text)`` finds something (``ignore_case``:
  with ``re.IGNORECASE``).
- ``numeric``: the numbers of the text (``-3``, ``2.5``, ``1,234``, ``1e-3``)
  are read; the last one (``pick: "first"``: the first; ``"any"``: any of
  them) must be within ``tolerance`` of ``value``, or within
  ``relative_tolerance * |value|``. A ``field`` holding a number is that
  number.
- ``json_schema``: the structured answer (the ``final_answer``'s
  ``structured``), else the answer's text parsed as JSON (the whole text, else
  the first fenced code block in it), fits ``schema``.
- ``tool_call``: the calls of ``tool`` the reply made (from its ``tool_call``
  events; the finish tool of a structured answer is not a call) are
  counted; a call matches when each of ``arguments`` matches the call's
  argument of that name: equal JSON values (numbers compared as numbers, so
  ``35`` matches ``35.0``; objects and arrays compared member by member), or,
  for an expected number, a string that the built-in calculator evaluates to
  that number within ``tolerance`` (``{"expr": 35}`` matches
  ``calculator(expr="2026 - 1991")``). At least ``min_calls`` calls must
  match, and ``max_calls`` (when given) bounds the calls of ``tool``.

The ``judge`` grader asks another agent (:mod:`fleetbus.evals.runner`):
:func:`judge_request` is what it is asked, :data:`VERDICT_SCHEMA` the shape
of its answer, and :func:`verdict` reads it.

``field`` (for ``exact``, ``regex`` and ``numeric``) is a dotted path into
the structured answer (or the text parsed as JSON): ``total``,
``items.0.name``; a path that leads nowhere fails the grader, saying so.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import jsonschema  # type: ignore[import-untyped]
import orjson
import referencing
import referencing.exceptions

from fleetbus.evals.dataset import (
    Case,
    ExactGrader,
    Grader,
    JsonSchemaGrader,
    JudgeGrader,
    NumericGrader,
    RegexGrader,
    ToolCallGrader,
)
from fleetbus.tools_workers.builtin import calculator

__all__ = [
    "VERDICT_SCHEMA",
    "Grade",
    "Reply",
    "ToolCallMade",
    "grade",
    "judge_request",
    "numbers_in",
    "verdict",
]

SHOWN = 80
"""Characters of an answer a reason quotes at most."""

VERDICT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "pass": {"type": "boolean", "description": "whether the answer meets the criteria"},
        "reason": {"type": "string", "description": "why, in one or two sentences"},
    },
    "required": ["pass", "reason"],
}
"""The structured answer a judge agent is asked for (its ``output_schema``)."""

_NUMBER = re.compile(
    r"(?<![\w.])[-\u2212]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?(?![\w])"
    r"|(?<![\w.])[-\u2212]?\.\d+(?:[eE][-+]?\d+)?(?![\w])"
)
_FENCED = re.compile(r"```[\w-]*\s*\n(.*?)```", re.S)


@dataclass(frozen=True, slots=True)
class ToolCallMade:
    """A tool call a reply made.

    Attributes:
        name: the tool.
        arguments: its arguments.
        status: how it ended (``success``, ``error``…), when its result was seen.
    """

    name: str
    arguments: dict[str, Any]
    status: str | None = None


@dataclass(frozen=True, slots=True)
class Reply:
    """What an agent answered a case, as the graders see it.

    Attributes:
        text: the answer's text.
        structured: the validated structured answer, when one was asked for.
        tool_calls: the tool calls the reply made, in order.
    """

    text: str
    structured: dict[str, Any] | None = None
    tool_calls: Sequence[ToolCallMade] = field(default_factory=tuple)


@dataclass(frozen=True, slots=True)
class Grade:
    """One grader's verdict.

    Attributes:
        kind: the grader's kind.
        passed: whether it passed.
        reason: why (or why not), in a line.
    """

    kind: str
    passed: bool
    reason: str


def grade(grader: Grader, reply: Reply) -> Grade:
    """Run ``grader`` (any but ``judge``) on ``reply``.

    Raises:
        TypeError: ``grader`` is a judge (it asks an agent: see
            :class:`fleetbus.evals.Evaluation`).
    """
    match grader:
        case ExactGrader():
            return _exact(grader, reply)
        case RegexGrader():
            return _regex(grader, reply)
        case NumericGrader():
            return _numeric(grader, reply)
        case JsonSchemaGrader():
            return _json_schema(grader, reply)
        case ToolCallGrader():
            return _tool_call(grader, reply)
    raise TypeError(f"a {grader.kind} grader is not graded here")


def _exact(grader: ExactGrader, reply: Reply) -> Grade:
    found = _target(grader.field, reply)
    if isinstance(found, _Missing):
        return Grade(grader.kind, False, found.reason)
    text = found if isinstance(found, str) else _dumps(found)

    def norm(s: str) -> str:
        if grader.ignore_whitespace:
            s = " ".join(s.split())
        return s.casefold() if grader.ignore_case else s

    if norm(text) == norm(grader.value):
        return Grade(grader.kind, True, f"equals {_quote(grader.value)}")
    return Grade(grader.kind, False, f"{_quote(text)} is not {_quote(grader.value)}")


def _regex(grader: RegexGrader, reply: Reply) -> Grade:
    found = _target(grader.field, reply)
    if isinstance(found, _Missing):
        return Grade(grader.kind, False, found.reason)
    text = found if isinstance(found, str) else _dumps(found)
    match = re.search(grader.pattern, text, re.IGNORECASE if grader.ignore_case else 0)
    if match is not None:
        return Grade(grader.kind, True, f"/{grader.pattern}/ found {_quote(match.group())}")
    return Grade(grader.kind, False, f"/{grader.pattern}/ not found in {_quote(text)}")


def _numeric(grader: NumericGrader, reply: Reply) -> Grade:
    found = _target(grader.field, reply)
    if isinstance(found, _Missing):
        return Grade(grader.kind, False, found.reason)
    if isinstance(found, int | float) and not isinstance(found, bool):
        numbers = [float(found)]
    else:
        numbers = numbers_in(found if isinstance(found, str) else _dumps(found))
    if not numbers:
        return Grade(grader.kind, False, f"no number in {_quote(_text_of(found))}")
    candidates = {"last": numbers[-1:], "first": numbers[:1], "any": numbers}[grader.pick]
    allowed = max(grader.tolerance, grader.relative_tolerance * abs(grader.value))
    expected = _show(grader.value)
    for number in candidates:
        if abs(number - grader.value) <= allowed:
            return Grade(grader.kind, True, f"{_show(number)} is {expected}")
    within = f" ± {allowed:g}" if allowed > 1e-9 else ""
    which = "any number" if grader.pick == "any" else f"the {grader.pick} number"
    got = ", ".join(_show(n) for n in candidates[:5])
    return Grade(grader.kind, False, f"{which} ({got}) is not {expected}{within}")


def _json_schema(grader: JsonSchemaGrader, reply: Reply) -> Grade:
    value: Any = reply.structured
    where = "the structured answer"
    if value is None:
        parsed = _parsed(reply.text)
        if isinstance(parsed, _Missing):
            return Grade(grader.kind, False, parsed.reason)
        value, where = parsed, "the answer (as JSON)"
    problems = schema_problems(value, grader.schema_)
    if problems:
        return Grade(grader.kind, False, f"{where} does not fit: {problems}")
    return Grade(grader.kind, True, f"{where} fits the schema")


def _tool_call(grader: ToolCallGrader, reply: Reply) -> Grade:
    calls = [c for c in reply.tool_calls if c.name == grader.tool]
    matching = [c for c in calls if _arguments_match(grader, c.arguments)]
    wanted = f"{grader.tool}({_arguments(grader.arguments)})"
    if grader.max_calls is not None and len(calls) > grader.max_calls:
        return Grade(
            grader.kind,
            False,
            f"{len(calls)} calls of {grader.tool}, more than {grader.max_calls}",
        )
    if len(matching) >= grader.min_calls:
        if not matching:
            return Grade(grader.kind, True, f"{len(calls)} calls of {grader.tool}")
        shown = f"{grader.tool}({_arguments(matching[0].arguments)})"
        return Grade(grader.kind, True, f"{len(matching)} call(s) like {wanted}: {shown}")
    made = ", ".join(f"{c.name}({_arguments(c.arguments)})" for c in reply.tool_calls[:5])
    more = f" and {len(reply.tool_calls) - 5} more" if len(reply.tool_calls) > 5 else ""
    return Grade(
        grader.kind,
        False,
        f"{len(matching)} call(s) like {wanted}, not {grader.min_calls}; "
        f"calls made: {made + more or 'none'}",
    )


def _arguments_match(grader: ToolCallGrader, arguments: dict[str, Any]) -> bool:
    return all(
        name in arguments and _matches(expected, arguments[name], grader.tolerance)
        for name, expected in grader.arguments.items()
    )


def _matches(expected: Any, actual: Any, tolerance: float) -> bool:
    """Whether an argument's value is the expected one (see the module docstring)."""
    if _is_number(expected):
        if _is_number(actual):
            return bool(abs(actual - expected) <= tolerance)
        if isinstance(actual, str):
            try:
                value = calculator(actual)
            except (ValueError, TypeError, ArithmeticError, SyntaxError, RecursionError):
                return False
            return _is_number(value) and bool(abs(value - expected) <= tolerance)
        return False
    if isinstance(expected, dict):
        return (
            isinstance(actual, dict)
            and expected.keys() == actual.keys()
            and all(_matches(v, actual[k], tolerance) for k, v in expected.items())
        )
    if isinstance(expected, list):
        return (
            isinstance(actual, list)
            and len(expected) == len(actual)
            and all(_matches(e, a, tolerance) for e, a in zip(expected, actual, strict=True))
        )
    return type(expected) is type(actual) and bool(expected == actual)


def numbers_in(text: str) -> list[float]:
    """The numbers written in ``text``, in order (``1,234`` is one number)."""
    found = []
    for token in _NUMBER.findall(text):
        try:
            number = float(token.replace(",", "").replace("\u2212", "-"))
        except ValueError:
            continue
        if math.isfinite(number):
            found.append(number)
    return found


def schema_problems(value: Any, schema: dict[str, Any]) -> str:
    """What keeps ``value`` from fitting ``schema`` ('' when it fits): the
    first three problems, each where and what."""
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    validator = cls(schema, registry=referencing.Registry())
    problems: list[str] = []
    try:
        for error in validator.iter_errors(value):
            where = "/".join(str(p) for p in error.absolute_path)
            problem = f"{where}: {error.message}" if where else error.message
            if problem not in problems:
                problems.append(problem)
            if len(problems) > 3:
                break
    except referencing.exceptions.Unresolvable as exc:
        return f"the schema refers to what it does not hold ({exc})"
    return "; ".join(_clip(p, 160) for p in problems[:3]) + (" …" if len(problems) > 3 else "")


# -- the judge ---------------------------------------------------------------------------


def judge_request(case: Case, grader: JudgeGrader, reply: Reply) -> str:
    """What a judge agent is asked: the case, the criteria, the answer (and
    the tool calls it made)."""
    answer = _dumps(reply.structured) if reply.structured is not None else reply.text
    calls = "\n".join(f"- {c.name}({_arguments(c.arguments)})" for c in reply.tool_calls[:20])
    return (
        "You grade an assistant's answer. Say whether it meets the criteria, and why.\n\n"
        f"<question>\n{case.input}\n</question>\n\n"
        f"<criteria>\n{grader.criteria}\n</criteria>\n\n"
        f"<answer>\n{answer}\n</answer>\n\n"
        f"<tool_calls>\n{calls or '(none)'}\n</tool_calls>\n\n"
        'Answer with "pass" (true when the answer meets every criterion) and "reason".'
    )


def verdict(structured: dict[str, Any] | None, text: str) -> Grade:
    """The grade a judge's answer gives: its structured ``pass`` and
    ``reason`` (or its text parsed as such JSON); a judge that gives neither
    fails the grader, saying what it answered."""
    found: Any = structured
    if found is None:
        parsed = _parsed(text)
        found = None if isinstance(parsed, _Missing) else parsed
    if isinstance(found, dict) and isinstance(found.get("pass"), bool):
        reason = found.get("reason")
        why = " ".join(reason.split()) if isinstance(reason, str) and reason.strip() else "-"
        return Grade("judge", found["pass"], _clip(f"the judge: {why}", 300))
    return Grade("judge", False, f"the judge gave no verdict: {_quote(text or _dumps(structured))}")


# -- helpers ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Missing:
    """What a grader looked for is not there: why."""

    reason: str


def _target(path: str | None, reply: Reply) -> Any:
    """The text a grader reads, or the value at ``path`` in the structured answer."""
    if path is None:
        return reply.text
    value: Any = reply.structured
    if value is None:
        value = _parsed(reply.text)
        if isinstance(value, _Missing):
            return _Missing(f"no field {path!r}: {value.reason}")
    for part in path.split("."):
        if isinstance(value, dict) and part in value:
            value = value[part]
        elif isinstance(value, list) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        else:
            return _Missing(f"the answer has no field {path!r}")
    return value


def _parsed(text: str) -> Any:
    """``text`` as JSON: the whole of it, else its first fenced code block."""
    candidates = [text.strip()]
    fenced = _FENCED.search(text)
    if fenced is not None:
        candidates.append(fenced.group(1).strip())
    for candidate in candidates:
        try:
            return orjson.loads(candidate)
        except orjson.JSONDecodeError:
            continue
    return _Missing(f"the answer is not JSON: {_quote(text)}")


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _show(number: float) -> str:
    return str(int(number)) if number.is_integer() and abs(number) < 1e15 else f"{number:g}"


def _dumps(value: Any) -> str:
    return orjson.dumps(value, default=str).decode()


def _text_of(value: Any) -> str:
    return value if isinstance(value, str) else _dumps(value)


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _quote(text: str) -> str:
    return '"' + _clip(" ".join(text.split()), SHOWN) + '"'


def _arguments(arguments: dict[str, Any]) -> str:
    return ", ".join(f"{k}={_clip(_dumps(v), 60)}" for k, v in arguments.items())
