"""Hostile input that must not escape the codec or the tools, nor make a
reply, a log line or a stats document unbounded (issue 11)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from fleetbus.bus import EndpointStats
from fleetbus.bus.micro import MAX_LAST_ERROR
from fleetbus.errors import InvalidFieldError, MalformedMessageError, ProtocolError
from fleetbus.protocol import (
    ToolCall,
    decode,
    decode_content,
    encode,
    encode_content,
)
from fleetbus.protocol.codec import MAX_ECHO_CHARS, clip
from fleetbus.tools_workers import tool
from fleetbus.tools_workers.builtin import MAX_PATH_CHARS, file_tools

DEPTH = 10_000
DEEP_ARRAY = b"[" * DEPTH + b"]" * DEPTH
DEEP_OBJECT = b'{"a":' * DEPTH + b"1" + b"}" * DEPTH


def _nested(depth: int) -> list[Any]:
    value: list[Any] = []
    for _ in range(depth - 1):
        value = [value]
    return value


@pytest.mark.parametrize(
    "payload",
    [
        pytest.param(
            b'{"type":"tool_call","call_id":"c","tool_name":"t","parameters":{"a":'
            + DEEP_ARRAY
            + b"}}",
            id="in-parameters",
        ),
        pytest.param(
            b'{"type":"tool_call","call_id":"c","tool_name":"t","parameters":' + DEEP_OBJECT + b"}",
            id="objects-in-parameters",
        ),
        pytest.param(b'{"type":"tool_call","unknown":' + DEEP_ARRAY + b"}", id="unknown-field"),
        pytest.param(b'{"first":' + DEEP_ARRAY + b',"type":"cancel"}', id="before-type"),
        pytest.param(b'{"type":"tool_call","call_id":' + DEEP_ARRAY + b"}", id="wrong-type"),
        pytest.param(b'{"type":"cancel","version":' + b"[" * DEPTH, id="truncated"),
        pytest.param(
            b'{"type":"user_request","content":"hi","metadata":{"a":' + DEEP_ARRAY + b"}}",
            id="agent-metadata",
        ),
        pytest.param(
            b'{"type":"llm_prompt","model":"m","messages":[],"options":{"a":' + DEEP_ARRAY + b"}}",
            id="model-options",
        ),
    ],
)
def test_a_deeply_nested_payload_is_malformed_not_a_recursion_error(payload: bytes) -> None:
    with pytest.raises(MalformedMessageError) as caught:
        decode(payload)
    assert caught.value.code == "malformed"


def test_deeply_nested_stored_content_is_malformed() -> None:
    with pytest.raises(MalformedMessageError, match="deeper"):
        decode_content(DEEP_ARRAY)


def test_a_value_nested_too_deep_to_encode_is_an_invalid_field() -> None:
    deep = _nested(DEPTH)
    with pytest.raises(InvalidFieldError):
        encode(ToolCall(call_id="c", tool_name="t", parameters={"a": deep}))
    with pytest.raises(InvalidFieldError):
        encode_content(deep)


def test_an_unknown_type_is_quoted_briefly() -> None:
    payload = b'{"type":"' + b"t" * 1_000_000 + b'","call_id":"c-1"}'
    with pytest.raises(ProtocolError) as caught:
        decode(payload)
    assert caught.value.code == "malformed"
    assert caught.value.call_id == "c-1"
    assert len(str(caught.value)) < 400
    assert "(999936 more characters)" in str(caught.value)


def test_an_invalid_enum_value_is_quoted_briefly() -> None:
    payload = (
        b'{"type":"llm_prompt","model":"m","messages":[{"role":"'
        + b"r" * 1_000_000
        + b'","content":[]}]}'
    )
    with pytest.raises(ProtocolError) as caught:
        decode(payload)
    assert caught.value.code == "malformed"
    assert len(str(caught.value)) <= MAX_ECHO_CHARS + 40


def test_clip_keeps_short_texts_and_says_how_much_it_cut() -> None:
    assert clip("short") == "short"
    assert clip("x" * MAX_ECHO_CHARS) == "x" * MAX_ECHO_CHARS
    assert clip("abcdef", 2) == "ab… (4 more characters)"


async def test_a_tool_error_quoting_a_huge_argument_is_capped() -> None:
    @tool
    def shout(text: str) -> str:
        """Fail, quoting the argument."""
        raise ValueError(f"cannot shout {text!r}")

    outcome = await shout.run({"text": "x" * 1_000_000})
    assert outcome.status == "error"
    assert outcome.error_detail is not None
    message = outcome.error_detail.message
    assert message.startswith("ValueError: cannot shout 'xxx")
    assert len(message) <= MAX_ECHO_CHARS + 40
    assert message.endswith("more characters)")


async def test_a_tool_returning_a_value_nested_too_deep_is_a_tool_error() -> None:
    @tool
    def echo(value: Any) -> Any:
        """Return the argument."""
        return value

    outcome = await echo.run({"value": _nested(600)})
    assert outcome.status == "error"
    assert outcome.error_detail is not None
    assert outcome.error_detail.code == "tool_error"
    assert "not JSON-serializable" in outcome.error_detail.message


def test_the_last_error_of_an_endpoint_is_capped() -> None:
    stats = EndpointStats()
    stats.record(10, "tool_error: " + "x" * 1_000_000)
    assert len(stats.last_error) <= MAX_LAST_ERROR + 40
    assert stats.last_error.startswith("tool_error: xxx")
    assert stats.num_errors == 1


async def test_read_file_refuses_a_huge_path_briefly(tmp_path: Path) -> None:
    read_file = file_tools(tmp_path)[0]
    outcome = await asyncio.wait_for(read_file.run({"path": "a" * (1024 * 1024)}), 10)
    assert outcome.status == "error"
    assert outcome.error_detail is not None
    message = outcome.error_detail.message
    assert f"at most {MAX_PATH_CHARS} are accepted" in message
    assert len(message) < 300
