"""Skills on the bus: served by a ``fleetbus worker fleetbus.tools_workers.skills``
process to an agent here, and loaded by an agent served with ``fleetbus agent``."""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path

import pytest

from fleetbus.agents import Agent
from fleetbus.bus import Bus, EmbeddedServer, ToolClient
from fleetbus.errors import BusError
from fleetbus.protocol import FinalAnswer, ToolResultBlock, UserRequest
from fleetbus.testing import ScriptedModel
from fleetbus.tools_workers import Toolkit
from tests.helpers import running, wait_for_workers, workers
from tests.integration.test_examples import run_example

pytestmark = pytest.mark.slow

SECRET = "Count the syllables of every line twice."


def skills(tmp_path: Path) -> Path:
    folder = tmp_path / "skills" / "haiku"
    (folder / "scripts").mkdir(parents=True)
    (folder / "SKILL.md").write_text(
        "---\nname: haiku\ndescription: Write a haiku. Use when asked for one.\n---\n\n"
        f"# Haiku\n\n{SECRET}\n"
    )
    (folder / "scripts" / "count.py").write_text("print(5, 7, 5)\n")
    return folder.parent


async def test_a_worker_process_serves_skills_to_an_agent(
    nats_server: EmbeddedServer, bus: Bus, tmp_path: Path
) -> None:
    env = {"FLEETBUS_SKILLS": str(skills(tmp_path))}
    model = ScriptedModel(
        [
            ScriptedModel.call("load_skill", {"skill": "haiku"}),
            ScriptedModel.call("load_skill", {"skill": "haiku", "file": "scripts/count.py"}),
            ScriptedModel.text("Done."),
        ]
    )
    with workers(nats_server.url, bus.prefix, 1, spec="fleetbus.tools_workers.skills", env=env):
        await wait_for_workers(bus, "load_skill", 1)
        kit = Toolkit()
        assert await kit.add_remote(ToolClient(bus, timeout=20)) == ["load_skill"]
        answer = await Agent("poet", "", model, toolkit=kit).reply("A haiku, please.")
    assert answer.finished_reason == "completed"
    first, second, third = model.requests
    offered = next(spec for spec in first.tools if spec.name == "load_skill")
    assert "- haiku: Write a haiku. Use when asked for one." in offered.description
    assert offered.parameters["properties"]["skill"]["enum"] == ["haiku"]
    assert SECRET not in repr(first)
    results = [b for m in third.messages for b in m.content if isinstance(b, ToolResultBlock)]
    assert [r.state for r in results] == ["success", "success"]
    assert SECRET in str(results[0].output)
    assert "- scripts/count.py" in str(results[0].output)
    assert SECRET in repr(second)
    assert results[1].output == "haiku/scripts/count.py\n\nprint(5, 7, 5)\n"


async def test_an_agent_process_loads_its_skills_from_its_own_folders(
    nats_server: EmbeddedServer, bus: Bus, tmp_path: Path
) -> None:
    env = {"FLEETBUS_TEST_SKILLS": str(skills(tmp_path))}
    command = [
        "agent",
        "tests.integration.skill_specs:skilled",
        "--nats",
        nats_server.url,
        "--prefix",
        bus.prefix,
        "--no-remote-tools",
    ]
    with running([command], env=env):
        text = 'tool load_skill {"skill": "haiku"}'
        answer = await ask_when_up(bus, text)
        unknown = await ask_when_up(bus, 'tool load_skill {"skill": "sonnet"}')
    assert answer.finished_reason == "completed"
    assert "load_skill=# Skill haiku" in str(answer.content)
    assert SECRET in str(answer.content)
    assert "no skill named 'sonnet'; the skills are: haiku" in str(unknown.content)


async def ask_when_up(bus: Bus, text: str, timeout: float = 30.0) -> FinalAnswer:
    """The agent's answer to ``text``, retried while its process starts."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            reply = await bus.request(
                bus.subjects.agent_inbox("skilled"),
                UserRequest(content=text, session_id=f"s-{uuid.uuid4().hex[:8]}"),
                timeout=5,
                attempts=1,
            )
        except BusError:  # no replica serving yet
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.1)
            continue
        assert isinstance(reply, FinalAnswer), reply
        return reply


def test_the_example_runs_over_the_bus() -> None:
    out = run_example("examples/skills.py", "--bus")
    assert "the model calls load_skill(skill='rot13')" in out
    assert "request 1: 2 messages, instructions of the skill absent" in out
    assert "request 2: 4 messages, instructions of the skill present" in out
    assert "answer (completed): The skill's script says: Hello from the fleet!" in out
