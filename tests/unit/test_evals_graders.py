"""What each grader checks (all but the judge, which asks an agent: its
request and how its verdict is read are here too)."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from fleetbus.evals import Grade, JudgeGrader, Reply, ToolCallMade, grade, parse_case
from fleetbus.evals.graders import judge_request, numbers_in, verdict


def check(grader: dict[str, Any], reply: Reply) -> Grade:
    """``grader`` (as a dataset writes it) run on ``reply``."""
    case = parse_case(orjson.dumps({"id": "t", "input": "q", "expect": grader}))
    return grade(case.expect[0], reply)


def text(answer: str) -> Reply:
    return Reply(answer)


def test_exact_with_and_without_case_and_whitespace() -> None:
    assert check({"kind": "exact", "value": "Paris"}, text("Paris")).passed
    missed = check({"kind": "exact", "value": "Paris"}, text("paris "))
    assert not missed.passed
    assert missed.reason == '"paris" is not "Paris"'
    assert check({"kind": "exact", "value": "Paris", "ignore_case": True}, text("PARIS")).passed
    assert not check(
        {"kind": "exact", "value": "Paris", "ignore_case": True}, text(" PARIS")
    ).passed
    loose = {"kind": "exact", "value": "New  York", "ignore_whitespace": True}
    assert check(loose, text("\n New York \t")).passed
    assert not check(loose, text("NewYork")).passed


def test_regex_searches_the_answer() -> None:
    found = check({"kind": "regex", "pattern": r"\b4[0-9]\b"}, text("It is 42."))
    assert found == Grade("regex", True, '/\\b4[0-9]\\b/ found "42"')
    assert not check({"kind": "regex", "pattern": "^42"}, text("It is 42.")).passed
    assert check({"kind": "regex", "pattern": "paris", "ignore_case": True}, text("PARIS")).passed
    assert not check({"kind": "regex", "pattern": "paris"}, text("PARIS")).passed


def test_numbers_in_a_text() -> None:
    assert numbers_in("2026 - 1991 = 35.") == [2026, 1991, 35]
    assert numbers_in("from -3.5 to 1,234,567 and 2e3, .5") == [-3.5, 1234567, 2000, 0.5]
    assert numbers_in("step2 v1.2.3 x") == []
    assert numbers_in("\u22127") == [-7]


def test_numeric_reads_the_last_number_within_the_tolerance() -> None:
    answer = text("(offline model) calculator: 2026 - 1991 = 35.")
    assert check({"kind": "numeric", "value": 35}, answer) == Grade("numeric", True, "35 is 35")
    wrong = check({"kind": "numeric", "value": 2026}, answer)
    assert wrong == Grade("numeric", False, "the last number (35) is not 2026")
    assert check({"kind": "numeric", "value": 2026, "pick": "first"}, answer).passed
    assert check({"kind": "numeric", "value": 1991, "pick": "any"}, answer).passed
    assert not check({"kind": "numeric", "value": 36}, answer).passed
    assert check({"kind": "numeric", "value": 36, "tolerance": 1}, answer).passed
    near = check({"kind": "numeric", "value": 34, "relative_tolerance": 0.01}, answer)
    assert near.reason == "the last number (35) is not 34 ± 0.34"
    assert check({"kind": "numeric", "value": 34, "relative_tolerance": 0.05}, answer).passed
    none = check({"kind": "numeric", "value": 1}, text("no idea"))
    assert none == Grade("numeric", False, 'no number in "no idea"')


def test_a_field_of_the_structured_answer_or_of_the_answer_as_json() -> None:
    structured = Reply("ignored", {"total": 12, "items": [{"name": "pen"}]})
    assert check({"kind": "numeric", "value": 12, "field": "total"}, structured).passed
    assert check({"kind": "exact", "value": "pen", "field": "items.0.name"}, structured).passed
    assert check({"kind": "exact", "value": "12", "field": "total"}, structured).passed
    missing = check({"kind": "exact", "value": "x", "field": "items.3.name"}, structured)
    assert missing == Grade("exact", False, "the answer has no field 'items.3.name'")
    fenced = Reply('Here:\n```json\n{"total": "about 12"}\n```')
    assert check({"kind": "regex", "pattern": "12", "field": "total"}, fenced).passed
    plain = check({"kind": "numeric", "value": 1, "field": "total"}, text("twelve"))
    assert plain.reason == "no field 'total': the answer is not JSON: \"twelve\""


def test_json_schema_of_the_structured_answer_or_of_the_text() -> None:
    schema = {
        "kind": "json_schema",
        "schema": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "celsius": {"type": "number"}},
            "required": ["city", "celsius"],
        },
    }
    good = check(schema, Reply("", {"city": "Oslo", "celsius": 3}))
    assert good == Grade("json_schema", True, "the structured answer fits the schema")
    bad = check(schema, Reply("", {"city": "Oslo", "celsius": "cold"}))
    assert bad == Grade(
        "json_schema",
        False,
        "the structured answer does not fit: celsius: 'cold' is not of type 'number'",
    )
    assert check(schema, text('{"city": "Rome", "celsius": 18.5}')).passed
    as_text = check(schema, text('```json\n{"city": "Rome"}\n```'))
    assert as_text.reason == ("the answer (as JSON) does not fit: 'celsius' is a required property")
    assert check(schema, text("Rome, 18 degrees")).reason == (
        'the answer is not JSON: "Rome, 18 degrees"'
    )


def calls(*made: tuple[str, dict[str, Any]]) -> Reply:
    return Reply("done", tool_calls=tuple(ToolCallMade(n, a, "success") for n, a in made))


def test_a_tool_call_with_equal_arguments_or_an_expression_that_evaluates_to_the_number() -> None:
    reply = calls(("current_time", {"timezone": "UTC"}), ("calculator", {"expr": "2026 - 1991"}))
    expected = {"kind": "tool_call", "tool": "calculator", "arguments": {"expr": 35}}
    found = check(expected, reply)
    assert found.passed
    assert found.reason == '1 call(s) like calculator(expr=35): calculator(expr="2026 - 1991")'
    assert check({**expected, "arguments": {"expr": 35.0}}, reply).passed
    wrong = check({**expected, "arguments": {"expr": 36}}, reply)
    assert wrong == Grade(
        "tool_call",
        False,
        '0 call(s) like calculator(expr=36), not 1; calls made: current_time(timezone="UTC"), '
        'calculator(expr="2026 - 1991")',
    )
    assert check({**expected, "arguments": {"expr": 36}, "tolerance": 1}, reply).passed
    # Equal values: strings as they are (not evaluated), numbers as numbers,
    # objects and arrays member by member.
    assert check({**expected, "arguments": {"expr": "2026 - 1991"}}, reply).passed
    assert not check({**expected, "arguments": {"expr": "2026-1991"}}, reply).passed
    zone = {"kind": "tool_call", "tool": "current_time", "arguments": {"timezone": "UTC"}}
    assert check(zone, reply).passed
    assert not check({**zone, "arguments": {"timezone": "utc"}}, reply).passed
    assert not check({**zone, "arguments": {"missing": "UTC"}}, reply).passed
    nested = calls(("plot", {"points": [1, 2.0], "style": {"bold": True}}))
    assert check(
        {
            "kind": "tool_call",
            "tool": "plot",
            "arguments": {"points": [1.0, 2], "style": {"bold": True}},
        },
        nested,
    ).passed
    assert not check(
        {"kind": "tool_call", "tool": "plot", "arguments": {"style": {"bold": 1}}}, nested
    ).passed
    # Not an expression, or one the calculator refuses: no match, no error.
    odd = calls(("calculator", {"expr": "import os"}), ("calculator", {"expr": "1/0"}))
    assert not check({**expected, "arguments": {"expr": 0}}, odd).passed


def test_how_many_calls() -> None:
    reply = calls(*[("calculator", {"expr": f"{n} + 1"}) for n in (1, 2, 3)])
    counted = {"kind": "tool_call", "tool": "calculator", "min_calls": 3, "max_calls": 3}
    assert check(counted, reply) == Grade(
        "tool_call", True, '3 call(s) like calculator(): calculator(expr="1 + 1")'
    )
    too_many = check({**counted, "max_calls": 2}, reply)
    assert too_many == Grade("tool_call", False, "3 calls of calculator, more than 2")
    assert not check({**counted, "min_calls": 4, "max_calls": None}, reply).passed
    never = {"kind": "tool_call", "tool": "calculator", "min_calls": 0, "max_calls": 0}
    assert check(never, calls()) == Grade("tool_call", True, "0 calls of calculator")
    assert not check(never, reply).passed
    assert not check({"kind": "tool_call", "tool": "search"}, reply).passed


def test_what_the_judge_is_asked_and_how_its_verdict_is_read() -> None:
    case = parse_case(
        '{"id": "j", "input": "Explain 2+2.", "expect": {"kind": "judge", "criteria": "Says 4."}}'
    )
    grader = case.expect[0]
    assert isinstance(grader, JudgeGrader)
    asked = judge_request(case, grader, calls(("calculator", {"expr": "2+2"})))
    assert "<question>\nExplain 2+2.\n</question>" in asked
    assert "<criteria>\nSays 4.\n</criteria>" in asked
    assert "<answer>\ndone\n</answer>" in asked
    assert '- calculator(expr="2+2")' in asked
    assert verdict({"pass": True, "reason": "It says 4."}, "") == Grade(
        "judge", True, "the judge: It says 4."
    )
    assert verdict(None, '{"pass": false, "reason": "no"}') == Grade(
        "judge", False, "the judge: no"
    )
    assert verdict(None, "I think it is fine") == Grade(
        "judge", False, 'the judge gave no verdict: "I think it is fine"'
    )
    assert not verdict({"pass": "yes", "reason": "?"}, "").passed


def test_the_judge_is_not_graded_without_an_agent() -> None:
    case = parse_case('{"input": "q", "expect": {"kind": "judge", "criteria": "c"}}')
    with pytest.raises(TypeError, match="a judge grader is not graded here"):
        grade(case.expect[0], text("a"))
