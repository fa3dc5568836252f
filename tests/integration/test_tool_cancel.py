"""Cancel crosses processes: a caller that stops waiting for a tool call
stops the tool on the worker running it, through the tool's control subject.

The tools below are served by worker OS processes
(``fleetbus worker tests.integration.test_tool_cancel:cancel_tools``); they
leave marks in ``$FLEETBUS_TEST_DIR`` so the test sees, across processes,
whether a call started, was cancelled, or finished.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest

from fleetbus.agents import Agent
from fleetbus.bus import Bus, EmbeddedServer, ToolClient
from fleetbus.protocol import Cancel, ToolCall, ToolResult, UserRequest
from fleetbus.testing import ScriptedModel
from fleetbus.tools_workers import Toolkit, ToolWorker, tool
from tests.helpers import wait_for_file, wait_for_workers, workers

SPEC = "tests.integration.test_tool_cancel:cancel_tools"


def _marks() -> Path:
    path = Path(os.environ["FLEETBUS_TEST_DIR"])
    path.mkdir(parents=True, exist_ok=True)
    return path


@tool
async def linger(tag: str, seconds: float = 30.0) -> str:
    """Mark the start, wait, mark the end; mark a cancellation instead of the end.

    Args:
        tag: names the marks.
        seconds: how long to wait.
    """
    marks, pid = _marks(), os.getpid()
    (marks / f"{tag}.{pid}.start").write_text(str(pid))
    try:
        await asyncio.sleep(seconds)
    except asyncio.CancelledError:
        (marks / f"{tag}.{pid}.cancelled").write_text(str(pid))
        raise
    (marks / f"{tag}.{pid}.done").write_text(str(pid))
    return f"{tag} done"


@tool
def ping() -> str:
    """Answer at once."""
    return "pong"


cancel_tools = Toolkit([linger, ping])


def names(directory: Path, pattern: str) -> list[str]:
    return sorted(p.name.split(".")[-1] for p in directory.glob(pattern))


def assert_cancelled_by_caller(result: ToolResult) -> None:
    assert result.status == "cancelled"
    assert result.content is None
    assert result.error_detail is not None
    assert result.error_detail.code == "cancelled"
    assert result.error_detail.message.startswith("cancelled by the caller: ")


async def test_cancelling_the_caller_cancels_the_tool_in_the_worker_process(
    nats_server: EmbeddedServer, bus: Bus, tmp_path: Path
) -> None:
    env = {"FLEETBUS_TEST_DIR": str(tmp_path)}
    with workers(nats_server.url, bus.prefix, 1, spec=SPEC, env=env) as procs:
        await wait_for_workers(bus, "linger", 1)
        client = ToolClient(bus, sender="caller-a", timeout=60)
        async with asyncio.TaskGroup() as tg:
            call = tg.create_task(client.call("linger", {"tag": "a"}, call_id="c-a"))
            await wait_for_file(tmp_path, "a.*.start")
            call.cancel()
        assert call.cancelled()
        cancelled_at = time.monotonic()
        await wait_for_file(tmp_path, "a.*.cancelled", timeout=30)
        assert time.monotonic() - cancelled_at < 5
        # The worker recorded the call as cancelled: a retry gets that answer
        # at once instead of running the tool again (or joining a run).
        retry = ToolClient(bus, sender="caller-a", timeout=3, attempts=1)
        replay = await retry.call("linger", {"tag": "a"}, call_id="c-a")
        assert procs[0].poll() is None
    assert_cancelled_by_caller(replay)
    assert replay.error_detail is not None
    assert replay.error_detail.message == (
        "cancelled by the caller: the caller stopped waiting for the result"
    )
    assert (replay.call_id, replay.sender) == ("c-a", "w1")
    assert names(tmp_path, "a.*") == ["cancelled", "start"]


async def test_interrupting_an_agent_cancels_its_remote_tool(
    nats_server: EmbeddedServer, bus: Bus, tmp_path: Path
) -> None:
    env = {"FLEETBUS_TEST_DIR": str(tmp_path)}
    agent_bus = await Bus.connect(nats_server.url, prefix=bus.prefix, name="agent-host")
    try:
        with workers(nats_server.url, bus.prefix, 1, spec=SPEC, env=env):
            await wait_for_workers(bus, "linger", 1)
            toolkit = Toolkit()
            client = ToolClient(agent_bus, sender="agent.b", timeout=60)
            await toolkit.add_remote(client, ["linger"])
            model = ScriptedModel(
                [
                    ScriptedModel.call("linger", {"tag": "b"}, call_id="b1"),
                    ScriptedModel.text("never reached"),
                ]
            )
            agent = Agent("b", "", model, toolkit=toolkit)
            async with await bus.observe(bus.subjects.tool_control("linger")) as control:
                await bus.flush()
                async with asyncio.TaskGroup() as tg:
                    reply = tg.create_task(agent.reply("go"))
                    await wait_for_file(tmp_path, "b.*.start")
                    agent.interrupt()
                final = reply.result()
                await wait_for_file(tmp_path, "b.*.cancelled", timeout=30)
                async with asyncio.timeout(5):
                    seen = await anext(aiter(control))
            assert isinstance(seen, Cancel)
            assert seen.call_id is not None
            replay = await ToolClient(bus, sender="agent.b", timeout=3, attempts=1).call(
                "linger", {"tag": "b"}, call_id=seen.call_id
            )
    finally:
        await agent_bus.close()
    assert final.finished_reason == "interrupted"
    # The cancel named the agent's call: its id, its caller, its session.
    assert seen.call_id.endswith(".b1")
    assert seen.sender == "agent.b"
    assert seen.reason == "the caller stopped waiting for the result"
    assert_cancelled_by_caller(replay)
    assert names(tmp_path, "b.*") == ["cancelled", "start"]


async def test_a_cancel_for_another_call_is_ignored_and_the_worker_keeps_serving(
    nats_server: EmbeddedServer, bus: Bus, tmp_path: Path
) -> None:
    env = {"FLEETBUS_TEST_DIR": str(tmp_path)}
    control = bus.subjects.tool_control("linger")
    with workers(nats_server.url, bus.prefix, 1, spec=SPEC, env=env) as procs:
        await wait_for_workers(bus, "linger", 1)
        client = ToolClient(bus, sender="caller-c", timeout=10)
        async with await bus.observe(bus.subjects.all_tools()) as every_tool:
            await bus.flush()
            async with asyncio.TaskGroup() as tg:
                call = tg.create_task(
                    client.call("linger", {"tag": "c", "seconds": 1.0}, call_id="c-c")
                )
                await wait_for_file(tmp_path, "c.*.start")
                # An unknown call_id, the right call_id from another caller,
                # and messages that are not a cancel: none of them stops it.
                await bus.publish(control, Cancel(sender="caller-c", call_id="nope", reason="x"))
                await bus.publish(control, Cancel(sender="someone-else", call_id="c-c"))
                await bus.publish(control, Cancel(sender="caller-c", call_id=None))
                await bus.publish(control, UserRequest(sender="caller-c", content="stop?"))
                await bus.nc.publish(control, b"not json")
            result = call.result()
            pong = await client.call("ping", {}, call_id="c-ping")
            seen = []
            async with asyncio.timeout(5):
                async for message in every_tool:
                    seen.append(message)
                    if message.call_id == "c-ping":
                        break
        assert procs[0].poll() is None
    assert result.ok
    assert result.content == "c done"
    assert names(tmp_path, "c.*") == ["done", "start"]
    assert pong.content == "pong"
    # The tools wildcard (one token) sees the calls, none of the control traffic.
    assert [(type(m), m.call_id) for m in seen] == [(ToolCall, "c-c"), (ToolCall, "c-ping")]


async def test_a_cancel_after_the_call_ended_changes_nothing(
    nats_server: EmbeddedServer, bus: Bus, tmp_path: Path
) -> None:
    env = {"FLEETBUS_TEST_DIR": str(tmp_path)}
    with workers(nats_server.url, bus.prefix, 1, spec=SPEC, env=env):
        await wait_for_workers(bus, "linger", 1)
        client = ToolClient(bus, sender="caller-d", timeout=10)
        first = await client.call("linger", {"tag": "d", "seconds": 0}, call_id="c-d")
        await bus.publish(
            bus.subjects.tool_control("linger"),
            Cancel(sender="caller-d", call_id="c-d", reason="late"),
        )
        await bus.flush()
        replay = await client.call("linger", {"tag": "d", "seconds": 0}, call_id="c-d")
    assert first.ok
    assert replay.ok
    assert replay.id == first.id
    assert names(tmp_path, "d.*") == ["done", "start"]


async def test_a_cancel_reaches_a_call_still_running_while_the_worker_drains(
    nats_server: EmbeddedServer, bus: Bus, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FLEETBUS_TEST_DIR", str(tmp_path))
    served = ToolWorker(bus, cancel_tools, worker_id="w-drain", drain_timeout=30)
    caller = await Bus.connect(nats_server.url, prefix=bus.prefix, name="caller-e")
    try:
        async with asyncio.TaskGroup() as tg:
            run = tg.create_task(served.run())
            await served.wait_ready()
            client = ToolClient(caller, sender="caller-e", timeout=60)
            call = tg.create_task(client.call("linger", {"tag": "e"}, call_id="c-e"))
            await wait_for_file(tmp_path, "e.*.start")
            served.stop()
            await asyncio.sleep(0.2)  # the call subscriptions are drained by now
            call.cancel()
            started = time.monotonic()
            async with asyncio.timeout(10):
                await run  # the drain would wait 30 s for the call
    finally:
        await caller.close()
    assert time.monotonic() - started < 5
    assert call.cancelled()
    assert served.cancelled == 1
    assert names(tmp_path, "e.*") == ["cancelled", "start"]


async def test_a_cancel_that_cannot_be_sent_is_logged_and_the_caller_still_stops(
    nats_server: EmbeddedServer,
    bus: Bus,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setenv("FLEETBUS_TEST_DIR", str(tmp_path))
    served = ToolWorker(bus, cancel_tools, worker_id="w-hang", drain_timeout=0.5)
    caller = await Bus.connect(nats_server.url, prefix=bus.prefix, name="caller-f")

    async def hang(subject: str, message: object) -> None:
        await asyncio.Event().wait()  # a publish that never completes

    try:
        async with asyncio.TaskGroup() as tg:
            run = tg.create_task(served.run())
            await served.wait_ready()
            client = ToolClient(caller, sender="caller-f", timeout=60, cancel_timeout=0.2)
            call = tg.create_task(client.call("linger", {"tag": "f", "seconds": 2}))
            await wait_for_file(tmp_path, "f.*.start")
            monkeypatch.setattr(caller, "publish", hang)
            call.cancel()
            started = time.monotonic()
            await asyncio.wait({call})
            stopped_after = time.monotonic() - started
            served.stop()
            await run
    finally:
        await caller.close()
    assert call.cancelled()
    assert stopped_after < 1.5
    assert served.cancelled == 0
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    assert any(
        "cancel of call" in r.getMessage() and "not sent" in r.getMessage() for r in warnings
    )
