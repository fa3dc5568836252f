"""Handoffs on the bus, agents served in this process: the hand-over is one
trace, and a handoff to an agent nobody serves is a clear error."""

from __future__ import annotations

import asyncio

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from fleetbus.agents import Agent
from fleetbus.agents.serving import RemoteAgent
from fleetbus.bus import Bus, EmbeddedServer
from fleetbus.capabilities import Handoffs, HandoffTo
from fleetbus.testing import ScriptedModel
from tests.helpers import serving


def _triage(to: str = "billing", **options: object) -> Agent:
    return Agent(
        "triage",
        "",
        ScriptedModel(
            [ScriptedModel.call(f"transfer_to_{to}", {"reason": "money"})], repeat_last=True
        ),
        capabilities=[Handoffs([HandoffTo(to, **options)])],  # type: ignore[arg-type]
    )


async def test_the_hand_over_is_one_trace(
    nats_server: EmbeddedServer, bus: Bus, spans: InMemorySpanExporter
) -> None:
    billing = Agent("billing", "", ScriptedModel([ScriptedModel.text("Refunded.")]))
    async with (
        serving(nats_server.url, bus.prefix, _triage()),
        serving(nats_server.url, bus.prefix, billing),
    ):
        answer = await RemoteAgent(bus, "triage", session_id="t1").reply("charged twice")
    assert (answer.sender, answer.content) == ("billing", "Refunded.")
    finished = spans.get_finished_spans()
    (ask,) = [s for s in finished if s.name == "fleetbus ask"]
    (handoff,) = [s for s in finished if s.name == "fleetbus handoff"]
    assert handoff.attributes is not None
    assert handoff.attributes["fleetbus.handoff.to"] == "billing"
    replies = [s for s in finished if s.name == "fleetbus reply"]
    assert {s.attributes["fleetbus.agent"] for s in replies if s.attributes} >= {
        "triage",
        "billing",
    }
    trace = ask.context.trace_id
    assert all(s.context.trace_id == trace for s in [handoff, *replies])  # one trace
    by_id = {s.context.span_id: s for s in finished}

    def ancestors(span: object) -> list[int]:
        out = []
        parent = getattr(span, "parent", None)
        while parent is not None:
            out.append(parent.span_id)
            parent = getattr(by_id.get(parent.span_id), "parent", None)
        return out

    (billing_reply,) = [
        s for s in replies if s.attributes and s.attributes["fleetbus.agent"] == "billing"
    ]
    assert handoff.context.span_id in ancestors(billing_reply)  # under the hand-over


async def test_a_handoff_to_an_agent_nobody_serves_is_an_error_for_the_requester(
    nats_server: EmbeddedServer, bus: Bus
) -> None:
    async with serving(nats_server.url, bus.prefix, _triage("nobody")):
        answer = await RemoteAgent(bus, "triage", session_id="t2", timeout=30).reply("hello")
    assert answer.finished_reason == "error"
    assert "could not be handed over to nobody: no agent 'nobody' is served" in str(answer.content)


async def test_what_the_other_agent_gets_goes_through_the_input_filter(
    nats_server: EmbeddedServer, bus: Bus
) -> None:
    model = ScriptedModel([ScriptedModel.text("Refunded.")])
    billing = Agent("billing", "", model)
    async with (
        serving(nats_server.url, bus.prefix, _triage(input_filter="last_user")),
        serving(nats_server.url, bus.prefix, billing),
    ):
        remote = RemoteAgent(bus, "triage", session_id="t3")
        await remote.reply("first")
    (request,) = model.requests
    assert [(m.role, m.content[0].text) for m in request.messages] == [("user", "first")]  # type: ignore[union-attr]


async def test_a_later_request_goes_on_to_the_agent_holding_the_conversation_once_it_serves(
    nats_server: EmbeddedServer, bus: Bus
) -> None:
    """A later request of the session goes on to billing; sent there while
    no replica of billing runs, it is lost, but triage sent no receipt for
    it: the requester sends it again until billing holds it."""
    billing = Agent(
        "billing", "", ScriptedModel([ScriptedModel.text("Refunded."), ScriptedModel.text("Sent.")])
    )
    remote = RemoteAgent(bus, "triage", session_id="t4", timeout=60)
    async with serving(nats_server.url, bus.prefix, _triage()):
        async with serving(nats_server.url, bus.prefix, billing):
            first = await remote.reply("charged twice")
        assert (first.sender, first.content) == ("billing", "Refunded.")
        # Sent on into nothing (no replica of billing runs): seen here, not answered.
        async with await bus.observe(bus.subjects.agent_inbox("billing")) as inbox:
            later = asyncio.create_task(remote.reply("and the invoice?"))
            async for passed in inbox:
                assert passed.call_id is not None
                break
        assert not later.done()
        async with serving(nats_server.url, bus.prefix, billing):
            answer = await later
    assert (answer.sender, answer.content) == ("billing", "Sent.")
    (_, request) = billing.model.requests  # type: ignore[attr-defined]
    assert [m.role for m in request.messages][-1] == "user"
