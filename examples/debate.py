"""Three agents debate a topic in a MsgHub; what one says, the others hear.

An optimist, a skeptic and a moderator get the same announcement, then take
turns for a few rounds. Each answer is broadcast to the other two, so every
turn answers what was said before. By default each agent is served on the bus
by its own :class:`~fleetbus.AgentService` on an embedded nats-server, and the
hub talks to them through :class:`~fleetbus.RemoteAgent` clients: every
announcement, turn and broadcast is a NATS request. ``--local`` runs the same
debate with local agents, ``--processes`` serves each agent from its own OS
process::

    python examples/debate.py
    python examples/debate.py "Cities should ban cars from their centres" --rounds 3
    python examples/debate.py --local
    python examples/debate.py --processes

The agents reason with the configured OpenAI-compatible model
(``FLEETBUS_MODEL`` with ``OPENAI_API_KEY`` or ``OPENAI_BASE_URL``), else with
the built-in offline model: deterministic, no network, no API key, which
argues the stance its system prompt gives it ("You argue that …") and answers
the last speaker by name.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
import threading
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from fleetbus import Agent, AgentService, Bus, EmbeddedServer, MsgHub, RemoteAgent
from fleetbus.agents import AgentSettings, Participant
from fleetbus.models import default_model, describe_default_model
from fleetbus.protocol import AgentMessage, ContentBlock, TextBlock

DEFAULT_TOPIC = "AI assistants will make software engineers more productive"
SPEAKERS = ("optimist", "skeptic", "moderator")
HOST = "host"
READY = "ready"
"""What a serving child process prints once its agent listens."""
TIMEOUT = 60.0
"""Seconds any one step (a turn, a start, a stop) may take."""

console = Console()


def system_prompts(topic: str) -> dict[str, str]:
    """Each debater's system prompt: who it is and the stance it argues."""
    return {
        "optimist": f"You are Olivia, an optimist in a debate. You argue that {topic}.",
        "skeptic": (
            f"You are Sam, a skeptic in a debate. "
            f"You argue that the evidence does not yet show that {topic}."
        ),
        "moderator": (
            "You are Maya, the moderator of a debate. You hold that both sides have a point "
            "and that careful measurement should settle it."
        ),
    }


def build_agent(name: str, topic: str) -> Agent:
    """One debater, reasoning with the default model (see the module docstring)."""
    return Agent(
        name, system_prompts(topic)[name], default_model(), settings=AgentSettings(max_iters=3)
    )


def model_note() -> None:
    """Say which model answers."""
    console.print(f"[dim]model: {describe_default_model()}[/]")


def text_of(content: str | list[ContentBlock]) -> str:
    """An answer's text."""
    if isinstance(content, str):
        return content
    return "\n".join(block.text for block in content if isinstance(block, TextBlock))


# -- the debate ---------------------------------------------------------------------------


async def debate(participants: Sequence[Participant], topic: str, rounds: int) -> bool:
    """Run the debate, printing each statement as it comes; ``True`` if all went well."""
    text = (
        f"Welcome to the debate: {topic}. Each of you states a position, "
        "then answers what the others said."
    )
    # From a named host, so every debater hears the same message, local or remote.
    announcement = AgentMessage(sender=HOST, name=HOST, content=[TextBlock(text=text)], reply=False)
    console.rule(f"[bold]{escape(topic)}")
    console.print(f"[bold]{HOST}:[/] {escape(text)}")
    ok = True
    async with MsgHub(participants, announcement=announcement) as hub:
        for round_no in range(1, rounds + 1):
            console.print(f"\n[bold underline]Round {round_no}[/]")
            for speaker in participants:
                answer = await asyncio.wait_for(hub.speak(speaker), TIMEOUT)
                style = {"optimist": "green", "skeptic": "red"}.get(speaker.name, "cyan")
                console.print(f"[bold {style}]{speaker.name}:[/] {escape(text_of(answer.content))}")
                if answer.finished_reason != "completed":
                    console.print(f"[red]  (the reply ended {answer.finished_reason})[/]")
                    ok = False
    summary = Table(title="Who said how much")
    for column in ("speaker", "statements", "words", "characters"):
        summary.add_column(column, justify="left" if column == "speaker" else "right")
    for speaker in participants:
        said = [text for who, text in hub.transcript if who == speaker.name]
        words = sum(len(text.split()) for text in said)
        summary.add_row(speaker.name, str(len(said)), str(words), str(sum(map(len, said))))
    console.print()
    console.print(summary)
    return ok


# -- serving the agents on the bus ----------------------------------------------------------


@contextlib.asynccontextmanager
async def services_in_process(bus: Bus, topic: str) -> AsyncIterator[None]:
    """Serve every debater from this process, each its own AgentService."""
    services = [AgentService(bus, build_agent(name, topic)) for name in SPEAKERS]
    async with asyncio.TaskGroup() as group:
        for service in services:
            group.create_task(service.run())
        try:
            for service in services:
                await service.wait_ready(TIMEOUT)
            console.print(f"[dim]serving {', '.join(SPEAKERS)} as AgentServices (in-process)[/]")
            yield
        finally:
            for service in services:
                service.stop()


@contextlib.asynccontextmanager
async def services_in_processes(url: str, prefix: str, topic: str) -> AsyncIterator[None]:
    """Serve every debater from its own OS process (this script with ``--serve``).

    A child stops when its stdin closes: here, or when this process dies.
    """
    children: list[asyncio.subprocess.Process] = []
    try:
        for name in SPEAKERS:
            child = await asyncio.create_subprocess_exec(
                sys.executable,
                __file__,
                topic,
                "--serve",
                name,
                "--nats",
                url,
                "--prefix",
                prefix,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
            )
            children.append(child)
        for name, child in zip(SPEAKERS, children, strict=True):
            assert child.stdout is not None
            line = await asyncio.wait_for(child.stdout.readline(), TIMEOUT)
            if line.decode().strip() != READY:
                raise RuntimeError(f"the process serving {name} did not start")
            console.print(f"[dim]serving {name} as an AgentService in process {child.pid}[/]")
        yield
    finally:
        for child in children:
            if child.stdin is not None:
                child.stdin.close()
        for child in children:
            try:
                await asyncio.wait_for(child.wait(), TIMEOUT)
            except TimeoutError:
                child.kill()
                await child.wait()
            console.print(f"stopped the agent process {child.pid} (exit {child.returncode})")


async def serve_one(name: str, topic: str, url: str, prefix: str) -> None:
    """The child's side of ``--processes``: serve one debater until stdin closes."""
    loop = asyncio.get_running_loop()
    bus = await Bus.connect(url, prefix=prefix, name=f"debate-{name}", timeout=TIMEOUT)
    try:
        service = AgentService(bus, build_agent(name, topic), drain_timeout=5.0)
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, service.stop)

        def wait_for_eof() -> None:
            sys.stdin.read()
            loop.call_soon_threadsafe(service.stop)

        threading.Thread(target=wait_for_eof, daemon=True).start()
        async with asyncio.TaskGroup() as group:
            group.create_task(service.run())
            await service.wait_ready(TIMEOUT)
            print(READY, flush=True)
    finally:
        await bus.close()


async def over_the_bus(url: str, args: argparse.Namespace) -> bool:
    """The debate with every agent served on the bus, driven through RemoteAgents."""
    prefix = "debate"
    bus = await Bus.connect(url, prefix=prefix, name=HOST, timeout=TIMEOUT)
    try:
        async with AsyncExitStack() as stack:
            if args.processes:
                await stack.enter_async_context(services_in_processes(url, prefix, args.topic))
            else:
                await stack.enter_async_context(services_in_process(bus, args.topic))
            debaters = [RemoteAgent(bus, name, timeout=TIMEOUT) for name in SPEAKERS]
            return await debate(debaters, args.topic, args.rounds)
    finally:
        await bus.close()


# -- the command line ---------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("topic", nargs="?", default=DEFAULT_TOPIC, help="what to debate")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of turns (default 2)")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--local", action="store_true", help="local agents, no bus")
    mode.add_argument(
        "--processes", action="store_true", help="serve each agent from its own OS process"
    )
    mode.add_argument("--serve", metavar="NAME", choices=SPEAKERS, help=argparse.SUPPRESS)
    parser.add_argument("--nats", help=argparse.SUPPRESS)
    parser.add_argument("--prefix", default="debate", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    args.topic = args.topic.strip().rstrip(".!?") or DEFAULT_TOPIC
    return args


def main() -> int:
    """Run the debate; exit 0 when every turn completed."""
    args = parse_args()
    if args.serve:
        asyncio.run(serve_one(args.serve, args.topic, args.nats, args.prefix))
        return 0
    model_note()
    if args.local:
        console.print("[dim]local agents, in this process, no bus[/]")
        agents = [build_agent(name, args.topic) for name in SPEAKERS]
        ok = asyncio.run(debate(agents, args.topic, args.rounds))
    else:
        with EmbeddedServer() as server:
            pid = server.pid
            console.print(f"[dim]started nats-server (pid {pid}) on {server.url}[/]")
            ok = asyncio.run(over_the_bus(server.url, args))
        console.print(f"stopped nats-server (pid {pid})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
