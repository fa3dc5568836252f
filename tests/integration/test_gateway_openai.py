"""The gateway's OpenAI-compatible face driven by the real ``openai`` SDK:
models listed, chat completions and responses streamed and not, a
conversation kept in one session, structured output, a paused reply shown
with where to confirm and continued with a "yes"."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest
from openai.types.responses import ResponseCompletedEvent

from fleetbus.agents import Agent, Permissions
from fleetbus.bus import EmbeddedServer
from fleetbus.capabilities import Guardrails, Handoffs, PatternGuardrail
from fleetbus.models import FINISH_TOOL
from fleetbus.models.model import ModelError
from fleetbus.testing import ScriptedModel
from fleetbus.tools_workers import Toolkit, tool
from tests.helpers import serving
from tests.integration.agent_specs import CommandModel
from tests.integration.gateway_fixtures import ALICE, BOB, Gateway, gateway

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def clerk(stamped: list[str]) -> Agent:
    """Echoes (CommandModel); ``stamp`` runs only once confirmed."""

    @tool
    def stamp(tag: str) -> str:
        """Stamp a tag."""
        stamped.append(tag)
        return f"stamped {tag}"

    return Agent(
        "clerk",
        "",
        CommandModel(),
        toolkit=Toolkit([stamp]),
        permissions=Permissions.from_strings(ask=["stamp"]),
        description="Stamps tags, once you confirm.",
    )


@pytest.fixture
async def served(
    nats_server: EmbeddedServer, prefix: str
) -> AsyncIterator[tuple[Gateway, list[str]]]:
    stamped: list[str] = []
    async with (
        serving(nats_server.url, prefix, clerk(stamped)),
        gateway(nats_server.url, prefix) as gw,
    ):
        yield gw, stamped


_OPEN: list[openai.AsyncOpenAI] = []


def client(gw: Gateway, token: str = ALICE, **headers: str) -> openai.AsyncOpenAI:
    """An SDK client of the gateway (closed after the test)."""
    made = openai.AsyncOpenAI(
        base_url=f"{gw.url}/v1", api_key=token, max_retries=0, default_headers=headers or None
    )
    _OPEN.append(made)
    return made


@pytest.fixture(autouse=True)
async def _close_clients() -> AsyncIterator[None]:
    yield
    while _OPEN:
        await _OPEN.pop().close()


async def test_models_list_the_agents(served: tuple[Gateway, list[str]]) -> None:
    gw, _ = served
    models = [m async for m in client(gw).models.list()]
    assert [(m.id, m.owned_by) for m in models] == [("clerk", "fleetbus")]
    assert (await client(gw).models.retrieve("clerk")).id == "clerk"
    with pytest.raises(openai.NotFoundError):
        await client(gw).models.retrieve("nobody")


async def test_chat_completion_answers_and_a_named_conversation_remembers(
    served: tuple[Gateway, list[str]],
) -> None:
    gw, _ = served
    chat = client(gw, **{"X-Fleetbus-Session": "talk"}).chat.completions
    raw = await chat.with_raw_response.create(
        model="clerk", messages=[{"role": "user", "content": "hello"}]
    )
    first = raw.parse()
    assert (first.choices[0].message.content or "").startswith("echo hello from ")
    assert first.choices[0].finish_reason == "stop"
    assert first.usage is not None
    assert first.usage.completion_tokens == 1
    session = raw.headers["x-fleetbus-session"]
    assert session.endswith("-talk")
    # The session remembers: only the new user message is sent.
    again = await chat.create(
        model="clerk",
        messages=[
            {"role": "user", "content": "hello"},
            {"role": "assistant", "content": first.choices[0].message.content},
            {"role": "user", "content": "heard?"},
        ],
    )
    assert again.choices[0].message.content == "heard: hello"


async def test_a_chat_without_a_conversation_gets_the_earlier_turns_as_a_transcript(
    served: tuple[Gateway, list[str]],
) -> None:
    gw, _ = served
    answer = await client(gw).chat.completions.create(
        model="clerk",
        messages=[
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "one"},
            {"role": "assistant", "content": "ok"},
            {"role": "user", "content": "two"},
        ],
    )
    text = answer.choices[0].message.content or ""
    assert "Earlier in this conversation:" in text
    assert "user: one" in text
    assert "two" in text


async def test_chat_completion_streams_text_and_tool_progress(
    served: tuple[Gateway, list[str]],
) -> None:
    gw, _ = served
    stream = await client(gw).chat.completions.create(
        model="clerk",
        messages=[{"role": "user", "content": "hi there"}],
        stream=True,
        stream_options={"include_usage": True},
    )
    content, finish, usage = "", None, None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            content += choice.delta.content or ""
            finish = choice.finish_reason or finish
    assert content.startswith("echo hi there from ")
    assert finish == "stop"
    assert usage is not None
    assert usage.total_tokens == 2


async def test_a_paused_reply_says_where_to_confirm_and_a_yes_continues_it(
    served: tuple[Gateway, list[str]],
) -> None:
    gw, stamped = served
    chat = client(gw, **{"X-Fleetbus-Session": "stamping"}).chat.completions
    paused = await chat.create(
        model="clerk", messages=[{"role": "user", "content": 'tool stamp {"tag": "A"}'}]
    )
    text = paused.choices[0].message.content or ""
    assert "waits for your confirmation to run stamp" in text
    assert "/v1/fleet/agents/clerk/sessions/" in text
    assert "/confirm" in text
    assert stamped == []
    done = await chat.create(model="clerk", messages=[{"role": "user", "content": "yes"}])
    assert "stamp=stamped A" in (done.choices[0].message.content or "")
    assert stamped == ["A"]


async def test_the_paused_reply_streamed_also_says_so(served: tuple[Gateway, list[str]]) -> None:
    gw, stamped = served
    chat = client(gw, **{"X-Fleetbus-Session": "s2"}).chat.completions
    stream = await chat.create(
        model="clerk",
        messages=[{"role": "user", "content": 'tool stamp {"tag": "B"}'}],
        stream=True,
    )
    text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    assert "waits for your confirmation to run stamp" in text
    no = await chat.create(model="clerk", messages=[{"role": "user", "content": "no"}])
    assert "stamp=" in (no.choices[0].message.content or "")
    assert stamped == []


async def test_responses_continue_by_previous_response_id_streamed_and_not(
    served: tuple[Gateway, list[str]],
) -> None:
    gw, _ = served
    responses = client(gw).responses
    first = await responses.create(model="clerk", input="alpha")
    assert first.output_text.startswith("echo alpha from ")
    assert first.status == "completed"
    events = []
    stream = await responses.create(
        model="clerk", input="heard?", previous_response_id=first.id, stream=True
    )
    async for event in stream:
        events.append(event)
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created"
    assert kinds[-1] == "response.completed"
    assert "response.output_text.delta" in kinds
    completed = events[-1]
    assert isinstance(completed, ResponseCompletedEvent)
    assert completed.response.output_text == "heard: alpha"
    again = await responses.retrieve(completed.response.id)
    assert again.output_text == "heard: alpha"


async def test_another_user_cannot_continue_a_response(served: tuple[Gateway, list[str]]) -> None:
    gw, _ = served
    mine = await client(gw).responses.create(model="clerk", input="secret")
    with pytest.raises(openai.NotFoundError):
        await client(gw, BOB).responses.create(
            model="clerk", input="heard?", previous_response_id=mine.id
        )
    with pytest.raises(openai.NotFoundError):
        await client(gw, BOB).responses.retrieve(mine.id)


async def test_structured_output_from_response_format(
    nats_server: EmbeddedServer, prefix: str
) -> None:
    schema: dict[str, Any] = {
        "type": "object",
        "properties": {"city": {"type": "string"}, "celsius": {"type": "number"}},
        "required": ["city", "celsius"],
    }
    model = ScriptedModel(
        [
            ScriptedModel.call(FINISH_TOOL, {"city": "Oslo", "celsius": 3.5}),
            ScriptedModel.call(FINISH_TOOL, {"city": "Rome", "celsius": 18}),
        ]
    )
    async with (
        serving(nats_server.url, prefix, Agent("forecaster", "", model)),
        gateway(nats_server.url, prefix) as gw,
    ):
        chat = await client(gw).chat.completions.create(
            model="forecaster",
            messages=[{"role": "user", "content": "Oslo?"}],
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "forecast", "schema": schema},
            },
        )
        assert json.loads(chat.choices[0].message.content or "") == {"city": "Oslo", "celsius": 3.5}
        response = await client(gw).responses.create(
            model="forecaster",
            input="Rome?",
            text={"format": {"type": "json_schema", "name": "forecast", "schema": schema}},
        )
        assert json.loads(response.output_text) == {"city": "Rome", "celsius": 18}


async def test_errors_have_the_openai_shape(served: tuple[Gateway, list[str]]) -> None:
    gw, _ = served
    with pytest.raises(openai.AuthenticationError):
        await client(gw, "sk-nobody-0123456789abcdef").models.list()
    with pytest.raises(openai.NotFoundError):
        await client(gw).chat.completions.create(
            model="nobody", messages=[{"role": "user", "content": "hi"}]
        )
    with pytest.raises(openai.BadRequestError, match="tools"):
        await client(gw).chat.completions.create(
            model="clerk",
            messages=[{"role": "user", "content": "hi"}],
            tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}],
        )
    async with httpx.AsyncClient() as http:
        big = await http.post(
            f"{gw.url}/v1/chat/completions",
            headers={"authorization": f"Bearer {ALICE}"},
            content=b"x" * (2 * 1024 * 1024),
        )
        assert big.status_code == 413
        assert big.json()["error"]["code"] == "request_too_large"


async def test_a_reply_that_ends_in_error_is_a_failed_response(
    nats_server: EmbeddedServer, prefix: str
) -> None:
    model = ScriptedModel([ModelError("the model is down", retryable=False)], repeat_last=True)
    async with (
        serving(nats_server.url, prefix, Agent("broken", "", model)),
        gateway(nats_server.url, prefix) as gw,
    ):
        response = await client(gw).responses.create(model="broken", input="hi")
        assert response.status == "failed"
        assert response.error is not None
        assert "the model is down" in response.error.message
        stream = await client(gw).responses.create(model="broken", input="hi", stream=True)
        kinds = [event.type async for event in stream]
        assert kinds[-1] == "response.failed"
        chat = await client(gw).chat.completions.create(
            model="broken", messages=[{"role": "user", "content": "hi"}]
        )
        assert "the model is down" in (chat.choices[0].message.content or "")


async def test_a_guardrail_trip_finishes_content_filter_and_a_handoff_answers_from_the_other_agent(
    nats_server: EmbeddedServer, prefix: str
) -> None:
    guarded = Agent(
        "guarded",
        "",
        ScriptedModel([ScriptedModel.text("never seen")], repeat_last=True),
        capabilities=[Guardrails(input=[PatternGuardrail([r"(?i)password"], name="secrets")])],
    )
    triage = Agent(
        "triage",
        "",
        ScriptedModel([ScriptedModel.call("transfer_to_billing", {})], repeat_last=True),
        capabilities=[Handoffs(["billing"])],
    )
    billing = Agent("billing", "", ScriptedModel([ScriptedModel.text("Refunded.")]))
    async with (
        serving(nats_server.url, prefix, guarded),
        serving(nats_server.url, prefix, triage),
        serving(nats_server.url, prefix, billing),
        gateway(nats_server.url, prefix) as gw,
    ):
        chat = client(gw).chat.completions
        tripped = await chat.create(
            model="guarded", messages=[{"role": "user", "content": "my password is x"}]
        )
        assert tripped.choices[0].finish_reason == "content_filter"
        handed = await chat.create(model="triage", messages=[{"role": "user", "content": "hi"}])
        assert handed.choices[0].message.content == "Refunded."
        assert handed.choices[0].finish_reason == "stop"
