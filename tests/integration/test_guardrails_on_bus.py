"""Guardrails of a served agent, on a real nats-server: the caller's final
answer carries ``guardrail_tripped`` and the trip, the session's journal keeps
it, the checks travel as ``guardrail`` events; an agent guardrail is another
agent of the fleet asked through ``RemoteAgent`` (a scripted model answering
the verdict as a structured answer), and failing it fails closed."""

from __future__ import annotations

import asyncio
from typing import Any

from fleetbus.agents import Agent, RemoteAgent
from fleetbus.agents.serving.sessions import SessionStore
from fleetbus.bus import Bus, EmbeddedServer
from fleetbus.capabilities import AgentGuardrail, Guardrails, PatternGuardrail
from fleetbus.models import FINISH_TOOL, ModelRequest, ModelResponse
from fleetbus.protocol import Event, FinalAnswer, GuardrailTrip, TextBlock
from fleetbus.testing import ScriptedModel
from tests.helpers import serving


def verdict(tripped: bool, reason: str) -> ModelResponse:
    """The guardrail agent's model, answering in the verdict's structure."""
    return ScriptedModel.call(FINISH_TOOL, {"tripped": tripped, "reason": reason})


def asked(request: ModelRequest) -> str:
    """The text of the last message a model was sent."""
    return "".join(b.text for b in request.messages[-1].content if isinstance(b, TextBlock))


async def test_an_agent_guardrail_on_the_bus_trips_a_served_agent(
    nats_server: EmbeddedServer, bus: Bus, prefix: str
) -> None:
    moderator_model = ScriptedModel([verdict(True, "it asks for homework")])
    moderator = Agent("moderator", "Stop homework requests.", moderator_model)
    helper_model = ScriptedModel([ScriptedModel.text("Here is your essay.")])
    helper = Agent(
        "helper",
        "You help.",
        helper_model,
        capabilities=[Guardrails(input=[AgentGuardrail("moderator", bus=bus, timeout=20)])],
    )
    async with (
        serving(nats_server.url, prefix, moderator, replica="m"),
        serving(nats_server.url, prefix, helper, replica="h"),
    ):
        remote = RemoteAgent(bus, "helper", timeout=30)
        items = [item async for item in remote.reply_stream("Write my homework essay")]
        store = await SessionStore.open(bus, owner="test")
        record = await store.get("helper", remote.session_id)

    final = items[-1]
    assert isinstance(final, FinalAnswer)
    assert final.finished_reason == "guardrail_tripped"
    assert final.guardrail == GuardrailTrip(
        name="moderator", stage="input", reason="it asks for homework"
    )
    assert "Here is your essay" not in str(final.content)
    # The moderator was asked the request, for a structured verdict.
    [question] = moderator_model.requests
    assert "Write my homework essay" in asked(question)
    assert FINISH_TOOL in [spec.name for spec in question.tools]
    # The check travelled as an event.
    events = [i for i in items if isinstance(i, Event) and i.event == "guardrail"]
    assert [(e.data["name"], e.data["stage"], e.data["tripped"]) for e in events] == [
        ("moderator", "input", True)
    ]
    # The journal keeps the trip: the answer, and memory's last message.
    assert record is not None
    assert record.final is not None
    assert record.final["finished_reason"] == "guardrail_tripped"
    assert record.final["guardrail"] == {
        "name": "moderator",
        "stage": "input",
        "reason": "it asks for homework",
    }
    last = record.state.memory[-1]
    assert last.role == "assistant"
    assert last.metadata["guardrail"]["name"] == "moderator"


async def test_a_guardrail_agent_that_lets_through_and_an_output_trip(
    nats_server: EmbeddedServer, bus: Bus, prefix: str
) -> None:
    moderator = Agent("moderator", "", ScriptedModel([verdict(False, "a fair question")]))
    helper_model = ScriptedModel([ScriptedModel.text("The token is abc123.")])
    helper = Agent(
        "helper",
        "",
        helper_model,
        capabilities=[
            Guardrails(
                input=[AgentGuardrail("moderator", bus=bus, timeout=20)],
                output=[PatternGuardrail([r"token is \w+"], name="no-tokens")],
            )
        ],
    )
    async with (
        serving(nats_server.url, prefix, moderator, replica="m"),
        serving(nats_server.url, prefix, helper, replica="h"),
    ):
        final = await RemoteAgent(bus, "helper", timeout=30).reply("What is the token?")

    assert final.finished_reason == "guardrail_tripped"
    assert final.guardrail == GuardrailTrip(
        name="no-tokens", stage="output", reason="it matches the pattern 'token is \\w+'"
    )
    assert "abc123" not in str(final.content)


async def test_a_guardrail_agent_that_answers_no_verdict_fails_closed(
    nats_server: EmbeddedServer, bus: Bus, prefix: str
) -> None:
    # The guardrail agent answers text where a structured verdict was asked:
    # reminded, it still does not, and its reply ends "error".
    moderator = Agent("moderator", "", ScriptedModel(["I think it is fine."], repeat_last=True))
    helper = Agent(
        "helper",
        "",
        ScriptedModel([ScriptedModel.text("Hello.")]),
        capabilities=[Guardrails(input=[AgentGuardrail("moderator", bus=bus, timeout=20)])],
    )
    async with (
        serving(nats_server.url, prefix, moderator, replica="m"),
        serving(nats_server.url, prefix, helper, replica="h"),
    ):
        final = await RemoteAgent(bus, "helper", timeout=30).reply("Hi")

    assert final.finished_reason == "guardrail_tripped"
    assert final.guardrail is not None
    assert final.guardrail.reason.startswith(
        "the check failed: the agent 'moderator' gave no verdict (error:"
    )


async def test_a_tool_call_on_a_served_agent_is_stopped_before_it_runs(
    nats_server: EmbeddedServer, bus: Bus, prefix: str
) -> None:
    from fleetbus import Toolkit, tool

    runs: list[dict[str, Any]] = []

    @tool
    def shell(command: str) -> str:
        """Run a shell command.

        Args:
            command: the command.
        """
        runs.append({"command": command})
        return "ok"

    helper = Agent(
        "helper",
        "",
        ScriptedModel([ScriptedModel.call("shell", {"command": "rm -rf /"})]),
        toolkit=Toolkit([shell]),
        capabilities=[Guardrails(tools=[PatternGuardrail(["rm -rf"], name="no-rm")])],
    )
    async with serving(nats_server.url, prefix, helper, replica="h"):
        final = await asyncio.wait_for(
            RemoteAgent(bus, "helper", timeout=30).reply("Clean the disk"), 40
        )

    assert runs == []
    assert final.finished_reason == "guardrail_tripped"
    assert final.guardrail == GuardrailTrip(
        name="no-rm", stage="tool_input", reason="it matches the pattern 'rm -rf'"
    )
