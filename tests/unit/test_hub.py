"""Multi-agent conversations: the hub lets the others hear a speaker,
pipelines chain and fan out replies; a RemoteAgent builds the messages of
the agent-inbox contract.

RemoteAgent against a served agent is tested with the server
(integration); here a recording stand-in for the bus checks what it sends.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import pytest

from fleetbus.agents import Agent, ModelRequest
from fleetbus.agents.hub import MsgHub, fanout_pipeline, sequential_pipeline, to_agent_message
from fleetbus.agents.model import ModelStreamItem
from fleetbus.agents.remote import RemoteAgent
from fleetbus.bus import Subjects
from fleetbus.errors import CallTimeoutError, ConfigError, RemoteError, UnexpectedMessageError
from fleetbus.protocol import (
    AgentMessage,
    AnyMessage,
    Cancel,
    ChatMessage,
    ConfirmResult,
    ContentBlock,
    ErrorMessage,
    Event,
    ExternalResult,
    FinalAnswer,
    Message,
    TextBlock,
    UserRequest,
)
from fleetbus.testing import ScriptedModel


def agent(name: str, *answers: str) -> tuple[Agent, ScriptedModel]:
    model = ScriptedModel([ScriptedModel.text(a) for a in answers])
    return Agent(name, f"You are {name}.", model), model


def said(message: ChatMessage) -> tuple[str, str | None, str]:
    """(role, name, text) of a message a model was sent."""
    text = "\n".join(b.text for b in message.content if isinstance(b, TextBlock))
    return message.role, message.name, text


# --- MsgHub ------------------------------------------------------------------


async def test_everyone_observes_the_announcement_on_entering() -> None:
    (a, model_a), (b, model_b) = agent("a"), agent("b")
    async with MsgHub([a, b], announcement="Plan the offsite.") as hub:
        for member in (a, b):
            assert [m.text for m in member.memory] == ["Plan the offsite."]
            assert "observed" in member.memory[0].marks
    assert model_a.requests == []
    assert model_b.requests == []
    assert hub.transcript == [("", "Plan the offsite.")]


async def test_what_a_speaker_answers_the_others_hear_under_its_name() -> None:
    (a, _), (b, model_b), (c, _) = agent("a", "Friday works."), agent("b", "Agreed."), agent("c")
    hub = MsgHub([a, b, c], announcement="When?")
    async with hub:
        answer = await hub.speak(a)
        assert answer.content == "Friday works."
        for other in (b, c):
            heard = other.memory[-1]
            assert (heard.role, heard.name, heard.text) == ("user", "a", "Friday works.")
            assert "observed" in heard.marks
        # The speaker does not hear itself again.
        assert [m.text for m in a.memory] == ["When?", "Friday works."]
        await hub.speak(b)
    sent = [said(m) for m in model_b.requests[0].messages]
    assert sent == [
        ("system", None, "You are b."),
        ("user", None, "When?"),
        ("user", "a", "Friday works."),
    ]
    assert c.memory[-1].name == "b"
    assert c.memory[-1].text == "Agreed."
    assert hub.transcript == [("", "When?"), ("a", "Friday works."), ("b", "Agreed.")]


async def test_with_broadcast_disabled_the_others_hear_nothing() -> None:
    (a, _), (b, _) = agent("a", "secret"), agent("b")
    async with MsgHub([a, b], enable_broadcast=False) as hub:
        await hub.speak(a, "Think aloud.")
    assert b.memory == []
    assert hub.transcript == [("a", "secret")]


async def test_a_broadcast_reaches_everyone_and_a_leaver_hears_no_more() -> None:
    (a, _), (b, _), (c, _) = agent("a"), agent("b"), agent("c")
    async with MsgHub([a, b]) as hub:
        hub.add(c)
        hub.add(c)  # joining twice is joining once
        assert hub.participants == [a, b, c]
        await hub.broadcast(AgentMessage(sender="host", content=[TextBlock(text="Welcome.")]))
        hub.remove(b)
        await hub.broadcast("Bye.")
        with pytest.raises(ConfigError, match="'b' is not a participant"):
            hub.remove(b)
    assert [m.text for m in a.memory] == ["Welcome.", "Bye."]
    assert [m.text for m in b.memory] == ["Welcome."]
    assert [m.text for m in c.memory] == ["Welcome.", "Bye."]
    assert a.memory[0].name == "host"
    assert hub.transcript == [("host", "Welcome."), ("", "Bye.")]


def test_an_answer_becomes_a_message_from_its_speaker() -> None:
    message = to_agent_message(FinalAnswer(content="hi", sender="x"), "alice")
    assert (message.name, message.sender, message.reply) == ("alice", "alice", True)
    assert message.content == [TextBlock(text="hi")]
    blocks: list[ContentBlock] = [TextBlock(text="one"), TextBlock(text="two")]
    assert to_agent_message(FinalAnswer(content=blocks), "bob").content == blocks


# --- pipelines -----------------------------------------------------------------


async def test_a_sequential_pipeline_passes_each_answer_to_the_next() -> None:
    (a, model_a), (b, model_b), (c, model_c) = (
        agent("a", "draft"),
        agent("b", "edited"),
        agent("c", "final"),
    )
    answer = await sequential_pipeline([a, b, c], "Write the invite.")
    assert answer.content == "final"
    assert said(model_a.requests[0].messages[-1]) == ("user", None, "Write the invite.")
    assert said(model_b.requests[0].messages[-1]) == ("user", "a", "draft")
    assert said(model_c.requests[0].messages[-1]) == ("user", "b", "edited")


async def test_a_sequential_pipeline_stops_at_a_failed_reply() -> None:
    failing = Agent("a", "", ScriptedModel([]))  # no turns: the model fails at once
    (b, model_b) = agent("b", "never")
    answer = await sequential_pipeline([failing, b], "go")
    assert answer.finished_reason == "error"
    assert answer.sender == "a"
    assert model_b.requests == []


async def test_a_sequential_pipeline_needs_a_participant() -> None:
    with pytest.raises(ConfigError, match="at least one participant"):
        await sequential_pipeline([], "go")


async def test_fanout_answers_come_in_participant_order() -> None:
    (a, model_a), (b, model_b), (c, model_c) = agent("a", "A"), agent("b", "B"), agent("c", "C")
    answers = await fanout_pipeline([c, a, b], "Friday or Monday?")
    assert [x.content for x in answers] == ["C", "A", "B"]
    for model in (model_a, model_b, model_c):
        assert said(model.requests[0].messages[-1]) == ("user", None, "Friday or Monday?")


class GatedModel:
    """A scripted model that logs its calls and, given a barrier, waits there
    before answering: two of them only finish if they run at the same time."""

    def __init__(self, name: str, answer: str, log: list[str], gate: asyncio.Barrier | None):
        self._inner = ScriptedModel([ScriptedModel.text(answer)], name=name)
        self._log = log
        self._gate = gate

    @property
    def name(self) -> str:
        return self._inner.name

    async def stream(self, request: ModelRequest) -> AsyncIterator[ModelStreamItem]:
        self._log.append(f"start {self.name}")
        if self._gate is not None:
            await self._gate.wait()
        async for item in self._inner.stream(request):
            yield item
        self._log.append(f"end {self.name}")


async def test_fanout_replies_run_concurrently() -> None:
    gate = asyncio.Barrier(2)
    log: list[str] = []
    a = Agent("a", "", GatedModel("ma", "A", log, gate))
    b = Agent("b", "", GatedModel("mb", "B", log, gate))
    # Sequential replies would wait at the barrier for ever: the deadline only
    # turns that into a failure instead of a hang.
    answers = await asyncio.wait_for(fanout_pipeline([a, b], "go"), timeout=10)
    assert [x.content for x in answers] == ["A", "B"]
    assert log[:2] == ["start ma", "start mb"]


async def test_fanout_without_concurrency_replies_one_after_another() -> None:
    log: list[str] = []
    a = Agent("a", "", GatedModel("ma", "A", log, None))
    b = Agent("b", "", GatedModel("mb", "B", log, None))
    answers = await fanout_pipeline([a, b], "go", concurrent=False)
    assert [x.content for x in answers] == ["A", "B"]
    assert log == ["start ma", "end ma", "start mb", "end mb"]


# --- RemoteAgent -----------------------------------------------------------


Responder = Callable[[Message], AnyMessage]


def contract(message: Message) -> AnyMessage:
    """What the served agent answers, by the inbox contract."""
    if isinstance(message, AgentMessage) and not message.reply:
        return Event(sender="agent.writer", session_id=message.session_id, event="observed")
    text = message.content if isinstance(message, UserRequest | AgentMessage) else "resumed"
    return FinalAnswer(
        sender="writer", session_id=message.session_id, call_id=message.call_id, content=str(text)
    )


class RecordingBus:
    """Stands in for a Bus: records what is sent, answers with ``responder``."""

    def __init__(self, responder: Responder = contract) -> None:
        self.subjects = Subjects("fleet")
        self.client_name = "tester"
        self.responder = responder
        self.requests: list[tuple[str, Message]] = []
        self.published: list[tuple[str, Message]] = []
        self.options: list[tuple[float, int]] = []

    async def request(
        self, subject: str, message: Message, *, timeout: float, attempts: int
    ) -> AnyMessage:
        self.requests.append((subject, message))
        self.options.append((timeout, attempts))
        return self.responder(message)

    async def publish(self, subject: str, message: Message) -> None:
        self.published.append((subject, message))

    @property
    def sent(self) -> list[Message]:
        return [message for _, message in self.requests]


async def test_replies_are_user_requests_to_the_inbox_in_one_session() -> None:
    bus = RecordingBus()
    writer = RemoteAgent(bus, "writer", timeout=12.5)
    first = await writer.reply("Draft it.")
    second = await writer.reply([TextBlock(text="Shorter.")])
    assert first.content == "Draft it."
    assert isinstance(second, FinalAnswer)
    assert [subject for subject, _ in bus.requests] == ["fleet.agent.writer.inbox"] * 2
    assert bus.options == [(12.5, 1), (12.5, 1)]
    one, two = bus.sent
    assert isinstance(one, UserRequest)
    assert isinstance(two, UserRequest)
    assert one.content == "Draft it."
    assert two.content == [TextBlock(text="Shorter.")]
    assert one.session_id == two.session_id == writer.session_id
    assert one.call_id
    assert two.call_id
    assert one.call_id != two.call_id
    assert one.sender == "tester"


async def test_a_session_can_be_given_for_the_instance_or_one_call() -> None:
    bus = RecordingBus()
    writer = RemoteAgent(bus, "writer", session_id="s-1", sender="cli")
    await writer.reply("a")
    await writer.reply("b", session_id="s-2")
    await writer.reply()
    assert [m.session_id for m in bus.sent] == ["s-1", "s-2", "s-1"]
    assert [m.sender for m in bus.sent] == ["cli"] * 3
    empty = bus.sent[2]
    assert isinstance(empty, UserRequest)
    assert empty.content == []


async def test_an_agent_message_is_sent_as_it_is_asking_for_a_reply() -> None:
    bus = RecordingBus()
    writer = RemoteAgent(bus, "writer", session_id="s-1")
    original = AgentMessage(
        sender="editor", name="editor", content=[TextBlock(text="Fix it.")], reply=False
    )
    await writer.reply(original)
    (sent,) = bus.sent
    assert isinstance(sent, AgentMessage)
    assert sent.reply is True
    assert (sent.sender, sent.name, sent.content) == ("editor", "editor", original.content)
    assert sent.session_id == "s-1"
    assert sent.call_id is not None


async def test_an_error_reply_raises_remote_error() -> None:
    def refuse(message: Message) -> AnyMessage:
        return ErrorMessage(
            code="overloaded",
            message="too busy",
            source_component="agent.writer",
            call_id=message.call_id,
        )

    bus = RecordingBus(refuse)
    writer = RemoteAgent(bus, "writer")
    with pytest.raises(RemoteError, match="overloaded: too busy") as caught:
        await writer.reply("hi")
    assert caught.value.code == "overloaded"
    assert caught.value.source_component == "agent.writer"
    assert caught.value.call_id == bus.sent[0].call_id
    with pytest.raises(RemoteError):
        await writer.observe("noted?")


async def test_a_reply_of_another_type_is_unexpected() -> None:
    bus = RecordingBus(lambda m: Event(event="reply_start", session_id=m.session_id))
    writer = RemoteAgent(bus, "writer")
    with pytest.raises(UnexpectedMessageError, match="final_answer"):
        await writer.reply("hi")
    bus.responder = lambda m: FinalAnswer(content="not an ack")
    with pytest.raises(UnexpectedMessageError, match="observed"):
        await writer.observe("noted?")


async def test_a_timeout_of_the_bus_goes_through() -> None:
    def silent(message: Message) -> AnyMessage:
        raise CallTimeoutError("no reply", subject="fleet.agent.writer.inbox")

    with pytest.raises(CallTimeoutError):
        await RemoteAgent(RecordingBus(silent), "writer").reply("hi")


async def test_observed_messages_are_sent_one_by_one_without_a_reply() -> None:
    bus = RecordingBus()
    writer = RemoteAgent(bus, "writer", session_id="s-1")
    asking = AgentMessage(sender="editor", name="editor", content=[TextBlock(text="b")])
    await writer.observe("a")
    await writer.observe([asking, "c"])
    assert all(isinstance(m, AgentMessage) for m in bus.sent)
    messages = [m for m in bus.sent if isinstance(m, AgentMessage)]
    assert [m.content for m in messages] == [[TextBlock(text=t)] for t in "abc"]
    assert [m.reply for m in messages] == [False] * 3
    assert [m.sender for m in messages] == ["tester", "editor", "tester"]
    assert {m.session_id for m in messages} == {"s-1"}
    assert len({m.call_id for m in messages}) == 3


async def test_cancel_is_published_on_the_control_subject() -> None:
    bus = RecordingBus()
    writer = RemoteAgent(bus, "writer", session_id="s-1")
    await writer.cancel("changed my mind")
    ((subject, message),) = bus.published
    assert subject == "fleet.agent.writer.control"
    assert isinstance(message, Cancel)
    assert (message.session_id, message.reason) == ("s-1", "changed my mind")
    assert bus.requests == []


async def test_confirmations_and_external_results_resume_the_session() -> None:
    bus = RecordingBus()
    writer = RemoteAgent(bus, "writer", session_id="s-1")
    resumed = await writer.confirm("c-7", allow=True, always=True)
    assert resumed.content == "resumed"
    await writer.external_result("c-8", {"rows": 3})
    await writer.external_result("c-9", "disk full", status="error")
    confirm, done, failed = bus.sent
    assert isinstance(confirm, ConfirmResult)
    assert [(c.call_id, c.confirmed, c.always) for c in confirm.confirmations] == [
        ("c-7", True, True)
    ]
    assert isinstance(done, ExternalResult)
    assert isinstance(failed, ExternalResult)
    assert [(r.call_id, r.status, r.content) for r in done.results] == [
        ("c-8", "success", {"rows": 3})
    ]
    (output,) = failed.results
    assert (output.call_id, output.status, output.content) == ("c-9", "error", None)
    assert output.error_detail is not None
    assert (output.error_detail.code, output.error_detail.message) == ("tool_error", "disk full")
    assert {m.session_id for m in bus.sent} == {"s-1"}
    assert [s for s, _ in bus.requests] == ["fleet.agent.writer.inbox"] * 3


def test_an_agent_name_that_is_no_subject_token_is_refused() -> None:
    with pytest.raises(ConfigError, match="invalid agent name"):
        RemoteAgent(RecordingBus(), "two words")


async def test_a_remote_agent_takes_part_in_a_hub() -> None:
    bus = RecordingBus()
    remote = RemoteAgent(bus, "writer", session_id="s-1")
    (local, _) = agent("host", "Welcome, writer.")
    async with MsgHub([local, remote], announcement="Start.") as hub:
        await hub.speak(local)
        answer = await hub.speak(remote, "Say hi.")
    assert answer.content == "Say hi."
    heard = [m for m in bus.sent if isinstance(m, AgentMessage)]
    assert [(m.name, m.content, m.reply) for m in heard] == [
        ("", [TextBlock(text="Start.")], False),
        ("host", [TextBlock(text="Welcome, writer.")], False),
    ]
    assert local.memory[-1].name == "writer"
    assert local.memory[-1].text == "Say hi."
