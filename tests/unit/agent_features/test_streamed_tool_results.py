"""Streamed tool results in-process: a tool that yields chunks streams each as
a ``tool_result_delta`` event, and the model sees the whole result at the end."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Any

from fleetbus import Agent, Toolkit, tool
from fleetbus.protocol import Event, FinalAnswer, ToolResultBlock
from fleetbus.testing import ScriptedModel


@tool
async def count_up(n: int) -> AsyncIterator[str]:
    """Count up to n, one line at a time."""
    for i in range(1, n + 1):
        await asyncio.sleep(0)
        yield f"{i}\n"


@tool
def rows(n: int) -> Iterator[dict[str, int]]:
    """Rows, one at a time (a sync generator)."""
    for i in range(n):
        yield {"row": i}


@tool(timeout=0.2)
async def endless() -> AsyncIterator[str]:
    """Never ends."""
    while True:
        yield "tick"
        await asyncio.sleep(0.05)


async def test_chunks_are_events_in_order_and_the_model_sees_the_whole_result() -> None:
    model = ScriptedModel([ScriptedModel.call("count_up", {"n": 3}, call_id="c1"), "Counted."])
    agent = Agent("counter", "You count.", model, toolkit=Toolkit([count_up]))

    items = [item async for item in agent.reply_stream("Count to 3")]

    assert isinstance(items[-1], FinalAnswer)
    events = [i for i in items if isinstance(i, Event)]
    names = [e.event for e in events]
    deltas = [e for e in events if e.event == "tool_result_delta"]
    assert [e.data["content"] for e in deltas] == ["1\n", "2\n", "3\n"]
    assert all(e.data["call_id"] == "c1" and e.data["tool_name"] == "count_up" for e in deltas)
    # Between the call and its result.
    first_delta = names.index("tool_result_delta")
    assert names.index("tool_call") < first_delta
    assert names.index("tool_result") > first_delta + 2
    result = next(e for e in events if e.event == "tool_result")
    assert result.data["output"] == "1\n2\n3\n"
    sent = [b for m in model.requests[1].messages for b in m.content]
    (block,) = [b for b in sent if isinstance(b, ToolResultBlock)]
    assert block.output == "1\n2\n3\n"


async def test_a_sync_generator_streams_json_chunks_and_ends_with_their_list() -> None:
    toolkit = Toolkit([rows])
    chunks: list[Any] = []

    async def take(chunk: Any) -> None:
        chunks.append(chunk)

    assert toolkit.is_streaming("rows")
    outcome = await toolkit.run("rows", {"n": 3}, on_chunk=take)

    assert outcome.status == "success"
    assert chunks == [{"row": 0}, {"row": 1}, {"row": 2}]
    assert outcome.content == chunks


async def test_without_on_chunk_a_streaming_tool_gives_its_whole_result() -> None:
    outcome = await Toolkit([count_up]).run("count_up", {"n": 2})
    assert (outcome.status, outcome.content) == ("success", "1\n2\n")


async def test_a_streaming_tool_past_its_timeout_is_a_timeout() -> None:
    seen: list[Any] = []

    async def take(chunk: Any) -> None:
        seen.append(chunk)

    outcome = await endless.run({}, on_chunk=take)

    assert outcome.status == "timeout"
    assert seen
    assert set(seen) == {"tick"}


def test_plain_functions_do_not_stream() -> None:
    @tool
    def add(a: int, b: int) -> int:
        """Add."""
        return a + b

    assert not add.streams
    assert count_up.streams
    assert rows.streams
    assert not Toolkit([add]).is_streaming("add")
