"""The offline model reads each message of a conversation once: a request of
a long conversation costs it what a request of a short one does, and it
answers exactly what it answers when it reads the whole conversation anew."""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from fleetbus.agents import Agent, AgentState, Msg
from fleetbus.capabilities import Planning
from fleetbus.models import ModelError, offline
from fleetbus.models.model import ModelRequest, ModelResponse, ModelStreamItem, complete
from fleetbus.models.offline import OFFLINE_PREFIX, OfflineModel
from fleetbus.protocol import (
    AgentMessage,
    ChatMessage,
    TextBlock,
    ToolResultBlock,
    ToolSpec,
    ToolUseBlock,
)
from fleetbus.tools_workers.builtin import builtin_toolkit

CALCULATOR = ToolSpec(name="calculator", parameters={"type": "object"})


def chat(role: Any, text: str, name: str | None = None) -> ChatMessage:
    return ChatMessage(role=role, content=[TextBlock(text=text)], name=name)


def conversation(count: int) -> list[ChatMessage]:
    """``count`` messages of earlier turns: a request, a call, its result, an answer."""
    messages: list[ChatMessage] = []
    while len(messages) < count:
        n = len(messages)
        use = ToolUseBlock(id=f"offline_{n // 4 + 1}", name="calculator", input={"expr": "1+1"})
        result = ToolResultBlock(id=use.id, name="calculator", output=2)
        messages += [
            chat("user", f"what is 1+1 ({n})"),
            ChatMessage(role="assistant", content=[use]),
            ChatMessage(role="tool", content=[result]),
            chat("assistant", "calculator: 1+1 = 2."),
        ]
    return messages[:count]


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """Counts the messages whose text or blocks the model reads."""
    counts: Counter[str] = Counter()
    text, blocks = offline._text, offline._blocks

    def counted_text(message: ChatMessage) -> str:
        counts["text"] += 1
        return text(message)

    def counted_blocks(message: ChatMessage, kind: Any) -> Any:
        counts["blocks"] += 1
        return blocks(message, kind)

    monkeypatch.setattr(offline, "_text", counted_text)
    monkeypatch.setattr(offline, "_blocks", counted_blocks)
    return counts


async def step_reads(prior: int, reads: Counter[str]) -> Counter[str]:
    """What the model reads for the second step of a turn after ``prior`` messages."""
    model = OfflineModel()
    earlier = conversation(prior)
    ask = chat("user", "what is 6*7")
    await complete(model, ModelRequest(messages=[chat("system", "You help."), *earlier, ask]))
    reads.clear()
    use = ToolUseBlock(id="offline_999", name="calculator", input={"expr": "6*7"})
    result = ToolResultBlock(id=use.id, name="calculator", output=42)
    messages = [
        chat("system", "You help."),  # made anew at every step, as an agent does
        *earlier,
        ask,
        ChatMessage(role="assistant", content=[use]),
        ChatMessage(role="tool", content=[result]),
    ]
    response = await complete(model, ModelRequest(messages=messages, tools=[CALCULATOR]))
    assert response.text == "calculator: 6*7 = 42."
    return Counter(reads)


async def test_a_step_reads_the_same_at_10_and_at_1000_messages(reads: Counter[str]) -> None:
    small = await step_reads(10, reads)
    large = await step_reads(1_000, reads)

    assert large == small
    assert 0 < small["text"] < 10


class Checked:
    """One offline model for every agent, each answer checked against a new
    model's, which reads the whole conversation."""

    def __init__(self) -> None:
        self.model = OfflineModel()
        self.checked = 0

    @property
    def name(self) -> str:
        return "checked"

    async def stream(self, request: ModelRequest) -> AsyncIterator[ModelStreamItem]:
        anew = await complete(OfflineModel(), request)
        async for item in self.model.stream(request):
            if isinstance(item, ModelResponse):
                assert item == anew
                self.checked += 1
            yield item


async def test_answers_are_those_of_a_model_reading_everything_anew(tmp_path: Path) -> None:
    model = Checked()
    kit = builtin_toolkit(files_root=tmp_path)
    prompts = {
        "alice": "You are Alice. You argue that tests should be counted.",
        "bob": "You are Bob. You believe that timing is enough.",
    }
    agents = {name: Agent(name, prompt, model, toolkit=kit) for name, prompt in prompts.items()}
    planner = Agent("planner", "You help.", model, toolkit=kit, capabilities=[Planning()])
    said: str | AgentMessage = "Debate: count or time?"
    for round_ in range(3):
        for name, agent in agents.items():
            answer = await agent.reply(said)
            assert isinstance(answer.content, str)
            said = AgentMessage(sender=name, name=name, content=[TextBlock(text=answer.content)])
        await planner.reply(f"what is {round_} + 2 and then what is 3 * {round_}")
    # A compression puts a summary first; an edit changes a message in the middle.
    alice = agents["alice"]
    alice.memory[:4] = [Msg.text_message("user", "<summary of earlier conversation>\nTask: t")]
    alice.memory[3] = Msg.text_message("user", "Changed: what is 5 * 5")
    await alice.reply("what is 8 - 3")
    # A restored state: the same conversation in new objects.
    restored = AgentState.model_validate_json(planner.state.model_dump_json())
    again = Agent("planner", "You help.", model, toolkit=kit, state=restored)
    await again.reply("what is 9 * 9")

    assert model.checked > 20


async def test_messages_that_are_not_chat_messages_are_refused_every_time() -> None:
    model = OfflineModel()
    bad: Any = [chat("user", "hi"), {"role": "user", "content": "hi"}]

    for _ in range(2):
        with pytest.raises(ModelError, match="must be ChatMessages"):
            await complete(model, ModelRequest(messages=bad))
    answer = await complete(model, ModelRequest(messages=bad[:1]))
    assert answer.text.startswith(OFFLINE_PREFIX)
