"""@tool and Toolkit: schemas from hints and docstrings, validation, and every
way a tool run can end."""

from __future__ import annotations

import asyncio
import sys
import threading
import time
import types
from collections.abc import Callable
from typing import Annotated, Any, Literal

import pydantic
import pytest

from fleetbus.errors import ToolDefinitionError, UnknownToolError
from fleetbus.tools_workers import DEFAULT_GROUP, Tool, Toolkit, load_toolkit, tool
from fleetbus.tools_workers.builtin import calculator, current_time


@tool
def add(a: int, b: int = 1) -> int:
    """Add two integers.

    Args:
        a: the first addend.
        b: the second addend.
    """
    return a + b


class Point(pydantic.BaseModel):
    x: float
    y: float


@tool(name="distance", timeout=5.0, concurrency_safe=False, group="geometry")
async def distance_tool(p: Point, q: Point, unit: Literal["m", "km"] = "m") -> dict[str, object]:
    """Distance between two points."""
    d = ((p.x - q.x) ** 2 + (p.y - q.y) ** 2) ** 0.5
    return {"distance": d, "unit": unit}


def test_schema_comes_from_hints_and_docstring() -> None:
    assert add.name == "add"
    assert add.description == "Add two integers."
    assert add.parameters["type"] == "object"
    assert add.parameters["required"] == ["a"]
    assert add.parameters["properties"]["a"] == {
        "description": "the first addend.",
        "title": "A",
        "type": "integer",
    }
    assert add.parameters["properties"]["b"]["default"] == 1
    assert add.parameters["additionalProperties"] is False


def test_options_of_the_decorator() -> None:
    assert distance_tool.name == "distance"
    assert distance_tool.timeout == 5.0
    assert distance_tool.concurrency_safe is False
    assert distance_tool.group == "geometry"
    assert distance_tool.parameters["properties"]["unit"]["enum"] == ["m", "km"]
    assert "Point" in distance_tool.parameters["$defs"]
    assert distance_tool.spec().name == "distance"


def test_a_tool_is_still_the_function() -> None:
    assert add(2, 3) == 5
    assert add.__doc__ is not None
    assert "Add two integers" in add.__doc__


async def test_success_and_coercion() -> None:
    outcome = await add.run({"a": "2"})
    assert (outcome.status, outcome.content, outcome.error_detail) == ("success", 3, None)
    nested = await distance_tool.run({"p": {"x": 0, "y": 0}, "q": {"x": 3, "y": 4}})
    assert nested.content == {"distance": 5.0, "unit": "m"}


@pytest.mark.parametrize(
    ("parameters", "fragment"),
    [
        ({}, "a: Field required"),
        ({"a": "two"}, "a: Input should be a valid integer"),
        ({"a": 1, "c": 2}, "c: Extra inputs are not permitted"),
        (["a"], "Input should be a valid dictionary"),
    ],
)
async def test_invalid_parameters_say_what_is_wrong(parameters: object, fragment: str) -> None:
    outcome = await add.run(parameters)
    assert outcome.status == "error"
    assert outcome.error_detail is not None
    assert outcome.error_detail.code == "invalid_parameters"
    assert fragment in outcome.error_detail.message


async def test_a_raising_tool_is_an_error_outcome() -> None:
    @tool
    def broken(x: int) -> int:
        """Fails."""
        raise ValueError(f"cannot handle {x}")

    outcome = await broken.run({"x": 7})
    assert outcome.status == "error"
    assert outcome.error_detail is not None
    assert (outcome.error_detail.code, outcome.error_detail.message) == (
        "tool_error",
        "ValueError: cannot handle 7",
    )


async def test_timeouts_end_async_and_sync_tools() -> None:
    @tool
    async def sleeper(seconds: float) -> str:
        """Sleeps."""
        await asyncio.sleep(seconds)
        return "woke"

    @tool
    def blocking(seconds: float) -> str:
        """Blocks a thread."""
        time.sleep(seconds)
        return "woke"

    for t in (sleeper, blocking):
        outcome = await t.run({"seconds": 0.4}, timeout=0.05)
        assert outcome.status == "timeout"
        assert outcome.error_detail is not None
        assert outcome.error_detail.code == "timeout"
        assert "0.05s" in outcome.error_detail.message


async def test_cancelling_the_caller_is_not_mistaken_for_a_timeout() -> None:
    @tool
    async def sleeper() -> None:
        """Sleeps."""
        await asyncio.sleep(5)

    task = asyncio.create_task(sleeper.run({}, timeout=10))
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_a_tool_that_swallows_the_timeout_leaves_the_task_clean() -> None:
    @tool
    async def stubborn() -> str:
        """Ignores cancellation once."""
        try:
            await asyncio.sleep(5)
        except asyncio.CancelledError:
            return "ignored"
        return "slept"

    outcome = await stubborn.run({}, timeout=0.02)
    assert outcome.content == "ignored"
    current = asyncio.current_task()
    assert current is not None
    assert current.cancelling() == 0
    await asyncio.sleep(0.01)  # no pending cancellation hits us later


async def test_a_timeout_error_the_tool_raises_is_its_own_failure() -> None:
    @tool
    async def impatient() -> None:
        """Its own client gives up."""
        raise TimeoutError("upstream did not answer")

    for limit in (None, 5.0):
        outcome = await impatient.run({}, timeout=limit)
        assert outcome.status == "error"
        assert outcome.error_detail is not None
        assert outcome.error_detail.message == "TimeoutError: upstream did not answer"


async def test_the_tools_own_timeout_applies_by_default() -> None:
    @tool(timeout=0.05)
    async def sleeper() -> None:
        """Sleeps."""
        await asyncio.sleep(2)

    assert (await sleeper.run({})).status == "timeout"


async def test_a_result_json_cannot_carry_is_an_error() -> None:
    @tool
    def opaque() -> object:
        """Returns an object."""
        return object()

    outcome = await opaque.run({})
    assert outcome.status == "error"
    assert outcome.error_detail is not None
    assert "not JSON-serializable" in outcome.error_detail.message


async def test_models_and_dates_are_returned_as_json() -> None:
    @tool
    def where() -> Point:
        """A point."""
        return Point(x=1, y=2)

    assert (await where.run({})).content == {"x": 1.0, "y": 2.0}


def test_functions_that_cannot_be_tools_are_refused() -> None:
    def no_hints(x):  # type: ignore[no-untyped-def]
        return x

    def star(*args: int) -> int:
        return 0

    def kw(**kwargs: int) -> int:
        return 0

    def positional(x: int, /) -> int:
        return x

    cases: list[tuple[Callable[..., Any], str]] = [
        (no_hints, "has no type hint"),
        (star, r"\*args and \*\*kwargs"),
        (kw, r"\*args and \*\*kwargs"),
        (positional, "positional-only"),
    ]
    for fn, fragment in cases:
        with pytest.raises(ToolDefinitionError, match=fragment):
            Tool(fn)
    with pytest.raises(ToolDefinitionError, match="invalid tool name"):
        tool(name="has space")(add.fn)
    with pytest.raises(ToolDefinitionError, match="timeout: Input should be greater than 0"):
        tool(timeout=0)(add.fn)


def test_annotated_descriptions_are_kept() -> None:
    @tool
    def greet(name: Annotated[str, pydantic.Field(description="who to greet")]) -> str:
        """Greets."""
        return f"hello {name}"

    assert greet.parameters["properties"]["name"]["description"] == "who to greet"


async def test_toolkit_holds_tools_by_name_and_group() -> None:
    kit = Toolkit([add])
    kit.add(distance_tool)
    kit.add(lambda_free_function, group="misc")
    assert kit.names == ["add", "distance", "lambda_free_function"]
    assert kit.groups == {
        DEFAULT_GROUP: ["add"],
        "geometry": ["distance"],
        "misc": ["lambda_free_function"],
    }
    assert [t.name for t in kit.in_groups("geometry")] == ["distance"]
    assert [s.name for s in kit.specs()] == kit.names
    assert "add" in kit
    assert len(kit) == 3
    with pytest.raises(UnknownToolError, match="unknown tool 'nope'; available tools: add"):
        kit.get("nope")
    unknown = await kit.run("nope", {})
    assert unknown.error_detail is not None
    assert unknown.error_detail.code == "unknown_tool"
    assert "distance" in unknown.error_detail.message
    assert (await kit.run("add", {"a": 1})).content == 2
    with pytest.raises(ToolDefinitionError, match="already in the toolkit"):
        kit.add(Tool(add.fn))
    kit.remove("add")
    assert "add" not in kit


def lambda_free_function(x: int) -> int:
    """Doubles."""
    return 2 * x


def test_load_toolkit_finds_tools_in_modules(monkeypatch: pytest.MonkeyPatch) -> None:
    module = types.ModuleType("fake_tools")
    module.add = add  # type: ignore[attr-defined]
    module.kit = Toolkit([distance_tool])  # type: ignore[attr-defined]
    module.make = lambda: [add]  # type: ignore[attr-defined]
    module.nothing = 3  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "fake_tools", module)
    assert load_toolkit("fake_tools").names == ["add"]
    assert load_toolkit("fake_tools:kit").names == ["distance"]
    assert load_toolkit("fake_tools:make").names == ["add"]
    assert load_toolkit("fake_tools:add").names == ["add"]
    with pytest.raises(ToolDefinitionError, match="no attribute 'missing'"):
        load_toolkit("fake_tools:missing")
    with pytest.raises(ToolDefinitionError, match="not a Toolkit"):
        load_toolkit("fake_tools:nothing")
    with pytest.raises(ToolDefinitionError, match="cannot import"):
        load_toolkit("no_such_module_here")
    assert "calculator" in load_toolkit("fleetbus.tools_workers.builtin").names


async def test_results_are_json_as_pydantic_makes_them_scalars_as_they_are() -> None:
    import enum

    class Level(enum.IntEnum):
        HIGH = 3

    @tool
    def give(kind: str) -> Any:
        """Give something of a kind."""
        return {"none": None, "int": 7, "bool": True, "str": "s", "float": 1.5, "enum": Level.HIGH}[
            kind
        ]

    outcomes = {k: await give.run({"kind": k}) for k in ("none", "int", "bool", "str", "float")}
    assert {k: o.content for k, o in outcomes.items()} == {
        "none": None, "int": 7, "bool": True, "str": "s", "float": 1.5,
    }  # fmt: skip
    assert all(o.status == "success" for o in outcomes.values())
    made = await give.run({"kind": "enum"})
    assert made.content == 3
    assert type(made.content) is int  # the enum's value, not the enum


async def test_a_sync_tool_runs_in_a_thread_unless_it_does_not_block() -> None:
    """A sync function runs in a worker thread (it may block); one marked
    ``blocking=False`` runs on the event loop's thread, its chunks too, and
    a timeout does not cut it short (nothing can)."""
    loop_thread = threading.get_ident()

    def where() -> bool:
        """Whether it runs on the event loop's thread."""
        return threading.get_ident() == loop_thread

    def chunks() -> Any:
        """Yields whether each step runs on the event loop's thread."""
        yield threading.get_ident() == loop_thread
        yield threading.get_ident() == loop_thread

    def slow() -> str:
        """Computes for longer than its timeout."""
        time.sleep(0.05)
        return "done"

    assert (await tool(where).run({})).content is False
    assert tool(where).blocking
    assert (await tool(blocking=False)(where).run({})).content is True
    assert (await tool(chunks).run({})).content == [False, False]
    assert (await tool(blocking=False)(chunks).run({})).content == [True, True]
    ran = await tool(blocking=False)(slow).run({}, timeout=0.01)
    assert (ran.status, ran.content) == ("success", "done")


def test_the_calculator_runs_on_the_loop() -> None:
    assert not calculator.blocking
    assert current_time.blocking  # its time zones are read from disk
