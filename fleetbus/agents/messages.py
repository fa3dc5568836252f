"""Memory entries: one message of a conversation, with marks.

A :class:`Msg` holds protocol content blocks (text, thinking, tool_use,
tool_result, data). It is a pydantic model so that the whole
:class:`~fleetbus.agents.state.AgentState` round-trips through JSON; its
blocks are the protocol's msgspec structs, converted at the edge.
"""

from __future__ import annotations

from typing import Annotated, Any, Final, Literal

import msgspec
import orjson
from pydantic import BaseModel, ConfigDict, Field, PlainSerializer, PlainValidator, WithJsonSchema

from fleetbus.protocol import (
    ChatMessage,
    ContentBlock,
    DataBlock,
    TextBlock,
    ThinkingBlock,
    ToolResultBlock,
    ToolUseBlock,
    new_id,
)

__all__ = ["Blocks", "Mark", "Msg", "Role", "made_message", "stored_json", "stored_messages"]

Role = Literal["system", "user", "assistant", "tool"]

Mark = Literal["hint", "compressed", "observed"]
"""``hint``: injected for one reasoning step, then removed; ``compressed``: a
summary standing for older messages; ``observed``: added by ``observe``."""


_BLOCK_TYPES = (TextBlock, ThinkingBlock, ToolUseBlock, ToolResultBlock, DataBlock)


def _to_blocks(value: Any) -> list[ContentBlock]:
    if isinstance(value, str):
        return [TextBlock(text=value)]
    if isinstance(value, list) and all(isinstance(b, _BLOCK_TYPES) for b in value):
        return value  # already blocks: the common case, and immutable ones
    try:
        return msgspec.convert(value, type=list[ContentBlock])
    except msgspec.ValidationError as exc:
        raise ValueError(f"invalid content blocks: {exc}") from exc


def _from_blocks(blocks: list[ContentBlock]) -> list[dict[str, Any]]:
    result: list[dict[str, Any]] = msgspec.to_builtins(blocks)
    return result


Blocks = Annotated[
    list[ContentBlock],
    PlainValidator(_to_blocks),
    PlainSerializer(_from_blocks, return_type=list[dict[str, Any]]),
    WithJsonSchema({"type": "array", "items": {"type": "object"}}),
]
"""A list of content blocks, as a pydantic field (a string becomes one text block)."""


class Msg(BaseModel):
    """One message in an agent's memory."""

    model_config = ConfigDict(frozen=True)

    msg_id: str = Field(default_factory=new_id)
    role: Role
    content: Blocks
    name: str = ""
    """Who spoke (an agent's or a user's display name)."""
    marks: frozenset[Mark] = frozenset()
    metadata: dict[str, Any] = Field(default_factory=dict)

    @classmethod
    def text_message(cls, role: Role, text: str, **kwargs: Any) -> Msg:
        """A message of one text block."""
        return cls(role=role, content=[TextBlock(text=text)], **kwargs)

    @property
    def text(self) -> str:
        """The text blocks, joined by newlines."""
        return "\n".join(b.text for b in self.content if isinstance(b, TextBlock))

    @property
    def thinking(self) -> str:
        """The thinking blocks, joined by newlines."""
        return "\n".join(b.thinking for b in self.content if isinstance(b, ThinkingBlock))

    @property
    def tool_uses(self) -> list[ToolUseBlock]:
        """The tool calls this message asks for."""
        return [b for b in self.content if isinstance(b, ToolUseBlock)]

    @property
    def tool_results(self) -> list[ToolResultBlock]:
        """The tool results this message carries."""
        return [b for b in self.content if isinstance(b, ToolResultBlock)]

    def marked(self, *marks: Mark) -> Msg:
        """A copy with more marks."""
        return self.model_copy(update={"marks": self.marks | set(marks)})

    def to_chat(self) -> ChatMessage:
        """As a protocol ``ChatMessage`` (what a model is sent).

        Made once per message and then reused (it is frozen; do not change its
        content list): an agent sends its whole memory at every step.
        """
        # Kept in __dict__ as functools.cached_property keeps its value: pydantic
        # neither serializes nor compares it. model_copy copies it along, so it
        # is checked against the content, role and name it was made from.
        made = self.__dict__.get("_chat")
        if made is not None and made[0] is self.content and made[1] == (self.role, self.name):
            chat: ChatMessage = made[2]
            return chat
        made = self.__dict__["_chat"] = _chat_form(self.role, self.content, self.name)
        return made[2]


def _chat_form(
    role: Role, content: list[ContentBlock], name: str
) -> tuple[list[ContentBlock], tuple[Role, str], ChatMessage]:
    """What :meth:`Msg.to_chat` keeps: the content and the role and name its
    ``ChatMessage`` was made from, and that ``ChatMessage``."""
    return content, (role, name), ChatMessage(role=role, content=list(content), name=name or None)


class _StoredMsg(msgspec.Struct):
    """:class:`Msg` as stored (its ``model_dump(mode="json")``), for reading
    many at once: msgspec checks the same types as pydantic, in a third of
    the time (what loading a session costs grows with its memory)."""

    role: Role
    content: list[ContentBlock]
    msg_id: str = msgspec.field(default_factory=new_id)
    name: str = ""
    marks: frozenset[Mark] = frozenset()
    metadata: dict[str, Any] = msgspec.field(default_factory=dict)


_STORED = list[_StoredMsg]


def stored_messages(data: Any) -> list[Msg]:
    """Messages from their stored JSON form: a list of
    ``Msg.model_dump(mode="json")``, or that list as JSON text (``bytes``,
    ``msgspec.Raw``), read straight into messages with no dicts made on the
    way (what loading a session costs grows with its memory).

    Raises:
        ValueError: ``data`` is not a list of stored messages (what is wrong, and where).
    """
    try:
        if isinstance(data, bytes | bytearray | memoryview | msgspec.Raw):
            stored = _STORED_JSON.decode(data)
        else:
            stored = msgspec.convert(data, type=_STORED)
    except msgspec.DecodeError as exc:  # a ValidationError too
        raise ValueError(f"invalid stored messages: {exc}") from exc
    return [_restored(m) for m in stored]


_STORED_JSON: Final = msgspec.json.Decoder(_STORED)

_STORED_ENCODER: Final = msgspec.json.Encoder()


def stored_json(message: Msg) -> bytes:
    """``message`` in its stored JSON form (``Msg.model_dump(mode="json")``,
    encoded), which :func:`stored_messages` reads.

    Written by msgspec straight from its fields (its content blocks are
    msgspec structs already), a third of the time pydantic takes, unless
    its metadata holds something: metadata may hold anything pydantic
    serializes, which only pydantic writes as pydantic does.
    """
    if message.metadata or type(message) is not Msg:
        return orjson.dumps(message.model_dump(mode="json"))
    return _STORED_ENCODER.encode(
        {
            "msg_id": message.msg_id,
            "role": message.role,
            "content": message.content,
            "name": message.name,
            "marks": list(message.marks),
            "metadata": {},
        }
    )


_FIELDS: Final = frozenset(Msg.model_fields)


def _restored(m: _StoredMsg) -> Msg:
    """A :class:`Msg` of checked fields (read by msgspec): it is made for
    every message of a session each time a host loads it."""
    return _built(m.msg_id, m.role, m.content, m.name, m.marks, m.metadata, chat=True)


_BLOCK_TYPE_SET: Final = frozenset(_BLOCK_TYPES)
_NO_MARKS: Final[frozenset[Mark]] = frozenset()


def made_message(role: Role, content: list[ContentBlock], name: str = "") -> Msg:
    """``Msg(role=role, content=content, name=name)`` for the messages the
    loop makes of blocks (a step's answer, a tool's result): the same
    message, made in 0.7 of the time pydantic's validation takes (a served
    reply makes several). ``content`` must be a list of content blocks; anything
    else goes through that validation, and its error."""
    if type(content) is not list or any(type(b) not in _BLOCK_TYPE_SET for b in content):
        return Msg(role=role, content=content, name=name)
    if role not in _ROLES or type(name) is not str:
        return Msg(role=role, content=content, name=name)
    return _built(new_id(), role, content, name, _NO_MARKS, {}, chat=False)


_ROLES: Final = frozenset(("system", "user", "assistant", "tool"))


def _built(
    msg_id: str,
    role: Role,
    content: list[ContentBlock],
    name: str,
    marks: frozenset[Mark],
    metadata: dict[str, Any],
    *,
    chat: bool,
) -> Msg:
    """A :class:`Msg` of checked fields, made as ``model_construct`` makes
    one when every field is given, without its generic per-field loop
    (``chat``: with its chat form made now)."""
    message = Msg.__new__(Msg)
    fields: dict[str, Any] = {
        "msg_id": msg_id,
        "role": role,
        "content": content,
        "name": name,
        "marks": marks,
        "metadata": metadata,
    }
    if chat and "hint" not in marks:
        # Its chat form, made now, while the message is fresh in the caches:
        # an agent's next step sends it, and made later from a loaded
        # session's cold messages it cost four times as much.
        fields["_chat"] = _chat_form(role, content, name)
    object.__setattr__(message, "__dict__", fields)
    object.__setattr__(message, "__pydantic_fields_set__", set(_FIELDS))
    object.__setattr__(message, "__pydantic_extra__", None)
    object.__setattr__(message, "__pydantic_private__", None)
    return message
