"""Guardrails in one process: input checks beside (or before) the first model
call, output checks before the answer is given, tool checks before a call and
on its result; a trip ends the reply ``guardrail_tripped`` with the trip, is
kept in memory, and every check is an event."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from pydantic import BaseModel

from fleetbus import Agent, Toolkit, tool
from fleetbus.agents import AgentSettings, Msg
from fleetbus.capabilities import (
    Checked,
    GuardrailContext,
    GuardrailResult,
    Guardrails,
    PatternGuardrail,
    guardrail,
)
from fleetbus.errors import ConfigError
from fleetbus.models import FINISH_TOOL, ModelRequest, ModelResponse
from fleetbus.models.model import ModelStreamItem
from fleetbus.protocol import Event, FinalAnswer, GuardrailTrip, ToolResultBlock
from fleetbus.testing import ScriptedModel

from ._support import result_for, unanswered

BOUND = 10.0
"""Seconds a reply may take before the test says it hangs."""


class Counter:
    """A tool that counts its runs."""

    def __init__(self, output: str = "done") -> None:
        self.runs: list[dict[str, Any]] = []
        self.output = output

        @tool
        def act(what: str) -> str:
            """Do something.

            Args:
                what: what to do.
            """
            self.runs.append({"what": what})
            return self.output

        self.tool = act


async def reply_with_events(
    agent: Agent, text: str, **kwargs: Any
) -> tuple[list[Event], FinalAnswer]:
    async def collect() -> tuple[list[Event], FinalAnswer]:
        items = [item async for item in agent.reply_stream(text, **kwargs)]
        *events, final = items
        assert isinstance(final, FinalAnswer)
        return [e for e in events if isinstance(e, Event)], final

    return await asyncio.wait_for(collect(), BOUND)


def checks(events: list[Event]) -> list[dict[str, Any]]:
    return [e.data for e in events if e.event == "guardrail"]


def trip_note(agent: Agent) -> Msg:
    """The message memory keeps of the trip (the last one)."""
    note = agent.memory[-1]
    assert note.role == "assistant"
    assert "guardrail" in note.metadata
    return note


# -- input ------------------------------------------------------------------------------


async def test_an_input_guardrail_runs_beside_the_first_model_call() -> None:
    called = asyncio.Event()

    def answer(request: ModelRequest) -> ModelResponse:
        called.set()
        return ScriptedModel.text("Hello.")

    @guardrail
    async def waits_for_the_model(checked: Checked, ctx: GuardrailContext) -> GuardrailResult:
        # Passes only once the model was called: it runs beside that call.
        await called.wait()
        return GuardrailResult.passed(info={"seen": checked.text})

    agent = Agent(
        "helper",
        "",
        ScriptedModel([answer]),
        capabilities=[Guardrails(input=[waits_for_the_model])],
    )
    events, final = await reply_with_events(agent, "Hi there", session_id="s-1")

    assert (final.finished_reason, final.content, final.guardrail) == ("completed", "Hello.", None)
    [check] = checks(events)
    assert check == {
        "name": "waits_for_the_model",
        "stage": "input",
        "tripped": False,
        "reason": "",
        "action": "pass",
        "info": {"seen": "Hi there"},
    }
    names = [e.event for e in events]
    assert names.index("model_call_start") < names.index("guardrail") < names.index("reply_end")


async def test_a_trip_beside_the_first_call_stops_its_tool_calls() -> None:
    counter = Counter()
    called = asyncio.Event()

    def calls_a_tool(request: ModelRequest) -> ModelResponse:
        called.set()
        return ScriptedModel.call("act", {"what": "launch"}, call_id="c1")

    @guardrail(name="no-launch")
    async def trips_after_the_model(checked: Checked, ctx: GuardrailContext) -> GuardrailResult:
        await called.wait()  # the model has answered with its call by now
        assert (ctx.agent_name, ctx.session_id, ctx.stage) == ("helper", "s-1", "input")
        return GuardrailResult.trip("launching is not allowed")

    model = ScriptedModel([calls_a_tool, ScriptedModel.text("Launched.")])
    agent = Agent(
        "helper",
        "",
        model,
        toolkit=Toolkit([counter.tool]),
        capabilities=[Guardrails(input=[trips_after_the_model])],
    )
    events, final = await reply_with_events(agent, "Launch it", session_id="s-1")

    assert counter.runs == []
    assert len(model.requests) == 1
    assert final.finished_reason == "guardrail_tripped"
    assert final.guardrail == GuardrailTrip(
        name="no-launch", stage="input", reason="launching is not allowed"
    )
    assert "no-launch" in str(final.content)
    assert "launching is not allowed" in str(final.content)
    assert "tool_call" not in [e.event for e in events]
    assert events[-1].event == "reply_end"
    assert events[-1].data["finished_reason"] == "guardrail_tripped"
    # Nothing the model said is kept: memory is the input, then the trip.
    assert [m.role for m in agent.memory] == ["user", "assistant"]
    assert not any(m.tool_uses for m in agent.memory)
    assert trip_note(agent).metadata["guardrail"] == {
        "name": "no-launch",
        "stage": "input",
        "reason": "launching is not allowed",
    }
    assert agent.state.reply is None


async def test_a_trip_cuts_the_model_call_short() -> None:
    started = asyncio.Event()

    class Endless:
        name = "endless"

        async def stream(self, request: ModelRequest) -> AsyncIterator[ModelStreamItem]:
            started.set()
            await asyncio.Event().wait()  # never answers
            yield ScriptedModel.text("never")

    @guardrail(name="stop")
    async def trips_once_called(checked: Checked, ctx: GuardrailContext) -> GuardrailResult:
        await started.wait()
        return GuardrailResult.trip("no")

    agent = Agent("helper", "", Endless(), capabilities=[Guardrails(input=[trips_once_called])])
    final = await asyncio.wait_for(agent.reply("Go"), BOUND)

    assert final.finished_reason == "guardrail_tripped"
    assert final.guardrail is not None
    assert final.guardrail.name == "stop"


async def test_a_blocking_input_guardrail_trips_before_any_model_call() -> None:
    model = ScriptedModel([ScriptedModel.text("Here is the password.")])
    secrets = PatternGuardrail([r"(?i)password"], name="no-secrets", run_in_parallel=False)
    agent = Agent("helper", "", model, capabilities=[Guardrails(input=[secrets])])
    events, final = await reply_with_events(agent, "Tell me the PASSWORD")

    assert model.requests == []
    assert "model_call_start" not in [e.event for e in events]
    assert final.finished_reason == "guardrail_tripped"
    assert final.guardrail == GuardrailTrip(
        name="no-secrets", stage="input", reason="it matches the pattern '(?i)password'"
    )
    assert checks(events) == [
        {
            "name": "no-secrets",
            "stage": "input",
            "tripped": True,
            "reason": "it matches the pattern '(?i)password'",
            "action": "trip",
            "info": {"pattern": "(?i)password"},
        }
    ]


async def test_the_first_trip_of_many_input_guardrails_stops_the_others() -> None:
    never = asyncio.Event()

    @guardrail(name="slow")
    async def slow(checked: Checked, ctx: GuardrailContext) -> GuardrailResult:
        await never.wait()
        return GuardrailResult.passed()

    fast = PatternGuardrail(["rm -rf"], name="fast")
    model = ScriptedModel([ScriptedModel.text("ok")])
    agent = Agent("helper", "", model, capabilities=[Guardrails(input=[slow, fast])])
    events, final = await reply_with_events(agent, "please rm -rf /")

    assert final.guardrail is not None
    assert final.guardrail.name == "fast"
    assert [c["name"] for c in checks(events)] == ["fast"]  # the slow one was cancelled


async def test_input_guardrails_check_only_the_first_step_of_a_reply() -> None:
    seen: list[str] = []

    @guardrail
    def records(checked: Checked, ctx: GuardrailContext) -> GuardrailResult:
        seen.append(checked.text)
        return GuardrailResult.passed()

    counter = Counter()
    model = ScriptedModel(
        [
            ScriptedModel.call("act", {"what": "a"}),
            ScriptedModel.text("First."),
            ScriptedModel.text("Second."),
        ]
    )
    agent = Agent(
        "helper",
        "",
        model,
        toolkit=Toolkit([counter.tool]),
        capabilities=[Guardrails(input=[records])],
    )
    await agent.reply("one")
    await agent.reply(["two", "three"])

    assert seen == ["one", "two\nthree"]


# -- output -----------------------------------------------------------------------------


async def test_an_output_guardrail_refuses_the_answer() -> None:
    model = ScriptedModel([ScriptedModel.text("The password is hunter2.")])
    secrets = PatternGuardrail([r"(?i)password is"], name="no-secrets")
    agent = Agent("helper", "", model, capabilities=[Guardrails(output=[secrets])])
    events, final = await reply_with_events(agent, "What is it?")

    assert final.finished_reason == "guardrail_tripped"
    assert final.guardrail == GuardrailTrip(
        name="no-secrets", stage="output", reason="it matches the pattern '(?i)password is'"
    )
    assert "hunter2" not in str(final.content)
    end = events[-1]
    assert end.event == "reply_end"
    assert "hunter2" not in str(end.data["content"])
    # The refused answer is not kept: the input, then the trip.
    assert [m.role for m in agent.memory] == ["user", "assistant"]
    assert all("hunter2" not in m.text for m in agent.memory)
    assert trip_note(agent).metadata["guardrail"]["stage"] == "output"


async def test_an_answer_that_passes_is_given() -> None:
    model = ScriptedModel([ScriptedModel.text("All fine.")])
    secrets = PatternGuardrail([r"(?i)password"], name="no-secrets")
    agent = Agent("helper", "", model, capabilities=[Guardrails(output=[secrets])])
    events, final = await reply_with_events(agent, "How is it?")

    assert (final.finished_reason, final.content) == ("completed", "All fine.")
    assert [(c["stage"], c["tripped"]) for c in checks(events)] == [("output", False)]
    assert agent.memory[-1].text == "All fine."


class Account(BaseModel):
    user: str
    password: str


async def test_an_output_guardrail_refuses_a_structured_answer() -> None:
    seen: list[dict[str, Any] | None] = []

    @guardrail(name="no-passwords")
    def no_passwords(checked: Checked, ctx: GuardrailContext) -> GuardrailResult:
        seen.append(checked.structured)
        if checked.structured and checked.structured.get("password"):
            return GuardrailResult.trip("a password in the answer")
        return GuardrailResult.passed()

    model = ScriptedModel([ScriptedModel.call(FINISH_TOOL, {"user": "ann", "password": "x1"})])
    agent = Agent("helper", "", model, capabilities=[Guardrails(output=[no_passwords])])
    final = await asyncio.wait_for(agent.reply("Ann's account?", structured_model=Account), BOUND)

    assert seen == [{"user": "ann", "password": "x1"}]
    assert final.finished_reason == "guardrail_tripped"
    assert final.structured is None
    assert final.guardrail == GuardrailTrip(
        name="no-passwords", stage="output", reason="a password in the answer"
    )
    assert [m.role for m in agent.memory] == ["user", "assistant"]
    assert not any(m.tool_uses or m.tool_results for m in agent.memory)


async def test_the_last_words_of_a_reply_out_of_steps_are_checked() -> None:
    counter = Counter()
    model = ScriptedModel(
        [ScriptedModel.call("act", {"what": "x"}), ScriptedModel.text("Secret: 42.")]
    )
    secrets = PatternGuardrail(["Secret"], name="no-secrets")
    agent = Agent(
        "helper",
        "",
        model,
        toolkit=Toolkit([counter.tool]),
        capabilities=[Guardrails(output=[secrets])],
        settings=AgentSettings(max_iters=1),
    )
    final = await asyncio.wait_for(agent.reply("Go"), BOUND)

    assert final.finished_reason == "guardrail_tripped"
    assert "42" not in str(final.content)
    assert all("42" not in m.text for m in agent.memory)
    assert unanswered(agent.memory) == []


# -- tools ------------------------------------------------------------------------------


async def test_a_tool_input_guardrail_trips_before_the_call_runs() -> None:
    counter = Counter()
    model = ScriptedModel([ScriptedModel.call("act", {"what": "rm -rf /"}, call_id="c1")])
    no_rm = PatternGuardrail(["rm -rf"], name="no-rm")
    agent = Agent(
        "helper",
        "",
        model,
        toolkit=Toolkit([counter.tool]),
        capabilities=[Guardrails(tools=[no_rm])],
    )
    events, final = await reply_with_events(agent, "Clean up")

    assert counter.runs == []
    assert final.finished_reason == "guardrail_tripped"
    assert final.guardrail == GuardrailTrip(
        name="no-rm", stage="tool_input", reason="it matches the pattern 'rm -rf'"
    )
    assert "'act'" in str(final.content)
    [check] = checks(events)
    assert (check["stage"], check["call_id"], check["tool_name"]) == ("tool_input", "c1", "act")
    # The call is answered with what happened to it.
    result = result_for(agent.memory, "c1")
    assert result.state == "cancelled"
    assert "not run" in str(result.output)
    assert unanswered(agent.memory) == []


async def test_a_tool_input_guardrail_rejects_a_call_and_the_model_goes_on() -> None:
    counter = Counter()

    @guardrail
    def only_reads(checked: Checked, ctx: GuardrailContext) -> GuardrailResult:
        assert checked.call is not None
        if checked.call.input.get("what") == "delete":
            return GuardrailResult.reject("this agent only reads")
        return GuardrailResult.passed()

    model = ScriptedModel(
        [
            ScriptedModel.call("act", {"what": "delete"}, call_id="c1"),
            ScriptedModel.call("act", {"what": "read"}, call_id="c2"),
            ScriptedModel.text("Read it instead."),
        ]
    )
    agent = Agent(
        "helper",
        "",
        model,
        toolkit=Toolkit([counter.tool]),
        capabilities=[Guardrails(tool_input=[only_reads])],
    )
    events, final = await reply_with_events(agent, "Delete it")

    assert final.finished_reason == "completed"
    assert counter.runs == [{"what": "read"}]
    rejected = result_for(agent.memory, "c1")
    assert rejected.state == "denied"
    assert "only_reads" in str(rejected.output)
    assert "this agent only reads" in str(rejected.output)
    [sent] = [b for b in model.requests[1].messages[-1].content if isinstance(b, ToolResultBlock)]
    assert sent.id == "c1"
    assert "this agent only reads" in str(sent.output)
    assert [c["action"] for c in checks(events)] == ["reject", "pass"]


async def test_a_tool_output_guardrail_trips_on_the_result() -> None:
    counter = Counter(output="user=ann password=hunter2")
    model = ScriptedModel([ScriptedModel.call("act", {"what": "look"}, call_id="c1")])
    secrets = PatternGuardrail(["password="], name="no-secrets")
    agent = Agent(
        "helper",
        "",
        model,
        toolkit=Toolkit([counter.tool]),
        capabilities=[Guardrails(tool_output=[secrets])],
    )
    events, final = await reply_with_events(agent, "Look")

    assert counter.runs == [{"what": "look"}]  # it ran; its result is not shown
    assert final.finished_reason == "guardrail_tripped"
    assert final.guardrail is not None
    assert final.guardrail.stage == "tool_output"
    assert len(model.requests) == 1
    assert all("hunter2" not in str(r.output) for m in agent.memory for r in m.tool_results)
    assert all("hunter2" not in str(e.data) for e in events)
    assert unanswered(agent.memory) == []


async def test_a_tool_output_guardrail_replaces_what_the_model_sees() -> None:
    counter = Counter(output="user=ann password=hunter2")

    @guardrail(name="redact")
    def redact(checked: Checked, ctx: GuardrailContext) -> GuardrailResult:
        if "password=" in checked.text:
            return GuardrailResult.replace("user=ann password=***", "a password was hidden")
        return GuardrailResult.passed()

    model = ScriptedModel(
        [ScriptedModel.call("act", {"what": "look"}, call_id="c1"), ScriptedModel.text("Done.")]
    )
    agent = Agent(
        "helper",
        "",
        model,
        toolkit=Toolkit([counter.tool]),
        capabilities=[Guardrails(tool_output=[redact])],
    )
    events, final = await reply_with_events(agent, "Look")

    assert final.finished_reason == "completed"
    assert result_for(agent.memory, "c1").output == "user=ann password=***"
    [sent] = [b for b in model.requests[1].messages[-1].content if isinstance(b, ToolResultBlock)]
    assert sent.output == "user=ann password=***"
    [check] = checks(events)
    assert (check["action"], check["reason"]) == ("replace", "a password was hidden")


# -- failures ---------------------------------------------------------------------------


async def test_a_failing_guardrail_fails_closed() -> None:
    @guardrail(name="broken")
    def broken(checked: Checked, ctx: GuardrailContext) -> GuardrailResult:
        raise RuntimeError("no policy loaded")

    model = ScriptedModel([ScriptedModel.text("Hi.")])
    agent = Agent("helper", "", model, capabilities=[Guardrails(input=[broken])])
    events, final = await reply_with_events(agent, "Hello")

    assert final.finished_reason == "guardrail_tripped"
    assert final.guardrail == GuardrailTrip(
        name="broken", stage="input", reason="the check failed: RuntimeError: no policy loaded"
    )
    assert checks(events)[0]["failed"] is True


async def test_a_fail_open_guardrail_lets_through_and_says_it_failed() -> None:
    @guardrail(name="broken", fail_open=True)
    async def broken(checked: Checked, ctx: GuardrailContext) -> GuardrailResult:
        return "yes"  # type: ignore[return-value]

    model = ScriptedModel([ScriptedModel.text("Hi.")])
    agent = Agent("helper", "", model, capabilities=[Guardrails(input=[broken], output=[broken])])
    events, final = await reply_with_events(agent, "Hello")

    assert (final.finished_reason, final.content) == ("completed", "Hi.")
    found = checks(events)
    assert [(c["stage"], c["tripped"], c.get("failed")) for c in found] == [
        ("input", False, True),
        ("output", False, True),
    ]
    assert "not a GuardrailResult" in found[0]["reason"]


async def test_a_guardrail_past_its_timeout_fails() -> None:
    @guardrail(name="stuck", timeout=0.05)
    async def stuck(checked: Checked, ctx: GuardrailContext) -> GuardrailResult:
        await asyncio.Event().wait()
        return GuardrailResult.passed()

    model = ScriptedModel([ScriptedModel.text("Hi.")])
    agent = Agent("helper", "", model, capabilities=[Guardrails(output=[stuck])])
    final = await asyncio.wait_for(agent.reply("Hello"), BOUND)

    assert final.finished_reason == "guardrail_tripped"
    assert final.guardrail is not None
    assert final.guardrail.reason == "the check failed: no result within 0.05 s"


async def test_a_rejection_outside_a_tool_call_trips() -> None:
    @guardrail(name="misused")
    def misused(checked: Checked, ctx: GuardrailContext) -> GuardrailResult:
        return GuardrailResult.reject("no")

    model = ScriptedModel([ScriptedModel.text("Hi.")])
    agent = Agent("helper", "", model, capabilities=[Guardrails(output=[misused])])
    final = await asyncio.wait_for(agent.reply("Hello"), BOUND)

    assert final.finished_reason == "guardrail_tripped"
    assert final.guardrail is not None
    assert final.guardrail.reason == "it asked to reject at the output stage: no"


def test_bad_guardrails_are_clear_errors() -> None:
    with pytest.raises(ConfigError, match="bad pattern '\\('"):
        PatternGuardrail(["("])
    with pytest.raises(ConfigError, match="has no pattern"):
        PatternGuardrail([])
    with pytest.raises(ConfigError, match="is not a guardrail"):
        Guardrails(input=["(?i)password"])  # type: ignore[list-item]
    with pytest.raises(ConfigError, match="timeout is a positive number"):
        PatternGuardrail(["x"], timeout=0)
    with pytest.raises(ConfigError, match="one of them"):
        GuardrailResult(tripped=True, rejected=True)


async def test_an_agent_without_guardrails_has_no_guardrail_events() -> None:
    model = ScriptedModel([ScriptedModel.text("Hi.")])
    agent = Agent("helper", "", model, capabilities=[Guardrails()])
    events, final = await reply_with_events(agent, "Hello")

    assert final.finished_reason == "completed"
    assert checks(events) == []


async def test_a_sequential_pipeline_stops_where_a_guardrail_trips() -> None:
    from fleetbus.agents.hub import sequential_pipeline

    secrets = PatternGuardrail(["hunter2"], name="no-secrets")
    first = Agent(
        "first",
        "",
        ScriptedModel(["The password is hunter2."]),
        capabilities=[Guardrails(output=[secrets])],
    )
    second_model = ScriptedModel(["never"])
    second = Agent("second", "", second_model)
    answer = await asyncio.wait_for(sequential_pipeline([first, second], "go"), BOUND)

    assert (answer.sender, answer.finished_reason) == ("first", "guardrail_tripped")
    assert second_model.requests == []


async def test_an_interrupt_while_input_guardrails_run_ends_the_reply() -> None:
    checking = asyncio.Event()

    @guardrail(name="slow")
    async def slow(checked: Checked, ctx: GuardrailContext) -> GuardrailResult:
        checking.set()
        await asyncio.Event().wait()
        return GuardrailResult.passed()

    class Endless:
        name = "endless"

        async def stream(self, request: ModelRequest) -> AsyncIterator[ModelStreamItem]:
            await asyncio.Event().wait()
            yield ScriptedModel.text("never")

    agent = Agent("helper", "", Endless(), capabilities=[Guardrails(input=[slow])])
    reply = asyncio.create_task(agent.reply("Hello"))
    await asyncio.wait_for(checking.wait(), BOUND)
    agent.interrupt()
    final = await asyncio.wait_for(reply, BOUND)

    assert final.finished_reason == "interrupted"
    assert final.guardrail is None
    assert [m.role for m in agent.memory] == ["user"]
