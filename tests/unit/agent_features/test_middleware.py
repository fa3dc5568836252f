"""Middleware: onion order, the system prompt transformer, budgets and step logs."""

from __future__ import annotations

import dataclasses
import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from types import FrameType
from typing import Any

import pytest

from fleetbus import Agent, BudgetLimit, StepLogger, Toolkit, tool
from fleetbus.agents import AgentSettings, Middleware, Msg, ReplyContext
from fleetbus.models import ModelRequest, ModelResponse
from fleetbus.models.model import ModelStreamItem
from fleetbus.protocol import FinalAnswer, ToolResultBlock, ToolUseBlock, Usage
from fleetbus.testing import ScriptedModel

from ._support import result_for, text_of, unanswered


class Recorder(Middleware):
    """Records entering (``>``) and leaving (``<``) each hook."""

    def __init__(self, name: str, log: list[str]) -> None:
        self.name = name
        self.log = log

    async def on_reply(
        self, ctx: ReplyContext, call_next: Callable[[], Awaitable[FinalAnswer]]
    ) -> FinalAnswer:
        self.log.append(f"{self.name}>reply")
        final = await call_next()
        self.log.append(f"{self.name}<reply")
        return final

    async def on_reasoning(self, ctx: ReplyContext, call_next: Callable[[], Awaitable[Msg]]) -> Msg:
        self.log.append(f"{self.name}>reasoning")
        message = await call_next()
        self.log.append(f"{self.name}<reasoning")
        return message

    async def on_model_call(
        self,
        ctx: ReplyContext,
        request: ModelRequest,
        call_next: Callable[[ModelRequest], Awaitable[ModelResponse]],
    ) -> ModelResponse:
        self.log.append(f"{self.name}>model")
        response = await call_next(request)
        self.log.append(f"{self.name}<model")
        return response

    async def on_tool_call(
        self,
        ctx: ReplyContext,
        call: ToolUseBlock,
        call_next: Callable[[ToolUseBlock], Awaitable[ToolResultBlock]],
    ) -> ToolResultBlock:
        self.log.append(f"{self.name}>tool")
        result = await call_next(call)
        self.log.append(f"{self.name}<tool")
        return result


class Suffix(Middleware):
    """Appends a tag and the step number to the system prompt."""

    def __init__(self, tag: str) -> None:
        self.tag = tag

    def system_prompt(self, prompt: str, ctx: ReplyContext) -> str:
        return f"{prompt} [{self.tag}{ctx.iteration}]"


def _costing(response: ModelResponse, tokens: int) -> ModelResponse:
    """``response`` reporting ``tokens`` input and output tokens."""
    return dataclasses.replace(response, usage=Usage(input_tokens=tokens, output_tokens=tokens))


def _counting_tool(runs: list[str]) -> Toolkit:
    @tool
    def ping(label: str) -> str:
        """Answer pong.

        Args:
            label: echoed back.
        """
        runs.append(label)
        return f"pong {label}"

    return Toolkit([ping])


async def test_first_middleware_is_the_outermost_layer_of_every_hook() -> None:
    log: list[str] = []
    model = ScriptedModel([ScriptedModel.call("ping", {"label": "x"}), "done"])
    agent = Agent(
        "a",
        "You ping.",
        model,
        toolkit=_counting_tool([]),
        middlewares=[Recorder("A", log), Recorder("B", log)],
    )

    answer = await agent.reply("ping once")

    assert answer.finished_reason == "completed"
    step = ["A>reasoning", "B>reasoning", "A>model", "B>model", "B<model", "A<model"]
    step += ["B<reasoning", "A<reasoning"]
    tool_call = ["A>tool", "B>tool", "B<tool", "A<tool"]
    assert log == ["A>reply", "B>reply", *step, *tool_call, *step, "B<reply", "A<reply"]


class ToolsOnly(Middleware):
    """Overrides one hook, the Recorder's ``on_tool_call``: every other hook
    is the base class's, which passes through."""

    on_tool_call = Recorder.on_tool_call

    def __init__(self, log: list[str]) -> None:
        self.name = "T"
        self.log = log


class FrameCountingModel(ScriptedModel):
    """Counts, at each model call, the middleware wrappers it is called through."""

    def __init__(self, script: list[Any]) -> None:
        super().__init__(script)
        self.wrappers: list[int] = []

    async def stream(self, request: ModelRequest) -> AsyncIterator[ModelStreamItem]:
        frame: FrameType | None = inspect.currentframe()
        wrappers = 0
        while frame is not None:
            wrappers += frame.f_code.co_qualname == "_layer.<locals>.call"
            frame = frame.f_back
        self.wrappers.append(wrappers)
        async for item in super().stream(request):
            yield item


async def test_a_hook_a_layer_does_not_override_is_not_wrapped() -> None:
    log: list[str] = []
    model = FrameCountingModel([ScriptedModel.call("ping", {"label": "x"}), "done"])
    reasoning = Recorder("R", log)
    # A hook given to one instance (not its class) is that layer's own.
    own = ToolsOnly(log)

    async def around(ctx: ReplyContext, call_next: Callable[[], Awaitable[Msg]]) -> Msg:
        log.append("own>reasoning")
        return await call_next()

    own.on_reasoning = around  # type: ignore[method-assign]
    agent = Agent(
        "a",
        "You ping.",
        model,
        toolkit=_counting_tool([]),
        middlewares=[ToolsOnly(log), own, reasoning],
    )

    answer = await agent.reply("ping once")

    assert answer.finished_reason == "completed"
    assert log.count("T>tool") == 2  # both ToolsOnly layers saw the call
    assert log.count("own>reasoning") == 2  # one per step
    # At each model call, inside: the Recorder's reply, reasoning and model
    # call layers, and the instance's reasoning layer; none for the hooks
    # left as they pass (three layers wrapping each of the three: 9).
    assert model.wrappers == [4, 4]


async def test_system_prompt_transformers_apply_in_list_order_before_each_model_call() -> None:
    model = ScriptedModel([ScriptedModel.call("ping", {"label": "x"}), "done"])
    agent = Agent(
        "a",
        "You ping.",
        model,
        toolkit=_counting_tool([]),
        middlewares=[Suffix("A"), Suffix("B")],
    )

    await agent.reply("ping once")

    systems = [r.messages[0] for r in model.requests]
    assert [m.role for m in systems] == ["system", "system"]
    assert [text_of(m) for m in systems] == ["You ping. [A0] [B0]", "You ping. [A1] [B1]"]
    assert agent.system_prompt == "You ping."
    assert all(m.role != "system" for m in agent.memory)


async def test_tool_call_budget_stops_before_the_second_call_with_one_last_answer() -> None:
    runs: list[str] = []
    model = ScriptedModel(
        [
            ScriptedModel.call("ping", {"label": "first"}),
            ScriptedModel.call("ping", {"label": "second"}, call_id="second"),
            "I pinged once.",
        ]
    )
    agent = Agent(
        "a",
        "You ping.",
        model,
        toolkit=_counting_tool(runs),
        middlewares=[BudgetLimit(max_tool_calls=1)],
    )

    answer = await agent.reply("ping twice")

    assert runs == ["first"]
    assert answer.finished_reason == "error"
    assert answer.content == "I pinged once."
    assert len(model.requests) == 3
    last = model.requests[2]
    assert last.tools == []
    assert last.tool_choice == "none"
    assert "budget of 1 tool calls" in text_of(last.messages[-1])
    stopped = result_for(agent.memory, "second")
    assert stopped.state == "cancelled"
    assert unanswered(agent.memory) == []
    assert agent.memory[-1].text == "I pinged once."


async def test_token_budget_ends_the_reply_before_a_second_model_call() -> None:
    runs: list[str] = []
    model = ScriptedModel([ScriptedModel.call("ping", {"label": "x"}), "never said"])
    agent = Agent(
        "a",
        "You ping.",
        model,
        toolkit=_counting_tool(runs),
        middlewares=[BudgetLimit(max_tokens=1)],
    )

    answer = await agent.reply("ping")

    assert answer.finished_reason == "error"
    assert "budget of 1 tokens" in str(answer.content)
    assert len(model.requests) == 1
    assert model.remaining == 1
    assert runs == ["x"]
    assert unanswered(agent.memory) == []
    assert agent.state.reply is None


async def test_step_logger_logs_each_model_call_and_each_tool_call(
    caplog: pytest.LogCaptureFixture,
) -> None:
    model = ScriptedModel(
        [
            ScriptedModel.calls(("ping", {"label": "a"}), ("ping", {"label": "b"})),
            ScriptedModel.call("ping", {"label": "c"}),
            "done",
        ]
    )
    agent = Agent("a", "You ping.", model, toolkit=_counting_tool([]), middlewares=[StepLogger()])

    with caplog.at_level(logging.INFO, logger="fleetbus.agents.steps"):
        answer = await agent.reply("ping three times")

    records = [r for r in caplog.records if r.name == "fleetbus.agents.steps"]
    messages = [r.getMessage() for r in records]
    model_logs = [m for m in messages if ": model " in m]
    tool_logs = [m for m in messages if ": tool ping -> success" in m]
    assert len(model_logs) == len(model.requests) == 3
    assert len(tool_logs) == 3
    assert [m for m in messages if " reply " in m] == [messages[0], messages[-1]]
    assert "completed" in messages[-1]
    assert getattr(records[0], "call_id", None) == answer.call_id


async def test_tool_call_budget_in_a_parallel_step_ends_cleanly() -> None:
    runs: list[str] = []
    model = ScriptedModel(
        [
            ScriptedModel.calls(("ping", {"label": "a"}), ("ping", {"label": "b"})),
            "I pinged once.",
        ]
    )
    agent = Agent(
        "a",
        "You ping.",
        model,
        toolkit=_counting_tool(runs),
        middlewares=[BudgetLimit(max_tool_calls=1)],
        settings=AgentSettings(parallel_tool_calls=True),
    )

    answer = await agent.reply("ping twice")

    assert unanswered(agent.memory) == []
    assert answer.finished_reason == "error"
    assert answer.content == "I pinged once."


async def test_tool_call_budget_keeps_the_result_of_a_call_that_ran_in_the_same_step() -> None:
    runs: list[str] = []
    model = ScriptedModel(
        [
            ScriptedModel.calls(("ping", {"label": "a"}, "ran"), ("ping", {"label": "b"}, "not")),
            "I pinged once.",
        ]
    )
    agent = Agent(
        "a",
        "You ping.",
        model,
        toolkit=_counting_tool(runs),
        middlewares=[BudgetLimit(max_tool_calls=1)],
    )

    await agent.reply("ping twice")

    assert runs == ["a"]
    assert result_for(agent.memory, "not").state == "cancelled"
    ran = result_for(agent.memory, "ran")
    assert (ran.state, ran.output) == ("success", "pong a")


async def test_token_budget_spent_during_the_last_answer_still_ends_with_reply_end() -> None:
    # 1 tool call allowed; 10 + 10 tokens a call: the budget of 30 lets the second model
    # call through (20 used) and refuses the summarizing third (40 used).
    model = ScriptedModel(
        [
            _costing(ScriptedModel.call("ping", {"label": "a"}), 10),
            _costing(ScriptedModel.call("ping", {"label": "b"}), 10),
            "never said",
        ]
    )
    agent = Agent(
        "a",
        "You ping.",
        model,
        toolkit=_counting_tool([]),
        middlewares=[BudgetLimit(max_tool_calls=1, max_tokens=30)],
    )

    items = [item async for item in agent.reply_stream("ping twice")]

    answer = items[-1]
    assert isinstance(answer, FinalAnswer)
    assert len(model.requests) == 2  # the budget refused the third call
    assert answer.finished_reason == "error"
    assert not str(answer.content).startswith("internal error")
    assert answer.call_id is not None
    assert [getattr(e, "event", None) for e in items[-2:]] == ["reply_end", None]
