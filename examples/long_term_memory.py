"""Long-term memory: what a user said in one session, the agent knows in the next.

Ann tells the agent a fact on Monday; on Tuesday, in a new session (a new
conversation, nothing of Monday in it), she asks about it. The agent's
long-term memory — SQLite with full-text search, in a temporary folder —
carries the fact over; Bob, another user, does not get Ann's memory::

    python examples/long_term_memory.py                # static mode
    python examples/long_term_memory.py --mode agent   # the model records and searches
    python examples/long_term_memory.py --mode both

In the static mode the memory is searched with each input before the reply,
and what it finds is shown to the model as a hint (printed below: what the
model was sent); the exchange is recorded after the reply. In the agent mode
the model gets ``record_to_memory`` and ``retrieve_from_memory`` and decides.
Everything runs in this process with a rule-following stand-in for a model
(a :class:`~fleetbus.testing.ScriptedModel` turn): no network, no API key;
with ``FLEETBUS_MODEL`` set, that model answers instead (what it was sent is
then not printed).

On the bus, the memory is a worker that every replica of the agent shares,
and it keeps what it learned across restarts::

    fleetbus server &
    FLEETBUS_MEMORY_DB=./memory.db fleetbus worker fleetbus.tools_workers.memory &
    fleetbus agent examples.long_term_memory:served --replicas 2 &
    fleetbus ask rememberer "My sister's name is Clara."
    fleetbus ask rememberer "What is my sister's name?"    # a new session, any replica

``served`` keys its memory by agent (``scope="agent"``) because ``fleetbus
ask`` names no user; a program names one with
``UserRequest(metadata={"user_id": …})`` and keeps the default ``user`` scope.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import tempfile
from pathlib import Path
from typing import get_args

from fleetbus import Agent
from fleetbus.capabilities import (
    BusMemory,
    LongTermMemory,
    LongTermMemoryConfig,
    LongTermMemoryMode,
    Memory,
)
from fleetbus.models import ModelRequest, ModelResponse, default_model
from fleetbus.protocol import ChatMessage, TextBlock, ToolResultBlock, UserRequest
from fleetbus.testing import ScriptedModel
from fleetbus.tools_workers.memory import SQLiteMemory

HINT = "<long_term_memory>"
_WORD = re.compile(r"[a-z]{3,}")
_PREFIXES = re.compile(r"^(\d+\. |user: |assistant: |The user said: |You told me before: )+")
"""How the lines of what memory returns start (its numbering, who spoke)."""
_COMMON = {"what", "the", "and", "you", "your", "who", "how", "name", "told", "user", "assistant"}


def _text(message: ChatMessage) -> str:
    return "".join(b.text for b in message.content if isinstance(b, TextBlock))


def _words(text: str) -> set[str]:
    return set(_WORD.findall(text.lower())) - _COMMON


def _best(question: str, lines: list[str]) -> str | None:
    """The line sharing the most words with the question, if any shares one."""
    scored = [(len(_words(question) & _words(line)), line) for line in lines]
    score, line = max(scored, default=(0, ""))
    return line if score else None


def think(request: ModelRequest) -> ModelResponse | str:
    """A stand-in for a model: note statements, answer questions from memory."""
    messages = request.messages
    hint = next((_text(m) for m in messages if HINT in _text(m)), "")
    asked = max(
        (i for i, m in enumerate(messages) if m.role == "user" and HINT not in _text(m)),
        default=-1,
    )
    said = _text(messages[asked]) if asked >= 0 else ""
    results = [
        b for m in messages[asked + 1 :] for b in m.content if isinstance(b, ToolResultBlock)
    ]
    tools = {spec.name for spec in request.tools}
    question = said.rstrip().endswith("?")
    if not results and question and "retrieve_from_memory" in tools:
        return ScriptedModel.call("retrieve_from_memory", {"keywords": sorted(_words(said))})
    if not results and not question and "record_to_memory" in tools:
        return ScriptedModel.call("record_to_memory", {"content": [f"The user said: {said}"]})
    if not question:
        return "Noted, I will remember that."
    found = [str(r.output) for r in results] + [hint]
    lines = [_PREFIXES.sub("", line) for text in found for line in text.splitlines()]
    facts = [x for x in lines if x and not x.endswith("?") and not x.startswith("Noted")]
    fact = _best(said, facts)
    return f"You told me before: {fact}" if fact else "I do not know that yet."


def agent(memory: LongTermMemory, mode: LongTermMemoryMode = "static") -> Agent:
    """The agent, with ``memory`` used in ``mode``."""
    model = default_model(otherwise=ScriptedModel([think], repeat_last=True))
    return Agent(
        "rememberer",
        "You help, and remember what users tell you.",
        model,
        capabilities=[Memory(memory, mode=mode)],
    )


def served() -> Agent:
    """The agent served by ``fleetbus agent examples.long_term_memory:served``:
    the memory worker on the bus, one memory for every asker (``fleetbus ask``
    names no user)."""
    model = default_model(otherwise=ScriptedModel([think], repeat_last=True))
    return Agent(
        "rememberer",
        "You help, and remember what users tell you.",
        model,
        capabilities=[Memory(BusMemory(), mode="both", config=LongTermMemoryConfig(scope="agent"))],
    )


async def main(mode: LongTermMemoryMode) -> None:
    with tempfile.TemporaryDirectory() as folder:
        store = SQLiteMemory(Path(folder) / "memory.db")
        definition = agent(store, mode)
        model = definition.model
        recorded = model if isinstance(model, ScriptedModel) else None
        print(f"long-term memory: {store.path} ({mode} mode, model {model.name})")
        for user, session, text in [
            ("ann", "monday", "My sister's name is Clara and she lives in Porto."),
            ("ann", "tuesday", "What is my sister's name?"),
            ("bob", "wednesday", "What is my sister's name?"),
        ]:
            sent = len(recorded.requests) if recorded is not None else 0
            request = UserRequest(content=text, session_id=session, metadata={"user_id": user})
            # A fresh session each time: nothing of the earlier ones in its conversation.
            answer = await definition.clone().reply(request)
            print(f"\n[{session}] {user}: {text}")
            calls = recorded.requests[sent:] if recorded is not None else []
            for message in calls[0].messages if calls else []:
                if HINT in _text(message):
                    shown = _text(message).replace("\n", "\n    ")
                    print(f"  the model was sent (with each of its {len(calls)} call(s)): {shown}")
            for block in (b for m in calls[-1:] for c in m.messages for b in c.content):
                if isinstance(block, ToolResultBlock):
                    output = str(block.output).replace("\n", "\n    ")
                    print(f"  {block.name} -> {output}")
            print(f"[{session}] rememberer: {answer.content}")
        store.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=get_args(LongTermMemoryMode), default="static")
    asyncio.run(main(parser.parse_args().mode))
