"""An agent uses tools served by worker processes on the bus exactly like
local ones: discovered into its Toolkit, called with the tool call's id."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from fleetbus.agents import Agent
from fleetbus.bus import Bus, EmbeddedServer, ToolClient
from fleetbus.errors import UnknownToolError
from fleetbus.protocol import ToolResultBlock
from fleetbus.testing import ScriptedModel
from fleetbus.tools_workers import RemoteToolProxy, Toolkit, tool
from tests.helpers import wait_for_workers, workers

SPEC = "tests.integration.worker_tools"


@tool
def local_double(x: int) -> int:
    """Double a number, here."""
    return 2 * x


async def test_local_and_remote_tools_are_used_the_same_way(
    nats_server: EmbeddedServer, bus: Bus, tmp_path: Path
) -> None:
    with workers(
        nats_server.url, bus.prefix, 1, spec=SPEC, env={"FLEETBUS_TEST_DIR": str(tmp_path)}
    ):
        await wait_for_workers(bus, "echo", 1)
        toolkit = Toolkit([local_double])
        added = await toolkit.add_remote(ToolClient(bus), ["echo", "record"])
        assert added == ["echo", "record"]
        assert isinstance(toolkit.get("echo"), RemoteToolProxy)
        assert toolkit.groups == {"default": ["local_double"], "remote": ["echo", "record"]}
        model = ScriptedModel(
            [
                ScriptedModel.calls(
                    ("local_double", {"x": 21}, "l1"),
                    ("echo", {"text": "over the bus"}, "r1"),
                    ("record", {"tag": "from-agent"}, "r2"),
                ),
                ScriptedModel.call("echo", {"text": 5}, call_id="r3"),
                ScriptedModel.text("done"),
            ]
        )
        agent = Agent("a", "", model, toolkit=toolkit)
        final = await agent.reply("go")
    assert final.content == "done"
    offered = {t.name for t in model.requests[0].tools}
    assert {"local_double", "echo", "record"} <= offered
    echo_spec = next(t for t in model.requests[0].tools if t.name == "echo")
    assert echo_spec.parameters["required"] == ["text"]
    results = {r.id: r for m in agent.memory for r in m.tool_results}
    assert results["l1"].output == 42
    assert results["r1"].output == "over the bus"
    record = results["r2"].output
    assert isinstance(record, dict)
    assert record["tag"] == "from-agent"
    # The worker validated the parameters and the agent showed the error.
    assert results["r3"].state == "error"
    assert "text: Input should be a valid string" in str(results["r3"].output)
    # The tool call's id travelled as the call_id: the marks name the call.
    assert (tmp_path / f"from-agent.{record['pid']}.done").exists()


async def with_echo_unserved(nats_server: EmbeddedServer, bus: Bus, client: ToolClient) -> Toolkit:
    """A toolkit with the remote tool ``echo``, found while a worker served
    it; that worker has stopped since."""
    with workers(nats_server.url, bus.prefix, 1, spec=SPEC):
        await wait_for_workers(bus, "echo", 1)
        toolkit = Toolkit()
        await toolkit.add_remote(client, ["echo"])
    return toolkit


def calling_echo_then(answer: str) -> ScriptedModel:
    """A model that calls ``echo``, then answers ``answer``."""
    return ScriptedModel(
        [ScriptedModel.call("echo", {"text": "anyone?"}), ScriptedModel.text(answer)]
    )


async def test_a_remote_tool_whose_workers_are_gone_is_an_error_result(
    nats_server: EmbeddedServer, bus: Bus
) -> None:
    client = ToolClient(bus, attempts=2, reply_grace=0.1, worker_wait=0.5)
    toolkit = await with_echo_unserved(nats_server, bus, client)
    # The worker stopped: the proxy stays, the call waits 0.5 s for a worker, then
    # finds no responders.
    model = calling_echo_then("no")
    agent = Agent("a", "", model, toolkit=toolkit)
    started = asyncio.get_running_loop().time()
    final = await agent.reply("go")
    waited = asyncio.get_running_loop().time() - started
    assert final.content == "no"
    seen = model.requests[1].messages[-1].content[0]
    assert isinstance(seen, ToolResultBlock)
    assert seen.state == "error"
    assert "no worker serves the tool 'echo'" in seen.output
    assert waited >= 0.4  # it waited for a worker before failing


async def test_a_remote_tool_call_waits_for_its_restarting_worker(
    nats_server: EmbeddedServer, bus: Bus
) -> None:
    toolkit = await with_echo_unserved(nats_server, bus, ToolClient(bus))
    # Its one worker is gone; a call now waits (ToolClient.worker_wait, 10 s)
    # and is answered by the worker that starts meanwhile.
    model = calling_echo_then("answered")
    agent = Agent("a", "", model, toolkit=toolkit)
    replying = asyncio.create_task(agent.reply("go"))
    await asyncio.sleep(0.5)
    assert not replying.done()
    with workers(nats_server.url, bus.prefix, 1, spec=SPEC):
        final = await asyncio.wait_for(replying, 30)
    assert final.content == "answered"
    seen = model.requests[1].messages[-1].content[0]
    assert isinstance(seen, ToolResultBlock)
    assert seen.state == "success", seen.output


async def test_adding_a_tool_nobody_serves_is_refused(bus: Bus) -> None:
    with pytest.raises(UnknownToolError, match="unknown tool 'ghost'"):
        await Toolkit().add_remote(ToolClient(bus), ["ghost"], timeout=0.2)


async def test_an_agent_calls_another_agent_as_a_tool(bus: Bus) -> None:
    from fleetbus.agents import AgentService
    from fleetbus.tools_workers import AgentTool
    from tests.integration.agent_specs import echo

    service = AgentService(bus, echo(), replica_id="echo-1")
    async with asyncio.TaskGroup() as tg:
        tg.create_task(service.run())
        await service.wait_ready()
        toolkit = Toolkit([AgentTool(ToolClient(bus, sender="agent.boss"), "echo")])
        model = ScriptedModel(
            [
                ScriptedModel.call("echo", {"request": "brief me"}, call_id="a1"),
                ScriptedModel.text("ok"),
            ]
        )
        boss = Agent("boss", "", model, toolkit=toolkit)
        final = await boss.reply("go")
        service.stop()
    assert final.content == "ok"
    assert model.requests[0].tools[0].parameters["required"] == ["request"]
    result = model.requests[1].messages[-1].content[0]
    assert isinstance(result, ToolResultBlock)
    assert result.state == "success"
    assert str(result.output).startswith("echo brief me from")
