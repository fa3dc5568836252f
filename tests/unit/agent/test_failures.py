"""Every failure of a real model and real tools ends in an observation the
model sees or a clear finished_reason — never a crash, a hang, or a memory
where a tool call lacks its result."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from fleetbus.agents import Agent, AgentSettings, Msg
from fleetbus.models import ModelConfig, ModelError, ModelRequest
from fleetbus.models.model import ModelStreamItem
from fleetbus.protocol import ToolResultBlock
from fleetbus.testing import ScriptedModel
from fleetbus.tools_workers import Toolkit, tool

runs: list[str] = []


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    runs.append("add")
    return a + b


@tool
def explode(reason: str) -> None:
    """Always fails."""
    runs.append("explode")
    raise RuntimeError(reason)


@tool(timeout=0.05)
async def slow() -> str:
    """Takes too long."""
    await asyncio.sleep(5)
    return "late"


def toolkit() -> Toolkit:
    return Toolkit([add, explode, slow])


def last_result(model: ScriptedModel, request: int) -> ToolResultBlock:
    """The tool result the model saw in its ``request``-th request (0-based)."""
    message = model.requests[request].messages[-1]
    assert message.role == "tool"
    block = message.content[0]
    assert isinstance(block, ToolResultBlock)
    return block


def assert_consistent(memory: list[Msg]) -> None:
    """Every tool_use has exactly one tool_result after it, and vice versa."""
    used = [u.id for m in memory for u in m.tool_uses]
    answered = [r.id for m in memory for r in m.tool_results]
    assert sorted(used) == sorted(answered)
    assert len(set(used)) == len(used)


@pytest.fixture(autouse=True)
def _clear_runs() -> None:
    runs.clear()


async def test_an_unknown_tool_is_told_which_tools_exist() -> None:
    model = ScriptedModel([ScriptedModel.call("substract", {"a": 1}), ScriptedModel.text("ok")])
    final = await Agent("a", "", model, toolkit=toolkit()).reply("go")
    result = last_result(model, 1)
    assert result.state == "error"
    assert "there is no tool 'substract'" in result.output
    assert "add, explode, slow" in result.output
    assert final.finished_reason == "completed"


async def test_arguments_that_are_not_json_are_shown_to_the_model() -> None:
    model = ScriptedModel(
        [
            ScriptedModel.call("add", '{"a": 1, "b": '),
            ScriptedModel.call("add", {"a": 1, "b": 2}),
            ScriptedModel.text("3"),
        ]
    )
    agent = Agent("a", "", model, toolkit=toolkit())
    final = await agent.reply("1 + 2")
    bad = last_result(model, 1)
    assert bad.state == "error"
    assert "not a JSON object" in bad.output
    assert '{"a": 1, "b": ' in bad.output
    assert last_result(model, 2).output == 3
    assert runs == ["add"]  # the malformed call never ran
    assert final.content == "3"
    assert_consistent(agent.memory)


async def test_arguments_that_fail_the_schema_carry_the_validation_message() -> None:
    model = ScriptedModel(
        [
            ScriptedModel.call("add", {"a": "one", "c": 2}),
            ScriptedModel.call("add", {"a": 1, "b": 2}),
            ScriptedModel.text("3"),
        ]
    )
    final = await Agent("a", "", model, toolkit=toolkit()).reply("1 + 2")
    bad = last_result(model, 1)
    assert bad.state == "error"
    assert "invalid_parameters" in bad.output
    assert "a: Input should be a valid integer" in bad.output
    assert "b: Field required" in bad.output
    assert final.finished_reason == "completed"


async def test_a_tool_that_raises_is_an_error_result_and_the_loop_goes_on() -> None:
    model = ScriptedModel(
        [ScriptedModel.call("explode", {"reason": "disk full"}), ScriptedModel.text("sorry")]
    )
    final = await Agent("a", "", model, toolkit=toolkit()).reply("go")
    result = last_result(model, 1)
    assert (result.state, result.output) == ("error", "tool_error: RuntimeError: disk full")
    assert final.content == "sorry"


async def test_a_tool_past_its_timeout_is_a_timeout_result() -> None:
    model = ScriptedModel([ScriptedModel.call("slow"), ScriptedModel.text("too slow")])
    final = await Agent("a", "", model, toolkit=toolkit()).reply("go")
    result = last_result(model, 1)
    assert result.state == "timeout"
    assert "did not finish within 0.05s" in result.output
    assert final.finished_reason == "completed"


async def test_the_same_failing_call_three_times_stops_the_reply() -> None:
    call = ScriptedModel.call("explode", {"reason": "again"})
    model = ScriptedModel([call, call, call, ScriptedModel.text("never asked")])
    agent = Agent("a", "", model, toolkit=toolkit())
    final = await agent.reply("go")
    assert final.finished_reason == "repeated_action"
    assert 'explode({"reason": "again"}) failed 3 times in a row' in final.content
    assert "RuntimeError: again" in final.content
    assert runs == ["explode"] * 3
    assert model.remaining == 1
    assert_consistent(agent.memory)


async def test_different_failing_calls_do_not_count_as_repeats() -> None:
    model = ScriptedModel(
        [
            ScriptedModel.call("explode", {"reason": "a"}),
            ScriptedModel.call("explode", {"reason": "b"}),
            ScriptedModel.call("explode", {"reason": "a"}),
            ScriptedModel.text("gave up"),
        ]
    )
    final = await Agent("a", "", model, toolkit=toolkit()).reply("go")
    assert final.finished_reason == "completed"


async def test_a_failing_model_is_retried_with_backoff() -> None:
    model = ScriptedModel([ModelError("503"), TimeoutError(), ScriptedModel.text("fine")])
    config = ModelConfig(max_retries=2, backoff=0.01)
    final = await Agent("a", "", model, settings=AgentSettings(model_calls=config)).reply("hi")
    assert (final.finished_reason, final.content) == ("completed", "fine")
    assert len(model.requests) == 3


async def test_the_fallback_model_answers_when_retries_are_spent() -> None:
    primary = ScriptedModel([ModelError("down")] * 3)
    fallback = ScriptedModel([ScriptedModel.text("from the fallback")], name="backup")
    config = ModelConfig(max_retries=2, backoff=0.0, fallback=fallback)
    final = await Agent("a", "", primary, settings=AgentSettings(model_calls=config)).reply("hi")
    assert final.content == "from the fallback"
    assert len(primary.requests) == 3


async def test_when_every_model_fails_the_reply_ends_with_the_reason() -> None:
    primary = ScriptedModel([ModelError("rate limited")] * 2)
    fallback = ScriptedModel([ModelError("bad key", retryable=False)], name="backup")
    config = ModelConfig(max_retries=1, backoff=0.0, fallback=fallback)
    agent = Agent("a", "", primary, settings=AgentSettings(model_calls=config))
    final = await agent.reply("hi")
    assert final.finished_reason == "error"
    assert "rate limited" in final.content
    assert "bad key" in final.content
    assert len(fallback.requests) == 1  # not retryable: tried once
    assert agent.state.reply is None


async def test_a_model_answering_garbage_is_retried() -> None:
    empty = ScriptedModel.text("   ")
    model = ScriptedModel([empty, ValueError("adapter bug"), ScriptedModel.text("ok")])
    final = await Agent(
        "a", "", model, settings=AgentSettings(model_calls=ModelConfig(backoff=0.0))
    ).reply("hi")
    assert final.content == "ok"


class SlowThenFast:
    """A model whose first call hangs; the second answers."""

    name = "slow-then-fast"

    def __init__(self) -> None:
        self.calls = 0

    async def stream(self, request: ModelRequest) -> AsyncIterator[ModelStreamItem]:
        self.calls += 1
        if self.calls == 1:
            await asyncio.sleep(30)
        async for item in ScriptedModel([ScriptedModel.text("fast")]).stream(request):
            yield item


async def test_a_hanging_model_call_times_out_and_is_retried() -> None:
    model = SlowThenFast()
    config = ModelConfig(timeout=0.05, backoff=0.0)
    final = await Agent("a", "", model, settings=AgentSettings(model_calls=config)).reply("hi")
    assert final.content == "fast"
    assert model.calls == 2


class Hanging:
    """A model that never answers."""

    name = "hanging"

    def __init__(self) -> None:
        self.calls = 0

    async def stream(self, request: ModelRequest) -> AsyncIterator[ModelStreamItem]:
        self.calls += 1
        await asyncio.sleep(30)
        yield ScriptedModel.text("never")


async def test_a_model_past_its_timeout_names_the_limit_and_the_setting(
    caplog: pytest.LogCaptureFixture,
) -> None:
    model = Hanging()
    config = ModelConfig(timeout=0.05, max_retries=2, backoff=0.0)
    final = await Agent("a", "", model, settings=AgentSettings(model_calls=config)).reply("hi")
    limit = "the model did not answer within 0.05 s (ModelConfig.timeout / FLEETBUS_MODEL_TIMEOUT)"
    assert final.finished_reason == "error"
    assert model.calls == 3
    # Said once, with how often, not once per attempt; never a bare TimeoutError.
    assert final.content == f"The model failed: hanging: ModelError: {limit} (3 attempts)"
    warnings = [r.getMessage() for r in caplog.records if "failed (attempt" in r.getMessage()]
    assert len(warnings) == 3
    assert all(limit in w for w in warnings)
    assert "attempt 3/3" in warnings[-1]


async def test_interrupting_a_reply_keeps_memory_consistent() -> None:
    started = asyncio.Event()

    @tool
    async def wait_forever() -> None:
        """Never returns."""
        started.set()
        await asyncio.sleep(60)

    model = ScriptedModel(
        [
            ScriptedModel.calls(
                ("add", {"a": 1, "b": 1}), ("wait_forever", None), ("add", {"a": 2, "b": 2})
            )
        ]
    )
    agent = Agent("a", "", model, toolkit=Toolkit([add, wait_forever]))
    reply = asyncio.create_task(agent.reply("go"))
    await started.wait()
    agent.interrupt()
    final = await reply
    assert final.finished_reason == "interrupted"
    assert_consistent(agent.memory)
    states = [r.state for m in agent.memory for r in m.tool_results]
    assert states.count("cancelled") >= 1
    assert agent.state.reply is None


async def test_leaving_the_stream_early_interrupts_cleanly() -> None:
    started = asyncio.Event()

    @tool
    async def wait_forever() -> None:
        """Never returns."""
        started.set()
        await asyncio.sleep(60)

    model = ScriptedModel([ScriptedModel.call("wait_forever")])
    agent = Agent("a", "", model, toolkit=Toolkit([wait_forever]))
    stream = agent.reply_stream("go")
    async for item in stream:
        if getattr(item, "event", "") == "tool_call":
            break
    await stream.aclose()
    assert_consistent(agent.memory)
    # The agent is free for the next reply.
    model.add(ScriptedModel.text("next"))
    assert (await agent.reply("again")).content == "next"


async def test_cancelling_the_caller_propagates_and_keeps_memory_consistent() -> None:
    started = asyncio.Event()

    @tool
    async def wait_forever() -> None:
        """Never returns."""
        started.set()
        await asyncio.sleep(60)

    agent = Agent(
        "a",
        "",
        ScriptedModel([ScriptedModel.call("wait_forever")]),
        toolkit=Toolkit([wait_forever]),
    )
    task = asyncio.create_task(agent.reply("go"))
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert_consistent(agent.memory)


async def test_a_script_that_runs_out_is_a_clear_error() -> None:
    final = await Agent("a", "", ScriptedModel([])).reply("hi")
    assert final.finished_reason == "error"
    assert "ran out of turns" in final.content


async def test_duplicate_tool_call_ids_from_the_model_are_made_unique() -> None:
    model = ScriptedModel(
        [
            ScriptedModel.calls(
                ("add", {"a": 1, "b": 1}, "same"), ("add", {"a": 2, "b": 2}, "same")
            ),
            ScriptedModel.text("done"),
        ]
    )
    agent = Agent("a", "", model, toolkit=toolkit())
    await agent.reply("go")
    assert_consistent(agent.memory)
    assert runs == ["add", "add"]
