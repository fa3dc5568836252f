"""Richer confirmations, in-process: the rules a pause suggests, an input the
person changes before allowing the call, rules accepted for the agent's later
sessions, and the clear errors of a confirmation that cannot be taken."""

from __future__ import annotations

import asyncio
import io
import runpy
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from fleetbus.agents import Agent, AgentState, Permissions
from fleetbus.agents.events import EventFactory
from fleetbus.agents.permissions import (
    AcceptedRules,
    PermissionRule,
    checked_confirmation,
    suggest_rules,
)
from fleetbus.agents.serving.client import confirm_result
from fleetbus.cli.main import build_parser, main
from fleetbus.cli.render import ReplyPrinter
from fleetbus.errors import ConfigError
from fleetbus.protocol import (
    Confirmation,
    ConfirmResult,
    Event,
    FinalAnswer,
    ToolUseBlock,
    decode,
    encode,
)
from fleetbus.testing import ScriptedModel
from fleetbus.tools_workers import Toolkit, tool

ROOT = Path(__file__).resolve().parents[3]

written: list[tuple[str, str]] = []


@tool
def write_file(path: str, content: str) -> str:
    """Write a file."""
    written.append((path, content))
    return f"wrote {path}"


@pytest.fixture(autouse=True)
def _clear_written() -> None:
    written.clear()


def asking_agent(turns: list[Any], **options: Any) -> Agent:
    options.setdefault("permissions", Permissions.from_strings(ask=["write_file"]))
    return Agent("writer", "", ScriptedModel(turns), toolkit=Toolkit([write_file]), **options)


def write(path: str, call_id: str, content: str = "x") -> Any:
    return ScriptedModel.call("write_file", {"path": path, "content": content}, call_id=call_id)


async def confirm_event(agent: Agent, text: str) -> tuple[Event, FinalAnswer]:
    events: list[Event] = []
    final: FinalAnswer | None = None
    async for item in agent.reply_stream(text):
        if isinstance(item, Event):
            events.append(item)
        else:
            final = item
    assert final is not None
    (asked,) = [e for e in events if e.event == "require_user_confirm"]
    return asked, final


# -- suggested rules ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("tool_name", "parameters", "expected"),
    [
        (
            "Write",
            {"file_path": "notes/2026/a.md", "content": "long text\nof many lines"},
            [
                "Write(file_path=notes/2026/a.md)",
                "Write(file_path=notes/2026/*)",
                "Write(file_path=notes/*)",
                "Write",
            ],
        ),
        (
            "Read",
            {"file_path": "/etc/hosts"},
            ["Read(file_path=/etc/hosts)", "Read(file_path=/etc/*)", "Read"],
        ),
        (
            "Bash",
            {"command": "git commit -m 'fix, again'", "cwd": "."},
            [
                "Bash(command=\"git commit -m 'fix, again'\")",
                "Bash(command=git commit *)",
                "Bash(command=git *)",
                "Bash",
            ],
        ),
        (
            "fetch",
            {"url": "https://example.com/docs/a.html"},
            [
                "fetch(url=https://example.com/docs/a.html)",
                "fetch(url=https://example.com/docs/*)",
                "fetch(url=https://example.com/*)",
                "fetch",
            ],
        ),
        (
            "calculator",
            {"expr": "2 * 3"},
            ["calculator(expr=2 [*] 3)", "calculator"],
        ),
        ("ping", {}, ["ping"]),
        ("count", {"n": 3}, ["count"]),
    ],
)
def test_suggestions_go_from_this_value_to_any_input(
    tool_name: str, parameters: dict[str, Any], expected: list[str]
) -> None:
    suggestions = suggest_rules(tool_name, parameters)
    assert suggestions == expected
    for text in suggestions:  # each reads back and allows this very call
        rule = PermissionRule.parse("allow", text)
        assert str(rule) == text
        assert rule.matches(tool_name, parameters)


def test_a_suggested_value_is_escaped_so_it_matches_only_itself() -> None:
    exact, folder, _ = suggest_rules("write_file", {"path": "data/[x]*?.txt"})
    rule = PermissionRule.parse("allow", exact)
    assert rule.matches("write_file", {"path": "data/[x]*?.txt"})
    assert not rule.matches("write_file", {"path": "data/x-anything.txt"})
    assert PermissionRule.parse("allow", folder).matches("write_file", {"path": "data/other"})


async def test_the_pause_event_suggests_rules_for_each_call() -> None:
    agent = asking_agent([write("notes/a.txt", "c1")])
    asked, final = await confirm_event(agent, "write it")
    assert final.finished_reason == "paused"
    (call,) = asked.data["calls"]
    assert call["call_id"] == "c1"
    assert call["suggested_rules"] == [
        "write_file(path=notes/a.txt)",
        "write_file(path=notes/*)",
        "write_file",
    ]


# -- an edited input ------------------------------------------------------------------


async def test_an_edited_input_is_what_runs_and_what_memory_records() -> None:
    agent = asking_agent([write("notes/a.txt", "c1", "draft"), ScriptedModel.text("done")])
    model = agent.model
    assert isinstance(model, ScriptedModel)
    await agent.reply("write it")
    edited = {"path": "notes/b.txt", "content": "final"}
    final = await agent.confirm("c1", allow=True, parameters=edited)
    assert (final.finished_reason, final.content) == ("completed", "done")
    assert written == [("notes/b.txt", "final")]  # the tool saw the edited input
    (asking,) = [m for m in agent.memory if m.tool_uses]
    assert asking.tool_uses[0].input == edited
    assert asking.metadata["edited_calls"] == {"c1": {"path": "notes/a.txt", "content": "draft"}}
    (result,) = [b for m in agent.memory for b in m.tool_results]
    assert result.state == "success"
    assert "changed the input" in result.output
    assert "wrote notes/b.txt" in result.output
    # The model is shown the call that ran, not the one it asked for.
    sent = [b for m in model.requests[-1].messages for b in m.content]
    (use,) = [b for b in sent if isinstance(b, ToolUseBlock)]
    assert use.input == edited


async def test_an_edit_lasts_through_a_saved_and_restored_state() -> None:
    agent = asking_agent([write("a.txt", "c1")])
    await agent.reply("write it")
    restored = Agent(
        "writer",
        "",
        ScriptedModel([ScriptedModel.text("done")]),
        toolkit=Toolkit([write_file]),
        state=AgentState.model_validate_json(agent.state.model_dump_json()),
    )
    await restored.confirm("c1", allow=True, parameters={"path": "b.txt", "content": "y"})
    again = AgentState.model_validate_json(restored.state.model_dump_json())
    assert [u.input for m in again.memory for u in m.tool_uses] == [
        {"path": "b.txt", "content": "y"}
    ]
    assert written == [("b.txt", "y")]


async def test_an_edited_input_that_does_not_fit_is_an_error_the_model_sees() -> None:
    agent = asking_agent([write("a.txt", "c1"), ScriptedModel.text("I see")])
    await agent.reply("write it")
    final = await agent.confirm("c1", allow=True, parameters={"path": "a.txt"})
    assert final.content == "I see"
    assert written == []
    (result,) = [b for m in agent.memory for b in m.tool_results]
    assert result.state == "error"
    assert "invalid" in result.output
    assert "content" in result.output


async def test_an_edited_input_a_deny_rule_matches_is_denied() -> None:
    permissions = Permissions.from_strings(ask=["write_file"], deny=["write_file(path=/etc/*)"])
    agent = asking_agent([write("a.txt", "c1"), ScriptedModel.text("ok")], permissions=permissions)
    await agent.reply("write it")
    await agent.confirm("c1", allow=True, parameters={"path": "/etc/passwd", "content": "x"})
    (result,) = [b for m in agent.memory for b in m.tool_results]
    assert result.state == "denied"
    assert "write_file(path=/etc/*)" in result.output
    assert written == []


# -- accepted rules ----------------------------------------------------------------


async def test_an_accepted_rule_lets_later_sessions_through_without_asking() -> None:
    definition = asking_agent(
        [
            write("notes/a.txt", "c1"),
            ScriptedModel.text("first"),
            write("notes/b.txt", "c2"),
            ScriptedModel.text("second"),
            write("secret.txt", "c3"),
        ]
    )
    first = definition.clone()
    await first.reply("write a")
    await first.confirm("c1", allow=True, accept_rules=["write_file(path=notes/*)"])
    assert isinstance(definition.accepted_rules, AcceptedRules)
    assert [str(r) for r in definition.accepted_rules.rules] == ["write_file(path=notes/*)"]
    assert [str(r) for r in first.state.permissions.accepted] == ["write_file(path=notes/*)"]

    later = definition.clone()
    answer = await later.reply("write b")
    assert (answer.finished_reason, answer.content) == ("completed", "second")
    assert written == [("notes/a.txt", "x"), ("notes/b.txt", "x")]
    # A call the rule does not cover still asks.
    other = await later.reply("write the secret")
    assert other.finished_reason == "paused"
    assert written[-1] == ("notes/b.txt", "x")
    # The agent's rules are loaded for each reply, not saved with each session.
    assert "agent_accepted" not in later.state.model_dump_json()


async def test_accepted_rules_given_to_the_definition_start_every_session() -> None:
    definition = asking_agent(
        [write("notes/a.txt", "c1"), ScriptedModel.text("done")],
        accepted_rules=["write_file(path=notes/*)"],
    )
    answer = await definition.clone().reply("write")
    assert answer.finished_reason == "completed"


async def test_an_accepted_rule_never_outranks_a_deny_rule() -> None:
    permissions = Permissions.from_strings(
        ask=["write_file"], deny=["write_file(path=notes/private/*)"]
    )
    permissions.accept("write_file(path=notes/*)")
    assert permissions.check("write_file", {"path": "notes/a"}).action == "allow"
    assert permissions.check("write_file", {"path": "notes/private/a"}).action == "deny"
    assert permissions.check("write_file", {"path": "elsewhere"}).action == "ask"
    with pytest.raises(ConfigError, match="allows"):
        permissions.accept(PermissionRule(action="deny", tool="x"))


async def test_a_rule_accepted_for_one_call_runs_the_others_it_covers() -> None:
    agent = asking_agent(
        [
            ScriptedModel.calls(
                ("write_file", {"path": "notes/a", "content": "1"}, "c1"),
                ("write_file", {"path": "notes/b", "content": "2"}, "c2"),
                ("write_file", {"path": "other", "content": "3"}, "c3"),
            ),
        ]
    )
    await agent.reply("write three")
    final = await agent.confirm("c1", allow=True, accept_rules=["write_file(path=notes/*)"])
    assert final.finished_reason == "paused"
    assert written == [("notes/a", "1"), ("notes/b", "2")]
    assert [p.call_id for p in agent.state.reply.pending] == ["c3"]  # type: ignore[union-attr]


# -- what cannot be taken ------------------------------------------------------------


@pytest.mark.parametrize(
    ("confirmations", "problem"),
    [
        ([], "names no call"),
        ([Confirmation(call_id="nope", confirmed=True)], "no call 'nope' waits for a confirmation"),
        (
            [
                Confirmation(call_id="c1", confirmed=True),
                Confirmation(call_id="c1", confirmed=False),
            ],
            "the call 'c1' is answered twice",
        ),
        (
            [Confirmation(call_id="c1", confirmed=True, parameters=[1, 2])],  # type: ignore[arg-type]
            "the edited parameters of 'c1' must be a JSON object, not an array",
        ),
        (
            [Confirmation(call_id="c1", confirmed=False, parameters={"path": "b"})],
            "only an allowed call is edited",
        ),
        (
            [Confirmation(call_id="c1", confirmed=True, accept_rules=["write_file(path="])],
            "invalid permission rule 'write_file(path='",
        ),
        (
            [Confirmation(call_id="c1", confirmed=True, accept_rules=["x" * 1001])],
            "at most 1000 characters",
        ),
    ],
)
async def test_a_confirmation_that_cannot_be_taken_is_refused_and_the_reply_waits(
    confirmations: list[Confirmation], problem: str
) -> None:
    agent = asking_agent([write("notes/a.txt", "c1"), ScriptedModel.text("done")])
    await agent.reply("write it")
    refused = await agent.reply(ConfirmResult(confirmations=confirmations))
    assert refused.finished_reason == "error"
    assert problem in str(refused.content)
    assert "still waits for: c1 (write_file)" in str(refused.content)
    assert agent.state.paused
    assert written == []
    assert isinstance(agent.accepted_rules, AcceptedRules)
    assert agent.accepted_rules.rules == []
    # Nothing of it was applied: a correct answer still works.
    final = await agent.confirm("c1", allow=True)
    assert final.content == "done"
    assert written == [("notes/a.txt", "x")]


def test_the_confirm_methods_check_their_input_before_sending() -> None:
    with pytest.raises(ConfigError, match="invalid permission rule"):
        checked_confirmation("c1", allow=True, accept_rules=["Bash(command="])
    with pytest.raises(ConfigError, match="must be an object"):
        checked_confirmation("c1", allow=True, parameters=[1])  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="only an allowed call is edited"):
        checked_confirmation("c1", allow=False, parameters={})
    made = checked_confirmation("c1", allow=True, accept_rules=[" Bash ( command = git * ) "])
    assert made.accept_rules == ["Bash(command=git *)"]


def test_the_new_fields_travel_and_old_messages_still_decode() -> None:
    message = ConfirmResult(
        confirmations=[
            Confirmation(call_id="c1", confirmed=True, parameters={"a": 1}, accept_rules=["t"])
        ]
    )
    back = decode(encode(message))
    assert back == message
    old = b'{"type":"confirm_result","version":1,"id":"x","timestamp":"2026-11-29T19:00:00Z",'
    old += b'"confirmations":[{"call_id":"c1","confirmed":true}]}'
    decoded = decode(old)
    assert isinstance(decoded, ConfirmResult)
    assert decoded.confirmations[0].parameters is None
    assert decoded.confirmations[0].accept_rules == []


# -- the command line --------------------------------------------------------------


def test_the_confirm_command_takes_edits_and_rules() -> None:
    args = build_parser().parse_args(
        [
            "confirm",
            "s-1",
            "--allow",
            "c1",
            "--edit",
            "c2",
            '{"path": "b"}',
            "--deny",
            "c3",
            "--accept-rules",
            "write_file(path=notes/*)",
            "Bash(command=git *)",
        ]
    )
    assert args.edit == [["c2", '{"path": "b"}']]
    assert args.accept_rules == ["write_file(path=notes/*)", "Bash(command=git *)"]
    message = confirm_result(
        "s-1",
        allow=args.allow,
        deny=args.deny,
        edits=[("c2", {"path": "b"})],
        accept_rules=args.accept_rules,
    )
    assert [(c.call_id, c.confirmed, c.parameters) for c in message.confirmations] == [
        ("c1", True, None),
        ("c2", True, {"path": "b"}),  # an edited call is allowed
        ("c3", False, None),
    ]
    assert message.confirmations[0].accept_rules == args.accept_rules
    assert message.confirmations[1].accept_rules == []


@pytest.mark.parametrize(
    ("argv", "error"),
    [
        (["--edit", "c1", "{not json"], "--edit c1: the parameters are not JSON"),
        (["--edit", "c1", "[1]"], "--edit c1: the parameters must be a JSON object, not an array"),
        (["--allow", "c1", "--accept-rules", "write_file(path="], "invalid permission rule"),
        (["--allow", "c1", "--deny", "c1"], "allowed and denied at once: c1"),
        (["--deny", "c1", "--edit", "c1", "{}"], "allowed and denied at once: c1"),
        ([], "name at least one call"),
    ],
)
def test_confirm_command_mistakes_are_one_clear_line(
    argv: list[str], error: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # Checked before connecting: the address is never dialled.
    code = main(["confirm", "s-1", *argv, "--nats", "nats://127.0.0.1:9"])
    out = capsys.readouterr()
    text = out.out + out.err
    assert code == 1
    assert error in text
    assert "Traceback" not in text


def test_the_printed_pause_shows_the_edit_command_and_the_suggested_rules() -> None:
    console = Console(record=True, width=200, file=io.StringIO())
    printer = ReplyPrinter(console, session_id="s-9")
    ev = EventFactory("writer", "r-1", "s-9")
    call = {
        "call_id": "c1",
        "tool_name": "write_file",
        "parameters": {"path": "it's/a.txt"},
        "kind": "confirm",
        "suggested_rules": ["write_file(path=it's/a.txt)", "write_file"],
    }
    printer.handle(ev("require_user_confirm", calls=[call]))
    printer.close()
    text = console.export_text()
    assert "fleetbus confirm s-9 --edit c1 '{\"path\": \"it'\\''s/a.txt\"}'" in text
    assert "--accept-rules 'write_file(path=it'\\''s/a.txt)' or 'write_file'" in text


def test_the_example_runs(capsys: pytest.CaptureFixture[str]) -> None:
    example = runpy.run_path(str(ROOT / "examples" / "confirmations.py"), run_name="example")
    asyncio.run(example["main"]())  # it checks what it shows
    out = capsys.readouterr().out
    assert "suggested rule: write_note(path=notes/*)" in out
    assert "confirmations asked: 0" in out
