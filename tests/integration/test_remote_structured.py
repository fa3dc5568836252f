"""Structured output asked for by a remote caller: the ``user_request`` carries
the JSON Schema of the answer (``output_schema``), the served agent offers the
finish tool with it and checks the model's answer, and the ``final_answer``
carries the validated object (``structured``). An answer that does not fit is
shown to the model and retried, then the reply ends ``error``; a request
without a schema is answered as before; a take-over keeps asking for the
schema the reply started with."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from pydantic import BaseModel

from fleetbus.agents import Agent, RemoteAgent
from fleetbus.agents.serving.sessions import SessionStore
from fleetbus.bus import Bus, EmbeddedServer
from fleetbus.errors import ConfigError
from fleetbus.models import FINISH_TOOL
from fleetbus.protocol import (
    AgentMessage,
    AnyMessage,
    ConfirmResult,
    FinalAnswer,
    TextBlock,
    ToolResultBlock,
    UserRequest,
    decode,
    to_builtins,
)
from fleetbus.testing import ScriptedModel
from tests.helpers import ghost_reply, serving

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "celsius": {"type": "number"},
        "sky": {"enum": ["sunny", "cloudy"]},
    },
    "required": ["city", "celsius"],
}


class Forecast(BaseModel):
    city: str
    celsius: float


def finish(arguments: dict[str, Any]) -> Any:
    return ScriptedModel.call(FINISH_TOOL, arguments)


def finish_results(model: ScriptedModel) -> list[ToolResultBlock]:
    """The finish tool's results the model was sent, in order."""
    return [
        block
        for request in model.requests
        for block in request.messages[-1].content
        if isinstance(block, ToolResultBlock) and block.name == FINISH_TOOL
    ]


async def requests_seen(bus: Bus, agent: str) -> tuple[list[AnyMessage], Any]:
    """Every message sent to ``agent``'s inbox from now on (and how to stop)."""
    seen: list[AnyMessage] = []

    async def cb(msg: Any) -> None:
        seen.append(decode(msg.data))

    sub = await bus.nc.subscribe(bus.subjects.agent_inbox(agent), cb=cb)
    await bus.flush()
    return seen, sub


async def test_a_request_with_a_schema_gets_the_validated_object(
    nats_server: EmbeddedServer, bus: Bus, prefix: str
) -> None:
    model = ScriptedModel(
        [
            finish({"city": "Oslo", "celsius": 3.5, "sky": "sunny"}),
            finish({"city": "Rome", "celsius": 18}),
            finish({"city": "Lima", "celsius": 20}),
        ]
    )
    async with serving(nats_server.url, prefix, Agent("forecaster", "", model)):
        inbox, sub = await requests_seen(bus, "forecaster")
        remote = RemoteAgent(bus, "forecaster", timeout=10)
        answer = await remote.reply("Weather in Oslo?", schema=SCHEMA)
        # A pydantic model is sent as its JSON Schema.
        typed = await remote.reply("And in Rome?", schema=Forecast, session_id="typed")
        # An agent message asks the same way, streamed.
        items = [
            item
            async for item in remote.reply_stream(
                AgentMessage(content=[TextBlock(text="Lima?")], reply=False),
                schema=SCHEMA,
                session_id="dm",
            )
        ]
        await sub.unsubscribe()

    assert answer.finished_reason == "completed"
    assert answer.structured == {"city": "Oslo", "celsius": 3.5, "sky": "sunny"}
    offered = {spec.name: spec.parameters for spec in model.requests[0].tools}
    assert offered[FINISH_TOOL] == SCHEMA
    [request, typed_request, message] = inbox
    assert isinstance(request, UserRequest)
    assert request.output_schema == SCHEMA
    expected = Forecast.model_json_schema()
    expected.pop("title")
    assert isinstance(typed_request, UserRequest)
    assert typed_request.output_schema == expected
    assert {spec.name: spec.parameters for spec in model.requests[1].tools}[FINISH_TOOL] == (
        expected
    )
    assert Forecast.model_validate(typed.structured) == Forecast(city="Rome", celsius=18)
    assert isinstance(message, AgentMessage)
    assert (message.reply, message.output_schema) == (True, SCHEMA)
    final = items[-1]
    assert isinstance(final, FinalAnswer)
    assert final.structured == {"city": "Lima", "celsius": 20}


async def test_an_answer_that_does_not_fit_is_retried_then_ends_in_error(
    nats_server: EmbeddedServer, bus: Bus, prefix: str
) -> None:
    model = ScriptedModel(
        [
            # Corrected after one try: completed.
            finish({"city": "Oslo"}),
            finish({"city": "Oslo", "celsius": 2}),
            # Never fits (different mistakes, so not a repeated action): error.
            finish({"city": "Oslo"}),
            finish({"city": 7, "celsius": 2}),
            finish({"city": "Oslo", "celsius": 2, "sky": "green"}),
            finish({"city": "Oslo", "celsius": 2}),
        ]
    )
    async with serving(nats_server.url, prefix, Agent("forecaster", "", model)):
        remote = RemoteAgent(bus, "forecaster", timeout=10)
        corrected = await remote.reply("Weather in Oslo?", schema=SCHEMA, session_id="s1")
        failed = await remote.reply("Weather in Oslo?", schema=SCHEMA, session_id="s2")

    assert corrected.finished_reason == "completed"
    assert corrected.structured == {"city": "Oslo", "celsius": 2}
    assert failed.finished_reason == "error"
    assert failed.structured is None
    assert FINISH_TOOL in str(failed.content)
    assert model.remaining == 1  # structured_retries (2) tries after the first, no more
    errors = [r.output for r in finish_results(model) if r.state == "error"]
    assert errors == [
        "invalid_parameters: missing required field(s): celsius. Call it again.",
        "invalid_parameters: missing required field(s): celsius. Call it again.",
        "invalid_parameters: city: should be string, not integer. Call it again.",
    ]


async def test_a_request_without_a_schema_is_answered_as_before(
    nats_server: EmbeddedServer, bus: Bus, prefix: str
) -> None:
    model = ScriptedModel(["Sunny, 3 °C."])
    async with serving(nats_server.url, prefix, Agent("forecaster", "", model)):
        inbox, sub = await requests_seen(bus, "forecaster")
        answer = await RemoteAgent(bus, "forecaster", timeout=10).reply("Weather in Oslo?")
        await sub.unsubscribe()

    assert (answer.finished_reason, answer.content) == ("completed", "Sunny, 3 °C.")
    assert answer.structured is None
    assert FINISH_TOOL not in [spec.name for spec in model.requests[0].tools]
    [request] = inbox
    assert isinstance(request, UserRequest)
    assert request.output_schema is None
    assert "output_schema" in to_builtins(request)  # on the wire as null


async def test_a_schema_goes_only_with_a_new_request_and_must_describe_an_object(
    nats_server: EmbeddedServer, bus: Bus, prefix: str
) -> None:
    model = ScriptedModel(["never asked"])
    async with serving(nats_server.url, prefix, Agent("forecaster", "", model)):
        remote = RemoteAgent(bus, "forecaster", timeout=10)
        with pytest.raises(ConfigError, match="a schema goes with a new request"):
            await remote.reply(ConfirmResult(confirmations=[]), schema=SCHEMA)
        answer = await remote.reply("Cities?", schema={"type": "array"})

    assert answer.finished_reason == "error"
    assert "must describe a JSON object" in str(answer.content)
    assert model.requests == []


@pytest.mark.parametrize("freeze_after", [0, 1])
async def test_a_take_over_keeps_asking_for_the_schema(
    nats_server: EmbeddedServer, bus: Bus, prefix: str, freeze_after: int
) -> None:
    """A replica dies after taking the request (0: the request is only in
    the lease record) or after recording it (1: the schema is in the saved
    reply); the replica that takes over asks for the same schema."""
    session = "s-take-over"
    got: list[AnyMessage] = []

    async def cb(msg: Any) -> None:
        got.append(decode(msg.data))

    reply_to = bus.nc.new_inbox()
    sub = await bus.nc.subscribe(reply_to, cb=cb)
    await bus.flush()

    # The ghost: takes the request like a service, saves, then freezes.
    ghost_model = ScriptedModel([finish({"city": "Ghost", "celsius": 0})], repeat_last=True)
    definition = Agent("forecaster", "", ghost_model)
    request = UserRequest(sender="test", session_id=session, content="Oslo?", output_schema=SCHEMA)
    ghost = await ghost_reply(bus, definition, request, reply_to, freeze_after=freeze_after)
    store = await SessionStore.open(bus, owner="test")
    if freeze_after == 1:
        saved = await store.get("forecaster", session)
        assert saved is not None
        assert saved.state.reply is not None
        assert saved.state.reply.structured_schema == SCHEMA

    taker_model = ScriptedModel([finish({"city": "Oslo", "celsius": 4})])
    taker = Agent("forecaster", "", taker_model)
    try:
        async with serving(nats_server.url, prefix, taker, recover_interval=0.2):
            async with asyncio.timeout(15):
                while not any(isinstance(m, FinalAnswer) for m in got):  # noqa: ASYNC110
                    await asyncio.sleep(0.05)
    finally:
        await ghost.stop()
        await sub.unsubscribe()

    [final] = [m for m in got if isinstance(m, FinalAnswer)]
    assert final.finished_reason == "completed"
    assert final.structured == {"city": "Oslo", "celsius": 4}
    offered = {spec.name: spec.parameters for spec in taker_model.requests[0].tools}
    assert offered[FINISH_TOOL] == SCHEMA
