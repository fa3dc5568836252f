"""Guardrail checks and trips as people see them: ``fleetbus ask`` prints
trips, rejections and replacements (the checks that passed only when
verbose), ``fleetbus watch`` describes every check and names the guardrail
of a tripped answer."""

from __future__ import annotations

import io

from rich.console import Console

from fleetbus.agents.events import EventFactory
from fleetbus.cli.render import ReplyPrinter, describe
from fleetbus.protocol import Event, FinalAnswer, GuardrailTrip

STOP = "Stopped: the guardrail 'no-rm' tripped on the call of 'shell': it matches 'rm -rf'."


def checks() -> list[Event | FinalAnswer]:
    ev = EventFactory("helper", "r-1", "s-1")
    return [
        ev("reply_start", reply_id="r-1"),
        ev("guardrail", name="moderator", stage="input", tripped=False, reason="", action="pass"),
        ev(
            "guardrail",
            name="redact",
            stage="tool_output",
            tripped=False,
            reason="a key was hidden",
            action="replace",
            call_id="c1",
            tool_name="read",
        ),
        ev(
            "guardrail",
            name="no-rm",
            stage="tool_input",
            tripped=True,
            reason="it matches 'rm -rf'",
            action="trip",
            call_id="c2",
            tool_name="shell",
        ),
        ev("reply_end", finished_reason="guardrail_tripped", content=STOP),
        FinalAnswer(
            sender="helper",
            session_id="s-1",
            content=STOP,
            finished_reason="guardrail_tripped",
            guardrail=GuardrailTrip(name="no-rm", stage="tool_input", reason="it matches 'rm -rf'"),
        ),
    ]


def printed(*, verbose: bool) -> str:
    console = Console(record=True, width=200, file=io.StringIO())
    printer = ReplyPrinter(console, session_id="s-1", verbose=verbose)
    for message in checks():
        printer.handle(message)
    printer.close()
    return console.export_text()


def test_ask_prints_trips_rejections_and_replacements() -> None:
    text = printed(verbose=False)
    assert "⚠ guardrail redact on tool_output read[c1]: replace — a key was hidden" in text
    assert "⛔ guardrail no-rm on tool_input shell[c2]: trip — it matches 'rm -rf'" in text
    assert "moderator" not in text
    assert STOP in text
    assert "⛔ guardrail_tripped (session s-1)" in text


def test_ask_verbose_prints_the_checks_that_passed() -> None:
    assert "· guardrail moderator on input: pass" in printed(verbose=True)


def test_watch_describes_each_check_and_the_tripped_answer() -> None:
    lines = [describe(message) for message in checks()]
    assert lines[1].endswith("guardrail#1 moderator on input: pass")
    assert lines[3].endswith(
        "guardrail#3 no-rm on tool_input shell[c2]: trip — it matches 'rm -rf'"
    )
    assert "guardrail_tripped [guardrail no-rm on tool_input] — Stopped:" in lines[5]
