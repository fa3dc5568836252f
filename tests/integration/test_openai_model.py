"""OpenAIChatModel against a local fake OpenAI-compatible server: streaming,
tool calls, the openai SDK's retries and refusals, memory formatting,
structured output, the text protocol for models without tool calling, and
whole agent replies. (Tool calls written as text, ``native_tools="auto"``:
test_text_tool_calls.py.)"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from openai import AsyncOpenAI
from pydantic import BaseModel

from fleetbus.agents import Agent, AgentSettings
from fleetbus.errors import ConfigError
from fleetbus.models import ModelConfig, ModelError, ModelRequest, ModelResponse
from fleetbus.models.model import ModelStreamItem, TextDelta, ThinkingDelta
from fleetbus.models.openai_model import OpenAIChatModel, OpenAIConfig
from fleetbus.protocol import (
    ChatMessage,
    DataBlock,
    TextBlock,
    ThinkingBlock,
    ToolResultBlock,
    ToolSpec,
    ToolUseBlock,
)
from fleetbus.testing import ScriptedModel
from fleetbus.tools_workers import Toolkit, tool
from tests.openai_server import (
    FakeOpenAIServer,
    SseReply,
    chunk,
    error_reply,
    reasoning_chunks,
    sse,
    text_chunks,
    tool_call_chunks,
    usage_chunk,
)

FAST = OpenAIConfig(max_retries=2, connect_timeout=2.0, read_timeout=5.0)
SOON = {"retry-after-ms": "10"}
"""The SDK honours this: retries in tests wait 10 ms, not its own 0.5 s and up."""
NO_RETRY = ModelConfig(max_retries=0, backoff=0.0, timeout=15.0)
ADD_SPEC = ToolSpec(
    name="add",
    description="Add two integers.",
    parameters={
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"],
    },
)


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("OPENAI_API_KEY", "OPENAI_BASE_URL", "FLEETBUS_MODEL"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def server() -> Iterator[FakeOpenAIServer]:
    with FakeOpenAIServer() as fake:
        yield fake


@pytest.fixture
async def model(server: FakeOpenAIServer) -> AsyncIterator[OpenAIChatModel]:
    async with OpenAIChatModel("fake-model", base_url=server.url, config=FAST) as chat_model:
        yield chat_model


def ask(text: str = "hi", **kwargs: Any) -> ModelRequest:
    return ModelRequest(
        messages=[ChatMessage(role="user", content=[TextBlock(text=text)])], **kwargs
    )


async def collect(
    chat_model: OpenAIChatModel, request: ModelRequest
) -> tuple[list[ModelStreamItem], ModelResponse]:
    async def run() -> list[ModelStreamItem]:
        return [item async for item in chat_model.stream(request)]

    items = await asyncio.wait_for(run(), timeout=10)
    final = items[-1]
    assert isinstance(final, ModelResponse)
    assert sum(isinstance(i, ModelResponse) for i in items) == 1
    return items[:-1], final


async def failure(chat_model: OpenAIChatModel, request: ModelRequest) -> ModelError:
    with pytest.raises(ModelError) as caught:
        await collect(chat_model, request)
    return caught.value


# -- streaming --------------------------------------------------------------------


async def test_text_streams_as_deltas_and_ends_with_one_response(
    server: FakeOpenAIServer, model: OpenAIChatModel
) -> None:
    server.add(sse(text_chunks("Hel", "lo ", "there"), usage=(12, 3)))

    deltas, final = await collect(model, ask())

    assert deltas == [TextDelta("Hel"), TextDelta("lo "), TextDelta("there")]
    assert final.content == [TextBlock(text="Hello there")]
    assert final.usage is not None
    assert (final.usage.input_tokens, final.usage.output_tokens) == (12, 3)
    assert final.finish_reason == "stop"
    assert final.model == "fake-model"
    body = server.bodies[0]
    assert body["model"] == "fake-model"
    assert body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert body["messages"] == [{"role": "user", "content": "hi"}]
    assert not {"tools", "tool_choice"} & body.keys()
    assert server.requests[0].headers["authorization"] == "Bearer not-needed"


async def test_reasoning_content_streams_as_thinking_before_the_text(
    server: FakeOpenAIServer, model: OpenAIChatModel
) -> None:
    server.add(sse([*reasoning_chunks("Two plus ", "two…"), *text_chunks("4")]))

    deltas, final = await collect(model, ask("2+2?"))

    assert deltas == [ThinkingDelta("Two plus "), ThinkingDelta("two…"), TextDelta("4")]
    assert final.content == [ThinkingBlock(thinking="Two plus two…"), TextBlock(text="4")]


async def test_a_tool_call_split_over_chunks_is_assembled(
    server: FakeOpenAIServer, model: OpenAIChatModel
) -> None:
    server.add(
        sse(
            [
                *text_chunks("Adding."),
                *tool_call_chunks(0, "call_A", "add", '{"a"', ": 2, ", '"b": 40}'),
            ],
            finish="tool_calls",
        )
    )

    _, final = await collect(model, ask("2+40?", tools=[ADD_SPEC], tool_choice="auto"))

    assert final.content == [
        TextBlock(text="Adding."),
        ToolUseBlock(id="call_A", name="add", input={"a": 2, "b": 40}),
    ]
    assert final.finish_reason == "tool_calls"


async def test_two_tool_calls_in_one_turn_keep_their_order_and_ids(
    server: FakeOpenAIServer, model: OpenAIChatModel
) -> None:
    first = tool_call_chunks(0, "call_1", "add", '{"a": 1,', ' "b": 2}')
    second = tool_call_chunks(1, "call_2", "add", '{"a": 3, "b": 4}')
    # Interleaved: pieces of both calls arrive in turns.
    server.add(sse([first[0], second[0], first[1], second[1], first[2]], finish="tool_calls"))

    _, final = await collect(model, ask(tools=[ADD_SPEC]))

    assert final.tool_uses == [
        ToolUseBlock(id="call_1", name="add", input={"a": 1, "b": 2}),
        ToolUseBlock(id="call_2", name="add", input={"a": 3, "b": 4}),
    ]


async def test_arguments_that_are_not_a_json_object_are_kept_raw(
    server: FakeOpenAIServer, model: OpenAIChatModel
) -> None:
    server.add(sse(tool_call_chunks(0, "call_X", "add", '{"a": 1, "b": '), finish="tool_calls"))

    _, final = await collect(model, ask(tools=[ADD_SPEC]))

    assert final.tool_uses == [
        ToolUseBlock(id="call_X", name="add", input={}, raw_arguments='{"a": 1, "b": ')
    ]


# -- failures ---------------------------------------------------------------------


async def test_a_rate_limit_is_retried_by_the_sdk_after_the_delay_it_asks_for(
    server: FakeOpenAIServer, model: OpenAIChatModel
) -> None:
    server.add(error_reply(429, "slow down", headers={"retry-after-ms": "300"}))
    server.add(sse(text_chunks("done")))

    started = asyncio.get_running_loop().time()
    _, final = await collect(model, ask())

    assert final.text == "done"
    assert asyncio.get_running_loop().time() - started >= 0.3
    assert len(server.requests) == 2
    # The SDK numbers its attempts: the second request is its first retry.
    retries = [r.headers.get("x-stainless-retry-count") for r in server.requests]
    assert retries == ["0", "1"]


async def test_a_retry_after_beyond_two_minutes_ends_the_call_at_once(
    server: FakeOpenAIServer, model: OpenAIChatModel
) -> None:
    server.add(error_reply(503, "busy", headers={"Retry-After": "3600"}))

    started = asyncio.get_running_loop().time()
    error = await failure(model, ask())

    assert asyncio.get_running_loop().time() - started < 2
    assert error.retryable is False
    assert str(error) == (
        f"{server.url} failed 1 time(s) for model 'fake-model'; last: 503 busy (Retry-After: 3600)"
    )
    assert len(server.requests) == 1


async def test_a_read_timeout_is_retried(server: FakeOpenAIServer) -> None:
    server.add(SseReply(sse(text_chunks("late")).chunks, delay=1.0))
    server.add(sse(text_chunks("on time")))
    config = FAST.model_copy(update={"read_timeout": 0.3})

    async with OpenAIChatModel("fake-model", base_url=server.url, config=config) as chat_model:
        _, final = await collect(chat_model, ask())

    assert final.text == "on time"


async def test_server_errors_past_the_retries_are_not_retryable(
    server: FakeOpenAIServer, model: OpenAIChatModel
) -> None:
    server.add(*[error_reply(500, "boom", headers=SOON) for _ in range(3)])

    error = await failure(model, ask())

    # Retried twice by the SDK (max_retries=2): not retryable by the agent again.
    assert error.retryable is False
    assert str(error) == f"{server.url} failed 3 time(s) for model 'fake-model'; last: 500 boom"
    assert len(server.requests) == 3


async def test_without_sdk_retries_a_server_error_stays_retryable(
    server: FakeOpenAIServer,
) -> None:
    server.add(error_reply(500, "boom"), error_reply(500, "boom"))
    server.add(sse(text_chunks("second time lucky")))
    config = FAST.model_copy(update={"max_retries": 0})

    async with OpenAIChatModel("fake-model", base_url=server.url, config=config) as m:
        error = await failure(m, ask())
        assert error.retryable is True
        # The agent's own retries apply then.
        agent = Agent(
            "a",
            "You help.",
            m,
            settings=AgentSettings(model_calls=NO_RETRY.model_copy(update={"max_retries": 1})),
        )
        final = await asyncio.wait_for(agent.reply("hello"), timeout=10)

    assert final.content == "second time lucky"
    assert len(server.requests) == 3


async def test_a_timeout_names_its_limit_and_setting(server: FakeOpenAIServer) -> None:
    server.add(*[SseReply(sse(text_chunks("late")).chunks, delay=1.0) for _ in range(2)])
    config = FAST.model_copy(update={"read_timeout": 0.3, "max_retries": 1})

    async with OpenAIChatModel("fake-model", base_url=server.url, config=config) as chat_model:
        error = await failure(chat_model, ask())

    assert str(error) == (
        f"model 'fake-model' at {server.url} did not answer within 0.3 s "
        "(OpenAIConfig.read_timeout / FLEETBUS_MODEL_TIMEOUT), 2 attempt(s)"
    )
    assert error.retryable is False
    assert len(server.requests) == 2


async def test_an_endpoint_that_cannot_be_reached_is_named_after_the_sdk_retries() -> None:
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{probe.getsockname()[1]}/v1"
    config = FAST.model_copy(update={"max_retries": 1})

    async with OpenAIChatModel("fake-model", base_url=url, config=config) as chat_model:
        error = await failure(chat_model, ask())

    assert str(error).startswith(f"cannot connect to {url} (")
    assert str(error).endswith("), 2 attempt(s)")
    assert error.retryable is False


async def test_the_agent_falls_back_when_the_endpoint_keeps_failing(
    server: FakeOpenAIServer, model: OpenAIChatModel
) -> None:
    server.add(*[error_reply(500, "boom", headers=SOON) for _ in range(3)])
    fallback = ScriptedModel(["The fallback answers."], name="backup")
    config = NO_RETRY.model_copy(update={"max_retries": 2, "fallback": fallback})
    agent = Agent("a", "You help.", model, settings=AgentSettings(model_calls=config))

    final = await asyncio.wait_for(agent.reply("hello"), timeout=10)

    assert final.finished_reason == "completed"
    assert final.content == "The fallback answers."
    # Not retried by the agent on top of the SDK: 3 attempts, then the fallback.
    assert len(server.requests) == 3
    assert len(fallback.requests) == 1


async def test_a_refused_key_is_a_clear_error_without_the_key(server: FakeOpenAIServer) -> None:
    secret = "sk-very-secret-1234"
    server.add(error_reply(401, f"Incorrect API key provided: {secret}"))

    async with OpenAIChatModel(
        "fake-model", base_url=server.url, api_key=secret, config=FAST
    ) as chat_model:
        error = await failure(chat_model, ask())

    assert str(error) == f"the API key was refused by {server.url} (check OPENAI_API_KEY)"
    assert error.retryable is False
    assert secret not in str(error)
    assert server.requests[0].headers["authorization"] == f"Bearer {secret}"
    assert len(server.requests) == 1


async def test_an_unknown_model_is_named_with_the_endpoint(
    server: FakeOpenAIServer, model: OpenAIChatModel
) -> None:
    server.add(error_reply(404, "The model `fake-model` does not exist"))

    error = await failure(model, ask())

    assert str(error).startswith(f"model 'fake-model' not found at {server.url}")
    assert error.retryable is False
    assert len(server.requests) == 1


async def test_a_bad_request_shows_the_server_message(
    server: FakeOpenAIServer, model: OpenAIChatModel
) -> None:
    server.add(error_reply(400, "max_tokens is too large"))

    error = await failure(model, ask())

    assert "max_tokens is too large" in str(error)
    assert "(400)" in str(error)
    assert error.retryable is False


async def test_empty_choices_are_an_error(server: FakeOpenAIServer, model: OpenAIChatModel) -> None:
    server.add(SseReply([usage_chunk(5, 0)]))

    error = await failure(model, ask())

    assert "no choices" in str(error)
    assert error.retryable is True


async def test_a_stream_that_ends_unfinished_is_an_error(
    server: FakeOpenAIServer, model: OpenAIChatModel
) -> None:
    server.add(sse(text_chunks("Half an ans"), finish=None, usage=None))

    error = await failure(model, ask())

    assert "ended before the answer was finished" in str(error)
    assert error.retryable is True


async def test_a_connection_dropped_mid_stream_is_an_error(
    server: FakeOpenAIServer, model: OpenAIChatModel
) -> None:
    server.add(sse(text_chunks("Half an ans"), finish=None, usage=None, drop=True))

    error = await failure(model, ask())

    assert "broke mid-answer" in str(error)
    assert error.retryable is True


async def test_an_error_event_in_the_stream_is_an_error(
    server: FakeOpenAIServer, model: OpenAIChatModel
) -> None:
    server.add(SseReply([*text_chunks("Hal"), {"error": {"message": "overloaded"}}]))

    error = await failure(model, ask())

    assert "overloaded" in str(error)
    assert error.retryable is True


# -- configuration ----------------------------------------------------------------


def test_the_model_name_is_required() -> None:
    with pytest.raises(ConfigError, match="FLEETBUS_MODEL"):
        OpenAIChatModel(base_url="http://127.0.0.1:1/v1")


@pytest.mark.parametrize(
    ("given", "mode"),
    [("auto", "auto"), ("on", "on"), ("off", "off"), (True, "on"), (False, "off"), (" OFF", "off")],
)
def test_native_tools_is_a_tool_mode_and_old_booleans_still_work(given: object, mode: str) -> None:
    assert OpenAIConfig().native_tools == "auto"
    assert OpenAIConfig(native_tools=given).native_tools == mode


def test_a_native_tools_that_is_not_a_tool_mode_is_refused_clearly() -> None:
    with pytest.raises(ValueError, match="native_tools must be 'auto', 'on' or 'off'"):
        OpenAIConfig(native_tools="yes")
    # model_copy does not validate: the model reads the mode again.
    unchecked = OpenAIConfig().model_copy(update={"native_tools": "yes"})
    with pytest.raises(ConfigError, match="not 'yes'"):
        OpenAIChatModel("m", base_url="http://127.0.0.1:1/v1", config=unchecked)


def test_openai_itself_needs_a_key() -> None:
    with pytest.raises(ConfigError, match="set OPENAI_API_KEY"):
        OpenAIChatModel("gpt-4o-mini")


async def test_model_endpoint_and_key_come_from_the_environment(
    server: FakeOpenAIServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FLEETBUS_MODEL", "env-model")
    monkeypatch.setenv("OPENAI_BASE_URL", server.url)
    monkeypatch.setenv("OPENAI_API_KEY", "sk-env")
    server.add(sse(text_chunks("ok")))

    async with OpenAIChatModel(config=FAST) as chat_model:
        assert chat_model.name == "env-model"
        await collect(chat_model, ask())

    assert server.bodies[0]["model"] == "env-model"
    assert server.requests[0].headers["authorization"] == "Bearer sk-env"


# -- what is sent -------------------------------------------------------------------


async def test_memory_is_sent_as_chat_completions_messages(
    server: FakeOpenAIServer, model: OpenAIChatModel
) -> None:
    server.add(sse(text_chunks("A cat and 3.")))
    messages = [
        ChatMessage(role="system", content=[TextBlock(text="You see.")]),
        ChatMessage(
            role="user",
            name="alice",
            content=[
                TextBlock(text="What is this?"),
                DataBlock(url="https://example.com/cat.png", media_type="image/png"),
                DataBlock(url="nats-object://files/report.pdf", media_type="application/pdf"),
            ],
        ),
        ChatMessage(
            role="assistant",
            content=[
                ThinkingBlock(thinking="Count first."),
                TextBlock(text="Let me count."),
                ToolUseBlock(id="call_1", name="add", input={"a": 1, "b": 2}),
                ToolUseBlock(id="call_2", name="add", input={}, raw_arguments="{oops"),
            ],
        ),
        ChatMessage(role="tool", content=[ToolResultBlock(id="call_1", name="add", output=3)]),
        ChatMessage(
            role="tool",
            content=[
                ToolResultBlock(
                    id="call_2", name="add", output={"error": "not JSON"}, state="error"
                )
            ],
        ),
    ]

    await collect(model, ModelRequest(messages=messages, tools=[ADD_SPEC], tool_choice="add"))

    body = server.bodies[0]
    assert body["messages"] == [
        {"role": "system", "content": "You see."},
        {
            "role": "user",
            "name": "alice",
            "content": [
                {"type": "text", "text": "What is this?"},
                {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}},
                {
                    "type": "text",
                    "text": "[attachment (application/pdf): nats-object://files/report.pdf]",
                },
            ],
        },
        {
            "role": "assistant",
            "content": "Let me count.",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'},
                },
                {
                    "id": "call_2",
                    "type": "function",
                    "function": {"name": "add", "arguments": "{oops"},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "3"},
        {"role": "tool", "tool_call_id": "call_2", "content": '{"error": "not JSON"}'},
    ]
    assert body["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "add",
                "description": "Add two integers.",
                "parameters": ADD_SPEC.parameters,
            },
        }
    ]
    assert body["tool_choice"] == {"type": "function", "function": {"name": "add"}}


async def test_thinking_is_sent_back_only_when_kept(server: FakeOpenAIServer) -> None:
    history = [
        ChatMessage(role="user", content=[TextBlock(text="q")]),
        ChatMessage(role="assistant", content=[ThinkingBlock(thinking="hmm"), TextBlock(text="a")]),
        ChatMessage(role="user", content=[TextBlock(text="q2")]),
    ]
    server.add(sse(text_chunks("x")), sse(text_chunks("y")))
    kept = FAST.model_copy(update={"keep_thinking": True})

    for config in (FAST, kept):
        async with OpenAIChatModel("fake-model", base_url=server.url, config=config) as m:
            await collect(m, ModelRequest(messages=history))

    dropped, sent = (body["messages"][1] for body in server.bodies)
    assert dropped == {"role": "assistant", "content": "a"}
    assert sent == {"role": "assistant", "content": "a", "reasoning_content": "hmm"}


async def test_options_are_sent_and_request_options_win(server: FakeOpenAIServer) -> None:
    config = FAST.model_copy(
        update={
            "temperature": 0.2,
            "max_tokens": 256,
            "parallel_tool_calls": False,
            "extra_body": {"top_k": 5, "enable_thinking": False},
        }
    )
    server.add(sse(text_chunks("x")), sse(text_chunks("y")))

    async with OpenAIChatModel("fake-model", base_url=server.url, config=config) as m:
        await collect(m, ask(tools=[ADD_SPEC], tool_choice="required", options={"top_k": 7}))
        await collect(m, ask(tools=[], tool_choice="none"))

    with_tools, without_tools = server.bodies
    assert with_tools["temperature"] == 0.2
    assert with_tools["max_tokens"] == 256
    assert with_tools["parallel_tool_calls"] is False
    assert with_tools["tool_choice"] == "required"
    assert with_tools["top_k"] == 7
    assert with_tools["enable_thinking"] is False
    # Without tools, OpenAI refuses tool_choice and parallel_tool_calls.
    assert not {"tools", "tool_choice", "parallel_tool_calls"} & without_tools.keys()


# -- agents over the fake server -------------------------------------------------------


async def test_an_agent_replies_with_a_local_tool(
    server: FakeOpenAIServer, model: OpenAIChatModel
) -> None:
    server.add(
        sse(tool_call_chunks(0, "call_1", "add", '{"a": 2, ', '"b": 40}'), finish="tool_calls"),
        sse(text_chunks("2 + 40 = ", "42.")),
    )
    agent = Agent(
        "calc",
        "You add.",
        model,
        toolkit=Toolkit([add]),
        settings=AgentSettings(model_calls=NO_RETRY),
    )

    final = await asyncio.wait_for(agent.reply("What is 2 + 40?"), timeout=10)

    assert final.finished_reason == "completed"
    assert final.content == "2 + 40 = 42."
    first, second = server.bodies
    assert [t["function"]["name"] for t in first["tools"]] == ["add"]
    assert first["tool_choice"] == "auto"
    assert second["messages"][-2]["tool_calls"][0]["id"] == "call_1"
    assert second["messages"][-1] == {"role": "tool", "tool_call_id": "call_1", "content": "42"}


async def test_malformed_arguments_are_shown_to_the_model_which_corrects_them(
    server: FakeOpenAIServer, model: OpenAIChatModel
) -> None:
    server.add(
        sse(tool_call_chunks(0, "call_1", "add", '{"a": 2, "b": }'), finish="tool_calls"),
        sse(tool_call_chunks(0, "call_2", "add", '{"a": 2, "b": 3}'), finish="tool_calls"),
        sse(text_chunks("5")),
    )
    agent = Agent(
        "calc",
        "You add.",
        model,
        toolkit=Toolkit([add]),
        settings=AgentSettings(model_calls=NO_RETRY),
    )

    final = await asyncio.wait_for(agent.reply("2 + 3?"), timeout=10)

    assert final.content == "5"
    second = server.bodies[1]["messages"]
    assert second[-2]["tool_calls"][0]["function"]["arguments"] == '{"a": 2, "b": }'
    assert second[-1]["tool_call_id"] == "call_1"
    assert second[-1]["content"].startswith("invalid_parameters: the arguments of add")
    assert server.bodies[2]["messages"][-1] == {
        "role": "tool",
        "tool_call_id": "call_2",
        "content": "5",
    }


class Forecast(BaseModel):
    city: str
    celsius: float


async def test_structured_output_through_the_finish_tool(
    server: FakeOpenAIServer, model: OpenAIChatModel
) -> None:
    arguments = '{"city": "Oslo", "celsius": 3.5}'
    server.add(
        sse(tool_call_chunks(0, "call_1", "generate_response", arguments), finish="tool_calls")
    )
    agent = Agent("weather", "You forecast.", model, settings=AgentSettings(model_calls=NO_RETRY))

    final = await asyncio.wait_for(agent.reply("Oslo?", structured_model=Forecast), timeout=10)

    assert final.structured == {"city": "Oslo", "celsius": 3.5}
    body = server.bodies[0]
    assert [t["function"]["name"] for t in body["tools"]] == ["generate_response"]
    assert "response_format" not in body


async def test_structured_output_through_response_format(server: FakeOpenAIServer) -> None:
    server.add(sse(text_chunks('{"city": "Oslo", ', '"celsius": 3.5}')))
    config = FAST.model_copy(update={"structured_output": "response_format"})

    async with OpenAIChatModel("fake-model", base_url=server.url, config=config) as m:
        agent = Agent("weather", "You forecast.", m, settings=AgentSettings(model_calls=NO_RETRY))
        final = await asyncio.wait_for(agent.reply("Oslo?", structured_model=Forecast), timeout=10)

    assert final.finished_reason == "completed"
    assert final.structured == {"city": "Oslo", "celsius": 3.5}
    body = server.bodies[0]
    assert not {"tools", "tool_choice"} & body.keys()
    schema = body["response_format"]["json_schema"]
    assert body["response_format"]["type"] == "json_schema"
    assert schema["name"] == "generate_response"
    assert schema["schema"]["required"] == ["city", "celsius"]


async def test_response_format_answers_that_do_not_validate_are_asked_again(
    server: FakeOpenAIServer,
) -> None:
    server.add(
        sse(text_chunks('{"city": "Oslo"}')), sse(text_chunks('{"city": "Oslo", "celsius": 1}'))
    )
    config = FAST.model_copy(update={"structured_output": "response_format"})

    async with OpenAIChatModel("fake-model", base_url=server.url, config=config) as m:
        agent = Agent("weather", "You forecast.", m, settings=AgentSettings(model_calls=NO_RETRY))
        final = await asyncio.wait_for(agent.reply("Oslo?", structured_model=Forecast), timeout=10)

    assert final.structured == {"city": "Oslo", "celsius": 1.0}
    # The failed answer and its error, as text: no tool messages without tools.
    retry = server.bodies[1]["messages"]
    assert retry[-2] == {"role": "assistant", "content": '{"city": "Oslo"}'}
    assert retry[-1]["role"] == "user"
    assert retry[-1]["content"].startswith("Observation from generate_response (error):")
    assert "celsius" in retry[-1]["content"]


# -- the text protocol (native_tools="off") ---------------------------------------------

TEXT = FAST.model_copy(update={"native_tools": "off"})


@pytest.mark.parametrize(
    "written",
    [
        '{"tool": "add", "arguments": {"a": 2, "b": 3}}',
        'I will add them.\n```json\n{"tool": "add", "arguments": {"a": 2, "b": 3}}\n```\nDone.',
        "{'tool': 'add', 'arguments': {'a': 2, 'b': 3,},}",
        '{"name": "add", "arguments": "{\\"a\\": 2, \\"b\\": 3}"}',
        '{"action": "add", "action_input": {"a": 2, "b": 3}}',
        '{tool: "add", arguments: {a: 2, b: 3}}',
        '{"tool": "add", "arguments": {"a": 2, "b": 3}',
    ],
)
async def test_the_text_protocol_reads_sloppy_actions(
    server: FakeOpenAIServer, written: str
) -> None:
    server.add(sse(text_chunks(written)))

    async with OpenAIChatModel("fake-model", base_url=server.url, config=TEXT) as m:
        deltas, final = await collect(m, ask("2+3?", tools=[ADD_SPEC], tool_choice="auto"))

    assert [(u.name, u.input, u.raw_arguments) for u in final.tool_uses] == [
        ("add", {"a": 2, "b": 3}, None)
    ]
    assert final.text == ""
    assert not any(isinstance(d, TextDelta) for d in deltas)


async def test_the_text_protocol_reads_python_constants_and_prose_answers(
    server: FakeOpenAIServer,
) -> None:
    flags = ToolSpec(name="flags", parameters={"type": "object"})
    server.add(
        sse(text_chunks("{'tool': 'flags', 'arguments': {'on': True, 'off': False, 'x': None}}")),
        sse(text_chunks("The answer is 5.")),
        sse(text_chunks('Thought: easy.\n{"answer": "5"}')),
    )

    async with OpenAIChatModel("fake-model", base_url=server.url, config=TEXT) as m:
        _, called = await collect(m, ask(tools=[flags]))
        prose_deltas, prose = await collect(m, ask(tools=[flags]))
        _, answered = await collect(m, ask(tools=[flags]))

    assert called.tool_uses[0].input == {"on": True, "off": False, "x": None}
    assert prose.content == [TextBlock(text="The answer is 5.")]
    assert prose_deltas == [TextDelta("The answer is 5.")]
    assert answered.content == [ThinkingBlock(thinking="Thought: easy."), TextBlock(text="5")]


async def test_an_agent_uses_tools_through_the_text_protocol(server: FakeOpenAIServer) -> None:
    server.add(
        sse(text_chunks("```json\n{'tool': 'add', 'arguments': {'a': 2, 'b': 3,}}\n```")),
        sse(text_chunks('{"answer": "2 + 3 = 5"}')),
    )

    async with OpenAIChatModel("fake-model", base_url=server.url, config=TEXT) as m:
        agent = Agent(
            "calc",
            "You add.",
            m,
            toolkit=Toolkit([add]),
            settings=AgentSettings(model_calls=NO_RETRY),
        )
        final = await asyncio.wait_for(agent.reply("2 + 3?"), timeout=10)

    assert final.finished_reason == "completed"
    assert final.content == "2 + 3 = 5"
    first, second = server.bodies
    assert not {"tools", "tool_choice"} & first.keys()
    system = first["messages"][0]
    assert system["role"] == "system"
    assert system["content"].startswith("You add.\n\n# Tools")
    assert "- add: Add two integers." in system["content"]
    assert '{"tool": "<tool name>", "arguments": {...}}' in system["content"]
    assert second["messages"][-2:] == [
        {"role": "assistant", "content": '{"tool": "add", "arguments": {"a": 2, "b": 3}}'},
        {"role": "user", "content": "Observation from add:\n5"},
    ]


@pytest.mark.parametrize(
    ("written", "why"),
    [
        (
            '{"tool": "add", "arguments": {"a": 2, "b": 3',
            "the JSON object is not valid (Expecting ',' delimiter: line 1 column 45 (char 44))",
        ),
        (
            '{"tool": "add", "arguments": {"a": 2 "b": 3}}',
            "the JSON object is not valid (Expecting ',' delimiter: line 1 column 38 (char 37))",
        ),
        (
            '{"tool": "add", "arguments": "a=2, b=3"}',
            'the "arguments" of add must be a JSON object',
        ),
        ("", "the answer is empty"),
    ],
)
async def test_an_unreadable_action_is_a_format_error_not_a_guess(
    server: FakeOpenAIServer, written: str, why: str
) -> None:
    server.add(sse(text_chunks(written) if written else []))

    async with OpenAIChatModel("fake-model", base_url=server.url, config=TEXT) as m:
        deltas, final = await collect(m, ask(tools=[ADD_SPEC]))

    [use] = final.content
    assert isinstance(use, ToolUseBlock)
    assert (use.name, use.raw_arguments) == ("format_error", written)
    assert use.input == {"error": why}  # what the agent records, and a person is shown
    assert deltas == []


async def test_a_given_client_is_used_with_the_configured_retries(
    server: FakeOpenAIServer,
) -> None:
    server.add(*[error_reply(500, "boom", headers=SOON) for _ in range(3)])
    client = AsyncOpenAI(base_url=server.url, api_key="sk-given", max_retries=5)

    try:
        async with OpenAIChatModel("fake-model", client=client, config=FAST) as m:
            error = await failure(m, ask())
        assert error.retryable is False
        assert len(server.requests) == 3
        assert server.requests[0].headers["authorization"] == "Bearer sk-given"
        assert not client.is_closed()
    finally:
        await client.close()


async def test_an_unreadable_action_is_shown_with_a_format_reminder(
    server: FakeOpenAIServer,
) -> None:
    garbled = '{"tool": "add", "arguments": {"a": 2 "b": 3}}'
    server.add(sse(text_chunks(garbled)), sse(text_chunks('{"answer": "5"}')))

    async with OpenAIChatModel("fake-model", base_url=server.url, config=TEXT) as m:
        agent = Agent(
            "calc",
            "You add.",
            m,
            toolkit=Toolkit([add]),
            settings=AgentSettings(model_calls=NO_RETRY),
        )
        final = await asyncio.wait_for(agent.reply("2 + 3?"), timeout=10)

    assert final.content == "5"
    assistant, reminder = server.bodies[1]["messages"][-2:]
    assert assistant == {"role": "assistant", "content": garbled}
    assert reminder["role"] == "user"
    assert reminder["content"].startswith(
        "Your last message could not be read as an action: the JSON object is not valid"
    )
    assert '{"answer": "<your answer>"}' in reminder["content"]


async def test_a_model_that_never_follows_the_format_ends_the_reply(
    server: FakeOpenAIServer,
) -> None:
    server.add(*[sse(text_chunks('{"tool": "add", "arguments": [2, 3]}')) for _ in range(2)])
    config = TEXT.model_copy(update={"format_retries": 1})

    async with OpenAIChatModel("fake-model", base_url=server.url, config=config) as m:
        agent = Agent(
            "calc",
            "You add.",
            m,
            toolkit=Toolkit([add]),
            settings=AgentSettings(model_calls=NO_RETRY),
        )
        final = await asyncio.wait_for(agent.reply("2 + 3?"), timeout=10)

    assert final.finished_reason == "error"
    assert "did not follow the tool-call text format 2 time(s) in a row" in final.content
    assert 'the "arguments" of add must be a JSON object' in final.content
    assert len(server.requests) == 2


async def test_without_tools_the_text_is_the_answer_even_if_it_is_json(
    server: FakeOpenAIServer,
) -> None:
    server.add(sse(text_chunks('{"tool": "add"}')))

    async with OpenAIChatModel("fake-model", base_url=server.url, config=TEXT) as m:
        _, final = await collect(m, ask(tools=[], tool_choice="none"))

    assert final.content == [TextBlock(text='{"tool": "add"}')]
    assert server.bodies[0]["messages"] == [{"role": "user", "content": "hi"}]


async def test_a_usage_only_chunk_without_choices_is_not_an_answer_on_its_own(
    server: FakeOpenAIServer, model: OpenAIChatModel
) -> None:
    # A server that sends the finish on a choice without a delta.
    server.add(SseReply([*text_chunks("ok"), _choice_without_delta(), usage_chunk(1, 1)]))

    _, final = await collect(model, ask())

    assert final.content == [TextBlock(text="ok")]
    assert final.finish_reason == "stop"


def _choice_without_delta() -> dict[str, Any]:
    body = chunk({}, finish_reason="stop")
    del body["choices"][0]["delta"]
    return body
