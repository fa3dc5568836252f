"""Memory compression: where the cut falls, what replaces the older messages,
and the invariants (tool pairs intact, a verbatim suffix kept) on random
conversations."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from fleetbus.agents.compression import (
    SUMMARY_HEADER,
    TRUNCATION_HEADER,
    ApproxTokenCounter,
    CompressionResult,
    ContextConfig,
    Summary,
    TokenCounter,
    compress,
    split_for_compression,
    summarize_with_model,
)
from fleetbus.agents.messages import Msg
from fleetbus.models.model import ModelRequest, ModelResponse, ModelStreamItem
from fleetbus.protocol import ContentBlock, TextBlock, ToolResultBlock, ToolUseBlock

COUNTER = ApproxTokenCounter()


class CharCounter:
    """One token per message: makes budgets easy to reason about."""

    def count(self, messages: Sequence[Msg]) -> int:
        return len(messages)


def text(role: Any, size: int = 40, **kwargs: Any) -> Msg:
    return Msg.text_message(role, "x" * size, **kwargs)


def tool_turn(call_ids: Sequence[str], result_size: int = 40) -> list[Msg]:
    uses: list[ContentBlock] = [ToolUseBlock(id=c, name="search", input={"q": c}) for c in call_ids]
    results = [
        Msg(role="tool", content=[ToolResultBlock(id=c, name="search", output="r" * result_size)])
        for c in call_ids
    ]
    return [Msg(role="assistant", content=uses), *results]


def previous_summary(body: str = "we found the answer is 42") -> Msg:
    return Msg(
        role="user",
        content=[TextBlock(text=f"{SUMMARY_HEADER}\n{body}")],
        marks=frozenset({"compressed"}),
    )


async def fake_summarize(messages: list[Msg]) -> Summary:
    return Summary(task=f"{len(messages)} messages", current_state="working")


async def failing_summarize(messages: list[Msg]) -> Summary:
    raise RuntimeError("model down")


# --- properties on random conversations --------------------------------------


@st.composite
def conversations(draw: st.DrawFn) -> list[Msg]:
    ids = itertools.count()
    sizes = st.integers(0, 3_000)
    messages: list[Msg] = []
    if draw(st.booleans()):
        messages.append(previous_summary("x" * draw(sizes)))
    for _ in range(draw(st.integers(1, 25))):
        kind = draw(st.sampled_from(["user", "assistant", "tools", "tools", "summary"]))
        if kind == "tools":
            calls = [f"call{next(ids)}" for _ in range(draw(st.integers(1, 3)))]
            messages += tool_turn(calls, draw(sizes))
        elif kind == "summary":
            messages.append(previous_summary("s" * draw(sizes)))
        else:
            messages.append(text(kind, draw(sizes)))
    return messages


@st.composite
def configs(draw: st.DrawFn) -> ContextConfig:
    trigger = draw(st.floats(0.1, 0.95))
    reserve = draw(st.floats(0.01, trigger - 0.05))
    return ContextConfig(
        context_length=draw(st.integers(100, 20_000)), trigger_ratio=trigger, reserve_ratio=reserve
    )


def assert_tool_pairs(messages: Sequence[Msg]) -> None:
    for index, message in enumerate(messages):
        for use in message.tool_uses:
            later = [r for m in messages[index + 1 :] for r in m.tool_results if r.id == use.id]
            assert len(later) == 1, f"tool_use {use.id} has {len(later)} results after it"
        for result in message.tool_results:
            earlier = [u for m in messages[:index] for u in m.tool_uses if u.id == result.id]
            assert earlier, f"tool_result {result.id} has no tool_use before it"


def assert_invariants(
    before: list[Msg], result: CompressionResult, config: ContextConfig, system_tokens: int
) -> None:
    assert_tool_pairs(result.messages)
    if result.removed == 0:
        assert result.method == "none"
        assert result.messages == before
        return
    head, *kept = result.messages
    # The kept part is exactly a suffix of the input: the same objects, in order.
    assert result.removed + len(kept) == len(before)
    assert all(a is b for a, b in zip(kept, before[result.removed :], strict=True))
    assert head.role == "user"
    assert "compressed" in head.marks
    assert kept
    assert kept[0].role != "tool"
    # Nothing more would have fit in the reserve.
    assert COUNTER.count(before[result.removed - 1 :]) > config.reserve_tokens


@settings(max_examples=100, deadline=None)
@given(conversations(), configs(), st.integers(0, 2_000), st.booleans())
def test_compress_keeps_tool_pairs_and_a_verbatim_suffix(
    messages: list[Msg], config: ContextConfig, system_tokens: int, force: bool
) -> None:
    result = asyncio.run(
        compress(
            messages, config, COUNTER, fake_summarize, system_tokens=system_tokens, force=force
        )
    )
    event(result.method)
    assert_invariants(messages, result, config, system_tokens)
    if not force and system_tokens + COUNTER.count(messages) <= config.trigger_tokens:
        assert result.method == "none"
    if result.removed:
        assert result.method == "summary"
        assert result.summary == Summary(task=f"{result.removed} messages", current_state="working")
        assert result.messages[0].text == f"{SUMMARY_HEADER}\n{result.summary.render()}"
        assert result.error is None


@settings(max_examples=100, deadline=None)
@given(conversations(), configs(), st.integers(0, 2_000))
def test_a_failing_summarizer_truncates_with_the_same_invariants(
    messages: list[Msg], config: ContextConfig, system_tokens: int
) -> None:
    result = asyncio.run(
        compress(
            messages, config, COUNTER, failing_summarize, system_tokens=system_tokens, force=True
        )
    )
    event(result.method)
    assert_invariants(messages, result, config, system_tokens)
    if result.removed:
        assert result.method == "truncation"
        assert result.error == "model down"
        assert result.summary is None
        note = result.messages[0].text
        assert note.startswith(f"{TRUNCATION_HEADER}\n{result.removed} earlier messages")
        dropped = [m for m in messages[: result.removed] if "compressed" in m.marks]
        if dropped:
            assert note.endswith(dropped[-1].text)


# --- split_for_compression ----------------------------------------------------


def test_below_the_trigger_nothing_is_compressed_unless_forced() -> None:
    config = ContextConfig(context_length=10, trigger_ratio=0.8, reserve_ratio=0.2)
    messages = [text("user"), text("assistant"), text("user"), text("assistant")]
    counter = CharCounter()
    assert split_for_compression(messages, config, counter) is None
    # The system prompt counts towards the trigger.
    assert split_for_compression(messages, config, counter, system_tokens=4) is None
    assert split_for_compression(messages, config, counter, system_tokens=5) == 2
    assert split_for_compression(messages, config, counter, force=True) == 2
    assert split_for_compression([], config, counter, force=True) is None


def test_the_kept_part_is_the_longest_suffix_within_the_reserve() -> None:
    config = ContextConfig(context_length=10, trigger_ratio=0.5, reserve_ratio=0.3)
    messages = [text("user"), text("assistant")] * 4
    assert split_for_compression(messages, config, CharCounter()) == 5


def test_the_cut_moves_back_to_keep_a_tool_use_with_its_results() -> None:
    config = ContextConfig(context_length=10, trigger_ratio=0.5, reserve_ratio=0.2)
    messages = [text("user"), text("user"), *tool_turn(["a", "b", "c"])]
    # Two messages fit the reserve, but they are results of the assistant at 2.
    assert split_for_compression(messages, config, CharCounter()) == 2


def test_the_last_message_is_kept_even_when_it_alone_exceeds_the_reserve() -> None:
    config = ContextConfig(context_length=1_000, trigger_ratio=0.5, reserve_ratio=0.1)
    messages = [text("user"), text("assistant"), text("user", size=10_000)]
    assert split_for_compression(messages, config, COUNTER) == 2
    # A huge tool result takes its assistant message along.
    messages = [text("user"), *tool_turn(["a"], result_size=10_000)]
    assert split_for_compression(messages, config, COUNTER) == 1


def test_a_lone_tool_message_never_starts_the_kept_part() -> None:
    config = ContextConfig(context_length=10, trigger_ratio=0.4, reserve_ratio=0.2)
    orphan = Msg(role="tool", content=[ToolResultBlock(id="gone", name="t", output="x")])
    messages = [text("user"), text("assistant"), text("user"), orphan, text("user")]
    assert split_for_compression(messages, config, CharCounter()) == 2


def test_nothing_to_compress_when_all_fits_or_only_a_summary_is_older() -> None:
    config = ContextConfig(context_length=100, trigger_ratio=0.5, reserve_ratio=0.4)
    counter = CharCounter()
    assert split_for_compression([text("user")] * 3, config, counter, force=True) is None
    huge = text("user", size=100_000)
    big = ContextConfig(context_length=1_000, trigger_ratio=0.5, reserve_ratio=0.1)
    assert split_for_compression([previous_summary(), huge], big, COUNTER) is None
    assert split_for_compression([text("user"), huge], big, COUNTER) == 1


def test_context_config_validates_its_ratios() -> None:
    with pytest.raises(ValidationError, match="reserve_ratio must be smaller"):
        ContextConfig(trigger_ratio=0.5, reserve_ratio=0.5)
    with pytest.raises(ValidationError):
        ContextConfig(trigger_ratio=1.0)
    with pytest.raises(ValidationError):
        ContextConfig(reserve_ratio=0)
    config = ContextConfig(context_length=1_000)
    assert (config.trigger_tokens, config.reserve_tokens) == (800, 250)


# --- the counter and the summary ----------------------------------------------


def test_approx_counter_counts_text_tools_and_overhead() -> None:
    counter = ApproxTokenCounter()
    assert isinstance(counter, TokenCounter)
    assert counter.count_text("abcd" * 10) == 10
    assert counter.count_text("abcde") == 2
    assert counter.count([]) == 0
    assert counter.count([text("user", size=40)]) == 10 + 4
    use = ToolUseBlock(id="1", name="find", input={"q": "cats"})  # find + {"q":"cats"}
    result = ToolResultBlock(id="1", name="find", output={"n": 12})  # find + {"n":12}
    assert counter.count([Msg(role="assistant", content=[use])]) == 4 + 4
    assert counter.count([Msg(role="tool", content=[result])]) == 3 + 4
    two = [text("user", size=40), text("assistant", size=8)]
    assert counter.count(two) == counter.count(two[:1]) + counter.count(two[1:])
    with pytest.raises(ValueError, match="chars_per_token"):
        ApproxTokenCounter(chars_per_token=0)


def test_summary_renders_as_readable_text() -> None:
    summary = Summary(
        task="Find the bug",
        current_state="Reproduced it",
        discoveries=["crash in parser.py:12"],
        next_steps=["write a test", "fix"],
    )
    assert summary.render() == (
        "Task: Find the bug\nCurrent state: Reproduced it\n"
        "Discoveries:\n- crash in parser.py:12\nNext steps:\n- write a test\n- fix"
    )
    assert Summary(task="t", current_state="s").render() == "Task: t\nCurrent state: s"


async def test_a_summarizer_returning_garbage_falls_back_to_truncation() -> None:
    async def wrong(messages: list[Msg]) -> Summary:
        return "not a summary"  # type: ignore[return-value]

    messages = [previous_summary("the key is 7"), *[text("user", 400)] * 6]
    config = ContextConfig(context_length=200, trigger_ratio=0.5, reserve_ratio=0.3)
    result = await compress(messages, config, COUNTER, wrong)
    assert result.method == "truncation"
    assert result.error is not None
    assert "not a Summary" in result.error
    assert "the key is 7" in result.messages[0].text


async def test_cancellation_is_not_swallowed() -> None:
    async def cancelled(messages: list[Msg]) -> Summary:
        raise asyncio.CancelledError

    messages = [text("user", 400)] * 6
    config = ContextConfig(context_length=200, trigger_ratio=0.5, reserve_ratio=0.3)
    with pytest.raises(asyncio.CancelledError):
        await compress(messages, config, COUNTER, cancelled)


async def test_a_failing_counter_means_no_compression() -> None:
    class Broken:
        def count(self, messages: Sequence[Msg]) -> int:
            raise RuntimeError("no tokenizer")

    messages = [text("user")]
    result = await compress(messages, ContextConfig(), Broken(), fake_summarize)
    assert (result.method, result.messages) == ("none", messages)
    assert result.error is not None
    assert "no tokenizer" in result.error


# --- summarize_with_model -----------------------------------------------------


class FakeModel:
    """Answers every request with one scripted response and records requests."""

    def __init__(self, *content: ContentBlock, delay: float = 0.0) -> None:
        self.content = list(content)
        self.delay = delay
        self.requests: list[ModelRequest] = []

    @property
    def name(self) -> str:
        return "fake"

    async def stream(self, request: ModelRequest) -> AsyncIterator[ModelStreamItem]:
        self.requests.append(request)
        await asyncio.sleep(self.delay)
        yield ModelResponse(content=self.content)


SUMMARY_INPUT: dict[str, Any] = {
    "task": "Count the cats",
    "current_state": "Counted 3",
    "discoveries": ["cats.csv has 3 rows"],
    "next_steps": ["report"],
}

CONVERSATION = [
    Msg.text_message("user", "How many cats are in cats.csv?", name="ann"),
    *tool_turn(["c1"], result_size=10_000),
    Msg.text_message("assistant", "There are 3."),
]


async def test_summarize_with_model_asks_for_the_write_summary_tool() -> None:
    model = FakeModel(ToolUseBlock(id="s", name="write_summary", input=SUMMARY_INPUT))
    summary = await summarize_with_model(model, CONVERSATION)
    assert summary == Summary.model_validate(SUMMARY_INPUT)
    (request,) = model.requests
    assert request.tool_choice == "write_summary"
    assert [t.name for t in request.tools] == ["write_summary"]
    assert set(request.tools[0].parameters["properties"]) == set(SUMMARY_INPUT)
    assert [m.role for m in request.messages] == ["system", "user"]
    transcript = request.messages[1].content[0]
    assert isinstance(transcript, TextBlock)
    assert "[user ann] How many cats are in cats.csv?" in transcript.text
    assert '[assistant calls search #c1] {"q":"c1"}' in transcript.text
    assert "[result of search #c1, success] " + "r" * 2_000 + "… [8000 more characters]" in (
        transcript.text
    )
    assert "[assistant] There are 3." in transcript.text


async def test_summarize_with_model_accepts_json_in_text() -> None:
    fenced = '```json\n{"task": "t", "current_state": "s", "next_steps": ["n"]}\n```'
    model = FakeModel(TextBlock(text=f"Here it is:\n{fenced}\nDone."))
    summary = await summarize_with_model(model, CONVERSATION)
    assert summary == Summary(task="t", current_state="s", next_steps=["n"])
    bare = FakeModel(TextBlock(text='Summary: {"task": "t", "current_state": "s"}'))
    assert (await summarize_with_model(bare, CONVERSATION)).task == "t"


async def test_summarize_with_model_rejects_answers_without_a_summary() -> None:
    with pytest.raises(ValueError, match="answered no summary"):
        await summarize_with_model(FakeModel(TextBlock(text="I cannot.")), CONVERSATION)
    invalid = FakeModel(ToolUseBlock(id="s", name="write_summary", input={"task": 3}))
    with pytest.raises(ValueError, match="invalid summary"):
        await summarize_with_model(invalid, CONVERSATION)
    with pytest.raises(TimeoutError):
        await summarize_with_model(FakeModel(delay=1.0), CONVERSATION, timeout=0.01)


async def test_compress_with_a_model_summarizer_end_to_end() -> None:
    model = FakeModel(ToolUseBlock(id="s", name="write_summary", input=SUMMARY_INPUT))
    config = ContextConfig(context_length=3_000, trigger_ratio=0.5, reserve_ratio=0.1)
    messages = [*CONVERSATION, Msg.text_message("user", "Thanks. Now the dogs?")]

    async def summarize(older: list[Msg]) -> Summary:
        return await summarize_with_model(model, older, timeout=5.0)

    result = await compress(messages, config, COUNTER, summarize, system_tokens=100)
    assert result.method == "summary"
    assert result.messages[1:] == messages[result.removed :]
    assert "Task: Count the cats" in result.messages[0].text
    assert_tool_pairs(result.messages)
