"""Tool calls written as text (fleetbus.models._text_calls): the shapes small
models write are read as calls to the offered tools; JSON that is not such a
call stays the answer; an invented observation is an error; the streaming
gate holds back only what may be a call. And the conversation-level rules of
the text protocol: the switch count and format errors shown as text."""

from __future__ import annotations

from typing import Any

import pytest

from fleetbus.models._text_calls import (
    TEXT_CALL_PREFIX,
    CallGate,
    TextCall,
    find_observation,
    new_call_id,
    read_calls,
)
from fleetbus.models._text_protocol import (
    FORMAT_ERROR_TOOL,
    format_errors_as_text,
    parse_action,
    text_call_steps,
)
from fleetbus.protocol import ChatMessage, TextBlock, ToolResultBlock, ToolUseBlock

OFFERED = frozenset({"calculator", "search"})
CALC = {"expr": "17 * 23 + 4"}


@pytest.mark.parametrize(
    ("text", "calls", "prose"),
    [
        pytest.param(
            '{"name": "calculator", "arguments": {"expr": "17 * 23 + 4"}}',
            [TextCall("calculator", CALC)],
            "",
            id="bare-json",
        ),
        pytest.param(
            '```json\n{"name": "calculator", "arguments": {"expr": "17 * 23 + 4"}}\n```',
            [TextCall("calculator", CALC)],
            "",
            id="fenced-json",
        ),
        pytest.param(
            'I will compute it.\n```json\n{"name": "calculator", "arguments": '
            '{"expr": "17 * 23 + 4"}}\n```\nThen I will answer.',
            [TextCall("calculator", CALC)],
            "I will compute it.\n\nThen I will answer.",
            id="prose-around-a-fence",
        ),
        pytest.param(
            'Sure: {"name": "calculator", "arguments": {"expr": "17 * 23 + 4"}} — one moment.',
            [TextCall("calculator", CALC)],
            "Sure:  — one moment.",
            id="prose-around-bare-json",
        ),
        pytest.param(
            '<tool_call>\n{"name": "calculator", "arguments": {"expr": "17 * 23 + 4"}}\n'
            '</tool_call>\n<tool_call>\n{"name": "search", "arguments": {"query": "x"}}\n'
            "</tool_call>",
            [TextCall("calculator", CALC), TextCall("search", {"query": "x"})],
            "",
            id="tool-call-tags",
        ),
        pytest.param(
            '<tool_call>{"name": "calculator", "arguments": {"expr": "17 * 23 + 4"}}',
            [TextCall("calculator", CALC)],
            "",
            id="unclosed-tag",
        ),
        pytest.param(
            # Seen from Qwen2.5-Coder-1.5B through llama.cpp: the template's braces leak.
            '{{"name": "calculator", "arguments": {"expr": "17 * 23 + 4"}}}',
            [TextCall("calculator", CALC)],
            "",
            id="doubled-braces",
        ),
        pytest.param(
            'First {"name": "calculator", "arguments": {"expr": "1 + 1"}} then '
            '{"tool": "search", "args": {"query": "y"}}',
            [TextCall("calculator", {"expr": "1 + 1"}), TextCall("search", {"query": "y"})],
            "First  then",
            id="two-calls-in-one-text",
        ),
        pytest.param(
            '[{"name": "calculator", "parameters": {"expr": "1"}}, '
            '{"function": "search", "input": {"query": "z"}}]',
            [TextCall("calculator", {"expr": "1"}), TextCall("search", {"query": "z"})],
            "",
            id="a-list-of-calls",
        ),
        pytest.param(
            '{"type": "function", "function": {"name": "calculator", '
            '"arguments": "{\\"expr\\": \\"17 * 23 + 4\\"}"}}',
            [TextCall("calculator", CALC)],
            "",
            id="openai-shape-arguments-as-a-string",
        ),
        pytest.param(
            '{"tool_calls": [{"id": "c1", "type": "function", "function": '
            '{"name": "search", "arguments": {"query": "q"}}}]}',
            [TextCall("search", {"query": "q"})],
            "",
            id="tool-calls-list",
        ),
        pytest.param(
            "{'name': 'calculator', 'arguments': {'expr': '17 * 23 + 4',},}",
            [TextCall("calculator", CALC)],
            "",
            id="sloppy-json",
        ),
        pytest.param(
            '{"name": "search"}',
            [TextCall("search")],
            "",
            id="no-arguments",
        ),
        pytest.param(
            '{"name": "calculator", "arguments": "17 * 23"}',
            [TextCall("calculator", raw_arguments="17 * 23")],
            "",
            id="arguments-not-an-object-are-kept-raw",
        ),
        pytest.param(
            '{"name": "calculator", "arguments": {"expr": "1 + 1"}}\n'
            'Observation from calculator: {"result": 2}\nThe answer is 2.',
            [TextCall("calculator", {"expr": "1 + 1"})],
            "",
            id="a-call-then-an-invented-observation",
        ),
    ],
)
def test_calls_written_as_text_are_read(text: str, calls: list[TextCall], prose: str) -> None:
    read = read_calls(text, OFFERED)

    assert read.calls == calls
    assert read.prose == prose
    assert read.error is None


@pytest.mark.parametrize(
    "text",
    [
        pytest.param('{"answer": 395, "unit": "none"}', id="a-json-answer"),
        pytest.param(
            '{"name": "weather", "arguments": {"city": "Oslo"}, "source": "met.no"}',
            id="an-unknown-name-with-more-keys",
        ),
        pytest.param('{"name": "Ada Lovelace", "arguments": {"a": 1}}', id="a-name-no-tool-has"),
        pytest.param('{"name": "weather", "arguments": [1, 2]}', id="arguments-not-an-object"),
        pytest.param('{"arguments": {"expr": "1 + 1"}}', id="no-name"),
        pytest.param('{"name": "search", "results": ["a", "b"]}', id="data-with-a-tool-name"),
        pytest.param('```json\n{"name": "Ada", "born": 1815}\n```', id="fenced-data"),
        pytest.param("Use [the docs](https://x.y) and f(x) = {x | x > 0}.", id="brackets-in-prose"),
        pytest.param("The result is 395.", id="plain-text"),
        pytest.param("[1, 2, 3] are the first numbers", id="a-json-list"),
    ],
)
def test_text_that_is_not_a_call_to_an_offered_tool_stays_the_answer(text: str) -> None:
    read = read_calls(text, OFFERED)

    assert read.calls == []
    assert read.error is None
    assert read.prose == text


@pytest.mark.parametrize(
    ("text", "error"),
    [
        pytest.param(
            'Observation from calculator: {"answer": "402"}',
            "it holds 'Observation from calculator:', a tool result you wrote yourself",
            id="observation-from",
        ),
        pytest.param(
            "Let me see.\n**Observation**: 402\nSo the answer is 402.",
            "it holds 'Observation:'",
            id="markdown-observation",
        ),
        pytest.param(
            "<tool_response>\n402\n</tool_response>\nThe answer is 402.",
            "it holds '<tool_response>'",
            id="tool-response-tag",
        ),
        pytest.param(
            '{"name": "calculator", "arguments": {"expr": 17 * 23}}',
            "the call to calculator is not valid JSON",
            id="a-call-that-is-not-json",
        ),
        pytest.param(
            '<tool_call>{"name": "calculator", "arguments": </tool_call>',
            "the <tool_call> is not valid JSON",
            id="a-broken-tag",
        ),
    ],
)
def test_an_invented_observation_or_a_broken_call_is_an_error(text: str, error: str) -> None:
    read = read_calls(text, OFFERED)

    assert read.calls == []
    assert read.error is not None
    assert read.error.startswith(error)


@pytest.mark.parametrize(
    "text",
    [
        pytest.param('{"name": "weather", "arguments": {"city": "Oslo"}}', id="bare"),
        pytest.param('{"tool": "weather", "args": "{\\"city\\": \\"Oslo\\"}"}', id="encoded"),
        pytest.param(
            'Let me check.\n```json\n{"type": "function", "function": {"name": "weather", '
            '"arguments": "{\\"city\\": \\"Oslo\\"}"}}\n```',
            id="openai-shape-fenced",
        ),
    ],
)
def test_a_plain_call_to_an_unknown_tool_is_a_call(text: str) -> None:
    # Nothing but a name and arguments: the agent answers unknown_tool (and
    # lists the tools on offer) instead of taking the object for the answer.
    read = read_calls(text, OFFERED)

    assert read.calls == [TextCall("weather", {"city": "Oslo"})]
    assert read.error is None


def test_without_tools_on_offer_an_object_is_never_a_call() -> None:
    text = '{"name": "weather", "arguments": {"city": "Oslo"}}'

    assert read_calls(text, frozenset()).calls == []


@pytest.mark.parametrize(
    "text",
    [
        pytest.param(
            'Calling it.\n{"name": "calculator", "description": "Evaluate arithmetic.", '
            '"parameters": {"type": "object", "properties": {"expr": {"type": "string"}}}}',
            id="bare",
        ),
        pytest.param(
            '[{"type": "function", "function": {"name": "calculator", "description": "x", '
            '"parameters": {"type": "object", "properties": {}}}}]',
            id="as-offered",
        ),
    ],
)
def test_a_tool_description_the_model_echoed_is_an_error_not_a_call(text: str) -> None:
    read = read_calls(text, OFFERED)

    assert read.calls == []
    assert read.error is not None
    assert read.error.startswith("it holds the description of the tool calculator")
    assert '{"name": "calculator", "arguments": {...}}' in read.error


def test_a_tagged_call_to_an_unknown_tool_is_still_a_call() -> None:
    # The tags say it is a call: the agent then answers unknown_tool.
    read = read_calls('<tool_call>{"name": "weather", "arguments": {}}</tool_call>', OFFERED)

    assert read.calls == [TextCall("weather")]


def test_observations_are_found_only_where_a_tool_result_would_be() -> None:
    assert find_observation("Observation from calculator (error):\nboom") == (
        0,
        "Observation from calculator (error):",
    )
    assert find_observation("My observation: the sky is blue") is None
    assert find_observation("Observations: several") is None


def test_ids_of_calls_read_from_text_are_marked() -> None:
    first, second = new_call_id(), new_call_id()

    assert first.startswith(TEXT_CALL_PREFIX)
    assert first != second


def _fed(gate: CallGate, *pieces: str) -> list[str]:
    return [gate.feed(p) for p in pieces]


def test_the_gate_streams_answers_and_holds_back_what_may_be_a_call() -> None:
    plain = CallGate()
    assert _fed(plain, "The answer ", "is 395.") == ["The answer ", "is 395."]
    assert plain.rest() == ""

    call = CallGate()
    shown = _fed(call, "Let me com", "pute. ``", '`json\n{"name"', ': "calculator"}\n```')
    assert "".join(shown) == "Let me compute. "
    assert call.rest() == '```json\n{"name": "calculator"}\n```'

    # A marker cut between two pieces is held back until it is known.
    cut = CallGate()
    assert _fed(cut, "So. Obs", "ervation from x:") == ["So. ", ""]
    assert cut.rest() == "Observation from x:"
    tail = CallGate()
    assert _fed(tail, "Tool <tool", "s>") == ["Tool ", "<tools>"]


def test_the_text_protocol_refuses_an_invented_observation_but_keeps_a_call_before_it() -> None:
    invented = parse_action('Observation from calculator: {"answer": "402"}')
    assert invented.error is not None
    assert "'Observation from calculator:'" in invented.error
    assert invented.answer is None

    called = parse_action(
        '{"tool": "calculator", "arguments": {"expr": "1"}}\nObservation from calculator: 1'
    )
    assert (called.tool, called.arguments, called.error) == ("calculator", {"expr": "1"}, None)


def _assistant(*uses: ToolUseBlock) -> ChatMessage:
    return ChatMessage(role="assistant", content=list(uses))


def _use(call_id: str, name: str = "calculator", **kwargs: Any) -> ToolUseBlock:
    return ToolUseBlock(id=call_id, name=name, input={}, **kwargs)


def test_steps_with_calls_written_as_text_are_counted_until_a_native_one() -> None:
    user = ChatMessage(role="user", content=[TextBlock(text="q")])
    text_step = _assistant(_use(new_call_id()))
    error_step = _assistant(_use("call_x", FORMAT_ERROR_TOOL, raw_arguments="?"))

    assert text_call_steps([user]) == 0
    assert text_call_steps([user, text_step, error_step, text_step]) == 2
    assert text_call_steps([user, text_step, _assistant(_use("call_native"))]) is None


def test_format_errors_are_shown_to_a_native_request_as_text_and_a_reminder() -> None:
    written = "Observation from calculator: 402"
    messages = [
        ChatMessage(role="user", content=[TextBlock(text="17 * 23 + 4?")]),
        _assistant(_use("call_e", FORMAT_ERROR_TOOL, raw_arguments=written)),
        ChatMessage(
            role="tool",
            content=[ToolResultBlock(id="call_e", name=FORMAT_ERROR_TOOL, output="bad")],
        ),
    ]

    shown = format_errors_as_text(messages, OFFERED)

    assert shown[0] == messages[0]
    assert shown[1] == ChatMessage(role="assistant", content=[TextBlock(text=written)])
    assert shown[2].role == "user"
    reminder = shown[2].content[0]
    assert isinstance(reminder, TextBlock)
    assert reminder.text.startswith(
        "Your last message could not be used: it holds 'Observation from calculator:'"
    )
    assert len(shown) == 3
    assert format_errors_as_text(messages[:1], OFFERED) == messages[:1]


@pytest.mark.parametrize(
    ("text", "prose"),
    [
        pytest.param(
            '{"name": "calculator", "arguments": {"expr": "1"}}}', "", id="one-more-brace"
        ),
        pytest.param(
            'Now: {{"name": "calculator", "arguments": {"expr": "1"}}} ok', "Now:  ok", id="doubled"
        ),
    ],
)
def test_the_braces_a_template_leaks_around_a_call_are_not_prose(text: str, prose: str) -> None:
    read = read_calls(text, OFFERED)

    assert read.calls == [TextCall("calculator", {"expr": "1"})]
    assert read.prose == prose


@pytest.mark.parametrize(
    "text", ['{"answer": "It is 4."}}', '{{"answer": "It is 4."}}}'], ids=["one-more", "doubled"]
)
def test_in_the_text_protocol_leaked_braces_are_no_thought(text: str) -> None:
    action = parse_action(text)

    assert (action.answer, action.prose) == ("It is 4.", "")
