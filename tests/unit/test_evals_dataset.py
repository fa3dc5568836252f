"""Reading an evaluation dataset: JSON lines, one case a line, each with its
graders; a line that is not a case is refused with the file, the line and
what is wrong."""

from __future__ import annotations

from pathlib import Path

import pytest

from fleetbus.errors import ConfigError
from fleetbus.evals import (
    ExactGrader,
    JsonSchemaGrader,
    JudgeGrader,
    NumericGrader,
    RegexGrader,
    ToolCallGrader,
    load_dataset,
)
from tests.helpers import ROOT


def write(tmp_path: Path, *lines: str) -> Path:
    path = tmp_path / "cases.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def error_of(path: Path) -> str:
    with pytest.raises(ConfigError) as caught:
        load_dataset(path)
    return str(caught.value)


def test_every_grader_kind_one_or_many_a_case(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "# a comment, then a blank line",
        "",
        '{"id": "a", "input": "What is 2 + 2?", "expect": {"kind": "numeric", "value": 4}}',
        '{"input": "Say hi", "expect": [{"kind": "exact", "value": "hi", "ignore_case": true},'
        ' {"kind": "regex", "pattern": "h(i|ello)"}]}',
        '{"id": "c", "input": "JSON please", "output_schema": {"type": "object"},'
        ' "expect": [{"kind": "json_schema", "schema": {"type": "object", "required": ["x"]}},'
        ' {"kind": "tool_call", "tool": "calculator", "arguments": {"expr": 4}},'
        ' {"kind": "judge", "criteria": "polite", "agent": "critic"}], "timeout": 5,'
        ' "metadata": {"topic": "json"}}',
    )
    dataset = load_dataset(path)
    assert dataset.name == "cases"
    assert [c.id for c in dataset.cases] == ["a", "line-4", "c"]
    assert dataset.lines == (3, 4, 5)
    a, b, c = dataset.cases
    assert a.expect == [NumericGrader(kind="numeric", value=4)]
    assert isinstance(b.expect[0], ExactGrader)
    assert b.expect[0].ignore_case
    assert isinstance(b.expect[1], RegexGrader)
    schema, call, judge = c.expect
    assert isinstance(schema, JsonSchemaGrader)
    assert schema.schema_ == {"type": "object", "required": ["x"]}
    assert isinstance(call, ToolCallGrader)
    assert call.arguments == {"expr": 4}
    assert call.min_calls == 1
    assert call.max_calls is None
    assert isinstance(judge, JudgeGrader)
    assert judge.agent == "critic"
    assert c.output_schema == {"type": "object"}
    assert c.timeout == 5
    assert c.metadata == {"topic": "json"}
    assert dataset.judges() == {"critic"}


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        ("{not json", ":2: not JSON"),
        ("[1, 2]", ":2: a case is a JSON object, not an array"),
        (
            '{"id": "x", "input": "hi", "expect": {"kind": "fuzzy", "value": "hi"}}',
            ":2: expect.0: unknown grader kind 'fuzzy' (known: exact, regex, numeric, "
            "json_schema, tool_call, judge)",
        ),
        (
            '{"id": "x", "input": "hi", "expect": {"value": "hi"}}',
            ":2: expect.0: a grader needs a kind",
        ),
        ('{"id": "x", "expect": {"kind": "exact", "value": "hi"}}', ":2: input: missing"),
        ('{"id": "x", "input": "hi", "expect": []}', ":2: expect: List should have at least 1"),
        (
            '{"id": "x", "input": "hi", "expected": {"kind": "exact", "value": "hi"}}',
            ":2: expect: missing; expected: unknown field",
        ),
        (
            '{"id": "x", "input": "hi", "expect": {"kind": "regex", "pattern": "(unclosed"}}',
            ":2: expect.0.pattern: not a regular expression: missing ), unterminated subpattern",
        ),
        (
            '{"id": "x", "input": "hi", "expect": {"kind": "numeric", "value": "four"}}',
            ":2: expect.0.value: Input should be a valid number",
        ),
        (
            '{"id": "x", "input": "hi", "expect": {"kind": "numeric", "value": 4, '
            '"tolerance": -1}}',
            ":2: expect.0.tolerance: Input should be greater than or equal to 0",
        ),
        (
            '{"id": "x", "input": "hi", "expect": {"kind": "json_schema", '
            '"schema": {"type": "banana"}}}',
            ":2: expect.0.schema: not a valid JSON Schema:",
        ),
        (
            '{"id": "x", "input": "hi", "output_schema": {"type": "array"}, '
            '"expect": {"kind": "exact", "value": "hi"}}',
            ":2: output_schema: must be the JSON Schema of an object",
        ),
        (
            '{"id": "x", "input": "hi", "expect": {"kind": "tool_call", "tool": ""}}',
            ":2: expect.0.tool: String should have at least 1 character",
        ),
        (
            '{"id": "a", "input": "hi", "expect": {"kind": "exact", "value": "hi"}}',
            ":2: id 'a' is already the id of line 1",
        ),
    ],
)
def test_a_line_that_is_not_a_case_is_named_with_what_is_wrong(
    tmp_path: Path, line: str, problem: str
) -> None:
    first = '{"id": "a", "input": "hi", "expect": {"kind": "exact", "value": "hi"}}'
    path = write(tmp_path, first, line)
    message = error_of(path)
    assert message.startswith(f"{path}{problem}"), message


def test_a_file_without_cases_or_that_cannot_be_read(tmp_path: Path) -> None:
    empty = write(tmp_path, "", "# nothing")
    assert error_of(empty) == f"{empty} holds no case (one JSON object a line)"
    missing = tmp_path / "missing.jsonl"
    assert error_of(missing).startswith(f"cannot read the dataset {missing}: ")


@pytest.mark.parametrize("name", ["arithmetic", "multistep"])
def test_the_shipped_datasets_load(name: str) -> None:
    dataset = load_dataset(ROOT / "examples" / "evals" / f"{name}.jsonl")
    assert len(dataset.cases) >= 5
    assert all(any(isinstance(g, ToolCallGrader) for g in c.expect) for c in dataset.cases)
