"""Messages as lines for people: the streamed reply of ``fleetbus ask`` and the
one-line descriptions of ``fleetbus watch``."""

from __future__ import annotations

import io
from typing import Any

import pytest
from rich.console import Console

from fleetbus.agents import Agent, Permissions
from fleetbus.agents.events import EventFactory
from fleetbus.cli.render import ReplyPrinter, describe, shorten
from fleetbus.protocol import (
    AgentMessage,
    Cancel,
    ChatMessage,
    Confirmation,
    ConfirmResult,
    ErrorDetail,
    ErrorMessage,
    Event,
    ExternalOutput,
    ExternalResult,
    FinalAnswer,
    Handoff,
    LlmPrompt,
    LlmResponse,
    Message,
    TextBlock,
    ToolCall,
    ToolResult,
    ToolUseBlock,
    Usage,
    UserRequest,
)
from fleetbus.testing import ScriptedModel
from fleetbus.tools_workers import Toolkit, tool

ANSWER = "The sum is 4, says the [bold]calculator[/bold]."


def recording_console() -> Console:
    # file=StringIO keeps the terminal of the test run quiet; record=True keeps the text.
    return Console(record=True, width=100, file=io.StringIO())


def printed(messages: list[Any], *, session_id: str | None = None) -> tuple[str, ReplyPrinter]:
    console = recording_console()
    printer = ReplyPrinter(console, session_id=session_id)
    for message in messages:
        printer.handle(message)
    printer.close()
    return console.export_text(), printer


def one_tool_reply(answer: str = ANSWER) -> list[Event | FinalAnswer]:
    ev = EventFactory("adder", "r-1", "s-1")
    chunks = [answer[i : i + 7] for i in range(0, len(answer), 7)]
    return [
        ev("reply_start", reply_id="r-1"),
        ev("model_call_start", model="scripted", iteration=0),
        ev("thinking_delta", thinking="I should "),
        ev("thinking_delta", thinking="use the tool"),
        ev("model_call_end", model="scripted", input_tokens=10, output_tokens=5),
        ev("tool_call", call_id="c1", tool_name="add", parameters={"a": 2, "b": 2}),
        ev("tool_result", call_id="c1", tool_name="add", status="success", output=4),
        ev("tool_call", call_id="c2", tool_name="divide", parameters={"a": 1, "b": 0}),
        ev("tool_result", call_id="c2", tool_name="divide", status="error", output="division"),
        ev("model_call_start", model="scripted", iteration=1),
        *(ev("text_delta", text=chunk) for chunk in chunks),
        ev("model_call_end", model="scripted"),
        ev("reply_end", finished_reason="completed", content=answer),
        FinalAnswer(sender="adder", session_id="s-1", call_id="r-1", content=answer),
    ]


def test_a_streamed_reply_shows_thinking_tools_and_the_text_once() -> None:
    text, printer = printed(one_tool_reply())

    assert text.count(ANSWER) == 1  # streamed, not repeated by reply_end or the final answer
    assert "thinking: I should use the tool\n" in text
    assert '→ add({"a": 2, "b": 2})' in text
    assert "← add: success — 4" in text
    assert '→ divide({"a": 1, "b": 0})' in text
    assert "← divide: error — division" in text
    assert text.count("✓ completed") == 1
    assert text.rstrip().endswith("✓ completed (session s-1)")
    assert "model_call" not in text  # only with verbose
    assert printer.text == ANSWER
    assert printer.thinking == "I should use the tool"
    assert printer.finished_reason == "completed"


def test_streamed_pieces_continue_one_line_and_tools_start_new_ones() -> None:
    text, _ = printed(one_tool_reply())
    lines = text.splitlines()
    tool_line = lines.index('→ add({"a": 2, "b": 2})')
    assert lines[tool_line - 1] == "thinking: I should use the tool"
    assert ANSWER in lines


def test_an_answer_that_was_not_streamed_is_printed_with_the_end() -> None:
    final = FinalAnswer(
        sender="a", session_id="s-9", content="not streamed", finished_reason="exceed_max_iters"
    )
    text, _ = printed([final])
    assert "not streamed" in text
    assert "exceed_max_iters (session s-9)" in text


def test_structured_output_is_printed_once_after_the_end() -> None:
    ev = EventFactory("a", "r", "s")
    final = FinalAnswer(sender="a", session_id="s", content="{}", structured={"n": 4})
    text, _ = printed([ev("reply_end", finished_reason="completed", content="{}"), final])
    assert text.count('{"n": 4}') == 1
    assert text.count("completed") == 1


def test_a_pause_for_confirmation_prints_the_exact_commands() -> None:
    ev = EventFactory("writer", "r-2", "s-42")
    calls = [
        {
            "call_id": "c-7",
            "tool_name": "write_file",
            "parameters": {"path": "a.txt"},
            "kind": "confirm",
            "rule": "write_file",
        },
        {"call_id": "c-8", "tool_name": "shell", "parameters": {"cmd": "ls"}, "kind": "confirm"},
    ]
    text, printer = printed(
        [
            ev("require_user_confirm", calls=calls),
            ev("reply_end", finished_reason="paused", content="Waiting before running: …"),
        ]
    )
    assert "confirm before running 2 tool call(s)" in text
    assert 'write_file {"path": "a.txt"}  call_id c-7  (rule: write_file)' in text
    assert "fleetbus confirm s-42 --allow c-7" in text
    assert "fleetbus confirm s-42 --deny c-7" in text
    assert "fleetbus confirm s-42 --allow c-8" in text
    assert "Waiting before running" in text  # not streamed, so shown
    assert "⏸ paused (session s-42)" in text
    assert printer.finished_reason == "paused"


def test_a_pause_for_external_execution_prints_the_resume_commands() -> None:
    ev = EventFactory("a", "r", None)
    calls = [{"call_id": "x-1", "tool_name": "ask_human", "parameters": {"question": "ok?"}}]
    text, _ = printed([ev("require_external_execution", calls=calls)], session_id="s-5")
    assert 'ask_human {"question": "ok?"}  call_id x-1' in text
    assert "result: fleetbus resume s-5 --result x-1 JSON" in text
    assert "failed: fleetbus resume s-5 --error x-1 MESSAGE" in text


@tool
def write_file(path: str, content: str) -> str:
    """Write a file."""
    raise AssertionError("paused before running")


async def test_a_real_paused_reply_is_rendered_with_its_commands() -> None:
    model = ScriptedModel(
        [ScriptedModel.call("write_file", {"path": "a.txt", "content": "x"}, call_id="c1")]
    )
    agent = Agent(
        "w",
        "",
        model,
        toolkit=Toolkit([write_file]),
        permissions=Permissions.from_strings(ask=["write_file"]),
    )
    items = [item async for item in agent.reply_stream("write it", session_id="s-3")]
    text, printer = printed(items)
    assert '→ write_file({"path": "a.txt", "content": "x"})' in text
    assert "fleetbus confirm s-3 --allow c1" in text
    assert "fleetbus confirm s-3 --deny c1" in text
    assert printer.finished_reason == "paused"


@pytest.mark.parametrize(
    "message",
    [
        Event(event="tool_call"),
        Event(event="tool_result", data={"status": ["odd"], "output": object()}),
        Event(event="text_delta", data={"text": 42}),
        Event(event="require_user_confirm", data={"calls": "not a list"}),
        Event(event="require_external_execution", data={"calls": [1, None]}),
        Event(event="reply_end"),
        Event(event="something_new", data={"x": 1}),
        ErrorMessage(code="internal", message="boom"),
        ToolCall(tool_name="t"),
    ],
)
def test_odd_or_unknown_messages_never_raise(message: Message) -> None:
    text, _ = printed([message])
    assert "cannot show" not in text  # handled, not caught by the last-resort guard


def test_unknown_events_are_a_dim_line_and_errors_are_shown() -> None:
    text, _ = printed(
        [Event(event="something_new", data={"x": 1}), ErrorMessage(code="denied", message="no")]
    )
    assert '· something_new {"x": 1}' in text
    assert "error denied: no" in text


SESSION = "s-42"
CALL = "c-7"
DESCRIBED: list[tuple[Message, list[str]]] = [
    (
        UserRequest(sender="cli", session_id=SESSION, content="What is 2 + 2?"),
        ["user_request", "cli", "session=s-42", "What is 2 + 2?"],
    ),
    (
        LlmPrompt(
            sender="planner",
            model="gpt",
            messages=[ChatMessage(role="user", content=[TextBlock(text="hi there")])],
        ),
        ["llm_prompt", "gpt: 1 messages, 0 tools", "hi there"],
    ),
    (
        LlmResponse(
            sender="model-w",
            model="gpt",
            finish_reason="tool_calls",
            content=[ToolUseBlock(id="u1", name="add", input={"a": 1})],
            usage=Usage(input_tokens=3, output_tokens=4),
        ),
        ["llm_response", "gpt tool_calls (3 in / 4 out)", 'add({"a": 1})'],
    ),
    (
        ToolCall(
            sender="planner",
            session_id=SESSION,
            call_id=CALL,
            tool_name="calculator",
            parameters={"expr": "2026 - 1991"},
            attempt=2,
        ),
        ["tool_call", "call=c-7", 'calculator({"expr": "2026 - 1991"}) attempt 2'],
    ),
    (
        ToolResult(sender="w1", call_id=CALL, tool_name="calculator", status="success", content=35),
        ["tool_result", "w1", "calculator success — 35"],
    ),
    (
        ToolResult(
            sender="w1",
            tool_name="calculator",
            status="timeout",
            error_detail=ErrorDetail(code="timeout", message="took too long"),
        ),
        ["calculator timeout — timeout: took too long"],
    ),
    (
        FinalAnswer(sender="planner", content="35 years", finished_reason="completed"),
        ["final_answer", "completed — 35 years"],
    ),
    (
        ErrorMessage(sender="w1", code="unknown_tool", message="no tool x", source_component="w1"),
        ["error", "unknown_tool: no tool x (from w1)"],
    ),
    (
        AgentMessage(sender="a", name="Alice", content=[TextBlock(text="hello")], reply=False),
        ["agent_message", "Alice: hello (no reply asked)"],
    ),
    (
        Event(sender="a", event="tool_call", data={"call_id": "u1", "tool_name": "add"}, seq=3),
        ["event", "tool_call#3 add({}) tool_call_id=u1"],
    ),
    (
        Event(sender="a", event="text_delta", data={"text": "hi\n"}),
        ['text_delta#0 "hi\\n"'],
    ),
    (
        ConfirmResult(
            sender="cli",
            confirmations=[
                Confirmation(call_id="c1", confirmed=True, always=True),
                Confirmation(call_id="c2", confirmed=False),
            ],
        ),
        ["confirm_result", "allow c1 always, deny c2"],
    ),
    (
        ExternalResult(sender="cli", results=[ExternalOutput(call_id="x1", content="yes")]),
        ["external_result", "x1 success"],
    ),
    (Cancel(sender="cli", reason="enough"), ["cancel", "enough"]),
]


@pytest.mark.parametrize(("message", "expected"), DESCRIBED)
def test_describe_names_the_essentials_of_each_type(message: Message, expected: list[str]) -> None:
    line = describe(message, "fleet.tool.calculator")
    assert "\n" not in line
    for part in expected:
        assert part in line
    assert line.endswith("@ fleet.tool.calculator")


def test_describe_marks_replies_and_shortens_long_values() -> None:
    call = ToolCall(tool_name="echo", parameters={"text": "x" * 5000})
    line = describe(call, "_INBOX.abc.def")
    assert line.endswith("@ reply")
    assert "…" in line
    assert len(line) < 400


def test_shorten_folds_whitespace_and_cuts() -> None:
    assert shorten("a\n  b\tc") == "a b c"
    assert shorten("abcdef", 4) == "abc…"


def test_a_reply_handed_over_shows_the_hand_over_then_the_other_agents_reply() -> None:
    triage = EventFactory("triage", "r-1", "s-1")
    billing = EventFactory("billing", "r-2", "s-1")
    handoff = Handoff(agent="billing", by="triage", reason="a refund")
    text, printer = printed(
        [
            triage("reply_start", reply_id="r-1"),
            triage("tool_call", call_id="t", tool_name="transfer_to_billing", parameters={}),
            triage(
                "reply_end",
                finished_reason="handed_off",
                content="Handed over to billing: a refund",
                handoff={"agent": "billing", "reason": "a refund"},
            ),
            billing("reply_start", reply_id="r-2"),
            billing("text_delta", text="Refunded."),
            billing("reply_end", finished_reason="completed", content="Refunded."),
            FinalAnswer(sender="billing", session_id="s-1", content="Refunded."),
        ]
    )
    lines = text.splitlines()
    assert "↪ handed over to billing" in lines
    assert lines.index("↪ handed over to billing") < lines.index("Refunded.")
    assert text.rstrip().endswith("✓ completed (session s-1)")
    assert printer.finished_reason == "completed"
    # fleetbus watch: the answer handed over, and the request carrying it.
    ended = FinalAnswer(
        sender="triage", content="Handed over", finished_reason="handed_off", handoff=handoff
    )
    assert "handed_off → billing" in describe(ended, "_INBOX_x.y")
    handed = UserRequest(sender="agent.triage", content="", handoff=handoff)
    assert "handed over by triage (0 messages)" in describe(handed, "fleet.agent.billing.inbox")
