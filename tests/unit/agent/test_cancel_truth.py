"""An interrupted reply's memory tells what really happened to each call, and
leaving ``reply_stream`` early stops the reply from starting anything new."""

from __future__ import annotations

import asyncio

from fleetbus.agents import Agent, AgentSettings, Msg
from fleetbus.protocol import Event, FinalAnswer, ToolResultBlock
from fleetbus.testing import ScriptedModel
from fleetbus.tools_workers import Toolkit, tool


def results(memory: list[Msg]) -> dict[str, ToolResultBlock]:
    return {r.id: r for m in memory for r in m.tool_results}


def kit(written: list[str], started: asyncio.Event) -> Toolkit:
    @tool
    async def write(text: str) -> str:
        """Write a note (fast, with an effect)."""
        written.append(text)
        return f"wrote {text}"

    @tool
    async def wait() -> str:
        """Wait for ever."""
        started.set()
        await asyncio.sleep(60)
        return "never"

    return Toolkit([write, wait])


async def test_an_interrupt_keeps_finished_results_and_says_what_was_cut_short() -> None:
    written: list[str] = []
    started = asyncio.Event()
    model = ScriptedModel([ScriptedModel.calls(("write", {"text": "x"}, "w1"), ("wait", {}, "h1"))])
    agent = Agent(
        "a",
        "",
        model,
        toolkit=kit(written, started),
        settings=AgentSettings(parallel_tool_calls=True),
    )
    task = asyncio.create_task(agent.reply("go"))
    await started.wait()
    await asyncio.sleep(0.01)  # the write has finished by now
    agent.interrupt()
    final = await task
    assert final.finished_reason == "interrupted"
    assert written == ["x"]
    done = results(agent.memory)
    assert done["w1"].state == "success"
    assert done["w1"].output == "wrote x"  # it ran: not "cancelled: not run"
    assert done["h1"].state == "cancelled"
    assert "stopped while it ran" in str(done["h1"].output)


async def test_an_interrupt_marks_calls_never_started_as_not_run() -> None:
    written: list[str] = []
    started = asyncio.Event()
    model = ScriptedModel([ScriptedModel.calls(("wait", {}, "h1"), ("write", {"text": "y"}, "w1"))])
    agent = Agent("a", "", model, toolkit=kit(written, started))
    task = asyncio.create_task(agent.reply("go"))
    await started.wait()
    agent.interrupt()
    await task
    done = results(agent.memory)
    assert "stopped while it ran" in str(done["h1"].output)
    assert done["w1"].state == "cancelled"
    assert str(done["w1"].output).startswith("not run")
    assert written == []


async def test_break_out_of_the_stream_starts_nothing_new() -> None:
    written: list[str] = []
    started = asyncio.Event()
    model = ScriptedModel([ScriptedModel.call("write", {"text": "first"}, call_id="w1")])
    agent = Agent("a", "", model, toolkit=kit(written, started))
    stream = agent.reply_stream("go")  # held in a variable: not closed by the break
    async for item in stream:
        if isinstance(item, Event) and item.event == "tool_call":
            break
    await asyncio.sleep(0.2)
    # The call under way may finish; no further model call or tool call starts.
    assert written in ([], ["first"])
    assert len(model.requests) == 1
    # The next reply ends the abandoned one and runs.
    model.add(ScriptedModel.text("next"))
    answer = await asyncio.wait_for(agent.reply("again"), 5)
    assert isinstance(answer, FinalAnswer)
    assert answer.content == "next"
    assert len(model.requests) == 2
    if not written:  # stopped before its call ran: memory says so
        assert str(results(agent.memory)["w1"].output).startswith("not run")
    await stream.aclose()
    ids = [u.id for m in agent.memory for u in m.tool_uses]
    assert sorted(ids) == sorted(results(agent.memory))


async def test_an_interrupt_before_the_reply_starts_applies_only_when_pending() -> None:
    written: list[str] = []
    started = asyncio.Event()
    script = [ScriptedModel.calls(("write", {"text": "z"}, "w1")), ScriptedModel.text("done")]
    agent = Agent("a", "", ScriptedModel(script), toolkit=kit(written, started))
    agent.interrupt()  # nothing runs: nothing to stop, and nothing remembered
    assert (await agent.reply("go")).finished_reason == "completed"
    assert written == ["z"]
    pending = Agent("b", "", ScriptedModel(script), toolkit=kit(written, started))
    pending.interrupt(pending=True)  # a cancel that came while the reply was set up
    final = await pending.reply("go")
    assert final.finished_reason == "interrupted"
    assert written == ["z"]  # its tool never ran
    assert (await pending.reply("again")).finished_reason == "completed"  # once only
