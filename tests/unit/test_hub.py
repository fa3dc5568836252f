"""Multi-agent conversations: the hub lets the others hear a speaker,
pipelines chain and fan out replies.

RemoteAgent, and a hub mixing local and remote agents, are tested against a
served agent on a real server: tests/integration/test_remote_agent.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from fleetbus.agents import Agent
from fleetbus.agents.hub import MsgHub, fanout_pipeline, sequential_pipeline, to_agent_message
from fleetbus.errors import ConfigError
from fleetbus.models import ModelRequest
from fleetbus.models.model import ModelStreamItem
from fleetbus.protocol import AgentMessage, ChatMessage, ContentBlock, FinalAnswer, TextBlock
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
