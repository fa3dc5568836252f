"""A reply leaves no reference cycle behind: what it made is freed by
reference counting as it ends. A host serving many agents raises the cycle
collector's threshold (``fleetbus.bus.tune_gc``) on that ground; a cycle in
every reply kept each reply's objects alive until a collection, and a
population host's memory and CPU a reply grew with them."""

from __future__ import annotations

import gc
from collections.abc import Awaitable, Callable

from fleetbus.agents import Agent, AgentSettings, Middleware, ReplyContext
from fleetbus.capabilities import Guardrails, PatternGuardrail
from fleetbus.protocol import Event, FinalAnswer
from fleetbus.testing import ScriptedModel
from fleetbus.tools_workers import Toolkit, tool

SETTINGS = AgentSettings(max_iters=3)


@tool
def noop() -> str:
    """Does nothing."""
    return "ok"


def toolkit() -> Toolkit:
    kit = Toolkit()
    kit.add(noop)
    return kit


class Watching(Middleware):
    """A layer that watches the events and emits one of its own."""

    def __init__(self) -> None:
        self.seen = 0

    def on_event(self, ctx: ReplyContext, event: Event) -> None:
        self.seen += 1

    async def on_reply(
        self, ctx: ReplyContext, call_next: Callable[[], Awaitable[FinalAnswer]]
    ) -> FinalAnswer:
        ctx.event("watched", note="a reply began")
        return await call_next()


def model() -> ScriptedModel:
    return ScriptedModel([ScriptedModel.call("noop", {}), ScriptedModel.text("done")])


async def cycles_left(reply: Callable[[int], Awaitable[object]], replies: int = 20) -> int:
    """The objects the cycle collector finds unreachable after ``replies``
    replies made with it off (after two replies that warm caches up)."""
    for number in range(2):
        await reply(number)
    gc.collect()
    gc.disable()
    try:
        for number in range(replies):
            await reply(number)
    finally:
        found = gc.collect()
        gc.enable()
    return found


async def test_a_reply_with_a_tool_call_leaves_no_cycle() -> None:
    kit = toolkit()

    async def reply(number: int) -> object:
        agent = Agent(f"a{number}", "You help.", model(), toolkit=kit, settings=SETTINGS)
        answer = await agent.reply("hello")
        assert answer.content == "done"
        return answer

    assert await cycles_left(reply) == 0


async def test_a_streamed_reply_with_layers_and_guardrails_leaves_no_cycle() -> None:
    kit = toolkit()
    watching = Watching()
    guarded = Guardrails(input=[PatternGuardrail(r"secret")], output=[PatternGuardrail(r"key")])

    async def reply(number: int) -> object:
        agent = Agent(
            f"a{number}",
            "You help.",
            model(),
            toolkit=kit,
            settings=SETTINGS,
            middlewares=[watching],
            capabilities=[guarded],
        )
        items = [item async for item in agent.reply_stream("hello")]
        assert isinstance(items[-1], FinalAnswer)
        assert "watched" in [item.event for item in items if isinstance(item, Event)]
        return items

    assert await cycles_left(reply) == 0
    assert watching.seen > 0
