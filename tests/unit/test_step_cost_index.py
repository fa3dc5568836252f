"""The memory index keeps up with memory however it changes, and a message's
chat form is made once and never outlives what it was made from."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from fleetbus.agents import Msg
from fleetbus.agents.compression import ApproxTokenCounter
from fleetbus.agents.state import AgentState
from fleetbus.protocol import TextBlock, ToolResultBlock, ToolUseBlock

CALL_IDS = ["a", "b", "c", "d"]
"""Few, so that memory often holds the same id twice."""


def message(kind: int, call_id: str, hint: bool) -> Msg:
    marks: frozenset[Any] = frozenset({"hint"}) if hint else frozenset()
    if kind == 0:
        return Msg.text_message("user", f"text {call_id}", marks=marks)
    if kind == 1:
        use = ToolUseBlock(id=call_id, name="t", input={"k": call_id})
        return Msg(role="assistant", content=[TextBlock(text="calling"), use], marks=marks)
    return Msg(role="tool", content=[ToolResultBlock(id=call_id, name="t", output="x" * 9)])


messages = st.builds(message, st.integers(0, 2), st.sampled_from(CALL_IDS), st.booleans())

edits = st.one_of(
    st.tuples(st.just("append"), messages),
    st.tuples(st.just("pop"), st.none()),
    st.tuples(st.just("cut"), st.integers(0, 12)),
    st.tuples(st.just("replace"), st.tuples(st.integers(0, 12), messages)),
    st.tuples(st.just("insert"), st.tuples(st.integers(0, 12), messages)),
    st.tuples(st.just("compress"), st.tuples(st.integers(0, 12), messages)),
    st.tuples(st.just("copy"), st.integers(0, 12)),
    st.tuples(st.just("reassign"), st.none()),
)


def apply(state: AgentState, edit: tuple[str, Any]) -> None:
    memory = state.memory
    kind, arg = edit
    if kind == "append":
        memory.append(arg)
    elif kind == "pop" and memory:
        memory.pop()
    elif kind == "cut":
        del memory[arg:]
    elif kind == "replace" and memory:
        memory[arg[0] % len(memory)] = arg[1]
    elif kind == "insert":
        memory.insert(arg[0], arg[1])
    elif kind == "compress":
        memory[: arg[0]] = [arg[1].marked("compressed")]
    elif kind == "copy" and memory:
        at = arg % len(memory)
        memory[at] = memory[at].model_copy()  # equal, not the same object
    elif kind == "reassign":
        state.memory = list(memory)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(messages, max_size=10),
    st.lists(st.tuples(st.lists(edits, min_size=1, max_size=3), st.booleans()), max_size=12),
)
def test_the_index_matches_memory_after_any_edits(
    start: list[Msg], rounds: list[tuple[list[tuple[str, Any]], bool]]
) -> None:
    counter = ApproxTokenCounter()
    state = AgentState(agent_name="a", memory=list(start))
    for edits_of_round, count_tokens in rounds:
        index = state.memory_index()
        if count_tokens:
            assert index.tokens(counter) == counter.count(state.memory)
        for edit in edits_of_round:
            apply(state, edit)
        index = state.memory_index()
        memory = state.memory
        assert index.chats == [m.to_chat() for m in memory if "hint" not in m.marks]
        in_memory = {u.id for m in memory for u in m.tool_uses}
        assert {i for i in CALL_IDS if i in index.call_ids} == in_memory
        assert index.tokens(counter) == counter.count(memory)


def test_another_counter_counts_anew() -> None:
    state = AgentState(agent_name="a", memory=[Msg.text_message("user", "x" * 40)])
    index = state.memory_index()

    assert index.tokens(ApproxTokenCounter()) == 10 + 4
    assert index.tokens(ApproxTokenCounter(chars_per_token=2, message_overhead=0)) == 20


def test_a_message_is_converted_once_and_its_copies_only_when_they_differ() -> None:
    original = Msg.text_message("user", "hello", name="ann")

    chat = original.to_chat()
    marked = original.marked("observed")
    renamed = original.model_copy(update={"name": "bob"})
    rewritten = original.model_copy(update={"content": [TextBlock(text="bye")]})

    assert original.to_chat() is chat
    assert marked.to_chat() is chat  # the marks are not sent
    assert renamed.to_chat().name == "bob"
    assert rewritten.to_chat().content == [TextBlock(text="bye")]
    assert chat.name == "ann"
    assert chat.content == [TextBlock(text="hello")]
    assert original == Msg.model_validate_json(original.model_dump_json())
    assert "_chat" not in original.model_dump_json()
