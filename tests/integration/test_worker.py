"""A ToolWorker in this process against a real server: every kind of request
gets the right reply, and the worker keeps serving."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import msgspec
import pytest

from fleetbus.bus import Bus, EmbeddedServer, Request, ToolClient, discover
from fleetbus.errors import ConfigError, NoRespondersError, RemoteError
from fleetbus.protocol import ErrorMessage, Message, ToolCall, ToolResult, decode, encode
from fleetbus.tools_workers import Toolkit, ToolWorker, tool

runs: dict[str, int] = {}


@tool
async def counted(key: str, delay: float = 0.0) -> dict[str, object]:
    """Count how often each key really ran.

    Args:
        key: what to count.
        delay: seconds to take.
    """
    runs[key] = runs.get(key, 0) + 1
    await asyncio.sleep(delay)
    return {"key": key, "runs": runs[key]}


@tool
def explode(message: str) -> None:
    """Always raises."""
    raise RuntimeError(message)


@tool(timeout=0.1)
async def dawdle() -> str:
    """Takes longer than its own timeout."""
    await asyncio.sleep(5)
    return "never"


@pytest.fixture
async def worker(bus: Bus) -> AsyncIterator[ToolWorker]:
    served = ToolWorker(
        bus, Toolkit([counted, explode, dawdle]), worker_id="w-test", max_request_bytes=4096
    )
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
        yield ToolClient(bus, timeout=5.0)
    finally:
        await bus.close()


async def test_success_carries_the_call_id_and_worker(
    worker: ToolWorker, client: ToolClient
) -> None:
    result = await client.call("counted", {"key": "plain"}, call_id="c-1", session_id="s-1")
    assert result.ok
    assert (result.call_id, result.session_id, result.sender) == ("c-1", "s-1", "w-test")
    assert result.content == {"key": "plain", "runs": 1}


async def test_a_raising_tool_is_an_error_result(worker: ToolWorker, client: ToolClient) -> None:
    result = await client.call("explode", {"message": "kaboom"})
    assert result.status == "error"
    assert result.error_detail is not None
    assert (result.error_detail.code, result.error_detail.message) == (
        "tool_error",
        "RuntimeError: kaboom",
    )
    assert (await client.call("counted", {"key": "after-explode"})).ok


async def test_timeouts_from_the_call_and_from_the_tool(
    worker: ToolWorker, client: ToolClient
) -> None:
    by_call = await client.call("counted", {"key": "slow", "delay": 5}, timeout=0.1)
    by_tool = await client.call("dawdle", {})
    for result in (by_call, by_tool):
        assert result.status == "timeout"
        assert result.error_detail is not None
        assert result.error_detail.code == "timeout"


async def test_invalid_parameters_carry_the_validation_message(
    worker: ToolWorker, client: ToolClient
) -> None:
    result = await client.call("counted", {"key": 3, "extra": True})
    assert result.status == "error"
    assert result.error_detail is not None
    assert result.error_detail.code == "invalid_parameters"
    assert "key: Input should be a valid string" in result.error_detail.message
    assert "extra: Extra inputs are not permitted" in result.error_detail.message


async def test_a_repeated_call_id_runs_the_tool_once(
    worker: ToolWorker, client: ToolClient
) -> None:
    first = await client.call("counted", {"key": "dedup"}, call_id="same")
    second = await client.call("counted", {"key": "dedup"}, call_id="same")
    assert runs["dedup"] == 1
    assert first.content == second.content == {"key": "dedup", "runs": 1}
    assert first.id == second.id  # the recorded result itself


async def test_the_same_call_id_on_another_tool_is_another_call(
    worker: ToolWorker, client: ToolClient
) -> None:
    counted_result = await client.call("counted", {"key": "shared-id"}, call_id="shared")
    explode_result = await client.call("explode", {"message": "own run"}, call_id="shared")
    assert counted_result.tool_name == "counted"
    assert counted_result.ok
    assert explode_result.tool_name == "explode"
    assert explode_result.status == "error"


async def test_two_callers_choosing_the_same_call_id_get_their_own_answers(
    worker: ToolWorker, bus: Bus
) -> None:
    first = ToolClient(bus, sender="agent-a")
    second = ToolClient(bus, sender="agent-b")
    a = await first.call("counted", {"key": "caller-a"}, call_id="call_0")
    b = await second.call("counted", {"key": "caller-b"}, call_id="call_0")
    assert a.content == {"key": "caller-a", "runs": 1}
    assert b.content == {"key": "caller-b", "runs": 1}


async def test_a_refused_call_is_not_recorded_so_a_fixed_retry_runs(
    worker: ToolWorker, bus: Bus
) -> None:
    subject = bus.subjects.tool("counted")
    bad = ToolCall(tool_name="counted", call_id="fix-me", parameters={"key": "fixed"}, timeout=-1)
    refused = await bus.request(subject, bad, timeout=2)
    assert isinstance(refused, ToolResult)
    assert refused.status == "error"
    good = ToolCall(tool_name="counted", call_id="fix-me", parameters={"key": "fixed"}, timeout=5)
    ran = await bus.request(subject, good, timeout=2)
    assert isinstance(ran, ToolResult)
    assert ran.ok
    assert runs["fixed"] == 1


async def test_a_retry_while_the_call_runs_joins_it(worker: ToolWorker, client: ToolClient) -> None:
    results = await asyncio.gather(
        *(client.call("counted", {"key": "joined", "delay": 0.2}, call_id="one") for _ in range(3))
    )
    assert runs["joined"] == 1
    assert {r.content["runs"] for r in results if isinstance(r.content, dict)} == {1}


async def test_malformed_and_unknown_messages_get_error_replies(
    worker: ToolWorker, bus: Bus
) -> None:
    subject = bus.subjects.tool("counted")
    cases = [
        (
            b'{"type": "tool_call", "call_id": "n", "session_id": "s-9", "tool_name": 1}',
            "malformed",
            "n",
        ),
        (b"{not json", "malformed", None),
        (
            b'{"type": "tool_call", "tool_name": "counted", "call_id": "v", "version": 2}',
            "unsupported_version",
            "v",
        ),
        (
            encode(ToolResult(tool_name="counted", status="success", call_id="wrong-type")),
            "malformed",
            "wrong-type",
        ),
        (
            b'{"type": "tool_call", "tool_name": "counted", "parameters": {"key": "k"}}',
            "malformed",
            None,
        ),
    ]
    for payload, code, call_id in cases:
        reply = decode((await bus.nc.request(subject, payload, timeout=2)).data)
        assert isinstance(reply, ErrorMessage), payload
        assert (reply.code, reply.call_id, reply.source_component) == (code, call_id, "w-test")
        assert reply.message
        if call_id == "n":
            assert reply.session_id == "s-9"


async def test_unknown_fields_are_ignored_by_the_worker(worker: ToolWorker, bus: Bus) -> None:
    payload = msgspec.json.encode(
        {
            "type": "tool_call",
            "version": 1,
            "call_id": "uf",
            "tool_name": "counted",
            "parameters": {"key": "unknown-fields"},
            "priority": "high",
            "trace": {"span": 1},
        }
    )
    reply = decode((await bus.nc.request(bus.subjects.tool("counted"), payload, timeout=2)).data)
    assert isinstance(reply, ToolResult)
    assert reply.ok
    assert reply.call_id == "uf"


async def test_a_wrong_tool_name_for_the_subject_is_unknown_tool(
    worker: ToolWorker, bus: Bus
) -> None:
    call = ToolCall(tool_name="explode", call_id="mismatch", parameters={"message": "x"})
    reply = await bus.request(bus.subjects.tool("counted"), call, timeout=2)
    assert isinstance(reply, ToolResult)
    assert reply.error_detail is not None
    assert reply.error_detail.code == "unknown_tool"


async def test_oversized_parameters_are_refused(worker: ToolWorker, client: ToolClient) -> None:
    result = await client.call("counted", {"key": "x" * 10_000})
    assert result.status == "error"
    assert result.error_detail is not None
    assert result.error_detail.code == "invalid_parameters"
    assert "at most 4096" in result.error_detail.message
    assert (await client.call("counted", {"key": "small-after-big"})).ok


async def test_an_unserved_tool_has_no_responders(worker: ToolWorker, client: ToolClient) -> None:
    with pytest.raises(NoRespondersError):
        await client.call("nonexistent", {}, attempts=1)


async def test_a_timeout_that_is_not_positive_is_refused(worker: ToolWorker, bus: Bus) -> None:
    with pytest.raises(ConfigError, match="timeout must be positive"):
        await ToolClient(bus).call("counted", {"key": "t"}, timeout=0)
    call = ToolCall(tool_name="counted", call_id="neg", parameters={"key": "t"}, timeout=-1)
    reply = await bus.request(bus.subjects.tool("counted"), call, timeout=2)
    assert isinstance(reply, ToolResult)
    assert reply.error_detail is not None
    assert reply.error_detail.code == "invalid_parameters"


async def test_an_error_reply_reaches_the_client_as_remote_error(bus: Bus) -> None:
    async def refuse(request: Request) -> Message:
        return ErrorMessage(
            call_id=request.message.call_id,
            code="overloaded",
            message="too busy",
            source_component="w-busy",
        )

    stop = asyncio.Event()
    ready = asyncio.Event()
    async with asyncio.TaskGroup() as tg:
        tg.create_task(bus.serve(bus.subjects.tool("busy"), refuse, stop=stop, ready=ready))
        await ready.wait()
        with pytest.raises(
            RemoteError, match="w-busy could not handle the call: overloaded"
        ) as caught:
            await ToolClient(bus).call("busy", {}, call_id="c-busy")
        stop.set()
    assert (caught.value.code, caught.value.call_id) == ("overloaded", "c-busy")


async def test_discovery_through_srv_info(worker: ToolWorker, client: ToolClient, bus: Bus) -> None:
    tools = await client.discover()
    assert list(tools) == ["counted", "dawdle", "explode"]
    counted_tool = tools["counted"]
    assert counted_tool.workers == 1
    assert counted_tool.worker_ids == ("w-test",)
    assert counted_tool.subject == bus.subjects.tool("counted")
    assert counted_tool.parameters["required"] == ["key"]
    assert counted_tool.description == "Count how often each key really ran."
    assert tools["dawdle"].timeout == 0.1
    services = await discover(bus, "fleetbus")
    mine = [s for s in services if s.metadata.get("fleetbus_prefix") == bus.prefix]
    assert len(mine) == 1
    assert {e.queue_group for e in mine[0].endpoints} == {
        "tool.counted",
        "tool.dawdle",
        "tool.explode",
    }


async def test_ping_and_stats_answer_with_the_micro_documents(
    worker: ToolWorker, client: ToolClient, bus: Bus
) -> None:
    await client.call("counted", {"key": "stats"})
    await client.call("explode", {"message": "for stats"})
    service_id = worker.service.id
    ping = msgspec.json.decode(
        (await bus.nc.request(f"$SRV.PING.fleetbus.{service_id}", b"", timeout=2)).data
    )
    assert ping["type"] == "io.nats.micro.v1.ping_response"
    assert ping["id"] == service_id
    stats = msgspec.json.decode(
        (await bus.nc.request(f"$SRV.STATS.fleetbus.{service_id}", b"", timeout=2)).data
    )
    assert stats["type"] == "io.nats.micro.v1.stats_response"
    by_name = {e["name"]: e for e in stats["endpoints"]}
    assert by_name["counted"]["num_requests"] >= 1
    assert by_name["explode"]["num_errors"] == 1
    assert "kaboom" not in by_name["explode"]["last_error"]
    assert "for stats" in by_name["explode"]["last_error"]
