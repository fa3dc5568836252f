"""A folder served by a real ``fleetbus worker fleetbus.tools_workers.knowledge``
process: an agent in this process and one served by ``fleetbus agent`` (this
module's :func:`librarian`) both put the right passage and its source before
their model, and list the source on the final answer."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from fleetbus.agents import Agent
from fleetbus.bus import Bus, EmbeddedServer
from fleetbus.capabilities import BusKnowledgeBase, Knowledge
from fleetbus.models import ModelRequest, ModelResponse
from fleetbus.models.model import ModelStreamItem
from fleetbus.protocol import FinalAnswer, TextBlock, UserRequest
from fleetbus.testing import ScriptedModel
from tests.helpers import running, wait_for_workers
from tests.unit.test_knowledge_index import write_docs

pytestmark = pytest.mark.slow

TOOL = "handbook_search"
QUESTION = "How many days do customers have to ask for a refund?"
TIME_LIMITS = "refunds.md:5-8 (Refunds > Time limits)"
PASSAGE = "Customers may ask for a refund within 30 days of delivery."


class HintEcho:
    """The served agent's model: answers with the knowledge hint it was sent."""

    name = "hint-echo"

    async def stream(self, request: ModelRequest) -> AsyncIterator[ModelStreamItem]:
        texts = [
            "".join(b.text for b in m.content if isinstance(b, TextBlock)) for m in request.messages
        ]
        hint = next((t for t in texts if t.startswith("<knowledge>")), "no knowledge")
        yield ModelResponse(content=[TextBlock(text=hint)])


def librarian() -> Agent:
    """Served by ``fleetbus agent``: its knowledge base is the worker's tool,
    reached over the host's bus (no bus given here)."""
    return Agent("librarian", "", HintEcho(), capabilities=[Knowledge([BusKnowledgeBase(TOOL)])])


async def ask(bus: Bus, text: str, session: str, *, timeout: float) -> FinalAnswer:
    reply = await bus.request(
        bus.subjects.agent_inbox("librarian"),
        UserRequest(content=text, session_id=session),
        timeout=timeout,
        attempts=1,
    )
    assert isinstance(reply, FinalAnswer), reply
    return reply


async def first_answer(bus: Bus, text: str, timeout: float = 30.0) -> FinalAnswer:
    """The served agent's answer, once its process serves."""
    deadline = time.monotonic() + timeout
    attempt = 0
    while True:
        attempt += 1
        try:
            return await ask(bus, text, f"s-{attempt}", timeout=5)
        except Exception:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.1)


async def test_a_worker_process_serves_the_folder_to_agents_here_and_served(
    nats_server: EmbeddedServer, bus: Bus, tmp_path: Path
) -> None:
    docs = write_docs(tmp_path / "docs")
    env = {
        "FLEETBUS_KNOWLEDGE_DIR": str(docs),
        "FLEETBUS_KNOWLEDGE_TOOL": TOOL,
        "FLEETBUS_KNOWLEDGE_INDEX": str(tmp_path / "index.sqlite"),
    }
    where = ["--nats", nats_server.url, "--prefix", bus.prefix]
    commands = [
        ["worker", "fleetbus.tools_workers.knowledge", *where, "--worker-id", "k1"],
        [
            "agent",
            "tests.integration.test_knowledge:librarian",
            *where,
            "--no-remote-tools",
            "--replica-id",
            "r1",
        ],
    ]
    with running(commands, env=env):
        await wait_for_workers(bus, TOOL, 1)

        # An agent in this process, its base bound to this bus.
        model = ScriptedModel(["Within 30 days."])
        agent = Agent(
            "clerk", "", model, capabilities=[Knowledge([BusKnowledgeBase(TOOL, bus=bus)])]
        )
        here = await agent.reply(QUESTION)

        # The agent served by `fleetbus agent`.
        served = await first_answer(bus, QUESTION)
        other = await ask(bus, "Where can I park my car?", "s-park", timeout=10)

    texts = [
        "".join(b.text for b in m.content if isinstance(b, TextBlock))
        for m in model.requests[0].messages
    ]
    [hint] = [t for t in texts if t.startswith("<knowledge>")]
    assert f"[1] {TIME_LIMITS}" in hint
    assert PASSAGE in hint.split("\n[2] ")[0]
    assert texts[texts.index(hint) + 1] == QUESTION
    assert here.sources[0] == TIME_LIMITS
    assert not any("<knowledge>" in m.text for m in agent.memory)

    assert isinstance(served.content, str)
    assert f"[1] {TIME_LIMITS}" in served.content
    assert PASSAGE in served.content.split("\n[2] ")[0]
    assert served.sources[0] == TIME_LIMITS
    assert isinstance(other.content, str)
    assert "[1] office.txt:1-3" in other.content
    assert other.sources[0] == "office.txt:1-3"
