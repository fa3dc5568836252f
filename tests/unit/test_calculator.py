"""The calculator tool: exact arithmetic, and refusal of everything else."""

from __future__ import annotations

import math
import time
import warnings

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fleetbus.tools_workers.builtin import calculator


@pytest.mark.parametrize(
    ("expr", "expected"),
    [
        ("2026 - 1991", 35),
        ("1 + 2 * 3", 7),
        ("(1 + 2) * 3", 9),
        ("-3 + 5", 2),
        ("-2 ** 2", -4),
        ("(-2) ** 2", 4),
        ("+-+4", -4),
        ("2 ** 3 ** 2", 512),
        ("7 // 2", 3),
        ("-7 // 2", -4),
        ("-7 % 3", 2),
        ("7 / 2", 3.5),
        ("10 / 4", 2.5),
        ("0.1 + 0.2", 0.1 + 0.2),
        ("1e3 * 2", 2000.0),
        ("2 ** -2", 0.25),
        ("1_000 * 3", 3000),
        ("0x10 + 1", 17),
        ("  12 * 12 ", 144),
        ("abs(-7)", 7),
        ("round(2.567, 2)", 2.57),
        ("round(7.5)", 8),
        ("min(3, 1, 2)", 1),
        ("max(3, 1, 2.5)", 3),
        ("sqrt(16)", 4.0),
        ("floor(2.7) + ceil(2.1)", 5),
        ("log(8, 2)", 3.0),
        ("2 * pi", 2 * math.pi),
        ("10 ** 1000 - 10 ** 1000", 0),
        ("+".join(["1"] * 50), 50),
    ],
)
def test_computes(expr: str, expected: float) -> None:
    result = calculator(expr)
    assert result == expected
    assert type(result) is type(expected)


def test_big_integers_stay_exact() -> None:
    assert calculator("2 ** 100 + 1") == 2**100 + 1
    assert calculator("10 ** 1000") == 10**1000


@pytest.mark.parametrize(
    ("expr", "reason"),
    [
        ("__import__('os')", "cannot call __import__"),
        ("__import__('os').system('true')", "cannot call Attribute"),
        ("x + 1", "unknown name 'x'"),
        ("sqrt", "is a function"),
        ("(1).__class__", "Attribute"),
        ("math.pi", "Attribute"),
        ("[1, 2][0]", "Subscript"),
        ("lambda: 1", "Lambda"),
        ("[x for x in (1, 2)]", "ListComp"),
        ("(x for x in (1, 2))", "GeneratorExp"),
        ("'a' * 3", "str literal"),
        ("b'a'", "bytes literal"),
        ("'\\d'", "backslashes"),
        ("1if 1else 2", "invalid number literal '1if'"),
        ("0x1for", "invalid number literal '0x1for'"),
        ("True + 1", "bool literal"),
        ("1j * 1j", "complex literal"),
        ("None", "NoneType literal"),
        ("1 < 2", "Compare"),
        ("1 if 1 else 2", "IfExp"),
        ("1 << 4", "LShift"),
        ("~1", "UnaryOp"),
        ("min(*(1, 2))", "Starred"),
        ("round(2.5, ndigits=1)", "keyword arguments"),
        ("abs(1, 2)", "takes 1 argument"),
        ("max()", "at least 1"),
        ("print(1)", "cannot call print"),
        ("(lambda: 1)()", "cannot call Lambda"),
        ("1 +", "invalid expression"),
        ("", "invalid expression"),
        ("1; 2", "invalid expression"),
        ("x = 1", "invalid expression"),
        ("1\x00", "invalid expression"),
    ],
)
def test_refuses_what_is_not_arithmetic(expr: str, reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        calculator(expr)


@pytest.mark.parametrize(
    ("expr", "reason"),
    [
        ("2 ** 10 ** 10", "exponent 10000000000 is too large"),
        ("9 ** 9 ** 9", "exponent 387420489 is too large"),
        ("(9 ** 9) ** (9 ** 9)", "too large"),
        ("2 ** 20000", "too large"),
        ("10 ** 1001", "too large"),
        ("-(10 ** 1000) - 1", "too large"),
        ("10 ** 600 * 10 ** 600", "too large"),
        ("10 ** 999 * 10 ** 999 * 10 ** 999 * 10 ** 999", "too large"),
        ("99999999999 ** 999", "too large"),
        ("10 ** 1000 / 3", "too large"),
        ("round(5, -100000)", "at most 1000 digits"),
        ("1e308 * 10", "not a finite number"),
        ("1e999", "not a finite number"),
        ("2.0 ** 5000", "too large"),
        ("exp(1000)", "exp\\(\\)"),
        ("sqrt(10 ** 1000)", "sqrt\\(\\)"),
        ("(-8) ** 0.5", "not a real number"),
        ("sqrt(-1)", "math domain error"),
    ],
)
def test_refuses_huge_or_unreal_results_promptly(expr: str, reason: str) -> None:
    started = time.perf_counter()
    with pytest.raises(ValueError, match=reason):
        calculator(expr)
    assert time.perf_counter() - started < 0.5


@pytest.mark.parametrize("expr", ["1 / 0", "1 // 0", "1 % 0", "1.5 / 0.0", "5 % 0.0", "0 ** -1"])
def test_division_by_zero(expr: str) -> None:
    with pytest.raises(ValueError, match="division by zero"):
        calculator(expr)


def test_refuses_too_long_input() -> None:
    expr = "1 + " * 300 + "1"
    with pytest.raises(ValueError, match="characters long"):
        calculator(expr)


@pytest.mark.parametrize(
    "expr",
    ["-" * 150 + "1", "abs(" * 120 + "1" + ")" * 120, "+".join(["1"] * 150)],
)
def test_refuses_deep_nesting(expr: str) -> None:
    with pytest.raises(ValueError, match="nested too deeply"):
        calculator(expr)


@pytest.mark.parametrize("expr", ["1if 1else 2", "0x1for x in y", "'\\d'", "1 is 1", "1 (2)"])
def test_refuses_without_emitting_warnings(expr: str) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(ValueError, match=r".+"):
            calculator(expr)
    assert [str(w.message) for w in caught] == []


async def test_run_reports_a_refusal_as_a_tool_error() -> None:
    outcome = await calculator.run({"expr": "__import__('os').system('true')"})
    assert outcome.status == "error"
    assert outcome.error_detail is not None
    assert outcome.error_detail.code == "tool_error"
    assert outcome.error_detail.message.startswith("ValueError: ")


async def test_run_returns_the_value() -> None:
    outcome = await calculator.run({"expr": "2026 - 1991"})
    assert outcome.status == "success"
    assert outcome.content == 35


# Operands stay small enough (at most 30 leaves of at most 50**5) that Python's
# own value never reaches the calculator's 10**1000 limit.
_leaves = st.one_of(
    st.integers(min_value=-1000, max_value=1000).map(str),
    st.builds(
        lambda b, e: f"{b} ** {e}",
        st.integers(min_value=0, max_value=50),
        st.integers(min_value=0, max_value=5),
    ),
)
_expressions = st.recursive(
    _leaves,
    lambda children: st.builds(
        lambda a, op, b: f"({a} {op} {b})",
        children,
        st.sampled_from(["+", "-", "*", "/", "//", "%"]),
        children,
    ),
    max_leaves=30,
)


@given(_expressions)
def test_agrees_with_python(expr: str) -> None:
    try:
        expected = eval(expr, {"__builtins__": {}})
    except ZeroDivisionError:
        with pytest.raises(ValueError, match="division by zero"):
            calculator(expr)
        return
    if isinstance(expected, float) and not math.isfinite(expected):
        with pytest.raises(ValueError, match="finite"):
            calculator(expr)
        return
    result = calculator(expr)
    assert result == expected
    assert type(result) is type(expected)


@given(st.text(alphabet="0123456789.e+-*/%() ,_abcdijlmnoprstx[]'<~=", max_size=60))
def test_any_input_gives_a_number_or_a_value_error(expr: str) -> None:
    try:
        result = calculator(expr)
    except ValueError:
        return
    assert type(result) in (int, float)
    assert not isinstance(result, float) or math.isfinite(result)
