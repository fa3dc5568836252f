"""Messages restored from their stored form are the messages stored: equal,
as pydantic models that copy, dump and convert like any other, and a
malformed stored message is a clear error."""

from __future__ import annotations

import msgspec
import orjson
import pytest

from fleetbus.agents import AgentState, Msg
from fleetbus.agents.compression import ApproxTokenCounter
from fleetbus.agents.messages import made_message, stored_json, stored_messages
from fleetbus.protocol import DataBlock, TextBlock, ThinkingBlock, ToolResultBlock, ToolUseBlock

MEMORY = [
    Msg(role="user", content=[TextBlock(text="hi")], name="ann", metadata={"user_id": "ann"}),
    Msg(
        role="assistant",
        content=[
            ThinkingBlock(thinking="a tool"),
            ToolUseBlock(id="c1", name="calc", input={"expr": "1+1"}),
        ],
    ),
    Msg(role="tool", name="calc", content=[ToolResultBlock(id="c1", name="calc", output=2)]),
    Msg(
        role="user",
        content=[DataBlock(url="https://x.y/a.png", media_type="image/png")],
        marks=frozenset({"observed"}),
    ),
]


def test_restored_messages_equal_and_behave_like_the_stored_ones() -> None:
    stored = [m.model_dump(mode="json") for m in MEMORY]

    restored = stored_messages(stored)

    assert restored == MEMORY
    assert [m.model_dump(mode="json") for m in restored] == stored
    assert all(m.model_fields_set == set(Msg.model_fields) for m in restored)
    assert [m.to_chat() for m in restored] == [m.to_chat() for m in MEMORY]
    renamed = restored[0].model_copy(update={"name": "bob"})
    assert (renamed.name, restored[0].name) == ("bob", "ann")
    assert restored[3].marked("hint").marks == {"observed", "hint"}
    with pytest.raises(Exception, match="frozen"):
        restored[0].name = "eve"  # type: ignore[misc]


def test_a_message_is_stored_as_pydantic_dumps_it() -> None:
    unusual = [
        Msg(role="assistant", content=[ToolUseBlock(id="c2", name="f", input={"x": 1.5e16})]),
        Msg(role="tool", content=[ToolResultBlock(id="c2", name="f", output=[0.1, -2, "é ☃"])]),
        Msg(role="user", content="plain", marks=frozenset({"hint", "observed"})),
    ]
    for message in [*MEMORY, *unusual]:
        stored = stored_json(message)
        assert orjson.loads(stored) == message.model_dump(mode="json")
        assert stored_messages(b"[" + stored + b"]") == [message]
    # Without metadata it is written by msgspec, byte for byte as pydantic's.
    for message in MEMORY[1:]:
        assert stored_json(message) == orjson.dumps(message.model_dump(mode="json"))


def test_a_malformed_stored_message_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match=r"invalid stored messages: .*role"):
        stored_messages([{"role": "nobody", "content": []}])


def test_messages_read_from_stored_json_equal_those_read_from_dicts() -> None:
    stored = [m.model_dump(mode="json") for m in MEMORY]
    text = orjson.dumps(stored)

    for form in (text, bytearray(text), memoryview(text), msgspec.Raw(text)):
        restored = stored_messages(form)
        assert restored == MEMORY
        assert [m.model_dump(mode="json") for m in restored] == stored
    assert stored_messages(b"[]") == []


@pytest.mark.parametrize(
    "text",
    [b'[{"role": "nobody", "content": []}]', b"[1, 2", b'{"role": "user"}', b""],
)
def test_stored_json_that_is_no_list_of_messages_is_a_clear_error(text: bytes) -> None:
    with pytest.raises(ValueError, match=r"invalid stored messages: "):
        stored_messages(text)


def test_restored_messages_carry_their_chat_form_and_count_as_the_originals() -> None:
    hint = Msg(role="user", content=[TextBlock(text="think")], marks=frozenset({"hint"}))
    stored = [m.model_dump(mode="json") for m in [*MEMORY, hint]]

    restored = stored_messages(orjson.dumps(stored))

    assert ["_chat" in m.__dict__ for m in restored] == [True] * len(MEMORY) + [False]
    for original, message in zip([*MEMORY, hint], restored, strict=True):
        assert message.to_chat() == original.to_chat()
        assert message.to_chat() is message.to_chat()
        assert message.model_dump() == original.model_dump()  # the chat form is no field
    changed = restored[0].model_copy(update={"content": [TextBlock(text="bye")]})
    assert changed.to_chat().content == [TextBlock(text="bye")]
    counter = ApproxTokenCounter()
    assert [counter.count_message(m) for m in restored] == [
        ApproxTokenCounter().count([m]) for m in [*MEMORY, hint]
    ]
    state = AgentState(agent_name="ann", memory=restored)
    assert state.memory_index().tokens(counter) == ApproxTokenCounter().count(restored)
    assert state.memory_index().call_ids == {"c1": 1}


@pytest.mark.parametrize("message", MEMORY[1:3], ids=["assistant", "tool"])
def test_a_message_the_loop_makes_is_the_message_pydantic_makes(message: Msg) -> None:
    made = made_message(message.role, list(message.content), message.name)
    validated = Msg(role=message.role, content=list(message.content), name=message.name)

    assert made.model_copy(update={"msg_id": validated.msg_id}) == validated
    assert made.msg_id != validated.msg_id  # a fresh id, as pydantic's default gives
    assert made.model_dump(exclude={"msg_id"}) == validated.model_dump(exclude={"msg_id"})
    assert made.to_chat() == validated.to_chat()
    assert made.model_fields_set >= {"role", "content", "name"}


def test_a_message_made_of_what_is_not_blocks_is_validated() -> None:
    # A string becomes a text block, as Msg makes it; what is no block fails as there.
    assert made_message("user", "hi").content == [TextBlock(text="hi")]  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="invalid content blocks"):
        made_message("user", [{"type": "bogus"}])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="role"):
        made_message("boss", [TextBlock(text="hi")])  # type: ignore[arg-type]
