"""Streamed tool results over the bus: a real ToolWorker on the real
nats-server sends a streaming tool's chunks as ``tool_result`` deltas to a
call that asks for them, in order, then the final result; a retry of the
call replays the final result alone."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from fleetbus.agents import Agent
from fleetbus.bus import Bus, EmbeddedServer, ToolClient
from fleetbus.protocol import Event, FinalAnswer, ToolResult, ToolResultBlock
from fleetbus.testing import ScriptedModel
from fleetbus.tools_workers import Toolkit, ToolWorker, tool

runs: dict[str, int] = {}


@tool
async def lines(key: str, n: int) -> AsyncIterator[str]:
    """Yield n lines.

    Args:
        key: what the runs are counted by.
        n: how many lines.
    """
    runs[key] = runs.get(key, 0) + 1
    for i in range(n):
        await asyncio.sleep(0.01)
        yield f"line {i}\n"


@tool
def plain(x: int) -> int:
    """Not streamed."""
    return x * 2


@pytest.fixture
async def worker(bus: Bus) -> AsyncIterator[ToolWorker]:
    served = ToolWorker(bus, Toolkit([lines, plain]), worker_id="w-stream")
    async with asyncio.TaskGroup() as tg:
        task = tg.create_task(served.run())
        await served.wait_ready()
        yield served
        served.stop()
        await task


@pytest.fixture
async def client(nats_server: EmbeddedServer, prefix: str) -> AsyncIterator[ToolClient]:
    bus = await Bus.connect(nats_server.url, prefix=prefix, name="caller")
    try:
        yield ToolClient(bus, timeout=30.0)
    finally:
        await bus.close()


async def test_deltas_come_in_order_then_the_final_result(
    worker: ToolWorker, client: ToolClient
) -> None:
    deltas: list[ToolResult] = []

    result = await client.call(
        "lines", {"key": "ordered", "n": 5}, call_id="s-1", on_delta=deltas.append
    )

    assert [d.content for d in deltas] == [f"line {i}\n" for i in range(5)]
    assert all(not d.final and d.status == "success" for d in deltas)
    assert {d.call_id for d in deltas} == {"s-1"}
    assert {d.sender for d in deltas} == {"w-stream"}
    assert result.final
    assert result.ok
    assert result.content == "".join(f"line {i}\n" for i in range(5))


async def test_a_retried_call_replays_the_final_result_alone(
    worker: ToolWorker, client: ToolClient
) -> None:
    first: list[ToolResult] = []
    again: list[ToolResult] = []
    result = await client.call(
        "lines", {"key": "replayed", "n": 3}, call_id="s-2", on_delta=first.append
    )
    replay = await client.call(
        "lines", {"key": "replayed", "n": 3}, call_id="s-2", on_delta=again.append
    )

    assert len(first) == 3
    assert again == []
    assert replay.final
    assert replay.content == result.content
    assert runs["replayed"] == 1


async def test_a_call_that_does_not_stream_gets_the_final_result_only(
    worker: ToolWorker, client: ToolClient
) -> None:
    result = await client.call("lines", {"key": "unstreamed", "n": 3})

    assert result.final
    assert result.content == "line 0\nline 1\nline 2\n"


async def test_a_tool_that_does_not_stream_sends_no_delta(
    worker: ToolWorker, client: ToolClient
) -> None:
    deltas: list[ToolResult] = []

    result = await client.call("plain", {"x": 21}, on_delta=deltas.append)

    assert (result.content, deltas) == (42, [])


async def test_a_failing_on_delta_does_not_lose_the_result(
    worker: ToolWorker, client: ToolClient
) -> None:
    def broken(delta: ToolResult) -> None:
        raise RuntimeError("a bug in the caller's callback")

    result = await client.call("lines", {"key": "broken", "n": 2}, on_delta=broken)

    assert result.content == "line 0\nline 1\n"


async def test_an_agent_streams_the_chunks_of_a_tool_served_on_the_bus(
    worker: ToolWorker, client: ToolClient
) -> None:
    toolkit = Toolkit()
    await toolkit.add_remote(client, ["lines", "plain"])
    assert toolkit.is_streaming("lines")  # its workers say so when discovered
    assert not toolkit.is_streaming("plain")
    model = ScriptedModel(
        [ScriptedModel.call("lines", {"key": "agent", "n": 3}, call_id="c1"), "Three lines."]
    )
    agent = Agent("reader", "You read.", model, toolkit=toolkit)

    items = [item async for item in agent.reply_stream("Three lines, please")]

    assert isinstance(items[-1], FinalAnswer)
    events = [i for i in items if isinstance(i, Event)]
    names = [e.event for e in events]
    deltas = [e for e in events if e.event == "tool_result_delta"]
    assert [e.data["content"] for e in deltas] == ["line 0\n", "line 1\n", "line 2\n"]
    assert names.index("tool_call") < names.index("tool_result_delta")
    assert names.index("tool_result") > names.index("tool_result_delta") + 2
    sent = [b for m in model.requests[1].messages for b in m.content]
    (block,) = [b for b in sent if isinstance(b, ToolResultBlock)]
    assert block.output == "line 0\nline 1\nline 2\n"  # the model sees the whole result
    assert runs["agent"] == 1
