"""An interrupted reply's memory tells what really happened to each call,
leaving ``reply_stream`` early stops the reply from starting anything new, and
an interrupt lands before the next model or tool call of a reply whose model
and tools never wait (one nobody streams too)."""

from __future__ import annotations

import asyncio

from fleetbus.agents import Agent, AgentSettings, Middleware, Msg
from fleetbus.agents.middleware import ReplyContext
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


async def test_a_pending_interrupt_stops_a_final_only_stream_before_anything_runs() -> None:
    # The model and the tool never wait: the interrupt still lands before
    # the first model call, as for a streamed reply.
    written: list[str] = []
    model = ScriptedModel([ScriptedModel.call("write", {"text": "z"}), ScriptedModel.text("done")])
    agent = Agent("a", "", model, toolkit=kit(written, asyncio.Event()))
    agent.interrupt(pending=True)
    items = [item async for item in agent.reply_stream("go", events=False)]
    assert [type(i).__name__ for i in items] == ["FinalAnswer"]
    final = items[0]
    assert isinstance(final, FinalAnswer)
    assert final.finished_reason == "interrupted"
    assert (model.requests, written, agent.state.reply) == ([], [], None)


async def test_an_interrupt_from_inside_a_reply_lands_before_its_next_model_call() -> None:
    agents: list[Agent] = []

    @tool
    async def stop() -> str:
        """Stop the reply (and never wait)."""
        agents[0].interrupt()
        return "stopping"

    model = ScriptedModel([ScriptedModel.call("stop", {}, call_id="s1"), ScriptedModel.text("no")])
    agents.append(Agent("a", "", model, toolkit=Toolkit([stop])))
    final = await agents[0].reply("go")
    assert final.finished_reason == "interrupted"
    assert len(model.requests) == 1
    assert results(agents[0].memory)["s1"].output == "stopping"


async def test_an_interrupt_after_the_last_wait_of_a_reply_does_not_lose_its_answer() -> None:
    agents: list[Agent] = []

    class StopAtTheEnd(Middleware):
        def on_event(self, ctx: ReplyContext, event: Event) -> None:
            if event.event == "reply_end":
                agents[0].interrupt()  # too late: the reply has ended

    agents.append(Agent("a", "", ScriptedModel(["done"]), middlewares=[StopAtTheEnd()]))
    final = await agents[0].reply("go")
    assert (final.content, final.finished_reason) == ("done", "completed")
    items = [i async for i in agents[0].reply_stream("again", events=False)]
    assert [type(i).__name__ for i in items] == ["FinalAnswer"]  # (the model ran out: an error)
