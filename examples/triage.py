"""A support desk on the bus: triage hands each conversation to billing or
refunds, and guardrails stop what must not go through.

The agents are those of ``examples/triage.toml``, each served by its own
:class:`~fleetbus.AgentService` on an embedded nats-server; each question is
asked of ``triage`` through a :class:`~fleetbus.RemoteAgent` and its reply is
streamed as ``fleetbus ask`` prints it — the hand-over, then the other desk's
answer, in one stream::

    python examples/triage.py
    python examples/triage.py "I want my money back for order 7"

The agents reason with the configured OpenAI-compatible model
(``FLEETBUS_MODEL`` with ``OPENAI_API_KEY`` or ``OPENAI_BASE_URL``), else with
the built-in offline model, which hands a conversation over when the question
names a desk's words ("invoice", "charge", "money"...). The same fleet runs as
processes with ``fleetbus agent examples/triage.toml`` (see the file).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from rich.console import Console

from fleetbus import AgentService, Bus, EmbeddedServer, RemoteAgent
from fleetbus.cli.fleet_file import bind_guardrails, load_agents
from fleetbus.cli.render import ReplyPrinter
from fleetbus.models import describe_default_model
from fleetbus.protocol import FinalAnswer

FLEET = Path(__file__).with_name("triage.toml")
QUESTIONS = (
    "My invoice 1042 has the same charge twice: what is 19.99 * 2?",
    "I want my money back for order 7.",
    "Please check the payment of card 4111 1111 1111 1111.",
)
TIMEOUT = 300.0
"""Seconds a question may take (a local model on a CPU is slow)."""

console = Console()


async def ask_all(url: str, questions: list[str]) -> list[str]:
    """Serve the fleet, ask each question in a session of its own; how each ended."""
    bus = await Bus.connect(url, prefix="triage", name="triage-example")
    ended: list[str] = []
    try:
        agents = load_agents(str(FLEET))
        bind_guardrails(agents, bus)
        services = [AgentService(bus, agent) for agent in agents]
        async with asyncio.TaskGroup() as group:
            for service in services:
                group.create_task(service.run())
            try:
                for service in services:
                    await service.wait_ready(30.0)
                names = ", ".join(a.name for a in agents)
                console.print(f"[dim]serving {names} from {FLEET.name}[/]")
                for number, question in enumerate(questions, 1):
                    ended.append(await ask(bus, f"desk-{number}", question))
            finally:
                for service in services:
                    service.stop()
    finally:
        await bus.close()
    return ended


async def ask(bus: Bus, session: str, question: str) -> str:
    """Ask triage one question and print its reply as it streams; how it ended."""
    console.rule(f"[bold]{question}")
    printer = ReplyPrinter(console, session_id=session)
    remote = RemoteAgent(bus, "triage", session_id=session, timeout=TIMEOUT)
    answer: FinalAnswer | None = None
    async for item in remote.reply_stream(question):
        printer.handle(item)
        if isinstance(item, FinalAnswer):
            answer = item
    printer.close()
    assert answer is not None
    who = answer.sender.removeprefix("agent.")
    console.print(f"[dim]answered by {who}: {answer.finished_reason}[/]")
    return f"{who}:{answer.finished_reason}"


def main() -> int:
    """Ask the questions; exit 0 when each reply ended as a desk meant it to."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("questions", nargs="*", help="what to ask (three examples by default)")
    args = parser.parse_args()
    console.print(f"[dim]model: {describe_default_model()}[/]")
    with EmbeddedServer() as server:
        pid = server.pid
        console.print(f"[dim]started nats-server (pid {pid}) on {server.url}[/]")
        ended = asyncio.run(ask_all(server.url, args.questions or list(QUESTIONS)))
    console.print(f"[dim]stopped nats-server (pid {pid})[/]")
    return 0 if all(e.split(":")[1] != "error" for e in ended) else 1


if __name__ == "__main__":
    sys.exit(main())
