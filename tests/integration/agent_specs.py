"""Agents that the agent-process tests serve (``fleetbus agent
tests.integration.agent_specs:NAME``).

Their model, :class:`CommandModel`, follows commands in the user's text so a
test can script a reply from outside the process:

- ``tool NAME {json}`` (several, separated by ``;``): call the tools in turn,
  one per step;
- ``sleep S``: take S seconds over the next model call (a slow model);
- anything else: answer ``echo <text> from <pid>``; after tool calls, answer
  ``done <outputs> from <pid>``; ``heard?`` answers with every observed text.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator, Iterator, Sequence

from fleetbus.agents import Agent, AgentSettings, Permissions
from fleetbus.models import ModelRequest, ModelResponse
from fleetbus.models.model import ModelStreamItem
from fleetbus.protocol import TextBlock, ToolResultBlock, ToolUseBlock, Usage
from fleetbus.tools_workers import Toolkit

PID = os.getpid()


class CommandModel:
    """A deterministic model driven by commands in the user's text."""

    name = "command-model"

    async def stream(self, request: ModelRequest) -> AsyncIterator[ModelStreamItem]:
        user_index = max(
            (i for i, m in enumerate(request.messages) if m.role == "user" and _text(m.content)),
            default=-1,
        )
        text = _text(request.messages[user_index].content) if user_index >= 0 else ""
        since = request.messages[user_index + 1 :]
        done = [b for m in since for b in m.content if isinstance(b, ToolResultBlock)]
        commands = [c.strip() for c in text.split(";") if c.strip()]
        tools = [c for c in commands if c.startswith("tool ")]
        for command in commands:
            if command.startswith("sleep "):
                await asyncio.sleep(float(command.split()[1]))
        if len(done) < len(tools):
            _, name, *rest = tools[len(done)].split(" ", 2)
            arguments = json.loads(rest[0]) if rest else {}
            step = sum(1 for m in request.messages if m.role == "assistant")
            block = ToolUseBlock(id=f"t{step}", name=name, input=arguments)
            yield ModelResponse(content=[block], usage=Usage(input_tokens=1, output_tokens=1))
            return
        if tools:
            outputs = ", ".join(f"{b.name}={b.output}" for b in done)
            answer = f"done {outputs} from {PID}"
        elif text.strip() == "heard?":
            heard = [
                _text(m.content)
                for m in request.messages[:user_index]
                if m.role == "user" and _text(m.content)
            ]
            answer = "heard: " + " | ".join(heard)
        else:
            answer = f"echo {text} from {PID}"
        yield ModelResponse(
            content=[TextBlock(text=answer)], usage=Usage(input_tokens=1, output_tokens=1)
        )


def _text(blocks: Sequence[object]) -> str:
    return "".join(b.text for b in blocks if isinstance(b, TextBlock))


def echo() -> Agent:
    """An agent with only remote tools (added from the bus by ``fleetbus agent``)."""
    return Agent(
        "echo", "", CommandModel(), toolkit=Toolkit(), settings=AgentSettings(max_iters=10)
    )


def careful() -> Agent:
    """Asks before any call of ``record``."""
    return Agent(
        "careful",
        "",
        CommandModel(),
        toolkit=Toolkit(),
        permissions=Permissions.from_strings(ask=["record"]),
    )


class Crowd:
    """``c0000`` … : a population (an ``AgentSource``) of agents built on
    demand, each with the :class:`CommandModel`; ``FLEETBUS_TEST_CROWD`` sets
    its size (default 1,000)."""

    name = "crowd"

    def __init__(self, size: int) -> None:
        self.size = size
        self._model = CommandModel()

    def __len__(self) -> int:
        return self.size

    def __iter__(self) -> Iterator[str]:
        return (crowd_member(i) for i in range(self.size))

    def __contains__(self, name: object) -> bool:
        if not isinstance(name, str) or len(name) != 5 or not name.startswith("c"):
            return False
        return name[1:].isdigit() and int(name[1:]) < self.size

    def agent(self, name: str) -> Agent:
        return Agent(
            name,
            f"You are {name}.",
            self._model,
            toolkit=Toolkit(),
            settings=AgentSettings(max_iters=3),
        )


def crowd_member(index: int) -> str:
    """The name of the crowd's agent ``index``."""
    return f"c{index:04d}"


crowd = Crowd(int(os.environ.get("FLEETBUS_TEST_CROWD", "1000")))
"""The population served by ``fleetbus agent tests.integration.agent_specs:crowd``."""
