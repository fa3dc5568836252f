"""A tool failing is an observation the model sees, never the end of the reply."""

from __future__ import annotations

from fleetbus import Agent, Toolkit, tool
from fleetbus.testing import ScriptedModel

from ._support import result_for, unanswered


@tool
def broken() -> str:
    """Always fails."""
    raise RuntimeError("disk on fire")


@tool
async def upstream() -> str:
    """Calls a service that times out (the tool's own deadline, not the agent's)."""
    raise TimeoutError("the service did not answer")


async def test_tool_raising_is_an_error_result_the_model_sees() -> None:
    model = ScriptedModel([ScriptedModel.call("broken", call_id="b"), "It is broken."])
    agent = Agent("a", "You try.", model, toolkit=Toolkit([broken]))

    answer = await agent.reply("Try it")

    assert answer.finished_reason == "completed"
    failed = result_for(agent.memory, "b")
    assert failed.state == "error"
    assert "disk on fire" in str(failed.output)
    assert model.requests[1].messages[-1].role == "tool"


async def test_tool_raising_its_own_timeout_error_is_a_result_the_model_sees() -> None:
    model = ScriptedModel([ScriptedModel.call("upstream", call_id="u"), "It timed out."])
    agent = Agent("a", "You try.", model, toolkit=Toolkit([upstream]))

    answer = await agent.reply("Call the service")

    assert unanswered(agent.memory) == []
    assert result_for(agent.memory, "u").state in ("timeout", "error")
    assert answer.finished_reason == "completed"
