"""Encoding and decoding of wire messages: the one codec of fleetbus.

``encode`` turns a message into UTF-8 JSON bytes; ``decode`` turns bytes back
into the right message class, or raises one :class:`~fleetbus.errors.ProtocolError`
subclass that says precisely what was wrong, with the ``call_id`` when it
could still be read.
"""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec

from fleetbus.errors import (
    InvalidFieldError,
    MalformedMessageError,
    UnexpectedMessageError,
    UnknownMessageTypeError,
    UnsupportedVersionError,
)
from fleetbus.protocol.content import DataBlock
from fleetbus.protocol.messages import (
    PROTOCOL_VERSION,
    AgentMessage,
    Cancel,
    ConfirmResult,
    ErrorMessage,
    Event,
    ExternalResult,
    FinalAnswer,
    LlmPrompt,
    LlmResponse,
    Message,
    ToolCall,
    ToolResult,
    UserRequest,
)

__all__ = [
    "MAX_ECHO_CHARS",
    "MESSAGE_TYPES",
    "AnyMessage",
    "by_reference",
    "clip",
    "content_reference",
    "decode",
    "decode_as",
    "decode_content",
    "encode",
    "encode_content",
    "to_builtins",
]

AnyMessage = (
    UserRequest
    | LlmPrompt
    | LlmResponse
    | ToolCall
    | ToolResult
    | FinalAnswer
    | ErrorMessage
    | AgentMessage
    | Event
    | ConfirmResult
    | ExternalResult
    | Cancel
)
"""Any message of protocol version 1."""

MESSAGE_TYPES: dict[str, type[Message]] = {
    cls.__struct_config__.tag: cls  # type: ignore[misc]
    for cls in (
        UserRequest,
        LlmPrompt,
        LlmResponse,
        ToolCall,
        ToolResult,
        FinalAnswer,
        ErrorMessage,
        AgentMessage,
        Event,
        ConfirmResult,
        ExternalResult,
        Cancel,
    )
}
"""Message classes by their ``type`` tag."""

M = TypeVar("M", bound=Message)

MAX_ECHO_CHARS = 2048
"""Most characters of a text made from what a message carried (an error
that quotes a field, an exception's text) that fleetbus puts in a reply, a
log line or a stored record; :func:`clip` cuts the rest."""

_TOO_DEEP = "payload nests arrays and objects deeper than this receiver decodes"

_encoder = msgspec.json.Encoder()
_decoder: msgspec.json.Decoder[AnyMessage] = msgspec.json.Decoder(AnyMessage)


class _Envelope(msgspec.Struct):
    """The few fields read to explain why a payload did not decode."""

    version: Any = None
    type: Any = None
    call_id: Any = None
    session_id: Any = None


_envelope_decoder = msgspec.json.Decoder(_Envelope)
_content_decoder = msgspec.json.Decoder()


def encode(message: Message) -> bytes:
    """Encode a message as UTF-8 JSON.

    Raises:
        InvalidFieldError: a field holds a value JSON cannot carry (a tool
            result that is not JSON-serializable, say).
    """
    try:
        return _encoder.encode(message)
    except (TypeError, msgspec.EncodeError, RecursionError) as exc:
        raise InvalidFieldError(
            f"cannot encode {type(message).__name__}: {exc}",
            call_id=message.call_id,
        ) from exc


def to_builtins(message: Message) -> dict[str, Any]:
    """The message as plain JSON-compatible Python objects (a dict)."""
    result: dict[str, Any] = msgspec.to_builtins(message)
    return result


def decode(data: bytes | bytearray | memoryview | str) -> AnyMessage:
    """Decode one message.

    Raises:
        MalformedMessageError: not JSON, or not a JSON object.
        UnsupportedVersionError: ``version`` is higher than this code speaks.
        UnknownMessageTypeError: ``type`` is missing or names no message.
        InvalidFieldError: a field has the wrong type, or a required one is missing.
    """
    try:
        message = _decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise _explain(data, exc) from exc
    except UnicodeDecodeError as exc:  # (msgspec 0.18, on a string that is not UTF-8)
        raise MalformedMessageError(clip(f"payload is not valid JSON: {exc}")) from exc
    except RecursionError:
        # msgspec's depth limit is the interpreter's recursion limit: a
        # payload like [[[[…]]]] must be an answer, not an escaping error.
        raise MalformedMessageError(_TOO_DEEP) from None
    if message.version > PROTOCOL_VERSION:
        raise UnsupportedVersionError(
            f"message speaks protocol version {message.version}; "
            f"this receiver speaks {PROTOCOL_VERSION}",
            version=message.version,
            call_id=message.call_id,
            session_id=message.session_id,
            message_type=type(message).__struct_config__.tag,  # type: ignore[arg-type]
        )
    return message


def decode_as(data: bytes | bytearray | memoryview | str, cls: type[M]) -> M:
    """Decode one message that must be of class ``cls``.

    Raises:
        UnexpectedMessageError: a valid message of another type.
        ProtocolError: any error of :func:`decode`.
    """
    message = decode(data)
    if not isinstance(message, cls):
        got = type(message).__struct_config__.tag
        want = cls.__struct_config__.tag
        raise UnexpectedMessageError(
            f"expected a {want!r} message, got {got!r}",
            call_id=message.call_id,
            session_id=message.session_id,
            message_type=got,  # type: ignore[arg-type]
        )
    return message


def encode_content(content: Any) -> bytes:
    """Encode what a tool returned (any JSON value) as UTF-8 JSON: the bytes
    of a result stored by reference.

    Raises:
        InvalidFieldError: the value is not JSON-serializable.
    """
    try:
        return _encoder.encode(content)
    except (TypeError, msgspec.EncodeError, RecursionError) as exc:
        raise InvalidFieldError(f"cannot encode the content: {exc}") from exc


def decode_content(data: bytes | bytearray | memoryview | str) -> Any:
    """Decode what :func:`encode_content` made.

    Raises:
        MalformedMessageError: not valid JSON, or nested too deep to decode.
    """
    try:
        return _content_decoder.decode(data)
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        raise MalformedMessageError(f"stored content is not valid JSON: {exc}") from exc
    except RecursionError:
        raise MalformedMessageError(f"stored content: {_TOO_DEEP}") from None


def by_reference(result: ToolResult, reference: DataBlock) -> ToolResult:
    """``result`` with its content replaced by ``reference``, the ``data``
    block of the object that holds it (``content_by_reference`` set)."""
    return msgspec.structs.replace(
        result, content=msgspec.to_builtins(reference), content_by_reference=True
    )


def content_reference(result: ToolResult) -> DataBlock | None:
    """The ``data`` block a result's content is stored at, or ``None`` when
    the content is in the result itself.

    Raises:
        InvalidFieldError: ``content_by_reference`` is set but ``content`` is
            not a ``data`` block.
    """
    if not result.content_by_reference:
        return None
    try:
        return msgspec.convert(result.content, DataBlock)
    except (msgspec.ValidationError, RecursionError) as exc:
        raise InvalidFieldError(
            f"a tool_result with content_by_reference needs a 'data' block as content: {exc}",
            call_id=result.call_id,
            session_id=result.session_id,
            message_type="tool_result",
        ) from exc


def clip(text: str, limit: int = MAX_ECHO_CHARS) -> str:
    """``text`` if it has at most ``limit`` characters; else its first
    ``limit`` characters and how many more there were."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}… ({len(text) - limit} more characters)"


def _explain(data: bytes | bytearray | memoryview | str, exc: Exception) -> Exception:
    """Turn a msgspec failure into the most precise ProtocolError."""
    try:
        envelope = _envelope_decoder.decode(data)
    except msgspec.ValidationError:  # a subclass of DecodeError: test it first
        return MalformedMessageError("payload is JSON but not a JSON object")
    except msgspec.DecodeError:
        return MalformedMessageError(clip(f"payload is not valid JSON: {exc}"))
    except RecursionError:
        return MalformedMessageError(_TOO_DEEP)
    call_id = envelope.call_id if isinstance(envelope.call_id, str) else None
    session_id = envelope.session_id if isinstance(envelope.session_id, str) else None
    message_type = envelope.type if isinstance(envelope.type, str) else None
    version = envelope.version
    if isinstance(version, int) and not isinstance(version, bool) and version > PROTOCOL_VERSION:
        return UnsupportedVersionError(
            f"message speaks protocol version {version}; this receiver speaks {PROTOCOL_VERSION}",
            version=version,
            call_id=call_id,
            session_id=session_id,
            message_type=message_type,
        )
    if message_type is None:
        return UnknownMessageTypeError(
            "message has no string 'type' field", call_id=call_id, session_id=session_id
        )
    if message_type not in MESSAGE_TYPES:
        known = ", ".join(sorted(MESSAGE_TYPES))
        return UnknownMessageTypeError(
            f"unknown message type {clip(message_type, 64)!r}; known types: {known}",
            call_id=call_id,
            session_id=session_id,
            message_type=message_type,
        )
    return InvalidFieldError(
        clip(f"invalid {message_type!r} message: {exc}"),
        call_id=call_id,
        session_id=session_id,
        message_type=message_type,
    )
