"""The middleware seams a guardrail needs, on their own: ``on_answer`` sees
the answer before it is given and may refuse it (it is then neither given
nor kept), and ``ReplyContext.event`` emits a layer's event in the reply's
stream."""

from __future__ import annotations

from typing import Any

from fleetbus import Agent
from fleetbus.agents import Middleware, ReplyContext, StopReply
from fleetbus.protocol import Event, FinalAnswer
from fleetbus.testing import ScriptedModel


class Refuses(Middleware):
    """Refuses answers with ``word``; says what it saw in an event."""

    def __init__(self, word: str) -> None:
        self.word = word
        self.seen: list[tuple[str, dict[str, Any] | None]] = []

    async def on_answer(
        self, ctx: ReplyContext, content: str, structured: dict[str, Any] | None
    ) -> None:
        self.seen.append((content, structured))
        ctx.event("checked", word=self.word, refused=self.word in content)
        if self.word in content:
            raise StopReply(f"the answer says {self.word!r}")


async def test_a_layer_refuses_an_answer_that_is_then_neither_given_nor_kept() -> None:
    layer = Refuses("secret")
    model = ScriptedModel([ScriptedModel.text("The secret is 7.")])
    agent = Agent("helper", "", model, middlewares=[layer])
    items = [item async for item in agent.reply_stream("Tell me")]
    *events, final = items

    assert isinstance(final, FinalAnswer)
    assert layer.seen == [("The secret is 7.", None)]
    assert final.finished_reason == "error"
    assert final.content == "Stopped: the answer says 'secret'."
    assert [m.role for m in agent.memory] == ["user"]
    checked = [e for e in events if isinstance(e, Event) and e.event == "checked"]
    assert [e.data for e in checked] == [{"word": "secret", "refused": True}]
    seqs = [e.seq for e in events if isinstance(e, Event)]
    assert seqs == list(range(len(seqs)))  # numbered with the reply's own


async def test_an_answer_a_layer_lets_through_is_given() -> None:
    layer = Refuses("secret")
    agent = Agent("helper", "", ScriptedModel(["All public."]), middlewares=[layer])
    final = await agent.reply("Tell me")

    assert (final.finished_reason, final.content) == ("completed", "All public.")
    assert layer.seen == [("All public.", None)]
    assert agent.memory[-1].text == "All public."
