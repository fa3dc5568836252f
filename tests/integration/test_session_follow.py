"""Following a session's journal: a client that joins late sees the facts
the journal holds, then each new one as it is appended — the same facts in
the same order as a client that was there from the start, each once."""

from __future__ import annotations

import asyncio

from fleetbus.agents import Agent, RemoteAgent
from fleetbus.agents.serving.sessions import SessionFact, SessionStore
from fleetbus.bus import Bus, EmbeddedServer
from fleetbus.testing import ScriptedModel
from fleetbus.tools_workers import Toolkit, tool
from tests.helpers import serving


@tool
def add(a: int, b: int) -> int:
    """Add two numbers."""
    return a + b


async def collect(store: SessionStore, got: list[SessionFact], ends: int) -> None:
    """Follow session f1 until ``ends`` end facts have come."""
    async for fact in store.follow("calc", "f1"):
        got.append(fact)
        if sum(f.kind == "end" for f in got) == ends:
            return


async def test_a_late_follower_sees_the_same_facts_in_the_same_order(
    nats_server: EmbeddedServer, bus: Bus, prefix: str
) -> None:
    model = ScriptedModel(
        [
            ScriptedModel.call("add", {"a": 1, "b": 2}),
            "three",
            ScriptedModel.call("add", {"a": 2, "b": 2}),
            "four",
        ]
    )
    store = await SessionStore.open(bus, owner="follower")
    agent = Agent("calc", "", model, toolkit=Toolkit([add]))
    async with serving(nats_server.url, prefix, agent):
        remote = RemoteAgent(bus, "calc", session_id="f1", timeout=30)
        await remote.reply("add 1 and 2")  # a session with one reply already
        early: list[SessionFact] = []
        following = asyncio.create_task(collect(store, early, ends=2))
        await asyncio.sleep(0)  # (it catches up while the next reply runs)
        await remote.reply("add 2 and 2")
        await asyncio.wait_for(following, 30)
    late: list[SessionFact] = []
    await asyncio.wait_for(collect(store, late, ends=2), 30)  # joins after both replies

    def shape(facts: list[SessionFact]) -> list[tuple[str, tuple[int, int], object]]:
        return [(f.kind, f.writer, f.final.get("content") if f.final else None) for f in facts]

    assert shape(early) == shape(late)
    # The second reply took the session its first released: its first fact
    # carries the request taken.
    assert [f.kind for f in late] == ["taken", "calls", "step", "end", "calls", "step", "end"]
    assert [f.owner for f in late] == ["calc@test", None, None, None, "calc@test", None, None]
    assert [f.final["content"] for f in late if f.final] == ["three", "four"]
    assert [f.n for f in early] == list(range(1, 8))
