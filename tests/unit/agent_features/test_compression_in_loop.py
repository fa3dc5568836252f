"""Memory compression inside the loop, and forced with ``compress_context``."""

from __future__ import annotations

from typing import Any

from fleetbus import Agent, ContextConfig, Toolkit, tool
from fleetbus.agents import AgentSettings, Summary
from fleetbus.agents.compression import SUMMARY_HEADER, TRUNCATION_HEADER
from fleetbus.models import ModelError
from fleetbus.testing import ScriptedModel

from ._support import text_of, unanswered

SUMMARY: dict[str, Any] = {
    "task": "Fetch the pages",
    "current_state": "page one fetched",
    "discoveries": ["page one is 40 characters long"],
    "next_steps": ["fetch page two"],
}

# Trigger at 500 tokens; keep about 100 verbatim. The 2,400-character page (~600
# tokens, about 4 characters a token) pushes memory past the trigger; the rest is small.
SMALL_CONTEXT = ContextConfig(context_length=1_000, trigger_ratio=0.5, reserve_ratio=0.1)


@tool
def fetch(size: int) -> str:
    """Fetch a page of ``size`` characters.

    Args:
        size: how long the page is.
    """
    return ("page " * size)[:size]


def _script(summary_turn: Any) -> ScriptedModel:
    return ScriptedModel(
        [
            ScriptedModel.call("fetch", {"size": 40}, call_id="c0"),
            ScriptedModel.calls(("fetch", {"size": 10}, "c1a"), ("fetch", {"size": 2_400}, "c1b")),
            summary_turn,  # the compression before step 2 asks the same model
            "Both pages fetched.",
        ]
    )


def _agent(model: ScriptedModel, context: ContextConfig = SMALL_CONTEXT) -> Agent:
    return Agent(
        "reader",
        "You fetch pages.",
        model,
        toolkit=Toolkit([fetch]),
        settings=AgentSettings(context=context),
    )


async def test_memory_past_the_trigger_is_summarized_and_calls_keep_their_results() -> None:
    model = _script(ScriptedModel.call("write_summary", SUMMARY))
    agent = _agent(model)

    answer = await agent.reply("Fetch the pages")

    assert answer.finished_reason == "completed"
    assert answer.content == "Both pages fetched."
    summary_request = model.requests[2]
    assert [t.name for t in summary_request.tools] == ["write_summary"]
    assert summary_request.tool_choice == "write_summary"
    assert "Fetch the pages" in text_of(summary_request.messages[-1])
    first = agent.memory[0]
    assert "compressed" in first.marks
    assert first.text.startswith(SUMMARY_HEADER)
    assert "page one is 40 characters long" in first.text
    assert agent.state.summary == Summary.model_validate(SUMMARY)
    # The step of the long page is kept whole: its call and both its results.
    assert [m.role for m in agent.memory] == ["user", "assistant", "tool", "tool", "assistant"]
    assert [u.id for u in agent.memory[1].tool_uses] == ["c1a", "c1b"]
    assert unanswered(agent.memory) == []
    assert all(u.id != "c0" for m in agent.memory for u in m.tool_uses)
    # The next step is sent the compressed memory.
    sent = model.requests[3].messages
    assert [m.role for m in sent] == ["system", "user", "assistant", "tool", "tool"]
    assert text_of(sent[1]).startswith(SUMMARY_HEADER)


async def test_failing_summary_truncates_memory_and_the_reply_completes() -> None:
    model = _script(ModelError("summarizer down", retryable=False))
    agent = _agent(model)

    answer = await agent.reply("Fetch the pages")

    assert answer.finished_reason == "completed"
    assert answer.content == "Both pages fetched."
    first = agent.memory[0]
    assert "compressed" in first.marks
    assert first.text.startswith(TRUNCATION_HEADER)
    assert agent.state.summary is None
    assert unanswered(agent.memory) == []
    assert [u.id for u in agent.memory[1].tool_uses] == ["c1a", "c1b"]
    assert model.remaining == 0


async def test_memory_below_the_trigger_is_not_compressed() -> None:
    model = ScriptedModel([ScriptedModel.call("fetch", {"size": 40}), "One page fetched."])
    agent = _agent(model)

    await agent.reply("Fetch a page")

    assert len(model.requests) == 2
    assert all("write_summary" not in [t.name for t in r.tools] for r in model.requests)
    assert all("compressed" not in m.marks for m in agent.memory)


async def test_compress_context_forces_a_summary_below_the_trigger() -> None:
    # A trigger that is never reached, and a reserve that holds about one message.
    config = ContextConfig(context_length=10_000, trigger_ratio=0.9, reserve_ratio=0.001)
    model = ScriptedModel(
        [
            ScriptedModel.call("fetch", {"size": 40}, call_id="c0"),
            "One page fetched.",
            ScriptedModel.call("write_summary", SUMMARY),
        ]
    )
    agent = _agent(model, config)
    await agent.reply("Fetch a page")
    assert len(agent.memory) == 4  # nothing compressed during the reply

    result = await agent.compress_context()

    assert result.method == "summary"
    assert result.removed == 3
    assert result.summary == Summary.model_validate(SUMMARY)
    assert [m.role for m in agent.memory] == ["user", "assistant"]
    assert "compressed" in agent.memory[0].marks
    assert agent.memory[1].text == "One page fetched."
    assert agent.state.summary == result.summary
    assert unanswered(agent.memory) == []
