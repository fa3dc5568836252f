"""The codec: round trips, and one precise error for each kind of bad payload."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from fleetbus.errors import (
    InvalidFieldError,
    MalformedMessageError,
    ProtocolError,
    UnexpectedMessageError,
    UnknownMessageTypeError,
    UnsupportedVersionError,
)
from fleetbus.protocol import (
    MESSAGE_TYPES,
    AgentMessage,
    ChatMessage,
    Confirmation,
    ConfirmResult,
    DataBlock,
    ErrorDetail,
    ErrorMessage,
    Event,
    ExternalOutput,
    ExternalResult,
    FinalAnswer,
    LlmPrompt,
    LlmResponse,
    Message,
    TextBlock,
    ThinkingBlock,
    ToolCall,
    ToolResult,
    ToolResultBlock,
    ToolSpec,
    ToolUseBlock,
    Usage,
    UserRequest,
    decode,
    decode_as,
    encode,
)

json_scalars = st.none() | st.booleans() | st.integers(-(2**53), 2**53) | st.text(max_size=20)
json_values = st.recursive(
    json_scalars | st.floats(allow_nan=False, allow_infinity=False),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)
json_objects = st.dictionaries(st.text(max_size=8), json_values, max_size=5)
ids = st.text(min_size=1, max_size=24)
optional_ids = st.none() | ids
times = st.datetimes(
    min_value=datetime(2000, 1, 1), max_value=datetime(2100, 1, 1), timezones=st.just(UTC)
)
blocks = st.one_of(
    st.builds(TextBlock, text=st.text()),
    st.builds(ThinkingBlock, thinking=st.text()),
    st.builds(ToolUseBlock, id=ids, name=ids, input=json_objects),
    st.builds(
        ToolResultBlock,
        id=ids,
        name=ids,
        output=json_values,
        state=st.sampled_from(["success", "error", "timeout", "denied", "cancelled"]),
    ),
    st.builds(DataBlock, url=st.text(min_size=1), size=st.none() | st.integers(0, 2**40)),
)
common: dict[str, Any] = {
    "id": ids,
    "timestamp": times,
    "sender": st.text(max_size=20),
    "session_id": optional_ids,
    "call_id": optional_ids,
}
statuses = st.sampled_from(["success", "error", "timeout", "denied", "cancelled"])
details = st.none() | st.builds(
    ErrorDetail, code=st.sampled_from(["tool_error", "timeout", "denied"]), message=st.text()
)
messages = st.one_of(
    st.builds(UserRequest, content=st.text() | st.lists(blocks, max_size=3), **common),
    st.builds(
        LlmPrompt,
        model=ids,
        messages=st.lists(
            st.builds(
                ChatMessage,
                role=st.sampled_from(["system", "user", "assistant", "tool"]),
                content=st.lists(blocks, max_size=3),
            ),
            max_size=3,
        ),
        tools=st.lists(st.builds(ToolSpec, name=ids, parameters=json_objects), max_size=2),
        **common,
    ),
    st.builds(
        LlmResponse,
        content=st.lists(blocks, max_size=3),
        usage=st.none()
        | st.builds(Usage, input_tokens=st.integers(0), output_tokens=st.integers(0)),
        **common,
    ),
    st.builds(
        ToolCall,
        tool_name=ids,
        parameters=json_objects,
        timeout=st.none() | st.floats(0.001, 1e6),
        attempt=st.integers(1, 10),
        **common,
    ),
    st.builds(
        ToolResult,
        tool_name=ids,
        status=statuses,
        content=json_values,
        error_detail=details,
        **common,
    ),
    st.builds(FinalAnswer, content=st.text(), structured=st.none() | json_objects, **common),
    st.builds(
        ErrorMessage,
        code=st.sampled_from(["malformed", "internal", "overloaded"]),
        message=st.text(),
        **common,
    ),
    st.builds(AgentMessage, content=st.lists(blocks, max_size=3), reply=st.booleans(), **common),
    st.builds(Event, event=ids, data=json_objects, seq=st.integers(0, 10**6), **common),
    st.builds(
        ConfirmResult,
        confirmations=st.lists(st.builds(Confirmation, call_id=ids, confirmed=st.booleans())),
        **common,
    ),
    st.builds(
        ExternalResult,
        results=st.lists(st.builds(ExternalOutput, call_id=ids, content=json_values)),
        **common,
    ),
)


@given(messages)
def test_every_message_survives_a_round_trip(message: Message) -> None:
    assert decode(encode(message)) == message


@given(messages)
def test_the_type_tag_is_the_first_key_and_names_the_class(message: Message) -> None:
    raw = msgspec.json.decode(encode(message))
    assert MESSAGE_TYPES[raw["type"]] is type(message)
    assert raw["version"] == 1


def test_the_design_example_decodes() -> None:
    payload = (
        b'{"version": 1, "type": "tool_call", "id": "0b9e", "timestamp": "2026-11-29T19:00:00Z",'
        b' "sender": "agent.planner", "session_id": "s-42", "call_id": "c-7",'
        b' "tool_name": "calculator", "parameters": {"expr": "2026 - 1991"}, "timeout": 30.0}'
    )
    call = decode_as(payload, ToolCall)
    assert call.tool_name == "calculator"
    assert call.parameters == {"expr": "2026 - 1991"}
    assert call.timestamp == datetime(2026, 11, 29, 19, 0, tzinfo=UTC)
    assert call.attempt == 1


def test_timestamps_are_rfc3339_utc_with_z() -> None:
    raw = msgspec.json.decode(encode(ToolCall(tool_name="x", call_id="c")))
    assert raw["timestamp"].endswith("Z")


def test_unknown_fields_are_ignored() -> None:
    payload = b'{"type":"tool_call","tool_name":"x","call_id":"c","future_field":{"a":1}}'
    call = decode_as(payload, ToolCall)
    assert (call.tool_name, call.call_id, call.parameters) == ("x", "c", {})
    assert not hasattr(call, "future_field")


@pytest.mark.parametrize(
    ("payload", "error", "code"),
    [
        (b"not json", MalformedMessageError, "malformed"),
        (b"", MalformedMessageError, "malformed"),
        (b"\xff\xfe", MalformedMessageError, "malformed"),
        # A string that is not UTF-8 (msgspec 0.18 raises UnicodeDecodeError there).
        (b'{"type": "tool_call", "tool_name": "\xff"}', ProtocolError, "malformed"),
        (b"[1, 2]", MalformedMessageError, "malformed"),
        (b'"a string"', MalformedMessageError, "malformed"),
        (b'{"tool_name": "x"}', UnknownMessageTypeError, "malformed"),
        (b'{"type": "teleport", "call_id": "c-1"}', UnknownMessageTypeError, "malformed"),
        (b'{"type": 7}', UnknownMessageTypeError, "malformed"),
        (
            b'{"type": "tool_call", "tool_name": 3, "call_id": "c-1"}',
            InvalidFieldError,
            "malformed",
        ),
        (b'{"type": "tool_call", "call_id": "c-1"}', InvalidFieldError, "malformed"),
        (
            b'{"type": "tool_call", "tool_name": "x", "timestamp": "noon"}',
            InvalidFieldError,
            "malformed",
        ),
        (b'{"type": "tool_call", "tool_name": "x", "version": 0}', InvalidFieldError, "malformed"),
        (b'{"type": "tool_call", "tool_name": "x", "attempt": 0}', InvalidFieldError, "malformed"),
        (
            b'{"type": "tool_call", "tool_name": "x", "timestamp": "2026-11-29T19:00:00"}',
            InvalidFieldError,
            "malformed",
        ),
        (
            b'{"type": "tool_call", "tool_name": "x", "version": 2}',
            UnsupportedVersionError,
            "unsupported_version",
        ),
        (
            b'{"type": "hologram", "version": 3, "call_id": "c-1"}',
            UnsupportedVersionError,
            "unsupported_version",
        ),
    ],
)
def test_each_bad_payload_raises_its_own_error(
    payload: bytes, error: type[ProtocolError], code: str
) -> None:
    with pytest.raises(error) as caught:
        decode(payload)
    assert caught.value.code == code
    assert str(caught.value)


def test_errors_carry_the_call_id_when_it_can_be_read() -> None:
    with pytest.raises(InvalidFieldError) as caught:
        decode(b'{"type": "tool_call", "tool_name": 3, "call_id": "c-9", "session_id": "s-1"}')
    assert (caught.value.call_id, caught.value.session_id) == ("c-9", "s-1")
    assert caught.value.message_type == "tool_call"
    with pytest.raises(UnsupportedVersionError) as version:
        decode(b'{"type": "tool_call", "tool_name": "x", "call_id": "c-8", "version": 2}')
    assert (version.value.call_id, version.value.version) == ("c-8", 2)


def test_error_messages_name_the_problem() -> None:
    with pytest.raises(InvalidFieldError, match=r"tool_name"):
        decode(b'{"type": "tool_call", "tool_name": 3}')
    with pytest.raises(UnknownMessageTypeError, match="teleport"):
        decode(b'{"type": "teleport"}')


def test_decode_as_refuses_another_type() -> None:
    with pytest.raises(UnexpectedMessageError, match="expected a 'tool_call'"):
        decode_as(encode(UserRequest(content="hi", call_id="c")), ToolCall)


def test_error_codes_are_open_for_later_versions() -> None:
    payload = b'{"type": "error", "code": "rate_limited", "message": "slow down"}'
    error = decode_as(payload, ErrorMessage)
    assert error.code == "rate_limited"


def test_offsets_other_than_utc_are_accepted() -> None:
    payload = b'{"type": "event", "event": "e", "timestamp": "2026-11-29T20:00:00+01:00"}'
    event = decode_as(payload, Event)
    assert event.timestamp == datetime(2026, 11, 29, 19, 0, tzinfo=UTC)


def test_encoding_a_value_json_cannot_carry_is_a_clear_error() -> None:
    with pytest.raises(InvalidFieldError, match="cannot encode ToolResult"):
        encode(ToolResult(tool_name="x", status="success", content=object(), call_id="c"))


def test_messages_are_frozen() -> None:
    call = ToolCall(tool_name="x")
    with pytest.raises(AttributeError):
        call.tool_name = "y"  # type: ignore[misc]


def test_fresh_messages_get_unique_ids() -> None:
    assert len({ToolCall(tool_name="x").id for _ in range(100)}) == 100
