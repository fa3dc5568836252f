"""Long tool results in the loop: cut to the limit, offloaded, read back."""

from __future__ import annotations

import re
from pathlib import Path

from fleetbus import Agent, ContextConfig, Toolkit, tool
from fleetbus.agents import AgentSettings, DirectoryOffloader
from fleetbus.capabilities import Offloading
from fleetbus.models import ModelRequest, ModelResponse
from fleetbus.testing import ScriptedModel

from ._support import result_for, results_of, unanswered

# 1,000 characters, every 5-character slice unique, so a slice shows where it came from.
TEXT = "".join(f"{i:04d}|" for i in range(200))
LIMIT = 100


@tool
def report() -> str:
    """Return the long report."""
    return TEXT


def _read_next(request: ModelRequest) -> ModelResponse:
    """The model reads on from the reference in the note of the cut result."""
    [cut] = results_of(request.messages[-1])
    found = re.search(r'read_offloaded\(ref="([^"]+)", offset=(\d+)', str(cut.output))
    assert found is not None, cut.output
    ref, offset = found.group(1), int(found.group(2))
    return ScriptedModel.call(
        "read_offloaded", {"ref": ref, "offset": offset, "limit": LIMIT}, call_id="read"
    )


async def test_long_result_is_cut_offloaded_and_read_on(tmp_path: Path) -> None:
    model = ScriptedModel(
        [ScriptedModel.call("report", call_id="rep"), _read_next, "Read two slices."]
    )
    agent = Agent(
        "reader",
        "You read reports.",
        model,
        toolkit=Toolkit([report]),
        capabilities=[Offloading(DirectoryOffloader(tmp_path))],
        settings=AgentSettings(context=ContextConfig(tool_result_limit=LIMIT)),
    )

    answer = await agent.reply("Read the report")

    assert answer.finished_reason == "completed"
    assert "read_offloaded" in [t.name for t in model.requests[0].tools]
    cut = result_for(agent.memory, "rep")
    assert cut.state == "success"
    assert isinstance(cut.output, str)
    assert cut.output.startswith(TEXT[:LIMIT])
    assert TEXT[LIMIT : LIMIT + 5] not in cut.output
    assert "900 of 1000 characters" in cut.output
    assert "read_offloaded" in cut.output
    assert [p.read_text(encoding="utf-8") for p in tmp_path.iterdir()] == [TEXT]
    read = result_for(agent.memory, "read")
    assert read.state == "success"
    assert isinstance(read.output, str)
    assert read.output.startswith(TEXT[LIMIT : 2 * LIMIT])
    assert TEXT[2 * LIMIT : 2 * LIMIT + 5] not in read.output
    assert f"offset={2 * LIMIT}" in read.output  # where to go on
    # What the model was sent is what memory holds.
    assert results_of(model.requests[2].messages[-1]) == [read]
    assert unanswered(agent.memory) == []


async def test_unknown_reference_is_an_error_the_model_sees(tmp_path: Path) -> None:
    model = ScriptedModel(
        [ScriptedModel.call("read_offloaded", {"ref": "file:nothing"}, call_id="r"), "Oh."]
    )
    agent = Agent(
        "reader",
        "You read.",
        model,
        capabilities=[Offloading(DirectoryOffloader(tmp_path / "empty"))],
    )

    answer = await agent.reply("Read it")

    assert answer.finished_reason == "completed"
    failed = result_for(agent.memory, "r")
    assert failed.state == "error"
    assert "read_offloaded failed" in str(failed.output)


async def test_without_an_offloader_the_result_is_cut_and_the_rest_is_lost() -> None:
    model = ScriptedModel([ScriptedModel.call("report", call_id="rep"), "Partly read."])
    agent = Agent(
        "reader",
        "You read reports.",
        model,
        toolkit=Toolkit([report]),
        settings=AgentSettings(context=ContextConfig(tool_result_limit=LIMIT)),
    )

    await agent.reply("Read the report")

    assert "read_offloaded" not in [t.name for t in model.requests[0].tools]
    cut = result_for(agent.memory, "rep")
    assert isinstance(cut.output, str)
    assert cut.output.startswith(TEXT[:LIMIT])
    assert TEXT[LIMIT : LIMIT + 5] not in cut.output
    assert "the rest is not available" in cut.output
    assert "read_offloaded" not in cut.output


async def test_result_within_the_limit_is_kept_whole(tmp_path: Path) -> None:
    model = ScriptedModel([ScriptedModel.call("report", call_id="rep"), "Read."])
    agent = Agent(
        "reader",
        "You read reports.",
        model,
        toolkit=Toolkit([report]),
        capabilities=[Offloading(DirectoryOffloader(tmp_path))],
        settings=AgentSettings(context=ContextConfig(tool_result_limit=len(TEXT))),
    )

    await agent.reply("Read the report")

    assert result_for(agent.memory, "rep").output == TEXT
    assert list(tmp_path.iterdir()) == []
