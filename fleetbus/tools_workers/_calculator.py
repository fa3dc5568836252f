"""A bounded arithmetic evaluator over the Python ``ast``, for the calculator tool.

Only numbers (``int`` and ``float`` literals), unary ``+``/``-``, the binary
operators ``+ - * / // % **``, parentheses, a few constants (``pi``, ``e``,
``tau``) and a few functions called by name with positional arguments are
accepted; anything else (other names, attributes, subscripts, strings, booleans,
comparisons, lambdas, comprehensions, keyword arguments) is refused with a
``ValueError`` before it runs.

Work is bounded: the source length and the nesting depth are capped, an
integer power is refused before it is computed when its result would be too
large, and every integer result must stay within ``10**1000`` in magnitude, so
no step multiplies numbers bigger than that. Float results must be finite.
"""

from __future__ import annotations

import ast
import io
import math
import operator
import re
import tokenize
from collections.abc import Callable
from typing import Final

__all__ = [
    "MAX_DEPTH",
    "MAX_EXPONENT",
    "MAX_EXPRESSION_LENGTH",
    "MAX_INT",
    "evaluate",
]

Number = int | float

MAX_EXPRESSION_LENGTH: Final = 1000
"""Longest expression accepted, in characters."""

MAX_DEPTH: Final = 100
"""Deepest nesting of syntax nodes accepted (``1+2+…`` nests one per operator)."""

MAX_EXPONENT: Final = 10_000
"""Largest absolute integer exponent accepted."""

MAX_INT: Final = 10**1000
"""Largest absolute integer value accepted, for results and every step."""

_MAX_INT_BITS: Final = MAX_INT.bit_length()
_MAX_ROUND_DIGITS: Final = 1000

_BINARY: Final[dict[type[ast.operator], Callable[[Number, Number], Number]]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}

_CONSTANTS: Final[dict[str, float]] = {"pi": math.pi, "e": math.e, "tau": math.tau}


def _round(x: Number, ndigits: Number | None = None) -> Number:
    if ndigits is None:
        return round(x)
    if not isinstance(ndigits, int):
        raise ValueError("the number of digits must be an integer")
    if abs(ndigits) > _MAX_ROUND_DIGITS:
        # round(int, -n) computes 10**n.
        raise ValueError(f"at most {_MAX_ROUND_DIGITS} digits")
    return round(x, ndigits)


# name: (function, fewest arguments, most arguments or None for any number)
_FUNCTIONS: Final[dict[str, tuple[Callable[..., Number], int, int | None]]] = {
    "abs": (abs, 1, 1),
    "round": (_round, 1, 2),
    "min": (lambda *xs: min(xs), 1, None),
    "max": (lambda *xs: max(xs), 1, None),
    "sqrt": (math.sqrt, 1, 1),
    "exp": (math.exp, 1, 1),
    "log": (math.log, 1, 2),
    "log10": (math.log10, 1, 1),
    "log2": (math.log2, 1, 1),
    "sin": (math.sin, 1, 1),
    "cos": (math.cos, 1, 1),
    "tan": (math.tan, 1, 1),
    "floor": (math.floor, 1, 1),
    "ceil": (math.ceil, 1, 1),
}


def evaluate(expr: str) -> Number:
    """Evaluate an arithmetic expression safely.

    Args:
        expr: the expression, in Python syntax, e.g. ``"(2 + 3) * 4 ** 0.5"``.

    Returns:
        The value: an ``int`` when every step is exact integer arithmetic
        (``/`` always gives a ``float``, as in Python), else a ``float``.

    Raises:
        ValueError: the expression is not plain arithmetic, is too long or too
            deep, divides by zero, or its value (or a step's) is too large or
            not finite.
    """
    if len(expr) > MAX_EXPRESSION_LENGTH:
        raise ValueError(
            f"expression is {len(expr)} characters long; the limit is {MAX_EXPRESSION_LENGTH}"
        )
    _check_tokens(expr)
    try:
        tree = ast.parse(expr.strip(), mode="eval")
    except (SyntaxError, ValueError, MemoryError, RecursionError) as exc:
        reason = exc.msg if isinstance(exc, SyntaxError) else str(exc) or type(exc).__name__
        raise ValueError(f"invalid expression: {reason}") from None
    return _eval(tree.body, 1)


_PLAIN = re.compile(r"[\d\s.+\-*/%()eE_]*")
"""Numbers and operators only, the common case: such an expression skips the
token scan, which costs several times the evaluation itself."""


def _check_tokens(expr: str) -> None:
    # The parser emits a SyntaxWarning (printed, or raised under -W error) for a
    # number glued to a keyword ("1if") and for bad escapes in strings; neither
    # is arithmetic, so refuse them before parsing.
    if "\\" in expr:
        raise ValueError("backslashes are not allowed")
    if _PLAIN.fullmatch(expr):
        return  # no letter but an exponent's e: nothing can be glued to a keyword
    previous: tokenize.TokenInfo | None = None
    try:
        for token in tokenize.generate_tokens(io.StringIO(expr).readline):
            if (
                previous is not None
                and previous.type == tokenize.NUMBER
                and token.type == tokenize.NAME
                and previous.end == token.start
            ):
                raise ValueError(f"invalid number literal {previous.string + token.string!r}")
            previous = token
    except (tokenize.TokenError, SyntaxError):
        pass  # ast.parse explains the error better


def _describe(node: ast.AST) -> str:
    if isinstance(node, ast.Constant):
        return f"{type(node.value).__name__} literal {node.value!r}"
    return f"{type(node).__name__} expression"


def _eval(node: ast.expr, depth: int) -> Number:
    if depth > MAX_DEPTH:
        raise ValueError(f"expression is nested too deeply (limit {MAX_DEPTH})")
    if isinstance(node, ast.Constant):
        # type() and not isinstance(): bool is an int subclass.
        if type(node.value) not in (int, float):
            raise ValueError(f"only numbers are allowed, not a {_describe(node)}")
        return _checked(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.UAdd | ast.USub):
        operand = _eval(node.operand, depth + 1)
        return -operand if isinstance(node.op, ast.USub) else +operand
    if isinstance(node, ast.BinOp):
        left = _eval(node.left, depth + 1)
        right = _eval(node.right, depth + 1)
        return _binary(node.op, left, right)
    if isinstance(node, ast.Name):
        if node.id in _CONSTANTS:
            return _CONSTANTS[node.id]
        if node.id in _FUNCTIONS:
            raise ValueError(f"{node.id} is a function; call it, e.g. {node.id}(2)")
        raise ValueError(f"unknown name {node.id!r}; {_allowed_names()}")
    if isinstance(node, ast.Call):
        return _call(node, depth)
    raise ValueError(f"not allowed in a calculation: {_describe(node)}")


def _call(node: ast.Call, depth: int) -> Number:
    if not isinstance(node.func, ast.Name) or node.func.id not in _FUNCTIONS:
        what = node.func.id if isinstance(node.func, ast.Name) else _describe(node.func)
        raise ValueError(f"cannot call {what}; {_allowed_names()}")
    name = node.func.id
    if node.keywords:
        raise ValueError(f"{name}(): keyword arguments are not allowed")
    fn, fewest, most = _FUNCTIONS[name]
    if len(node.args) < fewest or (most is not None and len(node.args) > most):
        if most is None:
            expected = f"at least {fewest}"
        else:
            expected = str(fewest) if fewest == most else f"{fewest} to {most}"
        raise ValueError(f"{name}() takes {expected} argument(s), got {len(node.args)}")
    args = [_eval(arg, depth + 1) for arg in node.args]
    try:
        result = fn(*args)
    except ZeroDivisionError:
        raise ValueError(f"{name}(): division by zero") from None
    except (ArithmeticError, ValueError, TypeError) as exc:
        raise ValueError(f"{name}(): {exc}") from None
    return _checked(result)


def _binary(op: ast.operator, left: Number, right: Number) -> Number:
    if isinstance(op, ast.Pow):
        return _power(left, right)
    fn = _BINARY.get(type(op))
    if fn is None:
        raise ValueError(f"operator {type(op).__name__} is not allowed")
    try:
        result = fn(left, right)
    except ZeroDivisionError:
        raise ValueError("division by zero") from None
    except OverflowError as exc:
        raise ValueError(f"result too large: {exc}") from None
    return _checked(result)


def _power(base: Number, exponent: Number) -> Number:
    if isinstance(exponent, int) and abs(exponent) > MAX_EXPONENT:
        raise ValueError(f"exponent {exponent} is too large (limit {MAX_EXPONENT})")
    if (
        isinstance(base, int)
        and isinstance(exponent, int)
        and exponent > 0
        and abs(base) > 1
        # Refuse before computing: the result has about exponent*log2|base| bits.
        and exponent * math.log2(abs(base)) > _MAX_INT_BITS
    ):
        raise ValueError("result too large: integers are limited to 10**1000 in magnitude")
    try:
        result = base**exponent
    except ZeroDivisionError:
        raise ValueError("division by zero") from None
    except OverflowError as exc:
        raise ValueError(f"result too large: {exc}") from None
    return _checked(result)


def _checked(value: object) -> Number:
    if type(value) is int:
        if abs(value) > MAX_INT:
            raise ValueError("result too large: integers are limited to 10**1000 in magnitude")
        return value
    if type(value) is float:
        if not math.isfinite(value):
            raise ValueError(f"result is not a finite number ({value})")
        return value
    # e.g. a negative number to a fractional power is complex.
    raise ValueError(f"result is not a real number ({value!r})")


def _allowed_names() -> str:
    return (
        f"allowed functions: {', '.join(sorted(_FUNCTIONS))}; "
        f"constants: {', '.join(sorted(_CONSTANTS))}"
    )
