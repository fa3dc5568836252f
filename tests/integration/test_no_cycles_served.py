"""A reply served on the bus, and asked for with a ``RemoteAgent``, leaves no
reference cycle behind: what a host makes for a reply — the session's lease
and records, the agent's clone, the reply's scope — and what a requester
makes — the subscription to the reply's events — is freed by reference
counting as the reply ends. A host raises the cycle collector's threshold
on that ground (``fleetbus.bus.tune_gc``)."""

from __future__ import annotations

import gc

from fleetbus.agents import Agent, AgentSettings
from fleetbus.agents.serving.remote import RemoteAgent
from fleetbus.bus import Bus, EmbeddedServer
from fleetbus.protocol import FinalAnswer, UserRequest
from fleetbus.testing import ScriptedModel
from fleetbus.tools_workers import Toolkit, tool
from tests.helpers import serving


@tool
def noop() -> str:
    """Does nothing."""
    return "ok"


async def test_replies_served_and_asked_for_leave_no_cycle(
    bus: Bus, nats_server: EmbeddedServer
) -> None:
    kit = Toolkit()
    kit.add(noop)
    model = ScriptedModel([ScriptedModel.call("noop", {}), ScriptedModel.text("done")] * 50)
    agent = Agent("acyclic", "You help.", model, toolkit=kit, settings=AgentSettings(max_iters=3))
    async with serving(nats_server.url, bus.prefix, agent, checkpoints="reply"):

        async def ask(number: int) -> None:
            session = f"s{number}"
            answer: object
            if number % 2:
                answer = await RemoteAgent(bus, "acyclic", session_id=session).reply(
                    "hello", timeout=30
                )
            else:  # a plain request: no subscription of the requester's
                answer = await bus.request(
                    bus.subjects.agent_inbox("acyclic"),
                    UserRequest(session_id=session, content="hello"),
                    timeout=30,
                )
            assert isinstance(answer, FinalAnswer), answer
            assert answer.content == "done"

        for number in range(4):  # caches, subscriptions, the store's streams
            await ask(number)
        gc.collect()
        gc.disable()
        try:
            for number in range(4, 44):
                await ask(number)
        finally:
            found = gc.collect()
            gc.enable()
    assert found == 0
