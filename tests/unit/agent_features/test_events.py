"""The events of a reply: their order, numbering, ids, and that they travel."""

from __future__ import annotations

from fleetbus import Agent, BudgetLimit, Toolkit, tool
from fleetbus.agents.events import EVENT_NAMES
from fleetbus.protocol import Event, FinalAnswer, decode, encode
from fleetbus.testing import ScriptedModel

ANSWER = "2 + 2 is 4, as the calculator says."


@tool
def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first addend.
        b: the second addend.
    """
    return a + b


async def _stream_one_tool_reply() -> tuple[list[Event], FinalAnswer, Agent]:
    model = ScriptedModel(
        [
            ScriptedModel.call("add", {"a": 2, "b": 2}, call_id="c1", thinking="use the tool"),
            ScriptedModel.text(ANSWER),
        ],
        chunk_size=5,
    )
    agent = Agent("adder", "You add.", model, toolkit=Toolkit([add]))
    items = [item async for item in agent.reply_stream("What is 2 + 2?", session_id="s-1")]
    *events, final = items
    assert isinstance(final, FinalAnswer)
    assert all(isinstance(e, Event) for e in events)
    return [e for e in events if isinstance(e, Event)], final, agent


def _collapsed(names: list[str]) -> list[str]:
    """Consecutive repeats of an event name folded into one."""
    return [n for i, n in enumerate(names) if i == 0 or names[i - 1] != n]


async def test_reply_with_one_tool_call_streams_the_events_in_order() -> None:
    events, final, _ = await _stream_one_tool_reply()

    names = [e.event for e in events]
    assert set(names) <= set(EVENT_NAMES)
    assert _collapsed(names) == [
        "reply_start",
        "model_call_start",
        "thinking_delta",
        "model_call_end",
        "tool_call",
        "tool_result",
        "model_call_start",
        "text_delta",
        "model_call_end",
        "reply_end",
    ]
    assert names.count("text_delta") > 1  # streamed in pieces
    assert final.finished_reason == "completed"
    assert final.content == ANSWER


async def test_events_are_numbered_from_zero_and_carry_the_reply_id() -> None:
    events, final, _ = await _stream_one_tool_reply()

    assert [e.seq for e in events] == list(range(len(events)))
    assert final.call_id is not None
    assert {e.call_id for e in events} == {final.call_id}
    assert {e.session_id for e in events} == {"s-1"}
    assert final.session_id == "s-1"
    assert {e.sender for e in events} == {"adder"}
    assert events[0].data["reply_id"] == final.call_id


async def test_deltas_rebuild_the_answer_and_the_reasoning() -> None:
    events, final, agent = await _stream_one_tool_reply()

    text = "".join(e.data["text"] for e in events if e.event == "text_delta")
    thinking = "".join(e.data["thinking"] for e in events if e.event == "thinking_delta")
    assert text == final.content == ANSWER
    assert thinking == "use the tool"
    assert agent.memory[-1].text == ANSWER


async def test_tool_and_end_events_say_what_happened() -> None:
    events, _, _ = await _stream_one_tool_reply()

    by_name = {e.event: e for e in events}
    assert by_name["tool_call"].data == {
        "call_id": "c1",
        "tool_name": "add",
        "parameters": {"a": 2, "b": 2},
    }
    assert by_name["tool_result"].data == {
        "call_id": "c1",
        "tool_name": "add",
        "status": "success",
        "output": 4,
    }
    assert by_name["reply_end"].data == {"finished_reason": "completed", "content": ANSWER}
    ends = [e for e in events if e.event == "model_call_end"]
    assert len(ends) == 2
    for end in ends:
        assert end.data["model"] == "scripted"
        assert isinstance(end.data["input_tokens"], int)
        assert end.data["input_tokens"] > 0
        assert isinstance(end.data["output_tokens"], int)
        assert end.data["output_tokens"] > 0
    starts = [e for e in events if e.event == "model_call_start"]
    assert [s.data["iteration"] for s in starts] == [0, 1]


async def test_events_round_trip_through_the_protocol_codec() -> None:
    events, final, _ = await _stream_one_tool_reply()

    for event in events:
        decoded = decode(encode(event))
        assert isinstance(decoded, Event)
        assert decoded == event
    assert decode(encode(final)) == final


async def test_every_tool_call_event_gets_a_tool_result_event_when_a_budget_stops_it() -> None:
    @tool
    def ping() -> str:
        """Answer pong."""
        return "pong"

    model = ScriptedModel(
        [
            ScriptedModel.call("ping", call_id="first"),
            ScriptedModel.call("ping", call_id="second"),
            "Pinged once.",
        ]
    )
    agent = Agent(
        "a",
        "You ping.",
        model,
        toolkit=Toolkit([ping]),
        middlewares=[BudgetLimit(max_tool_calls=1)],
    )

    events = [e async for e in agent.reply_stream("ping twice") if isinstance(e, Event)]

    called = [e.data["call_id"] for e in events if e.event == "tool_call"]
    answered = [e.data["call_id"] for e in events if e.event == "tool_result"]
    assert called == ["first", "second"]
    assert answered == called
