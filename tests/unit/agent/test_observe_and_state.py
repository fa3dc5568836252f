"""observe() adds to memory without replying; the state round-trips through
JSON and an agent built from it continues exactly."""

from __future__ import annotations

import pytest

from fleetbus.agents import Agent, AgentSettings, AgentState, Permissions
from fleetbus.capabilities import Planning
from fleetbus.errors import ConfigError
from fleetbus.protocol import AgentMessage, TextBlock, UserRequest
from fleetbus.testing import ScriptedModel


async def test_observed_messages_join_memory_without_a_model_call() -> None:
    model = ScriptedModel([ScriptedModel.text("I heard both")])
    agent = Agent("listener", "", model)
    await agent.observe("the meeting moved to 3pm")
    await agent.observe(
        AgentMessage(sender="agent.planner", name="planner", content=[TextBlock(text="ok")])
    )
    assert model.requests == []
    assert [m.text for m in agent.memory] == ["the meeting moved to 3pm", "ok"]
    assert all("observed" in m.marks for m in agent.memory)
    assert agent.memory[1].name == "planner"
    final = await agent.reply("what did you hear?")
    assert final.content == "I heard both"
    sent = [m.content[0] for m in model.requests[0].messages if m.role == "user"]
    assert [b.text for b in sent if isinstance(b, TextBlock)] == [
        "the meeting moved to 3pm",
        "ok",
        "what did you hear?",
    ]


async def test_the_state_round_trips_and_the_copy_continues_the_conversation() -> None:
    first = Agent(
        "a",
        "sys",
        ScriptedModel([ScriptedModel.text("one")]),
        permissions=Permissions.from_strings(ask=["shell"]),
        capabilities=[Planning()],
    )
    await first.reply(UserRequest(content="first", session_id="s-1"))
    saved = first.state.model_dump_json()
    restored = AgentState.model_validate_json(saved)
    assert restored == first.state
    model = ScriptedModel([ScriptedModel.text("two")])
    second = Agent("a", "sys", model, state=restored)
    final = await second.reply("second")
    assert final.content == "two"
    assert [m.text for m in second.memory] == ["first", "one", "second", "two"]
    assert second.state.plan is not None
    assert [str(r) for r in second.state.permissions.rules] == ["shell"]


async def test_the_session_id_of_a_request_is_carried_to_the_answer() -> None:
    agent = Agent("a", "", ScriptedModel([ScriptedModel.text("hi")]))
    final = await agent.reply(UserRequest(content="hello", session_id="s-7"))
    assert final.session_id == "s-7"
    assert final.sender == "a"


def test_a_state_of_another_agent_is_refused() -> None:
    with pytest.raises(ConfigError, match="the state is agent 'b'"):
        Agent("a", "", ScriptedModel([]), state=AgentState(agent_name="b"))


def test_an_agent_needs_a_model() -> None:
    with pytest.raises(ConfigError, match="needs a model"):
        Agent("a", "")


async def test_a_clone_shares_the_settings_and_starts_from_the_state_it_was_built_with() -> None:
    definition = Agent(
        "a",
        "sys",
        ScriptedModel([ScriptedModel.text("hi")], repeat_last=True),
        permissions=Permissions(default="deny"),
        capabilities=[Planning()],
        settings=AgentSettings(max_iters=4),
    )
    first, second = definition.clone(), definition.clone()
    assert first.model is definition.model
    assert first.settings.max_iters == 4
    assert first.state is not second.state
    assert first.state.memory == []
    assert first.state.plan is not None
    assert first.state.plan is not second.state.plan
    assert first.state.permissions.default == "deny"
    first.state.permissions.default = "allow"  # a session's permissions are its own
    assert second.state.permissions.default == definition.initial_state().permissions.default
    assert definition.initial_state().permissions.default == "deny"
    await first.reply("hello")
    assert [m.text for m in second.memory] == []
    assert len(first.memory) == 2
    assert (await second.reply("again")).content == "hi"  # its own lock, not first's
    saved = first.state
    resumed = definition.clone(state=saved)
    assert resumed.state is saved
    assert resumed.state.permissions.default == "allow"
    with pytest.raises(ConfigError, match="agent 'b'"):
        definition.clone(state=AgentState(agent_name="b"))
