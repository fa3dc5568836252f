"""reply_stream(events=False) yields the final answer alone and makes no
events, but for the middleware that watches them; the reply is the same.
reply() makes none either."""

from __future__ import annotations

from typing import Any

import pytest

from fleetbus.agents import Agent, Middleware
from fleetbus.agents.events import EventFactory
from fleetbus.agents.middleware import ReplyContext
from fleetbus.protocol import Event, FinalAnswer
from fleetbus.testing import ScriptedModel
from fleetbus.tools_workers import Toolkit, tool


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def adder(*middlewares: Middleware) -> Agent:
    model = ScriptedModel(
        [ScriptedModel.call("add", {"a": 2, "b": 3}), ScriptedModel.text("It is 5.")],
        repeat_last=False,
    )
    return Agent("adder", "", model, toolkit=Toolkit([add]), middlewares=middlewares)


class Watching(Middleware):
    def __init__(self) -> None:
        self.seen: list[str] = []

    def on_event(self, ctx: ReplyContext, event: Event) -> None:
        self.seen.append(event.event)


async def test_without_events_only_the_final_answer_comes_and_the_reply_is_the_same() -> None:
    with_events, without = adder(), adder()

    streamed = [item async for item in with_events.reply_stream("2+3?", session_id="s")]
    quiet = [item async for item in without.reply_stream("2+3?", session_id="s", events=False)]

    assert [type(i).__name__ for i in quiet] == ["FinalAnswer"]
    assert isinstance(streamed[-1], FinalAnswer)
    # (the events themselves, in order: tests/unit/agent_features/test_events.py)
    assert {"tool_call", "tool_result", "reply_end"} <= {
        e.event for e in streamed if isinstance(e, Event)
    }
    final = quiet[0]
    assert isinstance(final, FinalAnswer)
    assert (final.content, final.finished_reason) == (streamed[-1].content, "completed")
    assert [m.text for m in without.memory] == [m.text for m in with_events.memory]


async def test_the_middleware_watching_events_still_sees_every_one() -> None:
    watching = Watching()

    [final] = [i async for i in adder(watching).reply_stream("2+3?", events=False)]

    assert isinstance(final, FinalAnswer)
    assert watching.seen[0] == "reply_start"
    assert watching.seen[-1] == "reply_end"
    assert "tool_result" in watching.seen


async def test_reply_makes_no_events_but_for_the_middleware_watching(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    made: list[str] = []
    make = EventFactory.__call__

    def counting(self: EventFactory, name: str, **data: Any) -> Event:
        made.append(name)
        return make(self, name, **data)

    monkeypatch.setattr(EventFactory, "__call__", counting)
    streamed = [item async for item in adder().reply_stream("2+3?")]
    assert len(made) == len(streamed) - 1  # (the counter sees what a stream makes)
    made.clear()

    final = await adder().reply("2+3?")

    assert (final.content, final.finished_reason) == ("It is 5.", "completed")
    assert made == []
    watching = Watching()
    assert (await adder(watching).reply("2+3?")).content == "It is 5."
    assert watching.seen == made
    assert watching.seen[0] == "reply_start"
    assert watching.seen[-1] == "reply_end"
