"""A request asked again with its call_id replaces its earlier attempt in
memory: a client's retry, or a simulation round asked again after its runner
resumed, leaves the request once in memory, followed by what the new attempt
did."""

from __future__ import annotations

from fleetbus.agents import Agent
from fleetbus.protocol import TextBlock, UserRequest
from fleetbus.testing import ScriptedModel
from fleetbus.tools_workers import Toolkit, tool


@tool
def add(a: int, b: int) -> int:
    """Add two numbers."""
    return a + b


def user_texts(agent: Agent) -> list[str]:
    return [m.text for m in agent.memory if m.role == "user" and m.text]


async def test_a_request_asked_again_replaces_its_attempt() -> None:
    model = ScriptedModel(
        [
            ScriptedModel.text("first"),
            ScriptedModel.call("add", {"a": 1, "b": 2}),
            ScriptedModel.text("second, attempt one"),
            ScriptedModel.call("add", {"a": 2, "b": 2}),
            ScriptedModel.text("second, attempt two"),
        ]
    )
    agent = Agent("retry", "", model, toolkit=Toolkit([add]))
    await agent.reply(UserRequest(sender="c", call_id="r1", content="one"))
    await agent.reply(UserRequest(sender="c", call_id="r2", content="two"))
    answer = await agent.reply(UserRequest(sender="c", call_id="r2", content="two again"))

    assert answer.content == "second, attempt two"
    assert answer.call_id == "r2"
    assert user_texts(agent) == ["one", "two again"]
    texts = [m.text for m in agent.memory if m.role == "assistant" and m.text]
    assert texts == ["first", "second, attempt two"]
    results = [b.output for m in agent.memory for b in m.tool_results]
    assert results == [4]  # the first attempt's call went with it
    # What the model saw on the retry: the first exchange, then the retry only.
    retried = model.requests[3]
    seen = [
        b.text for m in retried.messages if m.role == "user" for b in m.content
        if isinstance(b, TextBlock)
    ]  # fmt: skip
    assert seen[:2] == ["one", "two again"]


async def test_requests_without_a_call_id_or_with_new_ones_are_all_kept() -> None:
    model = ScriptedModel(
        [ScriptedModel.text("a"), ScriptedModel.text("b"), ScriptedModel.text("c")]
    )
    agent = Agent("keep", "", model)
    await agent.reply(UserRequest(sender="c", content="one"))
    await agent.reply(UserRequest(sender="c", content="one"))
    await agent.reply(UserRequest(sender="c", call_id="x", content="two"))
    assert user_texts(agent) == ["one", "one", "two"]
