"""A reasoning step does the same work at 10 messages in memory as at 1,000.

Counted, not timed: conversions of messages to chat form, messages handed to
the token counter, reads of a message's tool calls and results. A reply works
on the messages it adds; memory it found is worked on once, by the first step
that sees it.
"""

from __future__ import annotations

import copy
import dataclasses
import pickle
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import msgspec
import pytest

from fleetbus.agents import Agent, AgentSettings, ContextConfig, Msg
from fleetbus.agents import messages as messages_module
from fleetbus.agents.compression import ApproxTokenCounter
from fleetbus.agents.middleware import Middleware, ReplyContext
from fleetbus.agents.state import AgentState
from fleetbus.models.model import ModelResponse
from fleetbus.protocol import ChatMessage, ToolResultBlock, ToolSpec, ToolUseBlock, Usage
from fleetbus.testing import ScriptedModel
from fleetbus.tools_workers import Toolkit, tool

USAGE = Usage(input_tokens=100, output_tokens=10)
"""Scripted turns carry usage: ScriptedModel would otherwise read every message."""


@tool
def noop() -> str:
    """Do nothing."""
    return "ok"


class CountingCounter:
    """An ``ApproxTokenCounter`` that counts the messages it is given."""

    def __init__(self) -> None:
        self.inner = ApproxTokenCounter()
        self.messages = 0

    def count(self, messages: Sequence[Msg]) -> int:
        self.messages += len(messages)
        return self.inner.count(messages)

    def count_text(self, text: str) -> int:
        return self.inner.count_text(text)


@pytest.fixture
def work(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """Counts conversions to chat form and reads of tool calls and results."""
    counts: Counter[str] = Counter()

    def counted_chat(**fields: Any) -> ChatMessage:
        counts["conversions"] += 1
        return ChatMessage(**fields)

    monkeypatch.setattr(messages_module, "ChatMessage", counted_chat)
    for name in ("tool_uses", "tool_results"):
        read = getattr(Msg, name).fget

        def counted(self: Msg, read: Any = read, name: str = name) -> Any:
            counts[name] += 1
            return read(self)

        monkeypatch.setattr(Msg, name, property(counted))
    return counts


def history(count: int) -> list[Msg]:
    """``count`` messages of earlier replies (a request, a call, its result, an answer)."""
    messages: list[Msg] = []
    while len(messages) < count:
        n = len(messages)
        use = ToolUseBlock(id=f"old_{n}", name="noop", input={})
        messages += [
            Msg.text_message("user", f"Request {n}."),
            Msg(role="assistant", content=[use]),
            Msg(
                role="tool",
                name="noop",
                content=[ToolResultBlock(id=use.id, name="noop", output="ok")],
            ),
            Msg.text_message("assistant", f"Answer {n}."),
        ]
    return messages[:count]


def script(*call_ids: str) -> list[ModelResponse]:
    """Two calls of noop (ids as given, else fresh), then an answer; all with usage."""
    ids: list[str | None] = [*call_ids] if call_ids else [None, None]
    turns = [ScriptedModel.call("noop", {}, call_id=i) for i in ids] + [ScriptedModel.text("Done.")]
    return [dataclasses.replace(turn, usage=USAGE) for turn in turns]


def agent_with(
    prior: int,
    counter: CountingCounter | None = None,
    checkpoint: Callable[[AgentState], Awaitable[None]] | None = None,
) -> Agent:
    agent = Agent(
        "worker",
        "You call noop.",
        ScriptedModel(),
        toolkit=Toolkit([noop]),
        checkpoint=checkpoint,
        settings=AgentSettings(token_counter=counter or CountingCounter(), max_iters=5),
    )
    agent.memory.extend(history(prior))
    return agent


async def reply_work(prior: int, work: Counter[str]) -> Counter[str]:
    """The work of a reply (two calls, an answer) of an agent that answered before."""
    counter = CountingCounter()
    agent = agent_with(prior, counter)
    agent.model = ScriptedModel(script())
    await agent.reply("Call noop twice.")
    work.clear()
    counter.messages = 0
    agent.model = ScriptedModel(script())
    answer = await agent.reply("Call noop twice again.")
    assert answer.finished_reason == "completed"
    return Counter({**work, "counted": counter.messages})


async def test_a_reply_does_the_same_work_at_10_and_at_1000_messages(
    work: Counter[str],
) -> None:
    small = await reply_work(10, work)
    large = await reply_work(1_000, work)

    assert large == small
    # Taken in: the last reply's answer, then the 5 messages of this reply
    # before its answer (its request, two calls and their results).
    assert small["conversions"] == 6
    assert small["counted"] == 6


async def test_memory_found_by_a_reply_is_worked_on_once(work: Counter[str]) -> None:
    counter = CountingCounter()
    agent = agent_with(1_000, counter)
    agent.model = ScriptedModel(script())

    await agent.reply("Call noop twice.")

    # Three steps: without the index each would convert and count all of memory.
    assert work["conversions"] == 1_000 + 5
    assert counter.messages == 1_000 + 5
    assert work["tool_uses"] < 1_000 + 50


async def test_the_model_is_sent_the_whole_memory_in_order() -> None:
    agent = agent_with(8)
    agent.model = ScriptedModel(script())
    await agent.reply("First.")
    model = ScriptedModel(script())
    agent.model = model

    await agent.reply("Second.")

    for request in model.requests:
        sent = request.messages[1:]
        assert sent == [m.to_chat() for m in agent.memory[: len(sent)]]
    assert len(model.requests[-1].messages) == 1 + len(agent.memory) - 1


async def test_a_call_id_already_in_memory_or_repeated_in_a_step_is_replaced() -> None:
    agent = agent_with(1_000)
    twice = ScriptedModel.calls(("noop", {}, "old_4"), ("noop", {}, "same"), ("noop", {}, "same"))
    agent.model = ScriptedModel([dataclasses.replace(twice, usage=USAGE), "Done."])

    await agent.reply("Call noop.")

    ids = [u.id for m in agent.memory for u in m.tool_uses]
    assert len(set(ids)) == len(ids)
    assert [r.id for m in agent.memory[-4:-1] for r in m.tool_results] == ids[-3:]


async def test_memory_changed_between_replies_is_followed() -> None:
    agent = agent_with(40)
    agent.model = ScriptedModel(script())
    await agent.reply("First.")
    # Cut back, a message replaced, one taken out: the next prompt shows memory as it is.
    del agent.memory[30:]
    agent.memory[5] = Msg.text_message("user", "Replaced.")
    del agent.memory[10]
    model = ScriptedModel(script())
    agent.model = model

    await agent.reply("Second.")

    first = model.requests[0].messages[1:]
    assert first == [m.to_chat() for m in agent.memory[: len(first)]]
    assert first[5].content == Msg.text_message("user", "Replaced.").content


async def test_the_index_is_never_saved_and_a_loaded_state_goes_on() -> None:
    agent = agent_with(20)
    agent.model = ScriptedModel(script())
    await agent.reply("First.")
    saved = agent.state.model_dump_json()

    loaded = AgentState.model_validate_json(saved)
    model = ScriptedModel(script())
    again = Agent("worker", "You call noop.", model, toolkit=Toolkit([noop]), state=loaded)
    answer = await again.reply("Second.")

    assert "_memory_index" not in saved
    assert "_chat" not in saved
    assert AgentState.model_validate_json(saved) == agent.state  # the index is not compared
    assert answer.finished_reason == "completed"
    sent = model.requests[0].messages[1:]
    assert len(sent) == 20 + 6 + 1
    assert sent == [m.to_chat() for m in loaded.memory[: len(sent)]]


async def test_a_copied_or_pickled_state_starts_with_an_empty_index() -> None:
    agent = agent_with(12)
    agent.model = ScriptedModel(script())
    await agent.reply("First.")
    state = agent.state

    for other in (copy.deepcopy(state), pickle.loads(pickle.dumps(state))):
        assert "_memory_index" not in other.__dict__ or not other.__dict__["_memory_index"].chats
        assert other == state
        assert other.memory_index().chats == state.memory_index().chats


async def test_a_reply_restored_between_its_calls_and_their_results_runs_them() -> None:
    saved: list[str] = []

    async def checkpoint(state: AgentState) -> None:
        saved.append(state.model_dump_json())

    agent = agent_with(200, checkpoint=checkpoint)
    agent.model = ScriptedModel(script("c1", "c2"))
    await agent.reply("Call noop twice.")
    states = [AgentState.model_validate_json(s) for s in saved]
    # The write-ahead save of the second step: its call made, not yet run.
    state = next(s for s in states if [u.id for u in s.memory[-1].tool_uses] == ["c2"])
    assert state.reply is not None
    assert not state.reply.arrived

    model = ScriptedModel([dataclasses.replace(ScriptedModel.text("Done."), usage=USAGE)])
    again = Agent("worker", "You call noop.", model, toolkit=Toolkit([noop]), state=state)
    answer = await again.reply()

    assert answer.finished_reason == "completed"
    assert again.memory[-2].tool_results[0].id == "c2"


async def reply_compressing(agent: Agent, compresses: bool) -> ScriptedModel:
    """Ask ``agent`` to go on; check that memory was compressed first (a
    summary written) or not, as ``compresses`` says. Returns the model."""
    summary = ScriptedModel.call(
        "write_summary", {"task": "t", "current_state": "s"}, call_id="sum"
    )
    model = ScriptedModel([summary, "Done."] if compresses else ["Done."])
    agent.model = model

    answer = await agent.reply("Go.")

    assert answer.finished_reason == "completed"
    assert model.remaining == 0
    assert model.requests[0].tool_choice == ("write_summary" if compresses else "auto")
    assert ("compressed" in agent.memory[0].marks) == compresses
    return model


async def test_compression_starts_exactly_past_the_threshold_with_a_warm_index() -> None:
    for over in (0, 1):
        counter = ApproxTokenCounter()
        context = ContextConfig(context_length=10_000, trigger_ratio=0.5, reserve_ratio=0.1)
        agent = Agent(
            "worker",
            "",
            ScriptedModel(),
            settings=AgentSettings(context=context, token_counter=counter),
        )
        agent.memory.extend(history(40))
        agent.model = ScriptedModel(["Fine."])
        await agent.reply("Warm up.")  # the index now counts memory
        # What the next step sends: no system prompt, the tool specs "[]" (1 token),
        # memory, the next input ("Go.": 1 + 4 tokens), and a filler message.
        before = 1 + counter.count(agent.memory) + 5
        filler = context.trigger_tokens - before + over - 4  # 4: a message's overhead
        await agent.observe(Msg.text_message("user", "x" * (4 * filler)))
        await reply_compressing(agent, bool(over))


async def test_the_tools_offered_are_counted_again_when_they_change() -> None:
    """The tokens of the tool specs are kept from step to step, by the specs'
    identities: a tool whose description grows is counted again, and the
    growth that takes the context one token past the threshold compresses
    memory at the next step (one token less does not)."""
    for over in (0, 1):

        @tool
        def lookup() -> str:
            """Look something up."""
            return "found"

        counter = ApproxTokenCounter()
        context = ContextConfig(context_length=10_000, trigger_ratio=0.5, reserve_ratio=0.1)
        agent = Agent(
            "worker",
            "",
            ScriptedModel(["Fine."]),
            toolkit=Toolkit([lookup]),
            settings=AgentSettings(context=context, token_counter=counter),
        )
        agent.memory.extend(history(200))  # past the reserve kept verbatim
        await agent.reply("Warm up.")  # below the threshold: the specs counted and kept
        first = lookup.spec()
        assert lookup.spec() is first  # the same spec while the tool is the same
        specs = counter.count_text(msgspec.json.encode([first]).decode())
        # What the next step sends: the specs, memory, the next input ("Go.": 1 + 4).
        before = specs + counter.count(agent.memory) + 5
        lookup.description += "x" * (4 * (context.trigger_tokens - before + over))
        assert lookup.spec() is not first
        await reply_compressing(agent, bool(over))


async def test_compression_counts_the_tools_the_step_offers() -> None:
    """A layer that offers a tool from its ``on_reasoning`` on: the step's
    compression check counts the tools that step sends, the new one too."""
    context = ContextConfig(context_length=10_000, trigger_ratio=0.5, reserve_ratio=0.1)
    big = ToolSpec(name="big", description="x" * (4 * context.trigger_tokens))

    class Offering(Middleware):
        offered = False

        def tools(self, ctx: ReplyContext) -> Sequence[ToolSpec]:
            return (big,) if self.offered else ()

        async def on_reasoning(
            self, ctx: ReplyContext, call_next: Callable[[], Awaitable[Msg]]
        ) -> Msg:
            self.offered = True
            return await call_next()

    agent = Agent(
        "worker",
        "",
        ScriptedModel(),
        middlewares=[Offering()],
        settings=AgentSettings(context=context, token_counter=ApproxTokenCounter()),
    )
    agent.memory.extend(history(200))

    model = await reply_compressing(agent, True)

    assert [t.name for t in model.requests[1].tools] == ["big"]
