"""A help desk agent that answers from a folder of documents, with their sources.

The agent is given a knowledge base: the folder ``examples/knowledge`` (text
and Markdown files), cut into passages and indexed with SQLite FTS5 by
:class:`~fleetbus.tools_workers.knowledge.KnowledgeIndex`. Before it
reasons, the agent searches it with the question; the passages found are put
before the model with their sources (file, lines, headings), and the final
answer lists those sources::

    python examples/knowledge_base.py
    python examples/knowledge_base.py "Can I return a sale item after three weeks?"
    python examples/knowledge_base.py --show-prompt "How long is a reset link valid?"

It runs offline: the model is a stand-in (a ``ScriptedModel`` that answers
with the best passage it was shown), so what you see is what retrieval
found. With ``FLEETBUS_MODEL`` set (README: a model string, a local model
included), that model reads the passages and answers from them.

On the bus, the folder is served by a tool worker and the agent reaches it
through its tool (any number of agents and replicas share one index)::

    fleetbus server &
    FLEETBUS_KNOWLEDGE_DIR=examples/knowledge fleetbus worker fleetbus.tools_workers.knowledge &
    fleetbus agent examples.knowledge_base:helpdesk --no-remote-tools &
    fleetbus ask helpdesk "Do you ship to Canada?" --json

``helpdesk`` (below) is the same agent with a ``BusKnowledgeBase``, which
uses the bus of the host serving it. ``--no-remote-tools`` keeps the search
tool itself from the model; without it, the model may also search by itself.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import sys
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from fleetbus.agents import Agent
from fleetbus.capabilities import BusKnowledgeBase, Knowledge, KnowledgeBase
from fleetbus.models import ModelRequest, default_model
from fleetbus.protocol import TextBlock
from fleetbus.testing import ScriptedModel
from fleetbus.tools_workers.knowledge import KnowledgeIndex

FOLDER = Path(__file__).resolve().parent / "knowledge"

QUESTIONS = (
    "How many days do I have to return an item?",
    "How do I reset my password?",
    "Do you ship to Canada?",
    "Is the shop open on Sunday?",
)

SYSTEM_PROMPT = (
    "You are the help desk of a small shop. Answer from the passages of the shop's "
    "documents you are given, and say which document each fact comes from."
)


def answer_from_passages(request: ModelRequest) -> str:
    """The stand-in model: the first sentences of the best passage shown, and its source."""
    for message in request.messages:
        text = "".join(b.text for b in message.content if isinstance(b, TextBlock))
        if not text.startswith("<knowledge>") or "\n[1] " not in text:
            continue
        best = text.split("\n[1] ", 1)[1].split("\n[2] ", 1)[0].removesuffix("\n</knowledge>")
        header, _, passage = best.partition("\n")
        source = header.rsplit(", score ", 1)[0]
        body = " ".join(line for line in passage.splitlines() if not line.startswith("#"))
        sentences = re.split(r"(?<=[.!?])\s+", body.strip())
        return f"{' '.join(sentences[:2])} (from {source})"
    return "I found nothing about that in the shop's documents."


def agent(knowledge: KnowledgeBase) -> Agent:
    """The help desk, with the stand-in model."""
    stand_in = ScriptedModel([answer_from_passages], repeat_last=True, name="passage-reader")
    model = default_model(otherwise=stand_in)  # FLEETBUS_MODEL's, when set
    return Agent("helpdesk", SYSTEM_PROMPT, model, capabilities=[Knowledge([knowledge])])


def helpdesk() -> Agent:
    """The help desk served by ``fleetbus agent``: the folder is the knowledge
    worker's tool (``FLEETBUS_KNOWLEDGE_DIR=examples/knowledge fleetbus worker
    fleetbus.tools_workers.knowledge``)."""
    return agent(BusKnowledgeBase())


async def main(questions: list[str], show_prompt: bool) -> int:
    console = Console()
    index = KnowledgeIndex(FOLDER)
    stats = await asyncio.to_thread(index.refresh)
    console.print(f"indexed {stats.chunks} passages of {stats.files} files in {FOLDER}")
    desk = agent(index)
    model = desk.model
    recorded = model if isinstance(model, ScriptedModel) else None
    if show_prompt and recorded is None:
        console.print(
            "[dim]--show-prompt shows what the stand-in model was sent; unset FLEETBUS_MODEL[/]"
        )
    for question in questions:
        seen = len(recorded.requests) if recorded is not None else 0
        final = await desk.reply(question)
        console.print(f"\n[bold]Q:[/] {escape(question)}")
        console.print(f"[bold]A:[/] {escape(str(final.content))}")
        console.print(f"[dim]sources: {escape(', '.join(final.sources) or 'none')}[/]")
        if show_prompt and recorded is not None:
            for message in recorded.requests[seen].messages:
                text = "".join(b.text for b in message.content if isinstance(b, TextBlock))
                console.print(f"[dim]--- {message.role}:[/]\n{escape(text)}")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("question", nargs="*", help="questions to ask (default: a few examples)")
    parser.add_argument(
        "--show-prompt", action="store_true", help="print what the model was sent for each"
    )
    args = parser.parse_args()
    sys.exit(asyncio.run(main(args.question or list(QUESTIONS), args.show_prompt)))
