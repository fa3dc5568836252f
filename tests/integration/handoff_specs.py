"""Agents for the handoff process tests (``fleetbus agent
tests.integration.handoff_specs:triage`` / ``:billing``).

- ``triage`` hands every conversation to ``billing`` (``transfer_to_billing``).
- ``billing`` calls its own tool ``ledger`` (in its process) with the last
  user message, then answers ``billing: <that message>``. ``ledger`` notes
  each run in the file ``$HANDOFF_RUNS`` and takes ``$HANDOFF_LEDGER_S``
  seconds (1 by default), long enough to kill the replica running it.
- ``HANDOFF_DIE_DIR`` in a triage replica's environment makes it SIGKILL
  itself once, right before it appends the end of a reply it handed over
  (the handoff is decided and saved with its step, not yet stored as the
  reply's end nor sent on).
"""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path
from typing import Any

from fleetbus.agents import Agent
from fleetbus.bus.journal import Journal
from fleetbus.capabilities import Handoffs
from fleetbus.models import ModelRequest, ModelResponse
from fleetbus.protocol import TextBlock, ToolResultBlock, ToolUseBlock
from fleetbus.testing import ScriptedModel
from fleetbus.tools_workers import Toolkit, tool

RUNS_ENV = "HANDOFF_RUNS"
LEDGER_ENV = "HANDOFF_LEDGER_S"
DIE_ENV = "HANDOFF_DIE_DIR"


def _last_user_text(request: ModelRequest) -> tuple[str, int]:
    for index in range(len(request.messages) - 1, -1, -1):
        message = request.messages[index]
        text = "".join(b.text for b in message.content if isinstance(b, TextBlock))
        if message.role == "user" and text:
            return text, index
    return "", -1


def _billing_turn(request: ModelRequest) -> ModelResponse:
    text, index = _last_user_text(request)
    done = [
        b
        for m in request.messages[index + 1 :]
        for b in m.content
        if isinstance(b, ToolResultBlock) and b.name == "ledger"
    ]
    if not done:
        return ModelResponse(content=[ToolUseBlock(id="", name="ledger", input={"text": text})])
    return ModelResponse(content=[TextBlock(text=f"billing: {text}")])


@tool
async def ledger(text: str) -> str:
    """Look the customer up in the ledger.

    Args:
        text: what the customer said.
    """
    await asyncio.to_thread(_note_run, f"{text}\n")
    await asyncio.sleep(float(os.environ.get(LEDGER_ENV, "1")))
    return "found"


def _note_run(line: str) -> None:
    with open(os.environ[RUNS_ENV], "a") as runs:
        runs.write(line)


def triage() -> Agent:
    """Hands every conversation to billing."""
    model = ScriptedModel(
        [ScriptedModel.call("transfer_to_billing", {"reason": "a billing question"})],
        repeat_last=True,
    )
    return Agent(
        "triage",
        "You route questions.",
        model,
        toolkit=Toolkit(),
        capabilities=[Handoffs(["billing"])],
    )


def billing() -> Agent:
    """Looks the customer up, then answers."""
    model = ScriptedModel([_billing_turn], repeat_last=True)
    return Agent("billing", "You handle billing.", model, toolkit=Toolkit([ledger]))


def _arm_self_kill() -> None:
    append = Journal.append

    async def die_before_the_end(self: Journal, key: str, data: bytes, **how: Any) -> int:
        if key.startswith("triage.") and b'"k":"end"' in data and b'"handed_off"' in data:
            try:
                (Path(os.environ[DIE_ENV]) / "died").touch(exist_ok=False)
            except FileExistsError:
                pass
            else:
                os.kill(os.getpid(), signal.SIGKILL)
        return await append(self, key, data, **how)

    Journal.append = die_before_the_end  # type: ignore[method-assign]


if os.environ.get(DIE_ENV):
    _arm_self_kill()
