"""Permissions, pause and resume: ask pauses the reply, a confirm_result or an
external_result resumes it — in the same agent or in one restored from JSON."""

from __future__ import annotations

from typing import Any

import pytest

from fleetbus.agents import Agent, AgentState, Permissions
from fleetbus.protocol import (
    Confirmation,
    ConfirmResult,
    ErrorDetail,
    Event,
    ExternalOutput,
    ExternalResult,
    FinalAnswer,
    ToolResultBlock,
    UserRequest,
)
from fleetbus.testing import ScriptedModel
from fleetbus.tools_workers import Toolkit, tool

written: list[str] = []


@tool
def write_file(path: str, content: str) -> str:
    """Write a file."""
    written.append(path)
    return f"wrote {path}"


@tool(external=True)
def ask_human(question: str) -> str:
    """Answered by a person, outside the agent."""
    raise AssertionError("an external tool is never run by the agent")


def kit() -> Toolkit:
    return Toolkit([write_file, ask_human])


@pytest.fixture(autouse=True)
def _clear_written() -> None:
    written.clear()


async def collect(agent: Agent, inputs: Any) -> tuple[list[Event], FinalAnswer]:
    events: list[Event] = []
    final: FinalAnswer | None = None
    async for item in agent.reply_stream(inputs):
        if isinstance(item, Event):
            events.append(item)
        else:
            final = item
    assert final is not None
    return events, final


def results(agent: Agent) -> list[ToolResultBlock]:
    return [r for m in agent.memory for r in m.tool_results]


async def test_ask_pauses_and_lists_the_pending_calls() -> None:
    model = ScriptedModel(
        [ScriptedModel.call("write_file", {"path": "a.txt", "content": "x"}, call_id="c1")]
    )
    agent = Agent(
        "a", "", model, toolkit=kit(), permissions=Permissions.from_strings(ask=["write_file"])
    )
    events, final = await collect(agent, "write it")
    assert final.finished_reason == "paused"
    confirm = [e for e in events if e.event == "require_user_confirm"]
    assert len(confirm) == 1
    assert confirm[0].data["calls"][0]["call_id"] == "c1"
    assert confirm[0].data["calls"][0]["parameters"] == {"path": "a.txt", "content": "x"}
    assert agent.state.paused
    assert [p.call_id for p in agent.state.reply.pending] == ["c1"]  # type: ignore[union-attr]
    assert written == []


async def test_a_confirmation_runs_the_call_and_the_reply_goes_on() -> None:
    model = ScriptedModel(
        [
            ScriptedModel.call("write_file", {"path": "a.txt", "content": "x"}, call_id="c1"),
            ScriptedModel.text("written"),
        ]
    )
    agent = Agent(
        "a", "", model, toolkit=kit(), permissions=Permissions.from_strings(ask=["write_file"])
    )
    await agent.reply("write it")
    final = await agent.reply(
        ConfirmResult(confirmations=[Confirmation(call_id="c1", confirmed=True)])
    )
    assert (final.finished_reason, final.content) == ("completed", "written")
    assert written == ["a.txt"]
    assert [r.state for r in results(agent)] == ["success"]
    assert agent.state.reply is None


async def test_a_denial_becomes_a_result_the_model_sees() -> None:
    model = ScriptedModel(
        [
            ScriptedModel.call("write_file", {"path": "a.txt", "content": "x"}, call_id="c1"),
            ScriptedModel.text("ok, I will not"),
        ]
    )
    agent = Agent(
        "a", "", model, toolkit=kit(), permissions=Permissions.from_strings(ask=["write_file"])
    )
    await agent.reply("write it")
    final = await agent.reply(
        ConfirmResult(confirmations=[Confirmation(call_id="c1", confirmed=False)])
    )
    assert final.content == "ok, I will not"
    seen = model.requests[-1].messages[-1].content[0]
    assert isinstance(seen, ToolResultBlock)
    assert seen.state == "denied"
    assert written == []


async def test_resuming_from_a_state_restored_from_json() -> None:
    first = Agent(
        "a",
        "",
        ScriptedModel(
            [ScriptedModel.call("write_file", {"path": "n.txt", "content": "y"}, call_id="c9")]
        ),
        toolkit=kit(),
        permissions=Permissions.from_strings(ask=["write_file"]),
    )
    await first.reply("write it")
    saved = first.state.model_dump_json()

    restored = AgentState.model_validate_json(saved)
    second = Agent(
        "a", "", ScriptedModel([ScriptedModel.text("done")]), toolkit=kit(), state=restored
    )
    final = await second.reply(
        ConfirmResult(confirmations=[Confirmation(call_id="c9", confirmed=True)])
    )
    assert (final.finished_reason, final.content) == ("completed", "done")
    assert written == ["n.txt"]
    assert second.state.permissions.rules == first.state.permissions.rules


async def test_always_adds_a_rule_so_the_next_call_is_not_asked() -> None:
    model = ScriptedModel(
        [
            ScriptedModel.call("write_file", {"path": "a", "content": "1"}, call_id="c1"),
            ScriptedModel.call("write_file", {"path": "b", "content": "2"}, call_id="c2"),
            ScriptedModel.text("both"),
        ]
    )
    agent = Agent(
        "a", "", model, toolkit=kit(), permissions=Permissions.from_strings(ask=["write_file"])
    )
    await agent.reply("write two")
    confirm = Confirmation(call_id="c1", confirmed=True, always=True)
    final = await agent.reply(ConfirmResult(confirmations=[confirm]))
    assert final.content == "both"
    assert written == ["a", "b"]
    assert any(
        str(r) == "write_file" and r.action == "allow" for r in agent.state.permissions.rules
    )


async def test_rules_with_parameter_patterns() -> None:
    model = ScriptedModel(
        [
            ScriptedModel.calls(
                ("write_file", {"path": "notes/today.md", "content": "1"}, "ok"),
                ("write_file", {"path": "etc/passwd", "content": "2"}, "no"),
                ("write_file", {"path": "other.txt", "content": "3"}, "ask"),
            ),
        ]
    )
    permissions = Permissions.from_strings(
        allow=["write_file(path=notes/*)"], deny=["write_file(path=etc/*)"], default="ask"
    )
    agent = Agent("a", "", model, toolkit=kit(), permissions=permissions)
    final = await agent.reply("write")
    assert final.finished_reason == "paused"
    assert written == ["notes/today.md"]
    by_id = {r.id: r.state for r in results(agent)}
    assert by_id == {"ok": "success", "no": "denied"}
    assert [p.call_id for p in agent.state.reply.pending] == ["ask"]  # type: ignore[union-attr]


async def test_an_external_tool_pauses_until_its_result_arrives() -> None:
    model = ScriptedModel(
        [
            ScriptedModel.call("ask_human", {"question": "color?"}, call_id="h1"),
            ScriptedModel.text("blue it is"),
        ]
    )
    agent = Agent("a", "", model, toolkit=kit())
    events, paused = await collect(agent, "pick a color")
    assert paused.finished_reason == "paused"
    assert [e.event for e in events if e.event.startswith("require_")] == [
        "require_external_execution"
    ]
    final = await agent.reply(
        ExternalResult(results=[ExternalOutput(call_id="h1", content="blue")])
    )
    assert final.content == "blue it is"
    seen = model.requests[-1].messages[-1].content[0]
    assert isinstance(seen, ToolResultBlock)
    assert (seen.state, seen.output) == ("success", "blue")


async def test_an_external_failure_is_a_result_too() -> None:
    model = ScriptedModel(
        [ScriptedModel.call("ask_human", {"question": "?"}, call_id="h1"), ScriptedModel.text("ok")]
    )
    agent = Agent("a", "", model, toolkit=kit())
    await agent.reply("ask")
    failed = ExternalOutput(
        call_id="h1",
        status="error",
        error_detail=ErrorDetail(code="tool_error", message="nobody answered"),
    )
    await agent.reply(ExternalResult(results=[failed]))
    assert results(agent)[0].state == "error"
    assert "nobody answered" in results(agent)[0].output


async def test_a_confirmation_when_nothing_waits_is_a_clear_error() -> None:
    agent = Agent("a", "", ScriptedModel([]))
    final = await agent.reply(
        ConfirmResult(confirmations=[Confirmation(call_id="x", confirmed=True)])
    )
    assert final.finished_reason == "error"
    assert "Nothing is waiting for a confirmation" in final.content


async def test_a_new_message_while_paused_closes_the_pending_calls() -> None:
    model = ScriptedModel(
        [
            ScriptedModel.call("write_file", {"path": "a", "content": "1"}, call_id="c1"),
            ScriptedModel.text("never mind then"),
        ]
    )
    agent = Agent(
        "a", "", model, toolkit=kit(), permissions=Permissions.from_strings(ask=["write_file"])
    )
    await agent.reply("write")
    final = await agent.reply("actually, don't")
    assert final.content == "never mind then"
    assert [r.state for r in results(agent)] == ["cancelled"]
    roles = [m.role for m in agent.memory]
    assert roles == ["user", "assistant", "tool", "user", "assistant"]


async def test_a_deny_rule_refuses_without_asking() -> None:
    model = ScriptedModel(
        [
            ScriptedModel.call("write_file", {"path": "a", "content": "1"}),
            ScriptedModel.text("fine"),
        ]
    )
    agent = Agent(
        "a", "", model, toolkit=kit(), permissions=Permissions.from_strings(deny=["write_*"])
    )
    final = await agent.reply("write")
    assert final.finished_reason == "completed"
    assert results(agent)[0].state == "denied"
    assert "write_*" in results(agent)[0].output


async def test_a_reply_restored_after_a_crash_continues_from_its_last_step() -> None:
    """The state saved after step 1 is enough to finish the reply elsewhere."""
    saved: list[str] = []

    async def checkpoint(state: AgentState) -> None:
        saved.append(state.model_dump_json())

    crashing = ScriptedModel(
        [
            ScriptedModel.call("write_file", {"path": "one", "content": "1"}, call_id="s1"),
            RuntimeError("the process died here"),
        ]
    )
    first = Agent("a", "", crashing, toolkit=kit(), checkpoint=checkpoint)
    first.model_config = first.model_config.model_copy(update={"max_retries": 0})
    await first.reply("write one, then answer")
    after_step_one = next(s for s in saved if '"s1"' in s and '"tool_result"' in s)

    model = ScriptedModel([ScriptedModel.text("all done")])
    second = Agent(
        "a", "", model, toolkit=kit(), state=AgentState.model_validate_json(after_step_one)
    )
    final = await second.reply()
    assert (final.finished_reason, final.content) == ("completed", "all done")
    assert written == ["one"]  # step 1 is not run again
    assert [m.role for m in model.requests[0].messages] == ["user", "assistant", "tool"]


async def test_a_confirmation_for_another_call_leaves_the_reply_paused() -> None:
    model = ScriptedModel(
        [ScriptedModel.call("write_file", {"path": "a", "content": "1"}, call_id="c1")]
    )
    agent = Agent(
        "a", "", model, toolkit=kit(), permissions=Permissions.from_strings(ask=["write_file"])
    )
    await agent.reply("write")
    wrong = ConfirmResult(confirmations=[Confirmation(call_id="nope", confirmed=True)])
    final = await agent.reply(wrong)
    assert final.finished_reason == "error"  # refused, saying why
    assert "no call 'nope' waits for a confirmation" in str(final.content)
    assert agent.state.paused
    assert [p.call_id for p in agent.state.reply.pending] == ["c1"]  # type: ignore[union-attr]
    assert written == []


async def test_a_final_answer_carries_the_call_id_of_the_message_it_answers() -> None:
    model = ScriptedModel(
        [
            ScriptedModel.call("write_file", {"path": "a.txt", "content": "x"}, call_id="c1"),
            ScriptedModel.text("written"),
        ]
    )
    agent = Agent(
        "a", "", model, toolkit=kit(), permissions=Permissions.from_strings(ask=["write_file"])
    )
    events, paused = await collect(agent, UserRequest(content="write it", call_id="r-1"))
    assert paused.call_id == "r-1"  # the request's, not the reply's own id
    reply_ids = {e.call_id for e in events}
    assert len(reply_ids) == 1
    assert "r-1" not in reply_ids  # events keep the reply's id
    assert agent.state.reply is not None
    assert agent.state.reply.request_id == "r-1"  # saved: a take-over answers alike
    restored = Agent(
        "a",
        "",
        model,
        toolkit=kit(),
        state=AgentState.model_validate_json(agent.state.model_dump_json()),
    )
    final = await restored.reply(
        ConfirmResult(confirmations=[Confirmation(call_id="c1", confirmed=True)], call_id="r-2")
    )
    assert (final.finished_reason, final.call_id) == ("completed", "r-2")
    nothing = await restored.reply(
        ConfirmResult(confirmations=[Confirmation(call_id="c1", confirmed=True)], call_id="r-3")
    )
    assert (nothing.finished_reason, nothing.call_id) == ("error", "r-3")
