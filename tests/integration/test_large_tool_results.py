"""Tool results larger than the server's max_payload travel by reference:
the worker stores them in the fleet's object store, the caller reads them
back, and gets the whole content as if it had fitted in one message."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest

from fleetbus.bus import Bus, EmbeddedServer, Request, ToolClient, object_store
from fleetbus.bus.tools import RESULTS_STORE, ResultStore
from fleetbus.protocol import (
    DataBlock,
    Message,
    ToolCall,
    ToolResult,
    content_reference,
    encode,
)
from fleetbus.tools_workers import Toolkit, ToolWorker, tool
from tests.helpers import wait_for_workers, workers

SPEC = "tests.integration.test_large_tool_results:large_tools"
MIB = 1024 * 1024

runs: dict[str, int] = {}


def long_text(mib: int = 3) -> str:
    """About ``mib`` MiB of UTF-8: CJK (3 bytes a character), kana, Latin, emoji."""
    line = "第{n}行、漢字とかなの混じった文章。Ünïcödé line {n} — ascii too. 🚀\n"
    parts, size, n = [], 0, 0
    while size < mib * MIB:
        part = line.format(n=n)
        parts.append(part)
        size += len(part.encode())
        n += 1
    return "".join(parts)


def big_value(rows: int = 12_000) -> dict[str, Any]:
    """A structured JSON value of well over 1 MiB: nesting, numbers, big ints, text."""
    return {
        "rows": [
            {
                "id": i,
                "name": f"項目-{i}",
                "score": i / 7,
                "tags": ["東京", "β-test", str(i % 13)],
                "nested": {"ok": i % 2 == 0, "none": None, "big": 10**30 + i},
            }
            for i in range(rows)
        ],
        "total": rows,
    }


@tool
def big_text(mib: int = 3) -> str:
    """Return about ``mib`` MiB of text.

    Args:
        mib: how many MiB.
    """
    runs["big_text"] = runs.get("big_text", 0) + 1
    return long_text(mib)


@tool
def big_json(rows: int = 12_000) -> dict[str, Any]:
    """Return a large structured value.

    Args:
        rows: how many rows.
    """
    return big_value(rows)


@tool
def small() -> str:
    """Return a short text."""
    return "short"


large_tools = Toolkit([big_text, big_json, small])


@pytest.fixture
async def worker(bus: Bus) -> AsyncIterator[ToolWorker]:
    served = ToolWorker(bus, large_tools, worker_id="w-large")
    async with asyncio.TaskGroup() as tg:
        task = tg.create_task(served.run())
        await served.wait_ready()
        yield served
        served.stop()
        await task


@pytest.fixture
async def caller(nats_server: EmbeddedServer, prefix: str) -> AsyncIterator[Bus]:
    connection = await Bus.connect(nats_server.url, prefix=prefix, name="caller")
    try:
        yield connection
    finally:
        await connection.close()


async def test_a_text_over_max_payload_arrives_whole(worker: ToolWorker, caller: Bus) -> None:
    expected = long_text(3)
    assert len(expected.encode()) > 3 * MIB > caller.max_payload
    result = await ToolClient(caller, sender="agent.big").call("big_text", {}, call_id="t-1")
    assert result.ok, result.error_detail
    assert result.content == expected
    assert not result.content_by_reference
    assert (result.call_id, result.sender) == ("t-1", "w-large")


async def test_a_structured_value_over_max_payload_arrives_whole(
    worker: ToolWorker, caller: Bus
) -> None:
    expected = big_value()
    assert len(msgspec.json.encode(expected)) > caller.max_payload
    result = await ToolClient(caller).call("big_json", {}, call_id="j-1")
    assert result.ok, result.error_detail
    assert result.content == expected


async def test_the_reply_on_the_wire_is_a_data_block_in_the_fleet_store(
    worker: ToolWorker, caller: Bus
) -> None:
    call = ToolCall(sender="agent.raw", call_id="w-1", tool_name="big_text", parameters={})
    reply = await caller.request(caller.subjects.tool("big_text"), call, timeout=30)
    assert isinstance(reply, ToolResult)
    assert reply.ok
    assert reply.content_by_reference
    assert len(encode(reply)) < 1024
    reference = content_reference(reply)
    assert reference is not None
    name = ResultStore.object_name("big_text", "agent.raw", "w-1")
    bucket = caller.subjects.kv_bucket(RESULTS_STORE)
    assert reference == DataBlock(
        url=f"nats-object://{bucket}/{name}",
        media_type="application/json",
        name="big_text result",
        size=len(msgspec.json.encode(long_text(3))),
    )
    stored = await (await object_store(caller, RESULTS_STORE)).get(name)
    assert msgspec.json.decode(stored) == long_text(3)


async def test_a_replay_of_the_call_reads_the_same_object(worker: ToolWorker, caller: Bus) -> None:
    client = ToolClient(caller, sender="agent.replay")
    before = runs.get("big_text", 0)
    first = await client.call("big_text", {"mib": 2}, call_id="r-1")
    again = await client.call("big_text", {"mib": 2}, call_id="r-1")
    assert runs["big_text"] == before + 1
    assert first.id == again.id
    assert first.content == again.content == long_text(2)


async def test_a_small_result_stays_inline(worker: ToolWorker, caller: Bus) -> None:
    call = ToolCall(call_id="s-1", tool_name="small")
    reply = await caller.request(caller.subjects.tool("small"), call, timeout=5)
    assert isinstance(reply, ToolResult)
    assert (reply.content, reply.content_by_reference) == ("short", False)


async def test_a_missing_object_is_an_error_result(worker: ToolWorker, caller: Bus) -> None:
    client = ToolClient(caller, sender="agent.gone")
    assert (await client.call("big_text", {"mib": 2}, call_id="g-1")).ok
    store = await object_store(caller, RESULTS_STORE)
    await store.delete(ResultStore.object_name("big_text", "agent.gone", "g-1"))
    replay = await client.call("big_text", {"mib": 2}, call_id="g-1")
    assert replay.status == "error"
    assert replay.content is None
    assert not replay.content_by_reference
    assert replay.error_detail is not None
    assert replay.error_detail.code == "tool_error"
    assert "that object is missing (expired or deleted)" in replay.error_detail.message
    # The client is fine: the next call works.
    assert (await client.call("small", {})).content == "short"


@pytest.mark.parametrize(
    ("content", "why"),
    [
        ({"type": "text", "text": "not a data block"}, "needs a 'data' block"),
        ({"type": "data", "url": "https://example.com/x"}, "not to an object in"),
        ({"type": "data", "url": "nats-object://other_bucket/x"}, "not to an object in"),
    ],
)
async def test_a_bad_reference_is_an_error_result(
    bus: Bus, caller: Bus, content: dict[str, Any], why: str
) -> None:
    async def answer(request: Request) -> Message:
        call = request.message
        assert isinstance(call, ToolCall)
        return ToolResult(
            call_id=call.call_id,
            tool_name=call.tool_name,
            status="success",
            content=content,
            content_by_reference=True,
        )

    stop, ready = asyncio.Event(), asyncio.Event()
    async with asyncio.TaskGroup() as tg:
        tg.create_task(bus.serve(bus.subjects.tool("forged"), answer, stop=stop, ready=ready))
        await ready.wait()
        result = await ToolClient(caller).call("forged", {})
        stop.set()
    assert result.status == "error"
    assert result.error_detail is not None
    assert result.error_detail.code == "tool_error"
    assert why in result.error_detail.message


async def test_a_worker_process_sends_a_large_result_to_a_remote_tool(
    nats_server: EmbeddedServer, bus: Bus
) -> None:
    with workers(nats_server.url, bus.prefix, 1, spec=SPEC):
        await wait_for_workers(bus, "big_text", 1)
        toolkit = Toolkit()
        await toolkit.add_remote(ToolClient(bus, sender="agent.proc"), ["big_text", "big_json"])
        text = await toolkit.run("big_text", {}, call_id="p-1")
        value = await toolkit.run("big_json", {"rows": 8000}, call_id="p-2")
        replay = await toolkit.run("big_text", {}, call_id="p-1")
    assert (text.status, value.status, replay.status) == ("success", "success", "success")
    assert text.content == replay.content == long_text(3)
    assert value.content == big_value(8000)
