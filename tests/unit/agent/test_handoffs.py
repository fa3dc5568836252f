"""Handoffs in one process: the ``transfer_to_<agent>`` tool ends the reply
``handed_off`` with the conversation, and the next agent answers it."""

from __future__ import annotations

import pytest

from fleetbus.agents import Agent, AgentState
from fleetbus.capabilities import Handoffs, HandoffTo, follow_handoffs
from fleetbus.errors import ConfigError
from fleetbus.protocol import (
    ChatMessage,
    Handoff,
    TextBlock,
    ToolResultBlock,
    ToolUseBlock,
    UserRequest,
)
from fleetbus.testing import ScriptedModel
from fleetbus.tools_workers import Toolkit, tool


def _triage(model: ScriptedModel, *targets: str | HandoffTo) -> Agent:
    return Agent(
        "triage",
        "Send billing questions to billing.",
        model,
        capabilities=[Handoffs(list(targets or ["billing"]))],
    )


async def test_the_transfer_tool_ends_the_reply_handed_off_with_the_conversation() -> None:
    model = ScriptedModel(
        [ScriptedModel.call("transfer_to_billing", {"reason": "a refund"}, call_id="t1")]
    )
    triage = _triage(model)
    final = await triage.reply("I was charged twice.", session_id="s1")
    assert final.finished_reason == "handed_off"
    assert final.handoff is not None
    assert (final.handoff.agent, final.handoff.by, final.handoff.reason) == (
        "billing",
        "triage",
        "a refund",
    )
    roles = [m.role for m in final.handoff.messages]
    assert roles == ["user"]  # the hand-over's own call is not handed over
    assert final.content == "Handed over to billing: a refund"
    # The model was offered the tool.
    assert "transfer_to_billing" in [t.name for t in model.requests[0].tools]
    # Recorded in the agent's memory: the call and its result.
    result = triage.state.memory[-1].tool_results[0]
    assert (result.name, result.state) == ("transfer_to_billing", "success")
    assert triage.state.reply is None


async def test_the_next_agent_answers_the_conversation_handed_over() -> None:
    triage = _triage(ScriptedModel([ScriptedModel.call("transfer_to_billing", {}, call_id="t")]))
    billing_model = ScriptedModel([ScriptedModel.text("Refunded.")])
    billing = Agent("billing", "You handle billing.", billing_model)
    final = await follow_handoffs([triage, billing], "triage", "I was charged twice.")
    assert (final.sender, final.content, final.finished_reason) == (
        "billing",
        "Refunded.",
        "completed",
    )
    sent = billing_model.requests[0].messages
    assert sent[0].role == "system"
    assert sent[0].content == [TextBlock(text="You handle billing.")]  # its own prompt
    assert [m.role for m in sent[1:]] == ["user"]
    assert billing.state.memory[0].metadata == {"handed_over_by": "triage"}


async def test_a_conversation_handed_over_takes_the_place_of_the_session() -> None:
    billing_model = ScriptedModel([ScriptedModel.text("Done.")])
    billing = Agent("billing", "", billing_model)
    await billing.reply("an older conversation")
    billing_model.add(ScriptedModel.text("Refunded."))
    handed = UserRequest(
        content="",
        handoff=Handoff(
            agent="billing",
            by="triage",
            messages=[ChatMessage(role="user", content=[TextBlock(text="charged twice")])],
        ),
    )
    final = await billing.reply(handed)
    assert final.content == "Refunded."
    assert [m.text for m in billing.state.memory] == ["charged twice", "Refunded."]


@tool
def lookup(order: int) -> str:
    """Look an order up.

    Args:
        order: its number.
    """
    return f"order {order}: paid twice"


@pytest.mark.parametrize(
    ("name", "roles"),
    [("all", ["user", "assistant", "tool"]), ("no_tools", ["user"]), ("last_user", ["user"])],
)
async def test_input_filters(name: str, roles: list[str]) -> None:
    model = ScriptedModel(
        [
            ScriptedModel.call("lookup", {"order": 7}, call_id="l"),
            ScriptedModel.call("transfer_to_billing", {}, call_id="t"),
        ]
    )
    triage = Agent(
        "triage",
        "",
        model,
        toolkit=Toolkit([lookup]),
        capabilities=[Handoffs([HandoffTo("billing", input_filter=name)])],  # type: ignore[arg-type]
    )
    final = await triage.reply("charged twice")
    assert final.handoff is not None
    assert [m.role for m in final.handoff.messages] == roles
    names = {
        b.name
        for m in final.handoff.messages
        for b in m.content
        if isinstance(b, ToolUseBlock | ToolResultBlock)
    }
    assert names == ({"lookup"} if name == "all" else set())  # never the hand-over's own call


async def test_a_filter_function_and_its_wrong_answer() -> None:
    def first_only(messages: list[ChatMessage]) -> list[ChatMessage]:
        return messages[:1]

    model = ScriptedModel([ScriptedModel.call("transfer_to_billing", {}, call_id="t")])
    final = await _triage(model, HandoffTo("billing", input_filter=first_only)).reply("hi")
    assert final.handoff is not None
    assert len(final.handoff.messages) == 1

    bad = HandoffTo("billing", input_filter=lambda messages: "nope")  # type: ignore[arg-type,return-value]
    with pytest.raises(ConfigError, match="list of ChatMessage"):
        bad.filtered([])


async def test_two_transfers_in_one_step_hand_over_once() -> None:
    model = ScriptedModel(
        [ScriptedModel.calls(("transfer_to_billing", {}, "a"), ("transfer_to_refunds", {}, "b"))]
    )
    triage = _triage(model, "billing", "refunds")
    final = await triage.reply("hi")
    assert final.handoff is not None
    assert final.handoff.agent == "billing"
    results = {b.id: b for m in triage.state.memory for b in m.tool_results}
    assert results["b"].state == "error"


async def test_a_step_that_ends_a_reply_is_ended_after_a_restore() -> None:
    """The end is saved with the step's results as they arrive: an agent
    restored from that state (a replica taking the session over) ends the
    reply the same way, without asking the model."""
    saved: list[AgentState] = []

    async def checkpoint(state: AgentState) -> None:
        if state.reply is not None and state.reply.ending is not None and not saved:
            saved.append(state.model_copy(deep=True))  # the result arrived, not yet in memory

    model = ScriptedModel([ScriptedModel.call("transfer_to_billing", {}, call_id="t")])
    await _triage(model).clone(checkpoint=checkpoint).reply("hi", session_id="s")
    heir_model = ScriptedModel()  # would fail the reply if asked
    heir = _triage(heir_model).clone(state=saved[0])
    final = await heir.reply(None)
    assert final.finished_reason == "handed_off"
    assert final.handoff is not None
    assert final.handoff.agent == "billing"
    assert [m.role for m in final.handoff.messages] == ["user"]
    assert heir_model.requests == []


def test_bad_declarations_are_refused() -> None:
    with pytest.raises(ConfigError, match="input filter"):
        HandoffTo("billing", input_filter="some")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="tool name"):
        HandoffTo("billing", tool_name="hand over")
    with pytest.raises(ConfigError, match="at least one"):
        Handoffs([])
    with pytest.raises(ConfigError, match="once"):
        Handoffs(["billing", "billing"])


async def test_an_agent_handing_to_itself_ends_its_reply_with_the_error() -> None:
    model = ScriptedModel([ScriptedModel.text("x")])
    agent = Agent("triage", "", model, capabilities=[Handoffs(["triage"])])
    final = await agent.reply("hi")
    assert final.finished_reason == "error"
    assert "cannot hand the conversation to itself" in final.content
    assert model.requests == []


async def test_follow_handoffs_stops_a_ring_of_hand_overs() -> None:
    a = Agent(
        "a",
        "",
        ScriptedModel([ScriptedModel.call("transfer_to_b", {})], repeat_last=True),
        capabilities=[Handoffs(["b"])],
    )
    b = Agent(
        "b",
        "",
        ScriptedModel([ScriptedModel.call("transfer_to_a", {})], repeat_last=True),
        capabilities=[Handoffs(["a"])],
    )
    final = await follow_handoffs({"a": a, "b": b}, "a", "hi", max_handoffs=3)
    assert final.finished_reason == "error"
    assert "3 hand-overs" in final.content
    with pytest.raises(ConfigError, match="no agent 'c'"):
        await follow_handoffs([a], "c", "hi")
