"""Agents with a long-term memory on the bus, served by the memory tests
(``fleetbus agent tests.integration.memory_specs``).

Both reach the memory worker with an unbound ``BusMemory()``, which the host
binds to its bus: ``keeper`` in the static mode, ``chooser`` in the agent
mode. Their model, :class:`MemoryModel`, answers with what it was sent, so a
test sees it from outside the process:

- ``remember: FACT``: call ``record_to_memory`` with the fact;
- ``recall: WORDS``: call ``retrieve_from_memory`` with the words;
- after a tool call: ``tool said: <output> | offered: <tools> from <pid>``;
- anything else: ``hint: <the memory hint, or none> | offered: <tools> from <pid>``.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Sequence

from fleetbus.agents import Agent
from fleetbus.capabilities import BusMemory, Memory
from fleetbus.models import ModelRequest, ModelResponse
from fleetbus.models.model import ModelStreamItem
from fleetbus.protocol import TextBlock, ToolResultBlock, ToolUseBlock, Usage
from fleetbus.tools_workers import Toolkit

PID = os.getpid()
HINT = "<long_term_memory>"


class MemoryModel:
    """A deterministic model that reports the memory hint and tool results it was sent."""

    name = "memory-model"

    async def stream(self, request: ModelRequest) -> AsyncIterator[ModelStreamItem]:
        messages = request.messages
        hint = next((_text(m.content) for m in messages if HINT in _text(m.content)), None)
        asked = max(
            (
                i
                for i, m in enumerate(messages)
                if m.role == "user" and _text(m.content) and HINT not in _text(m.content)
            ),
            default=-1,
        )
        text = _text(messages[asked].content) if asked >= 0 else ""
        done = [
            b for m in messages[asked + 1 :] for b in m.content if isinstance(b, ToolResultBlock)
        ]
        offered = ",".join(sorted(s.name for s in request.tools))
        usage = Usage(input_tokens=1, output_tokens=1)
        if not done and text.startswith(("remember: ", "recall: ")):
            command, _, rest = text.partition(": ")
            call = (
                ToolUseBlock(id="m1", name="record_to_memory", input={"content": [rest]})
                if command == "remember"
                else ToolUseBlock(
                    id="m1", name="retrieve_from_memory", input={"keywords": rest.split()}
                )
            )
            yield ModelResponse(content=[call], usage=usage)
            return
        if done:
            answer = f"tool said: {' / '.join(str(b.output) for b in done)}"
        else:
            answer = f"hint: {hint if hint is not None else 'none'}"
        yield ModelResponse(
            content=[TextBlock(text=f"{answer} | offered: {offered} from {PID}")], usage=usage
        )


def _text(blocks: Sequence[object]) -> str:
    return "".join(b.text for b in blocks if isinstance(b, TextBlock))


def agents() -> list[Agent]:
    """``keeper`` (static mode) and ``chooser`` (agent mode), one memory worker for both."""
    return [
        Agent("keeper", "", MemoryModel(), toolkit=Toolkit(), capabilities=[Memory(BusMemory())]),
        Agent(
            "chooser",
            "",
            MemoryModel(),
            toolkit=Toolkit(),
            capabilities=[Memory(BusMemory(), mode="agent")],
        ),
    ]
