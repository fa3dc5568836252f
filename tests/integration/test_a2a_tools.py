"""A2A agents as tools: an agent of a small a2a-sdk server (its card read,
streamed or not, text, data and message answers, a conversation kept by
``context_id`` and kept apart by session, a task asking for input, a server
gone, a deadline), several behind one pool, and a fleetbus agent calling an
agent of the fleetbus gateway through its A2A face."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Iterator

import pytest
import uvicorn
from a2a.helpers import new_data_part, new_task, new_text_message, new_text_part
from a2a.server.agent_execution import AgentExecutor, RequestContext
from a2a.server.events import EventQueue
from a2a.server.request_handlers import DefaultRequestHandler
from a2a.server.routes import create_agent_card_routes, create_jsonrpc_routes
from a2a.server.tasks import InMemoryTaskStore, TaskUpdater
from a2a.types import AgentCapabilities, AgentCard, AgentInterface, AgentSkill, TaskState
from starlette.applications import Starlette

from fleetbus.agents import Agent, Permissions
from fleetbus.bus import Bus, EmbeddedServer, ToolClient
from fleetbus.errors import ToolDefinitionError, ToolError
from fleetbus.protocol import ToolResultBlock
from fleetbus.testing import ScriptedModel
from fleetbus.tools_workers import Toolkit, tool
from fleetbus.tools_workers.a2a import A2AAgentTool, A2ATools
from tests.helpers import output, running, serving, spawn, wait_for_workers
from tests.integration.agent_specs import CommandModel
from tests.integration.gateway_fixtures import ALICE, gateway


class Echo(AgentExecutor):
    """Answers in capitals; ``ask`` asks for input, ``data`` answers data,
    ``msg TEXT`` answers a message, ``slow`` takes a minute. Keeps the
    context of every request."""

    def __init__(self) -> None:
        self.contexts: list[str] = []

    async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
        text = context.get_user_input()
        assert context.task_id is not None
        assert context.context_id is not None
        self.contexts.append(context.context_id)
        if text.startswith("msg "):
            message = new_text_message(text[4:], context_id=context.context_id)
            await event_queue.enqueue_event(message)
            return
        task = new_task(context.task_id, context.context_id, TaskState.TASK_STATE_SUBMITTED)
        await event_queue.enqueue_event(task)
        updater = TaskUpdater(event_queue, context.task_id, context.context_id)
        await updater.start_work()
        if text == "ask":
            await updater.requires_input(
                updater.new_agent_message([new_text_part("Which colour?")])
            )
            return
        if text == "slow":
            await asyncio.sleep(60)
        if text == "data":
            await updater.add_artifact([new_data_part({"n": 4, "of": ["a"]})], name="count")
        else:
            await updater.add_artifact([new_text_part(text.upper())], name="shout")
        await updater.complete()

    async def cancel(self, context: RequestContext, event_queue: EventQueue) -> None:
        raise NotImplementedError


class _QuietServer(uvicorn.Server):
    """uvicorn without its signal handlers (the test runner keeps its own)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


@contextlib.asynccontextmanager
async def echo_server(
    executor: Echo, *, name: str = "Echo Agent", streaming: bool = True
) -> AsyncIterator[str]:
    """A minimal a2a-sdk server of ``executor`` until the block ends; its URL."""
    sock = socket.create_server(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    card = AgentCard(
        name=name,
        description="Shouts back.",
        supported_interfaces=[
            AgentInterface(url=url, protocol_binding="JSONRPC", protocol_version="1.0")
        ],
        version="1.0",
        capabilities=AgentCapabilities(streaming=streaming),
        default_input_modes=["text/plain"],
        default_output_modes=["text/plain"],
        skills=[AgentSkill(id="shout", name="shout", description="Say it louder.", tags=["x"])],
    )
    handler = DefaultRequestHandler(executor, InMemoryTaskStore(), card)
    app = Starlette(routes=[*create_agent_card_routes(card), *create_jsonrpc_routes(handler, "/")])
    server = _QuietServer(uvicorn.Config(app, log_config=None, access_log=False, lifespan="off"))
    async with asyncio.TaskGroup() as tg:
        task = tg.create_task(server.serve(sockets=[sock]))
        try:
            yield url
        finally:
            await handler.aclose()
            server.should_exit = True
            server.force_exit = True
            await task
            sock.close()


@pytest.mark.parametrize("streaming", [True, False])
async def test_an_a2a_sdk_agent_is_a_tool(streaming: bool) -> None:
    executor = Echo()
    async with echo_server(executor, streaming=streaming) as url:
        toolkit = Toolkit()
        assert await toolkit.add_a2a(url) == "Echo_Agent"
        spec = toolkit.get("Echo_Agent").spec()
        assert spec.description == "Shouts back.\nSkills: shout: Say it louder."
        assert spec.parameters["required"] == ["message"]
        said = await toolkit.run("Echo_Agent", {"message": "hi"}, call_id="c1", session_id="s1")
        assert (said.status, said.content, said.call_id) == ("success", "HI", "c1")
        data = await toolkit.run("Echo_Agent", {"message": "data"})
        assert data.content == {"n": 4, "of": ["a"]}
        message = await toolkit.run("Echo_Agent", {"message": "msg plain"})
        assert message.content == "plain"
        asked = await toolkit.run("Echo_Agent", {"message": "ask"})
        assert asked.status == "error"
        assert asked.error_detail is not None
        assert asked.error_detail.message == "Echo_Agent needs input to go on: Which colour?"


async def test_a_context_id_keeps_a_conversation_within_a_session() -> None:
    executor = Echo()
    async with echo_server(executor) as url:
        agent = await A2AAgentTool.from_url(f"{url}/.well-known/agent-card.json", name="echo")
        for session in ("s1", "s1", "s2"):
            result = await agent.run({"message": "a", "context_id": "trip"}, session_id=session)
            assert result.ok
        await agent.run({"message": "a"}, session_id="s1")
        await agent.run({"message": "a"}, session_id="s1")
    first, again, other, fresh, fresh_again = executor.contexts
    assert first == again
    assert first.startswith("trip-")
    assert other != first
    assert len({first, other, fresh, fresh_again}) == 4


async def test_calls_that_cannot_be_answered_are_error_results() -> None:
    executor = Echo()
    async with echo_server(executor) as url:
        agent = await A2AAgentTool.from_url(url)
        bad = await agent.run({"text": "hi"})
        assert bad.error_detail is not None
        assert bad.error_detail.code == "invalid_parameters"
        late = await agent.run({"message": "slow"}, timeout=0.5)
        assert late.status == "timeout"
    gone = await agent.run({"message": "hi"})
    assert gone.status == "error"
    assert gone.error_detail is not None
    assert gone.error_detail.message.startswith(f"the A2A agent {url} ")
    with pytest.raises(ToolError, match="cannot read the card"):
        await A2AAgentTool.from_url(url, connect_timeout=5)


async def test_several_agents_share_one_pool() -> None:
    async with (
        echo_server(Echo(), name="one") as first,
        echo_server(Echo(), name="two") as second,
    ):
        async with A2ATools([first, second], name_prefix="a2a_") as remote:
            assert [t.name for t in remote.tools] == ["a2a_one", "a2a_two"]
            toolkit = Toolkit(remote.tools)
            assert (await toolkit.run("a2a_two", {"message": "yo"})).content == "YO"
        with pytest.raises(ToolDefinitionError, match="would both be named"):
            async with A2ATools([first, first]):
                pass


def clerk(stamped: list[str]) -> Agent:
    @tool
    def stamp(tag: str) -> str:
        """Stamp a tag."""
        stamped.append(tag)
        return f"stamped {tag}"

    return Agent(
        "clerk",
        "",
        CommandModel(),
        toolkit=Toolkit([stamp]),
        permissions=Permissions.from_strings(ask=["stamp"]),
        description="Stamps tags.",
    )


async def test_an_agent_asks_a_gateway_agent_through_a2a(
    nats_server: EmbeddedServer, prefix: str
) -> None:
    stamped: list[str] = []
    async with (
        serving(nats_server.url, prefix, clerk(stamped)),
        gateway(nats_server.url, prefix, a2a=True) as gw,
    ):
        toolkit = Toolkit()
        name = await toolkit.add_a2a(
            f"{gw.url}/a2a/clerk", headers={"authorization": f"Bearer {ALICE}"}
        )
        assert name == "clerk"
        assert toolkit.get("clerk").description.startswith("Stamps tags.\nSkills: clerk:")
        model = ScriptedModel(
            [
                ScriptedModel.call("clerk", {"message": "hi", "context_id": "t"}),
                ScriptedModel.call("clerk", {"message": "heard?", "context_id": "t"}),
                ScriptedModel.call("clerk", {"message": 'tool stamp {"tag": "A"}'}),
                ScriptedModel.text("done"),
            ]
        )
        boss = Agent("boss", "", model, toolkit=toolkit)
        answer = await asyncio.wait_for(boss.reply("go", session_id="b1"), 60)
    assert answer.content == "done"
    results = [
        block
        for request in model.requests[1:]
        for block in request.messages[-1].content
        if isinstance(block, ToolResultBlock)
    ]
    hi, heard, stamp = results
    assert str(hi.output).startswith("echo hi from ")
    assert heard.output == "heard: hi"
    assert stamp.state == "error"
    assert "clerk needs input to go on: The agent asks to run stamp" in str(stamp.output)
    assert stamped == []


@pytest.mark.slow
async def test_a_worker_serves_a_remote_a2a_agent_on_the_bus(
    nats_server: EmbeddedServer, bus: Bus, prefix: str
) -> None:
    async with echo_server(Echo()) as url:
        command = [
            "worker",
            "--a2a",
            url,
            "--a2a-header",
            "X-Caller: fleet",
            "--nats",
            nats_server.url,
            "--prefix",
            prefix,
        ]
        with running([command]):
            await wait_for_workers(bus, "Echo_Agent", 1)
            result = await ToolClient(bus).call("Echo_Agent", {"message": "over the bus"})
    assert (result.status, result.content) == ("success", "OVER THE BUS")


def test_an_a2a_header_must_be_a_name_and_a_value() -> None:
    proc = spawn(["worker", "--a2a", "http://127.0.0.1:9", "--a2a-header", "no colon"])
    assert proc.wait(60) == 1
    assert "--a2a-header takes 'NAME: VALUE'" in output(proc)
