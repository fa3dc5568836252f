"""The offline model drives a real agent and the built-in tools, deterministically."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from fleetbus.agents import Agent, Permissions
from fleetbus.capabilities import Handoffs, HandoffTo
from fleetbus.models import ChatModel, ModelError, ModelRequest
from fleetbus.models.model import ModelResponse, TextDelta
from fleetbus.models.offline import OFFLINE_PREFIX, OfflineModel
from fleetbus.protocol import (
    AgentMessage,
    ChatMessage,
    Confirmation,
    ConfirmResult,
    Event,
    FinalAnswer,
    TextBlock,
    ToolResultBlock,
    ToolSpec,
    ToolUseBlock,
)
from fleetbus.tools_workers.builtin import builtin_toolkit


def helper(tmp_path: Path, permissions: Permissions | None = None) -> Agent:
    kit = builtin_toolkit(files_root=tmp_path)
    return Agent("helper", "You help.", OfflineModel(), toolkit=kit, permissions=permissions)


def calls(agent: Agent) -> list[ToolUseBlock]:
    return [u for m in agent.memory for u in m.tool_uses]


def text(answer: FinalAnswer) -> str:
    assert isinstance(answer.content, str)
    return answer.content


def user(content: str, name: str | None = None) -> ChatMessage:
    return ChatMessage(role="user", content=[TextBlock(text=content)], name=name)


async def run(model: OfflineModel, request: ModelRequest) -> tuple[list[TextDelta], ModelResponse]:
    deltas: list[TextDelta] = []
    final: ModelResponse | None = None
    async for item in model.stream(request):
        if isinstance(item, TextDelta):
            deltas.append(item)
        elif isinstance(item, ModelResponse):
            assert final is None, "exactly one response, last"
            final = item
    assert final is not None
    return deltas, final


def test_it_is_a_chat_model() -> None:
    model = OfflineModel()
    assert isinstance(model, ChatModel)
    assert model.name == "fleetbus-offline"
    assert OfflineModel("other").name == "other"


async def test_arithmetic_question_calls_the_calculator_and_answers(tmp_path: Path) -> None:
    agent = helper(tmp_path)

    answer = await agent.reply("What is 2026 - 1991?")

    assert answer.finished_reason == "completed"
    assert [(u.name, u.input) for u in calls(agent)] == [("calculator", {"expr": "2026 - 1991"})]
    assert text(answer) == f"{OFFLINE_PREFIX}calculator: 2026 - 1991 = 35."


async def test_two_intents_are_two_calls_in_order_then_one_answer(tmp_path: Path) -> None:
    agent = helper(tmp_path)

    answer = await agent.reply("what time is it in Tokyo and what is 6*7")

    assert [(u.name, u.input) for u in calls(agent)] == [
        ("current_time", {"timezone": "Asia/Tokyo"}),
        ("calculator", {"expr": "6*7"}),
    ]
    # One call per step: each assistant message asks for at most one tool.
    assert all(len(m.tool_uses) <= 1 for m in agent.memory)
    assert "current_time in Asia/Tokyo:" in text(answer)
    assert "calculator: 6*7 = 42" in text(answer)
    assert text(answer).index("Asia/Tokyo") < text(answer).index("42")


async def test_write_request_writes_the_file_in_the_sandbox(tmp_path: Path) -> None:
    agent = helper(tmp_path)

    answer = await agent.reply("write 'buy milk' to notes/todo.md")

    assert (tmp_path / "notes" / "todo.md").read_text() == "buy milk"
    assert "write_file: wrote notes/todo.md" in text(answer)


async def test_read_and_list_follow_a_write_in_later_turns(tmp_path: Path) -> None:
    agent = helper(tmp_path)
    await agent.reply('save "call mom" as notes/a.txt')

    answer = await agent.reply("read notes/a.txt and then list notes")

    assert [u.name for u in calls(agent)] == ["write_file", "read_file", "list_dir"]
    assert 'read_file notes/a.txt: "call mom"' in text(answer)
    assert "list_dir notes: a.txt" in text(answer)
    ids = [u.id for u in calls(agent)]
    assert len(set(ids)) == len(ids)


async def test_ask_rule_pauses_and_a_confirmation_completes(tmp_path: Path) -> None:
    agent = helper(tmp_path, permissions=Permissions.from_strings(ask=["write_file"]))

    paused = await agent.reply("write 'buy milk' to notes/todo.md")

    assert paused.finished_reason == "paused"
    assert not (tmp_path / "notes" / "todo.md").exists()
    assert agent.state.reply is not None
    call_id = agent.state.reply.pending[0].call_id
    done = await agent.reply(
        ConfirmResult(confirmations=[Confirmation(call_id=call_id, confirmed=True)])
    )
    assert done.finished_reason == "completed"
    assert (tmp_path / "notes" / "todo.md").read_text() == "buy milk"
    assert "wrote notes/todo.md" in text(done)


async def test_a_refused_call_is_said_plainly(tmp_path: Path) -> None:
    agent = helper(tmp_path, permissions=Permissions.from_strings(ask=["write_file"]))
    await agent.reply("write 'x' to a.txt")
    assert agent.state.reply is not None
    call_id = agent.state.reply.pending[0].call_id

    done = await agent.reply(
        ConfirmResult(confirmations=[Confirmation(call_id=call_id, confirmed=False)])
    )

    assert done.finished_reason == "completed"
    assert "write_file was denied: the user refused this call." in text(done)
    assert not (tmp_path / "a.txt").exists()


async def test_a_failing_tool_is_reported_not_retried(tmp_path: Path) -> None:
    agent = helper(tmp_path)

    answer = await agent.reply("what is 1/0")

    assert [u.name for u in calls(agent)] == ["calculator"]
    assert text(answer).startswith(f"{OFFLINE_PREFIX}calculator failed:")


async def test_a_chat_answer_announces_the_offline_model_once(tmp_path: Path) -> None:
    agent = helper(tmp_path)

    first = await agent.reply("Hello there, how are you?")
    second = await agent.reply("Nice weather.")

    assert calls(agent) == []
    assert text(first).startswith("(offline model) ")
    assert "not an LLM" in text(first)
    assert not text(second).startswith("(offline model)")
    assert text(first) != text(second)


class Answer(BaseModel):
    summary: str
    value: int
    exact: bool
    steps: list[str]


async def test_structured_output_is_filled_from_its_schema(tmp_path: Path) -> None:
    agent = helper(tmp_path)

    answer = await agent.reply("What is 2026 - 1991?", structured_model=Answer)

    assert answer.finished_reason == "completed"
    assert answer.structured is not None
    parsed = Answer.model_validate(answer.structured)
    assert parsed.value == 35
    assert "2026 - 1991 = 35" in parsed.summary
    assert parsed.exact is False
    assert parsed.steps == []
    assert [u.name for u in calls(agent)] == ["calculator", "generate_response"]


async def test_structured_output_without_tool_intents() -> None:
    agent = Agent("a", "You answer.", OfflineModel())

    answer = await agent.reply("Summarize our plan please", structured_model=Answer)

    assert answer.finished_reason == "completed"
    assert answer.structured == {
        "summary": "Summarize our plan please",
        "value": 0,
        "exact": False,
        "steps": [],
    }


STANCES = {
    "alice": "You are Alice. You argue that cities should ban cars from their centres.",
    "bob": "You are Bob. You believe that cars remain essential for families and trades.",
    "carol": "You are Carol. Your position: congestion pricing beats outright bans.",
}
KEYWORDS = {"alice": "ban cars", "bob": "cars remain essential", "carol": "congestion pricing"}


async def test_three_agents_debate_in_distinct_statements() -> None:
    agents = {name: Agent(name, prompt, OfflineModel()) for name, prompt in STANCES.items()}
    message: str | AgentMessage = "Debate: should cities ban cars?"
    said: list[tuple[str, str]] = []
    for name in ["alice", "bob", "carol"] * 2:
        answer = await agents[name].reply(message)
        said.append((name, text(answer)))
        message = AgentMessage(sender=name, name=name, content=[TextBlock(text=text(answer))])

    statements = [s for _, s in said]
    assert len(set(statements)) == len(statements)
    for index, (name, statement) in enumerate(said):
        assert KEYWORDS[name] in statement
        assert statement.startswith(OFFLINE_PREFIX) == (index < 3)
        if index > 0:
            previous = said[index - 1][0]
            assert previous in statement  # it answers the last speaker...
            assert KEYWORDS[previous] in statement  # ...and what they said
    # The same agent does not repeat itself word for word, bar its position.
    assert said[0][1].removeprefix(OFFLINE_PREFIX).split(".")[0] != said[3][1].split(".")[0]


async def test_persona_gives_the_voice() -> None:
    model = OfflineModel(persona="a cautious economist")
    request = ModelRequest(messages=[user("Should we cut taxes?", name="dave")])

    _, response = await run(model, request)

    assert response.text.startswith(OFFLINE_PREFIX + "Speaking as a cautious economist")
    assert "dave" in response.text
    assert "Should we cut taxes" in response.text


async def test_a_role_in_the_system_prompt_gives_the_voice_but_assistant_does_not() -> None:
    def request(system: str) -> ModelRequest:
        prompt = ChatMessage(role="system", content=[TextBlock(text=system)])
        return ModelRequest(messages=[prompt, user("hello", name="bob")])

    _, skeptic = await run(OfflineModel(), request("You are Alice, a skeptic."))
    _, assistant = await run(OfflineModel(), request("You are the fleet's assistant."))

    assert "Speaking as Alice, a skeptic" in skeptic.text
    assert "bob" in skeptic.text
    assert "Speaking as" not in assistant.text
    assert "not an LLM" in assistant.text


async def test_streamed_pieces_concatenate_to_the_text() -> None:
    model = OfflineModel(chunk_size=5)
    request = ModelRequest(messages=[user("Hello!")])

    deltas, response = await run(model, request)

    assert len(deltas) > 1
    assert all(0 < len(d.text) <= 5 for d in deltas)
    assert "".join(d.text for d in deltas) == response.text
    assert response.finish_reason == "stop"
    assert response.model == "fleetbus-offline"
    assert response.usage is not None
    assert response.usage.output_tokens == len(response.text) // 4


async def test_agent_text_delta_events_concatenate_to_the_answer(tmp_path: Path) -> None:
    agent = helper(tmp_path)
    pieces: list[str] = []
    final: FinalAnswer | None = None

    async for item in agent.reply_stream("What is 6 * 7?"):
        if isinstance(item, Event) and item.event == "text_delta":
            pieces.append(item.data["text"])
        elif isinstance(item, FinalAnswer):
            final = item

    assert final is not None
    assert "".join(pieces) == text(final)
    assert "42" in text(final)


async def test_tool_choice_none_answers_in_text() -> None:
    spec = ToolSpec(name="calculator", parameters={"type": "object"})
    request = ModelRequest(messages=[user("what is 2+2")], tools=[spec], tool_choice="none")

    _, response = await run(OfflineModel(), request)

    assert response.tool_uses == []
    assert response.text.startswith(OFFLINE_PREFIX)


async def test_tools_not_offered_are_not_called() -> None:
    spec = ToolSpec(name="current_time", parameters={"type": "object"})
    request = ModelRequest(messages=[user("what is 2+2")], tools=[spec])

    _, response = await run(OfflineModel(), request)

    assert response.tool_uses == []


async def test_a_plan_hint_is_not_a_request() -> None:
    spec = ToolSpec(name="calculator", parameters={"type": "object"})
    hint = "<plan_hint>\nNow work on subtask 0: what is 3 * 3\n</plan_hint>"
    request = ModelRequest(messages=[user("Hi"), user(hint)], tools=[spec])

    _, response = await run(OfflineModel(), request)

    assert response.tool_uses == []
    assert '"Hi"' in response.text


async def test_forced_tool_choice_is_called_with_schema_arguments() -> None:
    schema = {
        "type": "object",
        "properties": {"task": {"type": "string"}, "count": {"type": "integer", "minimum": 1}},
        "required": ["task", "count"],
    }
    spec = ToolSpec(name="write_summary", parameters=schema)
    request = ModelRequest(messages=[user("plan 3 trips")], tools=[spec], tool_choice=spec.name)

    _, response = await run(OfflineModel(), request)

    [use] = response.tool_uses
    assert (use.name, use.input) == ("write_summary", {"task": "plan 3 trips", "count": 3})
    assert response.finish_reason == "tool_calls"


async def test_odd_input_gets_an_answer() -> None:
    for messages in ([], [ChatMessage(role="system", content=[])]):
        _, response = await run(OfflineModel(), ModelRequest(messages=messages))
        assert response.text.startswith(OFFLINE_PREFIX)


async def test_an_unanswerable_request_raises_a_final_model_error() -> None:
    request = ModelRequest(messages=[user("hi")], tool_choice="no_such_tool")

    with pytest.raises(ModelError, match="no_such_tool") as caught:
        await run(OfflineModel(), request)

    assert caught.value.retryable is False


async def test_the_conversations_it_keeps_are_bounded_in_messages() -> None:
    """A host that reloads each session from the store sends each request's
    conversation as new objects: every request starts a tally, and what the
    tallies hold together stays bounded (a replica grew by a copy of each
    conversation before)."""
    from fleetbus.models import offline

    model = OfflineModel()
    for n in range(300):
        conversation = [user(f"conversation {n}, message {i}") for i in range(100)]
        await run(model, ModelRequest(messages=conversation))
    kept = model._tallies.values()
    assert model._tallied == sum(len(t.messages) for t in kept)
    assert model._tallied <= offline._TALLIED_MESSAGES
    assert len(kept) <= offline._TALLIED_MESSAGES // 100
    # A conversation longer than the bound is still tallied (alone).
    long = [user(f"long {i}") for i in range(offline._TALLIED_MESSAGES + 10)]
    _, answer = await run(model, ModelRequest(messages=long))
    assert answer.content
    assert len(model._tallies) == 1


_REQUESTS = [
    "What is 2 + 3 * 4?",
    "write 'hello' to notes.txt then read notes.txt",
    'Save "a b" into the file out/x.md, and list the files',
    "note: buy milk in todo.txt",
    "NOTE: Call Bob IN Todo.TXT",
    "WRITE 'X' TO A.TXT",
    "open report.md and tell me the time in Tokyo",
    "What time is it in Europe/Paris? Then compute (1+2)**3.",
    "which files are there?",
    "cat a/b/c.txt; ls docs",
    "my shopping list is long",
    "Round 2 of 4. Last round the mean was 31.40. You pick 31.40 * (2/3)**2 + 0.85.",
    "rewrite nothing, unsaved, output, cathedral, opener, datelines",  # words inside words
    "\u017fave 'x' to y.txt",  # the long s: re.I matches it to 's', lower() keeps it
    "K time? \u212a",  # the Kelvin sign folds to k
    "Écris: save 'é' to é.txt and tell me the date",
    "",
    "time",
]


@pytest.mark.parametrize("text", _REQUESTS)
def test_skipping_patterns_whose_words_are_absent_finds_what_every_pattern_finds(
    text: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fleetbus.models import offline

    found = offline._scan(text)
    monkeypatch.setattr(offline, "_absent", lambda lowered, words: False)
    assert found == offline._scan(text)


async def test_a_request_naming_a_handoff_hands_the_conversation_over() -> None:
    triage = Agent(
        "triage",
        "You route questions.",
        OfflineModel(),
        capabilities=[Handoffs(["billing", HandoffTo("refunds", description="Money back.")])],
    )
    answer = await triage.reply("Please give my money back")
    assert answer.finished_reason == "handed_off"
    assert answer.handoff is not None
    assert (answer.handoff.agent, answer.handoff.reason) == (
        "refunds",
        "the request is about money",
    )
    answer = await triage.reply("A question about billing")
    assert answer.handoff is not None
    assert answer.handoff.agent == "billing"
    plain = await triage.reply("Hello there")
    assert plain.finished_reason == "completed"


async def test_usage_counts_what_json_cannot_hold() -> None:
    """A schema or a tool input JSON cannot hold (a key that is not text, an
    integer past 64 bits) is measured as text: the model still answers."""
    schema: dict[Any, Any] = {"type": "object", (1, 2): 2**70}
    odd = ToolSpec(name="odd", description="Odd.", parameters=schema)
    call = ToolUseBlock(id="c1", name="odd", input={"n": 2**70})
    messages = [
        user("What is 6 * 7?"),
        ChatMessage(role="assistant", content=[call]),
        ChatMessage(role="tool", content=[ToolResultBlock(id="c1", name="odd", output="done")]),
    ]
    plain = ModelRequest(messages=messages[:1], tools=[ToolSpec(name="odd", description="Odd.")])

    _, response = await run(OfflineModel(), ModelRequest(messages=messages, tools=[odd]))
    _, smaller = await run(OfflineModel(), plain)

    assert response.usage is not None
    assert smaller.usage is not None
    assert response.usage.input_tokens > smaller.usage.input_tokens
