"""The fleet part of ``fleetbus demo``: an agent with two replicas converses,
uses the tool workers, observes a broadcast, and pauses for a confirmation
that the demo grants — shown live."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from rich.table import Table

from fleetbus.agents.serving.client import stream_reply
from fleetbus.agents.serving.sessions import SessionStore
from fleetbus.bus import Bus
from fleetbus.cli._common import console
from fleetbus.cli.demo_fleet import describe_model
from fleetbus.cli.render import ReplyPrinter
from fleetbus.cli.settings import cli_settings
from fleetbus.errors import FleetbusError
from fleetbus.protocol import (
    AgentMessage,
    AnyMessage,
    Confirmation,
    ConfirmResult,
    ErrorMessage,
    Event,
    FinalAnswer,
    Message,
    TextBlock,
    UserRequest,
)

__all__ = ["converse_with_fleet"]

AGENT = "assistant"
SESSION = "demo"
TOPIC = "news"


async def converse_with_fleet(bus: Bus, url: str, run_dir: Path) -> int:
    """Start the agent (two replicas), hold the demo conversation, stop it.

    Returns 0 when every step ended as expected.
    """
    console.rule("[bold]fleetbus demo: an agent fleet")
    log = (run_dir / "agent.log").open("wb")
    env = {**os.environ, "FLEETBUS_NATS_URL": url, "FLEETBUS_CONNECT_TIMEOUT": "10"}
    env.pop("FLEETBUS_PREFIX", None)
    supervisor = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "fleetbus",
        "agent",
        "fleetbus.cli.demo_fleet:agents",
        "--replicas",
        "2",
        "--topic",
        TOPIC,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=log,
        stderr=asyncio.subprocess.STDOUT,
        env=env,
    )
    log.close()
    try:
        with console.status("starting the agent 'assistant' with two replicas…"):
            await _wait_for_agent(bus, supervisor, run_dir / "agent.log")
        console.print(
            f"agent [bold]{AGENT}[/]: 2 replica processes in queue group agent.{AGENT}, "
            f"session journals in JetStream; model: [bold]{describe_model()}[/]"
        )
        return await _conversation(bus)
    finally:
        with console.status("stopping the agent replicas…"):
            if supervisor.returncode is None:
                supervisor.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(supervisor.wait(), 30)
            except TimeoutError:
                supervisor.kill()
                await supervisor.wait()
        console.print(f"agent stopped (exit code {supervisor.returncode})")


async def _wait_for_agent(
    bus: Bus, supervisor: asyncio.subprocess.Process, log: Path, timeout: float = 60.0
) -> None:
    """Wait until a replica serves the agent's inbox: an ``agent_message``
    that only adds to memory is answered with an ``observed`` event, with no
    model call (a small local model takes a minute over its first one).

    Raises:
        FleetbusError: the agent exited (with the last line it wrote: why), or
            did not come up within ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if supervisor.returncode is not None:
            raise FleetbusError(f"the agent exited ({_last_line(log)})")
        try:
            reply = await bus.request(
                bus.subjects.agent_inbox(AGENT),
                AgentMessage(
                    content=[TextBlock(text="ping")], reply=False, session_id="demo-ready"
                ),
                timeout=5,
                attempts=1,
            )
        except FleetbusError:
            await asyncio.sleep(0.2)
            continue
        if isinstance(reply, Event):
            return
    raise FleetbusError(f"the agent did not come up within {timeout:g}s ({_last_line(log)})")


def _last_line(log: Path) -> str:
    """What a process said last in ``log``: its last ``error:`` line (joined
    with the lines the console wrapped it onto), else its last line."""
    try:
        said = [line.strip() for line in log.read_text(errors="replace").splitlines()]
    except OSError:
        said = []
    said = [line for line in said if line]
    errors = [i for i, line in enumerate(said) if line.startswith("error:")]
    if errors:
        return " ".join(said[errors[-1] :])[:500]
    return said[-1][:500] if said else "it wrote nothing"


_GRANTS = 3
"""Confirmations the demo gives one reply before it leaves the rest to a person."""


@dataclass
class _Step:
    """What one reply of the demo did."""

    final: FinalAnswer | None
    tools: list[str] = field(default_factory=list)
    """The tools the model called, in order."""
    problem: str = ""
    """Why the fleet gave no answer (empty when it answered)."""


class _Outcome:
    """What the demo saw: the fleet's failures, and what the model did not do."""

    def __init__(self) -> None:
        self.failures: list[str] = []
        self.notes: list[str] = []

    def answered(self, step: _Step, what: str) -> bool:
        if step.final is None:
            self.failures.append(f"{what}: {step.problem}")
            return False
        if step.final.finished_reason == "error":
            self.failures.append(f"{what}: the reply ended in error: {step.final.content}")
            return False
        return True

    def expect_tools(self, step: _Step, what: str, *tools: str) -> None:
        missing = [t for t in tools if t not in step.tools]
        if step.final is not None and missing:
            used = ", ".join(step.tools) or "no tool"
            self.notes.append(
                f"{what}: the model answered without {' and '.join(missing)} (it used {used}); "
                "the fleet served the reply, the model chose not to call the tool"
            )


async def _say(bus: Bus, message: Message, label: str) -> _Step:
    console.print(f"\n[bold cyan]you[/] {label}")
    printer = ReplyPrinter(console, session_id=SESSION)
    tools: list[str] = []

    def on_item(item: AnyMessage) -> None:
        if isinstance(item, Event) and item.event == "tool_call":
            tools.append(str(item.data.get("tool_name", "")))
        printer.handle(item)

    # A small local model on a shared CPU writes a few tokens a second.
    timeout = cli_settings().demo_timeout
    try:
        outcome = await stream_reply(bus, AGENT, SESSION, message, on_item=on_item, timeout=timeout)
    except FleetbusError as exc:
        printer.close()
        console.print(f"[red]{exc}[/]")
        return _Step(None, tools, str(exc))
    printer.close()
    if isinstance(outcome, ErrorMessage):
        console.print(f"[red]{outcome.code}: {outcome.message}[/]")
        return _Step(None, tools, f"{outcome.code}: {outcome.message}")
    return _Step(outcome, tools)


async def _conversation(bus: Bus) -> int:
    seen = _Outcome()
    text = "What is 2026 - 1991?"
    first = await _say(bus, _ask(text), text)
    if seen.answered(first, "the first question"):
        seen.expect_tools(first, "the first question", "calculator")

    news = "The office closes at 17:00 today."
    console.print(f"\n[bold magenta]broadcast[/] on topic {TOPIC!r}: {news}")
    await bus.publish(
        bus.subjects.topic(TOPIC),
        AgentMessage(
            sender="herald", session_id=SESSION, content=[TextBlock(text=news)], reply=False
        ),
    )
    store = await SessionStore.open(bus, owner="demo")
    observed = await _wait_observed(store, news)
    console.print(f"[dim]the assistant recorded it in session {SESSION!r}: {observed}[/]")
    if not observed:
        seen.failures.append("the broadcast was not recorded in the session within 10 s")

    text = "What time is it in Tokyo, and what is 12 * 12?"
    second = await _say(bus, _ask(text), text)
    if seen.answered(second, "the second question"):
        seen.expect_tools(second, "the second question", "current_time", "calculator")

    text = "Write 'the demo ran' to notes/demo.md"
    third = await _say(bus, _ask(text), text)
    if seen.answered(third, "the request to write a file"):
        await _confirm(bus, store, third, seen)
    await _show_sessions(store)
    return _verdict(seen)


async def _confirm(bus: Bus, store: SessionStore, asked: _Step, seen: _Outcome) -> None:
    """Grant the pause the write should have caused (or say why there was none)."""
    record = await store.get(AGENT, SESSION)
    pending = record.state.reply.pending if record and record.state.reply else []
    if asked.final is None or asked.final.finished_reason != "paused" or not pending:
        seen.notes.append(
            "the request to write a file: no confirmation was asked, because the model "
            f"did not call write_file (it used {', '.join(asked.tools) or 'no tool'}); "
            "with write_file, the reply pauses until someone allows it"
        )
        return
    granted = 0
    while pending and granted < _GRANTS:
        granted += 1
        call = pending[0]
        console.print(
            f"\n[bold yellow]the demo grants it[/] (as `fleetbus confirm {SESSION} "
            f"--allow {call.call_id}` would): {call.tool_name}({call.parameters})"
        )
        confirm = ConfirmResult(
            session_id=SESSION,
            confirmations=[Confirmation(call_id=call.call_id, confirmed=True)],
        )
        done = await _say(bus, confirm, f"confirm {call.call_id}")
        if not seen.answered(done, "the confirmed write"):
            return
        assert done.final is not None
        if done.final.finished_reason != "paused":
            return
        # The model asked for another call that needs a confirmation (a small
        # model often repeats the write it was allowed).
        record = await store.get(AGENT, SESSION)
        pending = record.state.reply.pending if record and record.state.reply else []
    seen.notes.append(
        f"the confirmed write: after {granted} confirmation(s) the model still asked for "
        "more calls that need one; the session stays paused (fleetbus confirm "
        f"{SESSION} --allow CALL_ID, or --deny)"
    )


def _verdict(seen: _Outcome) -> int:
    """0 when the fleet itself worked; what the model did differently is explained."""
    for note in seen.notes:
        console.print(f"[yellow]note[/] {note}")
    if seen.failures:
        for failure in seen.failures:
            console.print(f"[red]the fleet failed[/] {failure}")
        return 1
    if seen.notes:
        console.print(
            "[green]the fleet worked:[/] every message was answered by the agent's replicas; "
            "the notes above are choices of the model"
        )
    else:
        console.print("[green]the fleet worked:[/] every step went as expected")
    return 0


def _ask(text: str) -> UserRequest:
    return UserRequest(sender="demo", session_id=SESSION, content=text)


async def _wait_observed(store: SessionStore, text: str, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        record = await store.get(AGENT, SESSION)
        if record is not None and any(m.text == text for m in record.state.memory):
            return True
        await asyncio.sleep(0.05)
    return False


async def _show_sessions(store: SessionStore) -> None:
    table = Table(title="session journals in JetStream")
    for column in ("agent", "session", "status", "messages", "last answer"):
        table.add_column(column)
    for record in await store.records(AGENT):
        if record.session_id == "demo-ready":
            continue
        answer = str((record.final or {}).get("content", ""))
        table.add_row(
            record.agent,
            record.session_id,
            record.status,
            str(len(record.state.memory)),
            answer[:60],
        )
    console.print(table)
