"""The fleet part of ``fleetbus demo``: an agent with two replicas converses,
uses the tool workers, observes a broadcast, and pauses for a confirmation
that the demo grants — shown live."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from pathlib import Path

from rich.table import Table

from fleetbus.agents.serving.sessions import SessionStore
from fleetbus.bus import Bus
from fleetbus.cli._common import console
from fleetbus.cli.demo_fleet import describe_model
from fleetbus.cli.fleet import stream_reply
from fleetbus.cli.render import ReplyPrinter
from fleetbus.errors import FleetbusError
from fleetbus.protocol import (
    AgentMessage,
    Confirmation,
    ConfirmResult,
    ErrorMessage,
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
            await _wait_for_agent(bus)
        console.print(
            f"agent [bold]{AGENT}[/]: 2 replica processes in queue group agent.{AGENT}, "
            f"sessions in JetStream KV; model: [bold]{describe_model()}[/]"
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


async def _wait_for_agent(bus: Bus, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            reply = await bus.request(
                bus.subjects.agent_inbox(AGENT),
                UserRequest(content="ping", session_id="demo-ready"),
                timeout=10,
                attempts=1,
            )
        except FleetbusError:
            await asyncio.sleep(0.2)
            continue
        if isinstance(reply, FinalAnswer):
            return
    raise FleetbusError(f"the agent did not come up within {timeout:g}s")


async def _say(bus: Bus, message: Message, label: str) -> FinalAnswer | None:
    console.print(f"\n[bold cyan]you[/] {label}")
    printer = ReplyPrinter(console, session_id=SESSION)
    outcome = await stream_reply(bus, AGENT, SESSION, message, on_item=printer.handle, timeout=60)
    printer.close()
    if isinstance(outcome, ErrorMessage):
        console.print(f"[red]{outcome.code}: {outcome.message}[/]")
        return None
    return outcome


async def _conversation(bus: Bus) -> int:
    ok = True
    first = await _say(bus, _ask("What is 2026 - 1991?"), "What is 2026 - 1991?")
    ok &= first is not None and first.finished_reason == "completed"

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
    ok &= observed

    text = "What time is it in Tokyo, and what is 12 * 12?"
    second = await _say(bus, _ask(text), text)
    ok &= second is not None and second.finished_reason == "completed"

    text = "Write 'the demo ran' to notes/demo.md"
    paused = await _say(bus, _ask(text), text)
    ok &= paused is not None and paused.finished_reason == "paused"
    record = await store.get(AGENT, SESSION)
    pending = record.state.reply.pending if record and record.state.reply else []
    if pending:
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
        ok &= done is not None and done.finished_reason == "completed"
    else:
        ok = False
    await _show_sessions(store)
    return 0 if ok else 1


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
    table = Table(title="sessions in JetStream KV")
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
