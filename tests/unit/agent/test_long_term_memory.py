"""Long-term memory: the SQLite store (ranked, bounded, keyed, hostile queries,
concurrent use, on disk) and the agent's two modes, across sessions, checked on
what the model was sent."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path

import pytest

from fleetbus import Agent, Toolkit, tool
from fleetbus.capabilities import BusMemory, LongTermMemory, LongTermMemoryConfig, Memory
from fleetbus.capabilities.memory import memory_key
from fleetbus.errors import ConfigError
from fleetbus.models import ModelRequest
from fleetbus.protocol import ChatMessage, TextBlock, ToolResultBlock, UserRequest
from fleetbus.testing import ScriptedModel
from fleetbus.tools_workers.memory import MAX_QUERY_TERMS, SQLiteMemory, match_expression

HINT = "<long_term_memory>"


def text_of(message: ChatMessage) -> str:
    return "".join(b.text for b in message.content if isinstance(b, TextBlock))


def hints(request: ModelRequest) -> list[str]:
    return [text_of(m) for m in request.messages if HINT in text_of(m)]


def results(request: ModelRequest) -> list[ToolResultBlock]:
    return [b for m in request.messages for b in m.content if isinstance(b, ToolResultBlock)]


def ask(text: str, session: str, user: str | None = "ann") -> UserRequest:
    metadata = {"user_id": user} if user is not None else {}
    return UserRequest(sender="client", session_id=session, content=text, metadata=metadata)


@pytest.fixture
def store(tmp_path: Path) -> SQLiteMemory:
    return SQLiteMemory(tmp_path / "memory.db")


# -- the store ---------------------------------------------------------------------


async def test_retrieval_is_ranked_the_best_match_first(store: SQLiteMemory) -> None:
    await store.record(
        "helper",
        "user:ann",
        [
            "Ann works in a bakery in Lyon.",
            "Ann's favourite tea is a smoky lapsang souchong; she drinks tea every morning.",
            "Ann has a cat called Miso.",
            "The weather was rainy when Ann visited Oslo.",
        ],
    )

    hits = await store.retrieve("helper", "user:ann", "Which tea does Ann drink?")

    assert hits[0].startswith("Ann's favourite tea")
    assert len(hits) == 4  # "Ann" matches them all, ranked below the tea
    assert await store.retrieve("helper", "user:ann", "cat") == ["Ann has a cat called Miso."]
    # Stemmed: "visiting" finds "visited".
    assert await store.retrieve("helper", "user:ann", "visiting") == [
        "The weather was rainy when Ann visited Oslo."
    ]


async def test_retrieval_is_bounded_in_entries_and_characters(store: SQLiteMemory) -> None:
    await store.record("helper", "k", [f"note {i}: the garden needs water" for i in range(30)])
    await store.record("helper", "k", ["garden " * 3000])

    assert len(await store.retrieve("helper", "k", "garden", limit=3, max_chars=20_000)) == 3
    # The default 2,000 characters: the long entry ranks first and fills them.
    [first] = await store.retrieve("helper", "k", "garden")
    assert first.startswith("garden garden")
    assert len(first) == 2000
    bounded = await store.retrieve("helper", "k", "garden water", limit=50, max_chars=100)
    assert bounded
    assert sum(len(h) for h in bounded) <= 100
    huge = await store.retrieve("helper", "k", "garden garden garden", limit=1, max_chars=20_000)
    assert len(huge) == 1
    assert len(huge[0]) <= 8_000
    with pytest.raises(ConfigError):
        await store.retrieve("helper", "k", "garden", limit=0)
    with pytest.raises(ConfigError):
        await store.retrieve("helper", "k", "garden", max_chars=10**9)


async def test_entries_are_kept_apart_by_agent_and_key(store: SQLiteMemory) -> None:
    await store.record("helper", "user:ann", ["the code word is lighthouse"])
    await store.record("other", "user:ann", ["the code word is anchor"])
    await store.record("helper", "user:bob", ["the code word is compass"])

    assert await store.retrieve("helper", "user:ann", "code word") == [
        "the code word is lighthouse"
    ]
    assert await store.retrieve("other", "user:ann", "code word") == ["the code word is anchor"]
    assert await store.retrieve("helper", "user:eve", "code word") == []
    assert await store.count("helper") == 2


@pytest.mark.parametrize(
    "query",
    [
        '"',
        'say "hello',
        "NEAR(a b, 3)",
        "a* OR b*",
        "^start",
        "text:secret",
        "scope : 1 OR text : x",
        "AND OR NOT",
        "((((",
        "-minus +plus {col}",
        "\x00\x01\x02",
        "🙂 émoji naïve",
        "",
        "   ",
        "x" * 100_000,
        "tea " * 250_000,
    ],
)
async def test_hostile_queries_are_answered_not_raised(store: SQLiteMemory, query: str) -> None:
    await store.record("helper", "k", ['She said "NEAR(tea)" and AND OR * ^ naïve'])

    hits = await store.retrieve("helper", "k", query)

    assert isinstance(hits, list)
    assert all(isinstance(h, str) for h in hits)


def test_a_query_is_quoted_words_and_bounded() -> None:
    assert match_expression('say "hi" NEAR(x) *') == '"say" OR "hi" OR "near"'
    assert match_expression("?!*") is None
    many = match_expression(" ".join(f"w{i}" for i in range(1000)))
    assert many is not None
    assert many.count(" OR ") == MAX_QUERY_TERMS - 1


async def test_a_record_id_is_recorded_once(store: SQLiteMemory) -> None:
    assert await store.record("helper", "k", ["one", "two"], record_id="reply-1") == 2
    assert await store.record("helper", "k", ["one", "two"], record_id="reply-1") == 0
    assert await store.record("helper", "k", ["   ", ""]) == 0
    assert await store.count("helper", "k") == 2


async def test_concurrent_calls_on_one_store(store: SQLiteMemory) -> None:
    await asyncio.gather(
        *(store.record("helper", "k", [f"fact number {i} about rivers"]) for i in range(40)),
        *(store.retrieve("helper", "k", "rivers") for _ in range(40)),
    )
    assert await store.count("helper", "k") == 40
    assert len(await store.retrieve("helper", "k", "rivers", limit=50, max_chars=20_000)) == 40


async def test_the_memory_is_on_disk(tmp_path: Path) -> None:
    first = SQLiteMemory(tmp_path / "m.db")
    await first.record("helper", "k", ["the spare key is under the blue pot"])
    first.close()

    again = SQLiteMemory(tmp_path / "m.db")
    assert await again.retrieve("helper", "k", "where is the key") == [
        "the spare key is under the blue pot"
    ]
    again.close()


async def test_bad_names_and_keys_are_config_errors(store: SQLiteMemory) -> None:
    with pytest.raises(ConfigError):
        await store.record("", "k", ["x"])
    with pytest.raises(ConfigError):
        await store.retrieve("helper", "", "x")
    with pytest.raises(ConfigError):
        await store.record("helper", "k", ["x"] * 33)


# -- keys ----------------------------------------------------------------------------


def test_keys_fall_back_from_user_to_session_to_agent() -> None:
    assert memory_key("user", user_id="ann", session_id="s1") == "user:ann"
    assert memory_key("user", user_id=None, session_id="s1") == "session:s1"
    assert memory_key("user", user_id=None, session_id=None) == "agent"
    assert memory_key("session", user_id="ann", session_id="s1") == "session:s1"
    assert memory_key("agent", user_id="ann", session_id="s1") == "agent"
    assert memory_key("user", user_id="u" * 500, session_id=None).startswith("user:sha256:")


# -- the agent, static mode --------------------------------------------------------------


async def test_static_a_fact_told_in_one_session_is_a_hint_in_another(
    store: SQLiteMemory,
) -> None:
    echo = Toolkit()

    @echo.add
    @tool
    def lookup(word: str) -> str:
        """Look a word up."""
        return f"{word}: found"

    model = ScriptedModel(
        [
            "Noted: teal.",
            ScriptedModel.call("lookup", {"word": "teal"}),
            "Your favourite colour is teal.",
        ]
    )
    agent = Agent("helper", "You help.", model, toolkit=echo, capabilities=[Memory(store)])

    first = agent.clone()
    await first.reply(ask("My favourite colour is teal, remember it.", "s1"))
    assert hints(model.requests[0]) == []  # nothing remembered yet

    second = agent.clone()
    answer = await second.reply(ask("What is my favourite colour?", "s2"))

    assert answer.content == "Your favourite colour is teal."
    for request in model.requests[1:]:  # every model call of the reply has the hint
        [hint] = hints(request)
        assert "My favourite colour is teal" in hint
        texts = [text_of(m) for m in request.messages]
        assert texts[texts.index(hint) + 1] == "What is my favourite colour?"  # just before it
    assert not any(HINT in m.text for m in second.memory)  # never stored
    assert second.memory[0].text == "What is my favourite colour?"
    # Both exchanges are recorded, under the user.
    assert await store.count("helper", "user:ann") == 2


async def test_static_another_user_or_agent_does_not_see_it(store: SQLiteMemory) -> None:
    model = ScriptedModel(["Noted.", "I do not know.", "I do not know."])
    agent = Agent("helper", "", model, capabilities=[Memory(store)])
    await agent.clone().reply(ask("My locker code is 4711.", "s1", user="ann"))

    await agent.clone().reply(ask("What is my locker code?", "s2", user="bob"))
    other = Agent("stranger", "", model, capabilities=[Memory(store)])
    await other.reply(ask("What is my locker code?", "s3", user="ann"))

    assert hints(model.requests[1]) == []
    assert hints(model.requests[2]) == []


async def test_static_without_a_user_the_session_keys_the_memory(store: SQLiteMemory) -> None:
    model = ScriptedModel(["Noted.", "Green.", "No idea."])
    agent = Agent("helper", "", model, capabilities=[Memory(store, config=None)]).clone()
    await agent.reply(ask("The door is green.", "s1", user=None))
    await agent.reply(ask("What colour is the door?", "s1", user=None))
    await Agent("helper", "", model, capabilities=[Memory(store)]).reply(
        ask("What colour is the door?", "s2", user=None)
    )

    assert "The door is green." in hints(model.requests[1])[0]
    assert hints(model.requests[2]) == []
    assert await store.count("helper", "session:s1") == 2


async def test_static_retrieval_is_bounded_by_the_config(store: SQLiteMemory) -> None:
    await store.record("helper", "user:ann", [f"ann's plant {i} needs water" for i in range(20)])
    model = ScriptedModel(["Water them."])
    config = LongTermMemoryConfig(limit=3, max_chars=200)
    agent = Agent("helper", "", model, capabilities=[Memory(store, config=config)])

    await agent.reply(ask("Which plant needs water?", "s1"))

    [hint] = hints(model.requests[0])
    assert hint.count("needs water") == 3


# -- the agent, agent mode -------------------------------------------------------------


async def test_agent_mode_the_model_records_and_retrieves_across_sessions(
    store: SQLiteMemory,
) -> None:
    model = ScriptedModel(
        [
            ScriptedModel.call("record_to_memory", {"content": ["Ann's dog is named Pixel."]}),
            "I will remember.",
            ScriptedModel.call("retrieve_from_memory", {"keywords": ["dog", "name"]}),
            "Your dog is Pixel.",
        ]
    )
    agent = Agent("helper", "", model, capabilities=[Memory(store, mode="agent")])

    await agent.clone().reply(ask("My dog is named Pixel.", "s1"))
    answer = await agent.clone().reply(ask("What is my dog's name?", "s2"))

    offered = {s.name for s in model.requests[0].tools}
    assert {"record_to_memory", "retrieve_from_memory"} <= offered
    assert results(model.requests[1])[0].output == "Remembered 1 fact(s)."
    [found] = results(model.requests[3])
    assert found.state == "success"
    assert "Ann's dog is named Pixel." in str(found.output)
    assert answer.content == "Your dog is Pixel."
    assert not any(hints(r) for r in model.requests)  # no static hint in agent mode
    assert await store.count("helper") == 1  # only what the model chose to keep


async def test_both_modes_together(store: SQLiteMemory) -> None:
    model = ScriptedModel(
        [
            ScriptedModel.call("record_to_memory", {"content": "Ann is allergic to peanuts."}),
            "Noted.",
            "You are allergic to peanuts.",
        ]
    )
    agent = Agent("helper", "", model, capabilities=[Memory(store, mode="both")])
    await agent.clone().reply(ask("I am allergic to peanuts.", "s1"))
    await agent.clone().reply(ask("Am I allergic to anything? peanuts?", "s2"))

    [hint] = hints(model.requests[2])
    assert "Ann is allergic to peanuts." in hint
    assert {"record_to_memory", "retrieve_from_memory"} <= {s.name for s in model.requests[2].tools}
    assert await store.count("helper", "user:ann") == 3  # the fact and both exchanges


async def test_bad_tool_arguments_are_an_error_the_model_sees(store: SQLiteMemory) -> None:
    model = ScriptedModel(
        [ScriptedModel.call("record_to_memory", {"content": [1, 2]}), "Sorry."],
    )
    agent = Agent("helper", "", model, capabilities=[Memory(store, mode="agent")])
    await agent.reply(ask("Remember numbers.", "s1"))

    [error] = results(model.requests[1])
    assert error.state == "error"
    assert "invalid_parameters" in str(error.output)
    assert await store.count("helper") == 0


async def test_the_store_tools_are_never_offered_to_the_model(store: SQLiteMemory) -> None:
    kit = Toolkit()

    @kit.add
    @tool(name="long_term_memory_retrieve")
    def raw(agent_name: str, key: str, query: str) -> str:
        """Any agent's memory."""
        return "leaked"

    model = ScriptedModel(
        [ScriptedModel.call("long_term_memory_retrieve", {"agent_name": "x"}), "Ok."]
    )
    agent = Agent("helper", "", model, toolkit=kit, capabilities=[Memory(store)])
    await agent.reply(ask("hello", "s1"))

    assert "long_term_memory_retrieve" not in {s.name for s in model.requests[0].tools}
    [refused] = results(model.requests[1])
    assert refused.state == "error"
    assert "unknown_tool" in str(refused.output)


# -- failures -------------------------------------------------------------------------


class Broken:
    """A memory that fails every call."""

    def __init__(self) -> None:
        self.calls = 0

    async def record(
        self, agent_name: str, key: str, texts: Sequence[str], *, record_id: str | None = None
    ) -> int:
        self.calls += 1
        raise OSError("disk on fire")

    async def retrieve(
        self, agent_name: str, key: str, query: str, *, limit: int = 5, max_chars: int = 2000
    ) -> list[str]:
        self.calls += 1
        raise OSError("disk on fire")


async def test_a_failing_memory_does_not_fail_the_reply() -> None:
    broken = Broken()
    assert isinstance(broken, LongTermMemory)
    model = ScriptedModel(
        [ScriptedModel.call("retrieve_from_memory", {"keywords": ["x"]}), "Answered anyway."]
    )
    agent = Agent("helper", "", model, capabilities=[Memory(broken, mode="both")])

    answer = await agent.reply(ask("hello", "s1"))

    assert answer.finished_reason == "completed"
    assert answer.content == "Answered anyway."
    [error] = results(model.requests[1])
    assert error.state == "error"
    assert "disk on fire" in str(error.output)
    assert broken.calls == 3  # the static retrieval, the tool, the static record


async def test_an_unbound_bus_memory_says_what_to_do() -> None:
    model = ScriptedModel([ScriptedModel.call("retrieve_from_memory", {"keywords": ["x"]}), "Ok."])
    agent = Agent("helper", "", model, capabilities=[Memory(BusMemory(), mode="agent")])

    await agent.reply(ask("hello", "s1"))

    [error] = results(model.requests[1])
    assert error.state == "error"
    assert "BusMemory has no bus" in str(error.output)


def test_bad_settings_are_config_errors(store: SQLiteMemory) -> None:
    model = ScriptedModel(["x"])
    with pytest.raises(ConfigError, match="mode is one of static, agent, both"):
        Memory(store, mode="sometimes")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="record and retrieve"):
        Memory(object())  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="is not a capability"):
        Agent("a", "", model, capabilities=[store])  # type: ignore[list-item]
    with pytest.raises(ConfigError):
        LongTermMemoryConfig(scope="planet")  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        LongTermMemoryConfig(limit=0)
