"""An agent with knowledge bases: what they find is before the model (with its
sources) in every model call of the reply and never in memory; the final
answer lists the sources; threshold, bounds, the query rewrite, several
bases, failing and slow bases, a paused reply resumed, bad settings."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path

import pytest

from fleetbus.agents import Agent, Permissions
from fleetbus.capabilities import (
    BusKnowledgeBase,
    Knowledge,
    KnowledgeConfig,
    KnowledgeHit,
    KnowledgeRetrieval,
    Passage,
)
from fleetbus.errors import ConfigError
from fleetbus.models import ModelRequest
from fleetbus.protocol import ChatMessage, Confirmation, ConfirmResult, TextBlock
from fleetbus.testing import ScriptedModel
from fleetbus.tools_workers import Toolkit, tool
from fleetbus.tools_workers.knowledge import KnowledgeIndex
from tests.unit.test_knowledge_index import write_docs

QUESTION = "How many days do customers have to ask for a refund?"
TIME_LIMITS = "refunds.md:5-8 (Refunds > Time limits)"


def text_of(message: ChatMessage) -> str:
    return "".join(b.text for b in message.content if isinstance(b, TextBlock))


def hints(request: ModelRequest) -> list[str]:
    return [text_of(m) for m in request.messages if text_of(m).startswith("<knowledge>")]


class Recording:
    """A knowledge base that answers what it is given and keeps the queries."""

    def __init__(self, hits: Sequence[KnowledgeHit] = (), *, delay: float = 0.0) -> None:
        self.hits = list(hits)
        self.delay = delay
        self.queries: list[tuple[str, int, float | None]] = []

    async def retrieve(
        self, query: str, limit: int = 5, score_threshold: float | None = None
    ) -> list[KnowledgeHit]:
        self.queries.append((query, limit, score_threshold))
        await asyncio.sleep(self.delay)
        return self.hits


class Broken:
    async def retrieve(
        self, query: str, limit: int = 5, score_threshold: float | None = None
    ) -> list[KnowledgeHit]:
        raise OSError("the disk is gone")


@pytest.fixture
def docs(tmp_path: Path) -> Path:
    return write_docs(tmp_path / "docs")


async def test_the_right_passage_and_its_source_are_before_the_model(docs: Path) -> None:
    model = ScriptedModel(["Within 30 days [refunds.md:5-8]."])
    agent = Agent(
        "clerk",
        "You answer from the handbook.",
        model,
        capabilities=[Knowledge([KnowledgeIndex(docs)])],
    )
    final = await agent.reply(QUESTION)
    [request] = model.requests
    [hint] = hints(request)
    first = hint.split("\n[2] ")[0]
    assert f"[1] {TIME_LIMITS}" in first
    assert "Customers may ask for a refund within 30 days of delivery." in first
    # The hint comes right before the question, after the system prompt.
    roles = [(m.role, text_of(m)[:11]) for m in request.messages]
    assert roles[0] == ("system", "You answer ")
    assert roles[1] == ("user", "<knowledge>")
    assert text_of(request.messages[2]) == QUESTION
    assert final.finished_reason == "completed"
    assert final.sources[0] == TIME_LIMITS
    assert len(final.sources) == len(set(final.sources)) <= 5
    # Never stored in memory.
    assert [m.text for m in agent.memory] == [QUESTION, "Within 30 days [refunds.md:5-8]."]


async def test_every_model_call_of_the_reply_sees_it_and_the_next_reply_searches_anew(
    docs: Path,
) -> None:
    @tool
    def lookup(order: str) -> str:
        """Look an order up."""
        return f"order {order} was delivered 12 days ago"

    model = ScriptedModel(
        [
            ScriptedModel.call("lookup", {"order": "A1"}),
            "Yes, you still can.",
            "Park behind the building.",
        ]
    )
    agent = Agent(
        "clerk",
        "",
        model,
        toolkit=Toolkit([lookup]),
        capabilities=[Knowledge([KnowledgeIndex(docs)])],
    )
    await agent.reply(QUESTION + " My order is A1.")
    second = await agent.reply("Where can I park my car?")
    first_step, second_step, next_reply = model.requests
    assert hints(first_step) == hints(second_step)
    assert TIME_LIMITS in hints(first_step)[0]
    # After the tool call the hint is still just before the question.
    at = [text_of(m).startswith("<knowledge>") for m in second_step.messages].index(True)
    assert text_of(second_step.messages[at + 1]).startswith(QUESTION)
    assert second_step.messages[-1].role == "tool"
    [parking] = hints(next_reply)
    assert "[1] office.txt:1-3" in parking
    assert TIME_LIMITS not in parking  # the first reply's hint is gone
    assert second.sources[0] == "office.txt:1-3"
    assert not any("<knowledge>" in m.text for m in agent.memory)


async def test_the_score_threshold_and_the_limit_go_to_the_base_and_are_held(docs: Path) -> None:
    strong = Passage("strong passage", "strong.md:1-1", 3.0)
    weak = Passage("weak passage", "weak.md:1-1", 0.5)
    third = Passage("third passage", "third.md:1-1", 2.0)
    base = Recording([strong, weak, third])  # a base that ignores what it is asked
    model = ScriptedModel(["ok"])
    config = KnowledgeConfig(limit=2, score_threshold=1.0)
    agent = Agent("clerk", "", model, capabilities=[Knowledge([base], config)])
    final = await agent.reply("what is strong?")
    assert base.queries == [("what is strong?", 2, 1.0)]
    [hint] = hints(model.requests[0])
    assert "strong passage" in hint
    assert "weak passage" not in hint  # below the threshold
    assert "third passage" not in hint  # past the limit
    assert final.sources == ["strong.md:1-1"]
    # With a real index: nothing above the threshold, no hint at all.
    model = ScriptedModel(["no idea"])
    index = KnowledgeIndex(docs)
    agent = Agent(
        "clerk",
        "",
        model,
        capabilities=[Knowledge([index], KnowledgeConfig(score_threshold=1000.0))],
    )
    final = await agent.reply(QUESTION)
    assert hints(model.requests[0]) == []
    assert final.sources == []


async def test_what_is_shown_is_bounded() -> None:
    big = [Passage("x" * 5000, f"big{i}.md:1-100", 1.0) for i in range(5)]
    model = ScriptedModel(["ok"])
    agent = Agent(
        "clerk",
        "",
        model,
        capabilities=[Knowledge([Recording(big)], KnowledgeConfig(max_chars=7000))],
    )
    final = await agent.reply("anything")
    [hint] = hints(model.requests[0])
    assert hint.count("x") <= 7000
    assert len(hint) < 7000 + 1000
    assert final.sources == ["big0.md:1-100", "big1.md:1-100"]  # what was shown, only


async def test_several_bases_take_turns_and_a_failing_one_is_said(docs: Path) -> None:
    other = Recording([Passage("from the wiki", "wiki:refunds", 9.0)])
    model = ScriptedModel(["ok"])
    agent = Agent(
        "clerk", "", model, capabilities=[Knowledge([KnowledgeIndex(docs), Broken(), other])]
    )
    final = await agent.reply(QUESTION)
    [hint] = hints(model.requests[0])
    assert hint.index(TIME_LIMITS) < hint.index("wiki:refunds")
    assert hint.index("wiki:refunds") < hint.index("[3] ")  # the second base's first, second
    assert "knowledge base 2 could not be searched: OSError: the disk is gone" in hint
    assert final.finished_reason == "completed"
    assert final.sources[:2] == [TIME_LIMITS, "wiki:refunds"]


async def test_a_slow_base_is_given_up_on_and_the_reply_goes_on() -> None:
    model = ScriptedModel(["ok"])
    slow = Recording([Passage("late", "late.md:1-1", 1.0)], delay=30)
    agent = Agent(
        "clerk", "", model, capabilities=[Knowledge([slow], KnowledgeConfig(timeout=0.05))]
    )
    final = await agent.reply("anything")
    [hint] = hints(model.requests[0])
    assert "could not be searched: it did not answer within 0.05 s" in hint
    assert final.finished_reason == "completed"
    assert final.sources == []


async def test_the_query_can_be_rewritten_by_the_model_with_the_conversation() -> None:
    base = Recording([Passage("Badges are paper.", "security.md:9-11", 2.0)])
    model = ScriptedModel(
        [
            "security",  # the first reply's query
            "We have badges and passwords.",
            'Query: "visitor badge material"\n\n(the visitors\' badges)',
            "They are paper.",
        ]
    )
    agent = Agent(
        "clerk", "", model, capabilities=[Knowledge([base], KnowledgeConfig(rewrite_query=True))]
    )
    await agent.reply("What do you have about security?")
    final = await agent.reply("and what are the visitors' ones made of?")
    assert base.queries[0][0] == "security"
    rewrite = model.requests[2]
    assert rewrite.tools == []
    asked = text_of(rewrite.messages[-1])
    assert "assistant: We have badges and passwords." in asked
    assert asked.endswith("The request: and what are the visitors' ones made of?")
    assert base.queries[-1][0] == "visitor badge material"
    assert hints(model.requests[2]) == []  # the rewrite itself is not given the passages
    [hint] = hints(model.requests[3])
    assert '(searched for "visitor badge material")' in hint
    assert final.content == "They are paper."
    assert final.sources == ["security.md:9-11"]


async def test_a_failed_rewrite_searches_the_input_itself() -> None:
    base = Recording([Passage("p", "p.md:1-1", 1.0)])
    model = ScriptedModel([RuntimeError("model down"), "ok"])
    agent = Agent(
        "clerk", "", model, capabilities=[Knowledge([base], KnowledgeConfig(rewrite_query=True))]
    )
    final = await agent.reply("the question")
    assert base.queries == [("the question", 5, None)]
    assert final.finished_reason == "completed"


async def test_a_paused_reply_shows_the_passages_again_when_it_resumes(docs: Path) -> None:
    @tool
    def refund(order: str) -> str:
        """Refund an order."""
        return f"refunded {order}"

    model = ScriptedModel([ScriptedModel.call("refund", {"order": "A1"}), "Refunded."])
    agent = Agent(
        "clerk",
        "",
        model,
        toolkit=Toolkit([refund]),
        permissions=Permissions.from_strings(ask=["refund"]),
        capabilities=[Knowledge([KnowledgeIndex(docs)])],
    )
    paused = await agent.reply(QUESTION + " Refund A1.")
    assert paused.finished_reason == "paused"
    [pending] = agent.state.reply.pending if agent.state.reply else []
    restored = agent.clone(state=agent.state.model_copy(deep=True))  # another process, say
    final = await restored.reply(
        ConfirmResult(confirmations=[Confirmation(call_id=pending.call_id, confirmed=True)])
    )
    assert final.content == "Refunded."
    assert hints(model.requests[1]) == hints(model.requests[0])
    at = [text_of(m).startswith("<knowledge>") for m in model.requests[1].messages].index(True)
    assert text_of(model.requests[1].messages[at + 1]).startswith(QUESTION)
    assert final.sources[0] == TIME_LIMITS


async def test_clones_keep_the_knowledge_and_an_observed_only_memory_is_searched() -> None:
    base = Recording([Passage("p", "p.md:1-1", 1.0)])
    agent = Agent("clerk", "", ScriptedModel(["a", "b", "c"]), capabilities=[Knowledge([base])])
    clone = agent.clone()
    assert clone.capabilities == agent.capabilities
    await clone.observe("heard about parking")
    await clone.reply("where?")  # the input is searched, not what was heard before it
    await clone.reply(None)  # the memory as it is: nothing new to search with
    await clone.observe("they park on level -2")
    await clone.reply(None)  # answers what it heard: that is searched
    assert [q for q, _, _ in base.queries] == ["where?", "they park on level -2"]


async def test_a_bus_base_outside_a_host_and_without_a_bus_is_a_failure_the_model_sees() -> None:
    model = ScriptedModel(["ok"])
    agent = Agent("clerk", "", model, capabilities=[Knowledge([BusKnowledgeBase()])])
    final = await agent.reply("anything")
    [hint] = hints(model.requests[0])
    assert "has no bus" in hint
    assert final.finished_reason == "completed"


def test_bad_settings_are_refused() -> None:
    model = ScriptedModel()
    with pytest.raises(ConfigError, match="not a knowledge base"):
        Agent("clerk", "", model, capabilities=[Knowledge([object()])])  # type: ignore[list-item]
    with pytest.raises(ConfigError, match="limit"):
        KnowledgeConfig(limit=0)
    with pytest.raises(ConfigError, match="max_chars"):
        KnowledgeConfig(max_chars=10)
    with pytest.raises(ConfigError, match="timeout"):
        KnowledgeConfig(timeout=0)
    with pytest.raises(ConfigError, match="rewrite_query needs a model"):
        KnowledgeRetrieval([Recording()], KnowledgeConfig(rewrite_query=True))
    with pytest.raises(ConfigError, match="positive timeout"):
        BusKnowledgeBase(timeout=0)
