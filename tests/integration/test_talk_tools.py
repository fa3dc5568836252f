"""The talk tools (``send_message``, ``publish``) of agents served by an
AgentHost in the test's process, on a real server."""

from __future__ import annotations

import asyncio
import time

from fleetbus.agents import Agent
from fleetbus.agents.messages import Msg
from fleetbus.agents.serving.sessions import SessionStore
from fleetbus.bus import Bus, EmbeddedServer
from fleetbus.capabilities.talk import talk_tools
from fleetbus.errors import CallTimeoutError
from fleetbus.models import ModelRequest
from fleetbus.protocol import AgentMessage, FinalAnswer, ToolResultBlock, UserRequest
from fleetbus.testing import ScriptedModel, Turn
from fleetbus.tools_workers import Toolkit
from tests.integration.agent_specs import PID, CommandModel
from tests.integration.test_host import hosting


def talker(name: str, *turns: Turn) -> tuple[Agent, ScriptedModel]:
    """An agent with the talk tools that plays ``turns``, and its model."""
    model = ScriptedModel(turns)
    return Agent(name, "", model, toolkit=Toolkit(talk_tools())), model


def echo(name: str) -> Agent:
    return Agent(name, "", CommandModel(), toolkit=Toolkit())


def results(request: ModelRequest) -> list[ToolResultBlock]:
    """The tool results the model was shown last in ``request``."""
    return [b for b in request.messages[-1].content if isinstance(b, ToolResultBlock)]


async def ask(bus: Bus, agent: str, text: str, session: str) -> FinalAnswer:
    answer = await bus.request(
        bus.subjects.agent_inbox(agent), UserRequest(content=text, session_id=session), timeout=15
    )
    assert isinstance(answer, FinalAnswer), answer
    return answer


async def memory(bus: Bus, agent: str, session: str) -> list[Msg]:
    store = await SessionStore.open(bus, owner="test")
    record = await store.get(agent, session)
    assert record is not None, f"no session {session} of {agent}"
    return record.state.memory


async def test_send_message_records_the_message_in_the_recipients_session(
    nats_server: EmbeddedServer, bus: Bus
) -> None:
    alice, model = talker(
        "alice",
        ScriptedModel.call("send_message", {"to": "bob", "message": "the bridge is out"}),
        ScriptedModel.text("told bob"),
    )
    async with hosting(nats_server.url, bus.prefix, [alice, echo("bob")]):
        answer = await ask(bus, "alice", "warn bob", "dm-1")
        heard = await memory(bus, "bob", "dm-1")
    assert answer.content == "told bob"
    [result] = results(model.requests[1])
    assert (result.state, result.output) == ("success", "delivered to bob")
    [note] = heard  # only heard: bob did not reply
    assert (note.role, note.name, note.text) == ("user", "alice", "the bridge is out")
    assert "observed" in note.marks


async def test_send_message_waiting_for_a_reply_returns_the_answer(
    nats_server: EmbeddedServer, bus: Bus
) -> None:
    alice, model = talker(
        "alice",
        ScriptedModel.call(
            "send_message", {"to": "bob", "message": "status?", "wait_for_reply": True}
        ),
        ScriptedModel.text("bob answered"),
    )
    async with hosting(nats_server.url, bus.prefix, [alice, echo("bob")]):
        await ask(bus, "alice", "ask bob", "dm-2")
        bobs = await memory(bus, "bob", "dm-2")
    [result] = results(model.requests[1])
    assert (result.state, result.output) == ("success", f"echo status? from {PID}")
    assert [(m.role, m.text) for m in bobs] == [
        ("user", "status?"),
        ("assistant", f"echo status? from {PID}"),
    ]


async def test_publish_reaches_the_observers_of_the_topic(
    nats_server: EmbeddedServer, bus: Bus
) -> None:
    alice, model = talker(
        "alice",
        ScriptedModel.call("publish", {"topic": "news", "message": "storm tonight"}),
        ScriptedModel.text("announced"),
    )
    async with hosting(
        nats_server.url, bus.prefix, [alice, echo("carol"), echo("dave")], topics=["news"]
    ):
        async with await bus.observe(bus.subjects.topic("news")) as seen:
            await bus.flush()
            await ask(bus, "alice", "announce it", "town-1")
            broadcast = await asyncio.wait_for(anext(aiter(seen)), 10)
        store = await SessionStore.open(bus, owner="test")
        deadline = time.monotonic() + 10
        heard: dict[str, list[Msg]] = {}
        while time.monotonic() < deadline and len(heard) < 2:
            for name in ("carol", "dave"):
                record = await store.get(name, "town-1")
                if record is not None and record.owner is None:
                    heard[name] = record.state.memory
            await asyncio.sleep(0.05)
        alices = await memory(bus, "alice", "town-1")
    [result] = results(model.requests[1])
    assert (result.state, result.output) == ("success", "published on news")
    assert isinstance(broadcast, AgentMessage)
    assert (broadcast.sender, broadcast.session_id, broadcast.reply) == ("alice", "town-1", False)
    # Recorded by each observer in the sender's session, not by the sender.
    for name in ("carol", "dave"):
        assert [(m.name, m.text) for m in heard[name]] == [("alice", "storm tonight")]
    assert not [m for m in alices if "observed" in m.marks]


async def test_talk_tools_outside_a_host_give_the_model_a_tool_error() -> None:
    alice, model = talker(
        "alice",
        ScriptedModel.call("send_message", {"to": "bob", "message": "hello"}),
        ScriptedModel.call("publish", {"topic": "news", "message": "hello all"}),
        ScriptedModel.text("could not"),
    )
    answer = await alice.reply("say hello")
    assert answer.content == "could not"
    for request in model.requests[1:]:
        [result] = results(request)
        assert result.state == "error"
        assert "not served on the bus" in str(result.output)


async def test_sending_to_an_unknown_agent_or_to_oneself_is_a_tool_error(
    nats_server: EmbeddedServer, bus: Bus
) -> None:
    alice, model = talker(
        "alice",
        ScriptedModel.call("send_message", {"to": "nobody", "message": "hello?"}),
        ScriptedModel.call("send_message", {"to": "alice", "message": "me?"}),
        ScriptedModel.call("send_message", {"to": "two.tokens", "message": "you?"}),
        ScriptedModel.text("gave up"),
    )
    async with hosting(nats_server.url, bus.prefix, [alice]):
        answer = await ask(bus, "alice", "say hello", "lonely")
    assert answer.content == "gave up"
    errors = [results(request) for request in model.requests[1:]]
    assert [[r.state for r in rs] for rs in errors] == [["error"]] * 3
    unknown, myself, invalid = (str(rs[0].output) for rs in errors)
    assert "the message to nobody was not delivered: no agent 'nobody' is served" in unknown
    assert "that is yourself" in myself
    assert "agent name" in invalid


async def test_waiting_for_a_reply_from_an_agent_of_the_same_full_host(
    nats_server: EmbeddedServer, bus: Bus
) -> None:
    alice, _ = talker(
        "alice",
        ScriptedModel.call(
            "send_message", {"to": "bob", "message": "status?", "wait_for_reply": True}
        ),
        ScriptedModel.text("bob answered"),
    )
    async with hosting(
        nats_server.url, bus.prefix, [alice, echo("bob")], concurrency=1, drain_timeout=0.5
    ):
        try:
            answer: object = await bus.request(
                bus.subjects.agent_inbox("alice"),
                UserRequest(content="ask bob", session_id="full"),
                timeout=2,
            )
        except CallTimeoutError as exc:
            answer = exc  # the host stops (drains) as it would; no cancellation
    assert isinstance(answer, FinalAnswer), answer
    assert answer.content == "bob answered"
