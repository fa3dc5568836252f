"""An evaluation's dataset: JSON lines, one case a line.

A case is what to ask an agent and what its answer must satisfy::

    {"id": "sub", "input": "What is 2026 - 1991?",
     "expect": [{"kind": "numeric", "value": 35},
                {"kind": "tool_call", "tool": "calculator", "arguments": {"expr": 35}}]}

``expect`` is one grader or a list of them, each tagged by ``kind``; a case
passes when every one of its graders passes. The graders (what each checks
is in :mod:`fleetbus.evals.graders`):

- ``exact``: the answer equals ``value`` (optionally ignoring case, and
  runs of whitespace).
- ``regex``: ``pattern`` is found in the answer (Python ``re.search``).
- ``numeric``: the number found in the answer is ``value``, within
  ``tolerance`` (absolute) or ``relative_tolerance``.
- ``json_schema``: the structured answer (or the answer parsed as JSON)
  fits ``schema``.
- ``tool_call``: the agent called ``tool`` with ``arguments``.
- ``judge``: another agent of the fleet, given the case, ``criteria`` and
  the answer, says it passes.

``exact``, ``regex`` and ``numeric`` read the answer's text, or with
``field`` one field of the structured answer (a dotted path: ``total`` or
``items.0.name``). A case may send ``output_schema`` (a JSON Schema of an
object) so that the agent answers structured. :func:`load_dataset` reads a
file and says, for a line it cannot take, the file, the line and what is
wrong.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import jsonschema  # type: ignore[import-untyped]
import orjson
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, field_validator

from fleetbus.errors import ConfigError

__all__ = [
    "GRADER_KINDS",
    "Case",
    "Dataset",
    "ExactGrader",
    "Grader",
    "JsonSchemaGrader",
    "JudgeGrader",
    "NumericGrader",
    "RegexGrader",
    "ToolCallGrader",
    "load_dataset",
    "parse_case",
]

MAX_CASES = 100_000
"""Cases a dataset may hold."""


class _Strict(BaseModel):
    """Fields not declared are refused (a typo is an error, not ignored)."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class ExactGrader(_Strict):
    """The answer (or ``field``) equals ``value``."""

    kind: Literal["exact"]
    value: str
    ignore_case: bool = False
    ignore_whitespace: bool = False
    """Leading and trailing whitespace dropped, inner runs of it as one space."""
    field: str | None = None


class RegexGrader(_Strict):
    """``pattern`` is found in the answer (or ``field``)."""

    kind: Literal["regex"]
    pattern: str
    ignore_case: bool = False
    field: str | None = None

    @field_validator("pattern")
    @classmethod
    def _compiles(cls, pattern: str) -> str:
        try:
            re.compile(pattern)
        except re.error as exc:
            raise ValueError(f"not a regular expression: {exc}") from None
        return pattern


class NumericGrader(_Strict):
    """The number found in the answer (or ``field``) is ``value`` within a tolerance."""

    kind: Literal["numeric"]
    value: float
    tolerance: float = Field(default=1e-9, ge=0)
    """Absolute: ``|found - value| <= tolerance``."""
    relative_tolerance: float = Field(default=0.0, ge=0)
    """Relative to ``value``: ``|found - value| <= relative_tolerance * |value|``."""
    pick: Literal["last", "first", "any"] = "last"
    """Which number of the text counts: the last (default), the first, or any of them."""
    field: str | None = None


class JsonSchemaGrader(_Strict):
    """The structured answer, or the answer parsed as JSON, fits ``schema``."""

    kind: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    @field_validator("schema_")
    @classmethod
    def _valid(cls, schema: dict[str, Any]) -> dict[str, Any]:
        check_schema(schema)
        return schema


class ToolCallGrader(_Strict):
    """The agent called ``tool`` with ``arguments``: at least ``min_calls``
    such calls, and ``max_calls`` calls of ``tool`` at most."""

    kind: Literal["tool_call"]
    tool: str = Field(min_length=1)
    arguments: dict[str, Any] = Field(default_factory=dict)
    """The arguments that must match (others are not looked at): a value
    equal to the expected one (numbers compared as numbers), or, for an
    expected number, a string argument that the built-in calculator
    evaluates to it within ``tolerance``."""
    tolerance: float = Field(default=1e-9, ge=0)
    min_calls: int = Field(default=1, ge=0)
    max_calls: int | None = Field(default=None, ge=0)


class JudgeGrader(_Strict):
    """Another agent (``agent``, else the run's judge) says the answer meets ``criteria``."""

    kind: Literal["judge"]
    criteria: str = Field(min_length=1)
    agent: str | None = None


Grader = Annotated[
    ExactGrader | RegexGrader | NumericGrader | JsonSchemaGrader | ToolCallGrader | JudgeGrader,
    Field(discriminator="kind"),
]
"""One grader, tagged by ``kind``."""

GRADER_KINDS = ("exact", "regex", "numeric", "json_schema", "tool_call", "judge")
"""Every grader's ``kind``."""


class Case(_Strict):
    """One case of a dataset."""

    id: str = Field(min_length=1, max_length=200)
    """Unique in the dataset: two runs' cases are compared by it."""
    input: str = Field(min_length=1)
    """What the agent is asked (sent as a ``user_request``)."""
    expect: list[Grader] = Field(min_length=1)
    """The graders; all must pass."""
    output_schema: dict[str, Any] | None = None
    """Ask for a structured answer fitting this JSON Schema (of an object)."""
    timeout: float | None = Field(default=None, gt=0)
    """Seconds the reply may take (the run's ``timeout`` by default)."""
    metadata: dict[str, Any] = Field(default_factory=dict)
    """Free-form: kept in the results, not sent."""

    @field_validator("expect", mode="before")
    @classmethod
    def _one_or_many(cls, value: Any) -> Any:
        return [value] if isinstance(value, dict) else value

    @field_validator("output_schema")
    @classmethod
    def _an_object(cls, schema: dict[str, Any] | None) -> dict[str, Any] | None:
        if schema is not None:
            check_schema(schema)
            if schema.get("type", "object") != "object":
                raise ValueError("must be the JSON Schema of an object")
        return schema


_CASE = TypeAdapter(Case)


@dataclass(frozen=True, slots=True)
class Dataset:
    """The cases of a dataset file, in its order.

    Attributes:
        path: the file.
        cases: its cases.
        lines: the line of each case in the file (from 1).
    """

    path: Path
    cases: Sequence[Case]
    lines: Sequence[int]

    @property
    def name(self) -> str:
        """The file's name without its suffix."""
        return self.path.stem

    def judges(self) -> set[str | None]:
        """The agents the judge graders name (``None``: the run's judge)."""
        return {g.agent for c in self.cases for g in c.expect if isinstance(g, JudgeGrader)}


def load_dataset(path: str | os.PathLike[str]) -> Dataset:
    """The cases of the JSON lines file ``path`` (blank lines and lines
    starting with ``#`` are skipped). A case without ``id`` is named after
    its line (``line-7``).

    Raises:
        ConfigError: the file cannot be read, holds no case or too many, or a
            line is not a case (the error names the file, the line and what is
            wrong: not JSON, an unknown grader ``kind``, a missing field, a
            duplicate ``id``…).
    """
    file = Path(path)
    try:
        text = file.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read the dataset {file}: {exc.strerror or exc}") from exc
    cases: list[Case] = []
    lines: list[int] = []
    seen: dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        stripped = raw.strip()
        if not stripped or stripped.startswith(b"#"):
            continue
        case = parse_case(stripped, where=f"{file}:{number}", default_id=f"line-{number}")
        if case.id in seen:
            raise ConfigError(
                f"{file}:{number}: id {case.id!r} is already the id of line {seen[case.id]}"
            )
        seen[case.id] = number
        cases.append(case)
        lines.append(number)
        if len(cases) > MAX_CASES:
            raise ConfigError(f"{file}: more than {MAX_CASES:,} cases")
    if not cases:
        raise ConfigError(f"{file} holds no case (one JSON object a line)")
    return Dataset(file, tuple(cases), tuple(lines))


def parse_case(line: bytes | str, *, where: str = "case", default_id: str = "case") -> Case:
    """One case from its JSON text.

    Raises:
        ConfigError: it is not a case; the message starts with ``where``.
    """
    try:
        data = orjson.loads(line)
    except orjson.JSONDecodeError as exc:
        raise ConfigError(f"{where}: not JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: a case is a JSON object, not {_json_type(data)}")
    data.setdefault("id", default_id)
    try:
        return _CASE.validate_python(data)
    except ValidationError as exc:
        raise ConfigError(f"{where}: {_problems(exc)}") from None


def check_schema(schema: dict[str, Any]) -> None:
    """Check that ``schema`` is a JSON Schema (in the dialect it names, else 2020-12).

    Raises:
        ValueError: it is not.
    """
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        cls.check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise ValueError(f"not a valid JSON Schema: {exc.message}") from None


def _problems(exc: ValidationError) -> str:
    """What pydantic found wrong, in a line: where, then what (3 at most)."""
    found: list[str] = []
    for error in exc.errors(include_url=False):
        where = ".".join(str(part) for part in error["loc"] if not _is_tag(part))
        if error["type"] == "union_tag_invalid":
            kind = error["ctx"].get("tag")
            what = f"unknown grader kind {kind!r} (known: {', '.join(GRADER_KINDS)})"
        elif error["type"] == "union_tag_not_found":
            what = f"a grader needs a kind ({', '.join(GRADER_KINDS)})"
        elif error["type"] == "missing":
            what = "missing"
        elif error["type"] == "extra_forbidden":
            what = "unknown field"
        else:
            what = str(error["msg"]).removeprefix("Value error, ")
        problem = f"{where}: {what}" if where else what
        if problem not in found:
            found.append(problem)
    more = f" (and {len(found) - 3} more)" if len(found) > 3 else ""
    return "; ".join(found[:3]) + more


def _is_tag(part: Any) -> bool:
    """Whether a part of an error's location is a union's tag (``numeric``), not a field."""
    return isinstance(part, str) and part in GRADER_KINDS


def _json_type(value: Any) -> str:
    if isinstance(value, list):
        return "an array"
    if isinstance(value, str):
        return "a string"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    return "a number"
