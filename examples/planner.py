"""A planner splits a task, delegates the parts to worker agents, and merges the answers.

Everything runs on an embedded nats-server started here: a tool worker serves
the built-in tools (calculator, current_time, files in a temporary directory),
and two agents are served on the bus by :class:`~fleetbus.AgentService`s:

- ``mathematician``, with the calculator;
- ``clerk``, with current_time and the file tools; writing a file needs a
  person's confirmation (a Permissions ``ask`` rule on ``write_file``).

Both reach the tools over the bus (``Toolkit.add_remote``). The planner splits
the task with a simple deterministic rule (at commas and "and"), routes each
part to a worker by keyword, asks them all at once through
:class:`~fleetbus.RemoteAgent` (each part its own session), confirms the
clerk's paused file write, and prints the merged report::

    python examples/planner.py
    python examples/planner.py "What is 2**10, and what time is it in Lisbon?"

The agents reason with the configured OpenAI-compatible model
(``FLEETBUS_MODEL`` with ``OPENAI_API_KEY`` or ``OPENAI_BASE_URL``), else with
the built-in offline model: deterministic, no network, no API key.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import re
import sys
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from fleetbus import (
    Agent,
    AgentService,
    Bus,
    EmbeddedServer,
    Permissions,
    RemoteAgent,
    ToolClient,
    Toolkit,
    ToolWorker,
)
from fleetbus.agents import SessionStore
from fleetbus.models import default_model, describe_default_model
from fleetbus.protocol import ContentBlock, FinalAnswer, TextBlock
from fleetbus.tools_workers.builtin import builtin_toolkit

DEFAULT_TASK = (
    "What is 1234 * 5678, what time is it in Tokyo, and save a note 'meeting at 3' to notes/plan.md"
)
TIMEOUT = 60.0
"""Seconds any one step (a start, a reply, a confirmation) may take."""
PLANNER = "planner"

WORKERS: dict[str, tuple[str, list[str]]] = {
    "mathematician": (
        "You are the fleet's mathematician. Use the calculator for every computation "
        "and answer with the result.",
        ["calculator"],
    ),
    "clerk": (
        "You are the fleet's clerk. Use current_time for times and dates, and the file "
        "tools for notes. Answer briefly.",
        ["current_time", "read_file", "write_file", "list_dir"],
    ),
}
"""Each worker agent: its system prompt and the remote tools it gets."""

# A separator (comma, "and") outside a quoted string; a quoted string is kept whole.
_SEPARATOR = re.compile(r"""(?<!\w)('[^']*'|"[^"]*")(?!\w)|,|\band\b""", re.I)
# Arithmetic, or a word that asks for it; else the time, a date, a note or a file.
_ARITHMETIC = r"\d\s*(?:\*\*|[-+*/^%\u00d7\u00f7])\s*\(?\s*\d|\b(?:calculate|compute)\b"
_CLERICAL = r"\b(?:time|date|clock|note|save|write|read|file|list)\b"
_ROUTES = (
    ("mathematician", re.compile(_ARITHMETIC, re.I)),
    ("clerk", re.compile(_CLERICAL, re.I)),
)
_FALLBACK = "clerk"

console = Console()


@dataclass
class Outcome:
    """What became of one subtask."""

    subtask: str
    worker: str
    answer: FinalAnswer | None = None
    reasons: list[str] = field(default_factory=list)
    """The ``finished_reason`` of each answer, a pause first if there was one."""


def split_task(task: str) -> list[str]:
    """The subtasks of ``task``: its parts between commas and "and"."""
    parts: list[str] = []
    start = 0
    for match in _SEPARATOR.finditer(task):
        if match.group(1) is None:
            parts.append(task[start : match.start()])
            start = match.end()
    parts.append(task[start:])
    return [cleaned for part in parts if (cleaned := part.strip(" \t\n.?!;:"))]


def route(subtask: str) -> str:
    """The worker a subtask goes to: the first whose keywords it mentions."""
    return next((worker for worker, words in _ROUTES if words.search(subtask)), _FALLBACK)


def text_of(content: str | list[ContentBlock]) -> str:
    """An answer's text."""
    if isinstance(content, str):
        return content
    return "\n".join(block.text for block in content if isinstance(block, TextBlock))


def model_note() -> None:
    """Say which model answers."""
    console.print(f"[dim]model: {describe_default_model()}[/]")


# -- the fleet ----------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def fleet(bus: Bus, files_root: Path) -> AsyncIterator[None]:
    """A tool worker and the worker agents, served on the bus until the block ends."""
    worker = ToolWorker(bus, builtin_toolkit(files_root=files_root), drain_timeout=5.0)
    async with asyncio.TaskGroup() as group:
        group.create_task(worker.run())
        services: list[AgentService] = []
        try:
            await worker.wait_ready(TIMEOUT)
            console.print(f"[dim]tool worker serving {', '.join(worker.toolkit.names)}[/]")
            for name, (prompt, tools) in WORKERS.items():
                toolkit = Toolkit()
                await toolkit.add_remote(ToolClient(bus, sender=f"agent.{name}"), tools)
                permissions = Permissions.from_strings(
                    ask=["write_file"] if name == "clerk" else []
                )
                agent = Agent(
                    name, prompt, default_model(), toolkit=toolkit, permissions=permissions
                )
                services.append(AgentService(bus, agent, drain_timeout=5.0))
                group.create_task(services[-1].run())
            for service in services:
                await service.wait_ready(TIMEOUT)
            for name, (_, tools) in WORKERS.items():
                console.print(f"[dim]serving agent {name} with remote tools {', '.join(tools)}[/]")
            yield
        finally:
            for service in services:
                service.stop()
            worker.stop()


# -- the planner --------------------------------------------------------------------------


async def delegate(bus: Bus, store: SessionStore, outcome: Outcome) -> None:
    """Ask the worker in a session of its own; confirm any call it pauses for."""
    remote = RemoteAgent(bus, outcome.worker, sender=PLANNER, timeout=TIMEOUT)
    answer = await remote.reply(outcome.subtask)
    outcome.reasons.append(answer.finished_reason)
    while answer.finished_reason == "paused":
        record = await store.get(outcome.worker, remote.session_id)
        reply = record.state.reply if record is not None else None
        if reply is None or not reply.pending:
            break
        call = reply.pending[0]
        arguments = json.dumps(call.parameters, ensure_ascii=False)
        console.print(
            f"[yellow]{outcome.worker} paused: it asks to run {call.tool_name}"
            f"({escape(arguments)}) (rule {call.rule!r}). A human would be asked here; "
            f"the planner allows it.[/]"
        )
        answer = await remote.confirm(call.call_id, allow=True)
        outcome.reasons.append(answer.finished_reason)
    outcome.answer = answer


async def plan(url: str, task: str, files_root: Path) -> list[Outcome]:
    """Serve the fleet, delegate every subtask at once, and return what came back."""
    bus = await Bus.connect(url, prefix="planner", name=PLANNER, timeout=TIMEOUT)
    try:
        async with fleet(bus, files_root):
            store = await SessionStore.open(bus, owner=PLANNER)
            outcomes = [Outcome(subtask, route(subtask)) for subtask in split_task(task)]
            console.print()
            for number, outcome in enumerate(outcomes, 1):
                console.print(f"subtask {number} → [bold]{outcome.worker}[/]: {outcome.subtask}")
            async with asyncio.TaskGroup() as group:
                for outcome in outcomes:
                    group.create_task(delegate(bus, store, outcome))
    finally:
        await bus.close()
    return outcomes


def report(task: str, outcomes: list[Outcome]) -> bool:
    """Print the merged report; ``True`` when every subtask completed."""
    table = Table(title=f"Report: {escape(task)}", show_lines=True)
    table.add_column("#", justify="right")
    table.add_column("subtask", overflow="fold")
    table.add_column("worker")
    table.add_column("answer", overflow="fold")
    table.add_column("finished_reason")
    ok = True
    for number, outcome in enumerate(outcomes, 1):
        answer = text_of(outcome.answer.content) if outcome.answer is not None else "(none)"
        done = outcome.answer is not None and outcome.answer.finished_reason == "completed"
        ok = ok and done
        style = "green" if done else "red"
        table.add_row(
            str(number),
            escape(outcome.subtask),
            outcome.worker,
            escape(answer),
            f"[{style}]{' → '.join(outcome.reasons)}[/]",
        )
    console.print()
    console.print(table)
    return ok


def show_files(files_root: Path) -> None:
    """What the workers wrote."""
    for path in sorted(p for p in files_root.rglob("*") if p.is_file()):
        text = path.read_text(errors="replace")
        console.print(f"{path.relative_to(files_root)} now holds: {escape(text)!r}")


def main() -> int:
    """Run the planner; exit 0 when every subtask completed."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("task", nargs="?", default=DEFAULT_TASK, help="what to get done")
    task = parser.parse_args().task
    model_note()
    with tempfile.TemporaryDirectory(prefix="fleetbus-planner-") as tmp:
        files_root = Path(tmp)
        with EmbeddedServer() as server:
            pid = server.pid
            console.print(f"[dim]started nats-server (pid {pid}) on {server.url}[/]")
            outcomes = asyncio.run(plan(server.url, task, files_root))
            ok = report(task, outcomes)
            show_files(files_root)
        console.print(f"stopped nats-server (pid {pid})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
