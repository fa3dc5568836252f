"""Tool calls however the model writes them (``native_tools="auto"``), through
the real openai SDK against the local Chat Completions server, over SSE and
JSON: the shapes small local models write are run as calls, JSON that is no
call stays the answer, an invented observation is shown back as a format
error, and a model that keeps writing its calls as text is switched to the
text protocol."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

import fleetbus
from fleetbus.agents import AgentSettings
from fleetbus.bus import Bus, ToolClient
from fleetbus.models import ModelConfig, ModelError, ModelRequest
from fleetbus.models import _text_protocol as tp
from fleetbus.models.model import ModelStreamItem, TextDelta
from fleetbus.models.openai_model import OpenAIChatModel, OpenAIConfig
from fleetbus.protocol import ChatMessage, TextBlock, ToolResultBlock, ToolSpec, ToolUseBlock
from fleetbus.tools_workers import Toolkit, ToolWorker
from fleetbus.tools_workers.builtin import calculator
from tests.integration.test_openai_model import collect
from tests.openai_server import FakeOpenAIServer, JsonReply, completion

NO_RETRY = ModelConfig(max_retries=0, timeout=15.0)
CALC_SPEC = ToolSpec(
    name="calculator",
    description="Evaluate an arithmetic expression.",
    parameters={"type": "object", "properties": {"expr": {"type": "string"}}},
)
SEARCH_SPEC = ToolSpec(
    name="search",
    description="Search the web.",
    parameters={"type": "object", "properties": {"query": {"type": "string"}}},
)
CALL = '{"name": "calculator", "arguments": {"expr": "17 * 23 + 4"}}'
FENCED = f"```json\n{CALL}\n```"
INVENTED = 'Observation from calculator: {"answer": "402"}'


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("OPENAI_API_KEY", "OPENAI_BASE_URL", "FLEETBUS_MODEL"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def server() -> Iterator[FakeOpenAIServer]:
    with FakeOpenAIServer() as fake:
        yield fake


@pytest.fixture(params=["sse", "json"])
def config(request: pytest.FixtureRequest) -> OpenAIConfig:
    """The default tool mode (auto), streamed or not."""
    return OpenAIConfig(max_retries=0, read_timeout=5.0, stream=request.param == "sse")


@pytest.fixture
async def model(server: FakeOpenAIServer, config: OpenAIConfig) -> AsyncIterator[OpenAIChatModel]:
    async with OpenAIChatModel("fake-model", base_url=server.url, config=config) as chat_model:
        yield chat_model


def ask(text: str = "What is 17 * 23 + 4?", **kwargs: Any) -> ModelRequest:
    kwargs.setdefault("tools", [CALC_SPEC, SEARCH_SPEC])
    kwargs.setdefault("tool_choice", "auto")
    return ModelRequest(
        messages=[ChatMessage(role="user", content=[TextBlock(text=text)])], **kwargs
    )


def calculating(model: OpenAIChatModel) -> fleetbus.Agent:
    """An agent with the calculator, on ``model``, which it does not retry."""
    return fleetbus.Agent(
        "calc",
        "You compute.",
        model,
        toolkit=Toolkit([calculator]),
        settings=AgentSettings(model_calls=NO_RETRY),
    )


def shown(deltas: list[ModelStreamItem]) -> str:
    return "".join(d.text for d in deltas if isinstance(d, TextDelta))


# -- what a response is read as -------------------------------------------------------


@pytest.mark.parametrize(
    ("written", "calls", "prose"),
    [
        pytest.param(FENCED, [("calculator", {"expr": "17 * 23 + 4"})], "", id="fenced-json"),
        pytest.param(CALL, [("calculator", {"expr": "17 * 23 + 4"})], "", id="bare-json"),
        pytest.param(
            f"<tool_call>\n{CALL}\n</tool_call>\n<tool_call>\n"
            '{"name": "search", "arguments": {"query": "17 * 23"}}\n</tool_call>',
            [("calculator", {"expr": "17 * 23 + 4"}), ("search", {"query": "17 * 23"})],
            "",
            id="tool-call-tags",
        ),
        pytest.param(
            f'{CALL}\n{{"tool": "search", "parameters": {{"query": "395"}}}}',
            [("calculator", {"expr": "17 * 23 + 4"}), ("search", {"query": "395"})],
            "",
            id="two-calls-in-one-text",
        ),
        pytest.param(
            f"I need the calculator for this.\n{FENCED}\nI will report the result.",
            [("calculator", {"expr": "17 * 23 + 4"})],
            "I need the calculator for this.\n\nI will report the result.",
            id="prose-around-a-call",
        ),
        pytest.param(
            '{"type": "function", "function": {"name": "calculator", '
            '"arguments": "{\\"expr\\": \\"17 * 23 + 4\\"}"}}',
            [("calculator", {"expr": "17 * 23 + 4"})],
            "",
            id="openai-shape",
        ),
    ],
)
async def test_a_call_written_as_text_is_read_as_a_tool_call(
    server: FakeOpenAIServer,
    model: OpenAIChatModel,
    config: OpenAIConfig,
    written: str,
    calls: list[tuple[str, dict[str, Any]]],
    prose: str,
) -> None:
    server.add(completion(written))

    deltas, final = await collect(model, ask())

    assert [(u.name, u.input) for u in final.tool_uses] == calls
    assert all(u.id.startswith("call_text_") and u.raw_arguments is None for u in final.tool_uses)
    assert final.text == prose
    # The call itself never reaches the reader as answer text.
    assert not {"{", "`", "<"} & set(shown(deltas))
    assert prose.startswith(shown(deltas).strip())
    body = server.bodies[0]
    assert body["stream"] is config.stream
    assert [t["function"]["name"] for t in body["tools"]] == ["calculator", "search"]


@pytest.mark.parametrize(
    "written",
    [
        pytest.param('{"answer": 395, "explanation": "17 * 23 = 391"}', id="a-json-answer"),
        pytest.param(
            '```json\n{"name": "weather", "arguments": {}, "units": "metric"}\n```',
            id="an-unknown-name-with-more-keys",
        ),
        pytest.param('{"arguments": {"expr": "17 * 23 + 4"}}', id="no-name"),
        pytest.param('The result is 395. In JSON: {"result": 395}', id="prose-with-json"),
    ],
)
async def test_json_that_is_not_a_call_to_an_offered_tool_stays_the_answer(
    server: FakeOpenAIServer, model: OpenAIChatModel, written: str
) -> None:
    server.add(completion(written))

    deltas, final = await collect(model, ask())

    assert final.content == [TextBlock(text=written)]
    assert shown(deltas) == written


async def test_json_is_the_answer_when_no_tool_is_offered(
    server: FakeOpenAIServer, model: OpenAIChatModel
) -> None:
    server.add(completion(CALL))

    _, final = await collect(model, ask(tool_choice="none"))

    assert final.content == [TextBlock(text=CALL)]


async def test_an_invented_observation_is_a_format_error_not_the_answer(
    server: FakeOpenAIServer, model: OpenAIChatModel
) -> None:
    server.add(completion(INVENTED))

    deltas, final = await collect(model, ask())

    [use] = final.content
    assert isinstance(use, ToolUseBlock)
    assert (use.name, use.raw_arguments) == ("format_error", INVENTED)
    assert use.input["error"].startswith("it holds 'Observation from calculator:'")
    assert "402" not in shown(deltas)


async def test_native_calls_win_over_text(server: FakeOpenAIServer, model: OpenAIChatModel) -> None:
    arguments = '{"expr": "1 + 1"}'
    server.add(completion(CALL, tool_calls=[("call_native", "calculator", arguments)]))

    _, final = await collect(model, ask())

    assert final.content == [
        TextBlock(text=CALL),
        ToolUseBlock(id="call_native", name="calculator", input={"expr": "1 + 1"}),
    ]


async def test_with_native_tools_on_a_call_written_as_text_is_the_answer(
    server: FakeOpenAIServer,
) -> None:
    server.add(completion(FENCED))
    config = OpenAIConfig(max_retries=0, native_tools="on")

    async with OpenAIChatModel("fake-model", base_url=server.url, config=config) as m:
        _, final = await collect(m, ask())

    assert final.content == [TextBlock(text=FENCED)]


async def test_prose_before_a_call_streams_and_the_call_does_not(server: FakeOpenAIServer) -> None:
    server.add(completion(f"Let me compute that.\n{FENCED}", pieces=12))

    async with OpenAIChatModel("fake-model", base_url=server.url) as m:
        deltas, final = await collect(m, ask())

    assert len([d for d in deltas if isinstance(d, TextDelta)]) > 1
    assert shown(deltas) == "Let me compute that.\n"
    assert final.text == "Let me compute that."
    assert [u.name for u in final.tool_uses] == ["calculator"]


async def test_an_answer_that_is_not_a_chat_completion_is_a_retryable_error(
    server: FakeOpenAIServer,
) -> None:
    server.add(JsonReply("upstream said no"))
    config = OpenAIConfig(max_retries=0, stream=False)

    async with OpenAIChatModel("fake-model", base_url=server.url, config=config) as m:
        with pytest.raises(ModelError, match="not a chat completion: upstream said no") as caught:
            await collect(m, ask())

    assert caught.value.retryable is True


# -- agent replies ------------------------------------------------------------------------


async def test_an_agent_runs_a_call_written_as_text_and_answers_with_its_result(
    server: FakeOpenAIServer, model: OpenAIChatModel
) -> None:
    server.add(completion(FENCED), completion("17 * 23 + 4 = 395."))
    agent = calculating(model)

    final = await asyncio.wait_for(agent.reply("What is 17 * 23 + 4?"), timeout=10)

    assert final.finished_reason == "completed"
    assert final.content == "17 * 23 + 4 = 395."
    # The next request shows the step as an ordinary tool call and its result.
    second = server.bodies[1]
    assert [t["function"]["name"] for t in second["tools"]] == ["calculator"]
    call, result = second["messages"][-2:]
    call_id = call["tool_calls"][0]["id"]
    assert call_id.startswith("call_text_")
    assert call == {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": call_id,
                "type": "function",
                "function": {"name": "calculator", "arguments": '{"expr": "17 * 23 + 4"}'},
            }
        ],
    }
    assert result == {"role": "tool", "tool_call_id": call_id, "content": "395"}


async def test_a_text_call_to_a_tool_not_on_offer_gets_unknown_tool_not_the_answer(
    server: FakeOpenAIServer, model: OpenAIChatModel
) -> None:
    # What a small local model wrote in a walk of the README: a call to a
    # tool it imagined, which had been shown to the person as the answer.
    server.add(
        completion('```json\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n```'),
        completion("I have no weather tool; 17 * 23 + 4 is what I can compute."),
    )
    agent = calculating(model)

    final = await asyncio.wait_for(agent.reply("Weather in Oslo?"), timeout=10)

    assert final.content == "I have no weather tool; 17 * 23 + 4 is what I can compute."
    call, result = server.bodies[1]["messages"][-2:]
    assert call["tool_calls"][0]["function"]["name"] == "get_weather"
    assert result["role"] == "tool"
    assert result["content"].startswith("unknown_tool: there is no tool 'get_weather'")
    assert "calculator" in result["content"]


async def test_a_model_that_keeps_writing_calls_as_text_is_switched_to_the_text_protocol(
    server: FakeOpenAIServer, model: OpenAIChatModel
) -> None:
    server.add(
        completion(FENCED),
        completion('<tool_call>{"name": "calculator", "arguments": {"expr": "395 * 2"}}'),
        completion('{"answer": "395, and twice that is 790."}'),
    )
    agent = calculating(model)

    final = await asyncio.wait_for(agent.reply("17 * 23 + 4, and twice that?"), timeout=10)

    assert final.content == "395, and twice that is 790."
    first, second, third = server.bodies
    assert "tools" in first
    assert "tools" in second
    # Two steps wrote their calls as text and none were native: text protocol.
    assert not {"tools", "tool_choice"} & third.keys()
    system = third["messages"][0]["content"]
    assert system.startswith("You compute.\n\n# Tools")
    assert third["messages"][-2:] == [
        {
            "role": "assistant",
            "content": '{"tool": "calculator", "arguments": {"expr": "395 * 2"}}',
        },
        {"role": "user", "content": "Observation from calculator:\n790"},
    ]


async def test_a_native_call_in_the_conversation_keeps_native_tools(
    server: FakeOpenAIServer, model: OpenAIChatModel
) -> None:
    native = ("call_n", "calculator", '{"expr": "2 * 3"}')
    server.add(
        completion(FENCED),
        completion(tool_calls=[native]),
        completion('{"name": "calculator", "arguments": {"expr": "6 + 395"}}'),
        completion("401"),
    )
    agent = calculating(model)

    final = await asyncio.wait_for(agent.reply("Add it all up."), timeout=10)

    assert final.content == "401"
    assert all("tools" in body for body in server.bodies)
    assert len(server.bodies) == 4


async def test_an_invented_observation_is_shown_back_and_the_model_corrects_itself(
    server: FakeOpenAIServer, model: OpenAIChatModel
) -> None:
    server.add(completion(INVENTED), completion(FENCED), completion("It is 395."))
    agent = calculating(model)

    final = await asyncio.wait_for(agent.reply("What is 17 * 23 + 4?"), timeout=10)

    assert final.content == "It is 395."
    wrote, reminder = server.bodies[1]["messages"][-2:]
    assert wrote == {"role": "assistant", "content": INVENTED}
    assert reminder["role"] == "user"
    assert reminder["content"].startswith(
        "Your last message could not be used: it holds 'Observation from calculator:', "
        "a tool result you wrote yourself, but no tool ran."
    )
    assert server.bodies[2]["messages"][-1]["content"] == "395"


ECHO = "To use a tool, call it; its result comes in the next message."
"""What Qwen2.5-Coder-1.5B behind llama.cpp answered after a reminder (and,
that answer in its history, to the next request too)."""


async def test_an_answer_that_only_repeats_the_reminder_is_not_the_answer(
    server: FakeOpenAIServer, model: OpenAIChatModel
) -> None:
    server.add(completion(INVENTED), completion(ECHO), completion(FENCED), completion("395."))
    agent = calculating(model)

    final = await asyncio.wait_for(agent.reply("What is 17 * 23 + 4?"), timeout=10)

    assert final.content == "395."
    wrote, reminder = server.bodies[2]["messages"][-2:]
    assert wrote == {"role": "assistant", "content": ECHO}
    assert reminder["content"].startswith(
        "Your last message could not be used: it only repeats the reminder: call a tool, "
        "or give your final answer."
    )
    assert server.bodies[3]["messages"][-1]["content"] == "395"


async def test_a_model_that_keeps_repeating_the_reminder_ends_the_reply_with_an_error(
    server: FakeOpenAIServer, config: OpenAIConfig
) -> None:
    server.add(completion(INVENTED), completion(ECHO), completion(f"  {ECHO.upper()}  "))

    async with OpenAIChatModel("fake-model", base_url=server.url, config=config) as m:
        agent = calculating(m)
        final = await asyncio.wait_for(agent.reply("What is 17 * 23 + 4?"), timeout=10)

    assert final.finished_reason == "error"
    assert "only repeats the reminder" in final.content
    assert isinstance(final.content, str)
    assert ECHO not in final.content.replace(f"last: {tp.ECHOED_REMINDER}", "")
    assert len(server.requests) == 3
    # Nothing of it kept as an answer that a next request would see.
    assert all(ECHO not in m.text for m in agent.memory if m.role == "assistant")


async def test_in_the_text_protocol_an_invented_observation_gets_a_format_reminder(
    server: FakeOpenAIServer, config: OpenAIConfig
) -> None:
    server.add(
        completion(INVENTED),
        completion('{"tool": "calculator", "arguments": {"expr": "17 * 23 + 4"}}'),
        completion('{"answer": "395"}'),
    )
    text = config.model_copy(update={"native_tools": "off"})

    async with OpenAIChatModel("fake-model", base_url=server.url, config=text) as m:
        agent = calculating(m)
        final = await asyncio.wait_for(agent.reply("What is 17 * 23 + 4?"), timeout=10)

    assert final.content == "395"
    wrote, reminder = server.bodies[1]["messages"][-2:]
    assert wrote == {"role": "assistant", "content": INVENTED}
    assert reminder["content"].startswith(
        "Your last message could not be read as an action: it holds 'Observation from calculator:'"
    )


async def test_a_model_that_only_invents_observations_ends_the_reply_with_an_error(
    server: FakeOpenAIServer, config: OpenAIConfig
) -> None:
    server.add(completion(INVENTED), completion(INVENTED))
    strict = config.model_copy(update={"format_retries": 1})

    async with OpenAIChatModel("fake-model", base_url=server.url, config=strict) as m:
        agent = calculating(m)
        final = await asyncio.wait_for(agent.reply("What is 17 * 23 + 4?"), timeout=10)

    assert final.finished_reason == "error"
    assert "402" not in final.content
    assert "a tool result you wrote yourself" in final.content
    assert len(server.requests) == 2


async def test_a_call_written_as_text_runs_on_a_tool_worker_on_the_bus(
    server: FakeOpenAIServer, model: OpenAIChatModel, bus: Bus
) -> None:
    server.add(
        completion(
            'I will use the calculator.\n<tool_call>\n{"name": "calculator", '
            '"arguments": {"expr": "2026 - 1991"}}\n</tool_call>'
        ),
        completion("You are 35 in 2026."),
    )
    worker = ToolWorker(bus, Toolkit([calculator]), worker_id="w-calc")
    async with asyncio.TaskGroup() as tg:
        task = tg.create_task(worker.run())
        await worker.wait_ready()
        try:
            toolkit = Toolkit()
            await toolkit.add_remote(ToolClient(bus), ["calculator"])
            agent = fleetbus.Agent(
                "ages",
                "You compute ages.",
                model,
                toolkit=toolkit,
                settings=AgentSettings(model_calls=NO_RETRY),
            )
            final = await asyncio.wait_for(agent.reply("Born 1991: how old in 2026?"), timeout=15)
        finally:
            worker.stop()
        await task

    assert final.content == "You are 35 in 2026."
    assert worker.executed == 1
    call, result = server.bodies[1]["messages"][-2:]
    assert call["content"] == "I will use the calculator."
    assert json.loads(call["tool_calls"][0]["function"]["arguments"]) == {"expr": "2026 - 1991"}
    assert result == {"role": "tool", "tool_call_id": call["tool_calls"][0]["id"], "content": "35"}


async def test_a_step_the_model_wrote_wrong_is_shown_to_a_person_as_a_warning_not_a_tool(
    server: FakeOpenAIServer, model: OpenAIChatModel
) -> None:
    import io

    from rich.console import Console

    from fleetbus.cli.render import ReplyPrinter

    server.add(completion(INVENTED), completion("17 * 23 + 4 = 395."))
    agent = calculating(model)
    console = Console(record=True, width=200, file=io.StringIO())
    printer = ReplyPrinter(console)

    async for item in agent.reply_stream("What is 17 * 23 + 4?"):
        printer.handle(item)
    printer.close()
    text = console.export_text()

    assert "⚠ the model's step could not be used: it holds 'Observation from calculator:'" in text
    assert "asked again" in text
    assert "format_error" not in text
    assert "←" not in text
    assert text.count("17 * 23 + 4 = 395.") == 1
    # What memory records for the step says why, for whoever reads the session.
    block = next(m for m in agent.memory if m.role == "tool").content[0]
    assert isinstance(block, ToolResultBlock)
    assert "format_error: the model's step could not be used (it holds" in str(block.output)


EGGS = "A box holds 48 eggs. How many eggs are there in 365 boxes?"
"""What Qwen2.5-Coder-1.5B behind llama.cpp answered, word for word, after the
right calculator call (17,520): the question itself."""


async def test_an_answer_that_only_repeats_the_question_is_not_the_answer(
    server: FakeOpenAIServer, model: OpenAIChatModel
) -> None:
    server.add(
        completion(tool_calls=[("call_1", "calculator", '{"expr": "48 * 365"}')]),
        completion(EGGS),
        completion("There are 17520 eggs in 365 boxes."),
    )
    agent = calculating(model)

    final = await asyncio.wait_for(agent.reply(EGGS), timeout=10)

    assert final.content == "There are 17520 eggs in 365 boxes."
    assert len(server.bodies) == 3
    assert server.bodies[1]["messages"][-1]["content"] == "17520"  # the calculator ran
    wrote, reminder = server.bodies[2]["messages"][-2:]
    assert wrote == {"role": "assistant", "content": EGGS}
    assert reminder["role"] == "user"
    assert reminder["content"].startswith(
        f"Your last message could not be used: {tp.ECHOED_REQUEST}."
    )


async def test_the_text_protocol_takes_a_repeated_question_for_no_answer(
    server: FakeOpenAIServer,
) -> None:
    config = OpenAIConfig(max_retries=0, read_timeout=5.0, native_tools="off")
    server.add(completion(f"  {EGGS.lower()}  "), completion("17520"))

    async with OpenAIChatModel("fake-model", base_url=server.url, config=config) as m:
        final = await asyncio.wait_for(calculating(m).reply(EGGS), timeout=10)

    assert final.content == "17520"
    assert len(server.bodies) == 2
    assert server.bodies[1]["messages"][-1]["content"].startswith("Your last message could not")
