"""Sessions of the layout before journals — heads and memory chunks in KV
buckets, large values in the object store by reference — written here by
hand as that layout wrote them, carried into the journal by ``migrate`` (and
``fleetbus sessions migrate``): read back as they were, continued by a host,
carried once however often it runs, and the old buckets dropped."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import orjson
import pytest

from fleetbus.agents import Agent, AgentState, RemoteAgent
from fleetbus.agents.messages import Msg
from fleetbus.agents.serving.legacy import migrate
from fleetbus.agents.serving.sessions import SessionRecord, SessionStore
from fleetbus.bus import Bus, EmbeddedServer, key_value, object_store
from fleetbus.errors import KeyNotFoundError, StoreError
from fleetbus.protocol import FinalAnswer, TextBlock, to_builtins
from fleetbus.testing import ScriptedModel
from fleetbus.tools_workers import Toolkit
from tests.helpers import serving
from tests.integration.test_session_journal_cli import fleetbus

CREATED = datetime(2025, 3, 1, 12, 0, tzinfo=UTC)
BIG = "x" * 200_000
"""A message text that made its chunk go to the object store."""


def final(session: str, text: str) -> dict[str, Any]:
    return to_builtins(FinalAnswer(sender="clerk", session_id=session, content=text))


def talk(*lines: str) -> list[Msg]:
    """Messages, user and assistant in turn."""
    return [Msg.text_message("user" if i % 2 == 0 else "assistant", t) for i, t in enumerate(lines)]


def stored(messages: list[Msg]) -> list[dict[str, Any]]:
    return [m.model_dump(mode="json") for m in messages]


def head(session: str, tail: list[Msg], chunks: list[list[int]]) -> dict[str, Any]:
    """A head of format 2, as the old store wrote it."""
    state = AgentState(agent_name="clerk").model_dump(mode="json", exclude={"memory"})
    return {
        "format": 2,
        "agent": "clerk",
        "session_id": session,
        "status": "done",
        "owner": None,
        "epoch": 7,
        "seq": 4,
        "write": "w1",
        "created_at": CREATED.isoformat(),
        "updated_at": CREATED.isoformat(),
        "final": final(session, tail[-1].text),
        "reply_to": None,
        "pending_input": None,
        "state": state,
        "chunks": chunks,
        "tail": stored(tail),
    }


class OldLayout:
    """What the old store held, and wrote into its buckets."""

    def __init__(self) -> None:
        self.memory: dict[str, list[Msg]] = {}
        self.blobs: list[str] = []

    async def write(self, bus: Bus) -> None:
        heads = await key_value(bus, "sessions")
        chunks = await key_value(bus, "session_chunks")
        blobs = await object_store(bus, "session_blobs")

        async def by_reference(key: str, data: bytes) -> bytes:
            name = f"{key}.blob{len(self.blobs)}"
            await blobs.put(name, data)
            self.blobs.append(name)
            return orjson.dumps({"$blob": name})

        # Format 2: a sealed chunk (large: in the object store) and a tail.
        older, newer = talk("first question", BIG), talk("second question", "second answer")
        self.memory["clerk.chunked"] = older + newer
        chunk = await by_reference("clerk.chunked.7.0", orjson.dumps(stored(older)))
        await chunks.put("clerk.chunked.7.0", chunk)
        await heads.put("clerk.chunked", orjson.dumps(head("chunked", newer, [[7, 0, 0]])))

        # Format 2, the head itself in the object store.
        memory = talk("only question", "only answer")
        self.memory["clerk.inblob"] = memory
        value = await by_reference("clerk.inblob", orjson.dumps(head("inblob", memory, [])))
        await heads.put("clerk.inblob", value)

        # The session record stored whole, before chunks existed.
        memory = talk("ancient question", "ancient answer")
        self.memory["clerk.whole"] = memory
        record = SessionRecord(
            agent="clerk",
            session_id="whole",
            status="done",
            state=AgentState(agent_name="clerk", memory=memory),
            created_at=CREATED,
            updated_at=CREATED,
            final=final("whole", "ancient answer"),
            messages=2,
        )
        await heads.put(
            "clerk.whole", orjson.dumps(record.model_dump(mode="json", exclude={"seq"}))
        )

        # A session deleted: its deletion marker carries nothing.
        await heads.put("clerk.gone", orjson.dumps(head("gone", memory, [])))
        await heads.delete("clerk.gone")


async def test_migrate_carries_old_sessions_once_and_a_host_continues_them(
    nats_server: EmbeddedServer, bus: Bus, prefix: str
) -> None:
    store = await SessionStore.open(bus, owner="test")
    assert (await migrate(bus, store)).carried == []  # no old buckets: nothing, nothing made
    with pytest.raises(StoreError):
        await key_value(bus, "sessions", create=False)

    old = OldLayout()
    await old.write(bus)
    done = await migrate(bus, store)
    assert sorted(done.carried) == ["clerk.chunked", "clerk.inblob", "clerk.whole"]
    assert (done.kept, done.failed, done.dropped) == ([], {}, [])
    for key, memory in old.memory.items():
        record = await store.get("clerk", key.partition(".")[2])
        assert record is not None, key
        assert record.state.memory == memory
        assert record.messages == len(memory)
        assert (record.status, record.owner, record.created_at) == ("done", None, CREATED)
        assert record.final is not None
        assert record.final["content"] == memory[-1].text

    journals = await store.journal.keys("clerk.*")
    assert journals == {"clerk.chunked": 1, "clerk.inblob": 1, "clerk.whole": 1}  # a snapshot each

    model = ScriptedModel(["a new answer"])
    agent = Agent("clerk", "", model, toolkit=Toolkit())
    async with serving(nats_server.url, prefix, agent):
        answer = await RemoteAgent(bus, "clerk", session_id="chunked", timeout=30).reply("and?")
    assert isinstance(answer, FinalAnswer)
    assert answer.content == "a new answer"
    seen = [
        b.text for m in model.requests[-1].messages for b in m.content if isinstance(b, TextBlock)
    ]
    assert seen == ["first question", BIG, "second question", "second answer", "and?"]
    record = await store.get("clerk", "chunked")
    assert record is not None
    assert record.state.memory[:4] == old.memory["clerk.chunked"]
    assert [m.text for m in record.state.memory[4:]] == ["and?", "a new answer"]

    again = await migrate(bus, store)  # the journals win: nothing is carried twice
    assert again.carried == []
    assert sorted(again.kept) == ["clerk.chunked", "clerk.inblob", "clerk.whole"]
    after = await store.get("clerk", "chunked")
    assert after is not None
    assert after.seq == record.seq


async def test_sessions_migrate_drop_removes_the_old_buckets_and_their_objects(
    nats_server: EmbeddedServer, bus: Bus, prefix: str
) -> None:
    on_bus = ("--nats", nats_server.url, "--prefix", prefix)
    old = OldLayout()
    await old.write(bus)
    blobs = await object_store(bus, "session_blobs")
    await blobs.put("clerk.other.unrelated", b"a fact of the new layout")

    code, out, err = await fleetbus("sessions", "migrate", *on_bus)
    assert code == 0, err
    assert out.splitlines() == [
        "carried over clerk.chunked",
        "carried over clerk.inblob",
        "carried over clerk.whole",
    ]
    await key_value(bus, "sessions", create=False)  # still there

    code, out, err = await fleetbus("sessions", "migrate", "--drop", *on_bus, "--json")
    assert code == 0, err
    done = json.loads(out)
    assert (done["carried"], done["failed"]) == ([], {})
    assert sorted(done["kept"]) == ["clerk.chunked", "clerk.inblob", "clerk.whole"]
    assert done["dropped"] == [f"{prefix}_sessions", f"{prefix}_session_chunks"]
    for name in ("sessions", "session_chunks"):
        with pytest.raises(StoreError, match="does not exist"):
            await key_value(bus, name, create=False)
    for name in old.blobs:
        with pytest.raises(KeyNotFoundError):
            await blobs.get(name)
    assert await blobs.get("clerk.other.unrelated") == b"a fact of the new layout"

    store = await SessionStore.open(bus, owner="test")
    for key, memory in old.memory.items():
        record = await store.get("clerk", key.partition(".")[2])
        assert record is not None
        assert record.state.memory == memory
    code, out, err = await fleetbus("sessions", "migrate", "--drop", *on_bus)
    assert code == 0, err
    assert out.strip() == "no sessions of the layout before journals"


async def test_an_unreadable_old_session_is_named_and_keeps_the_buckets(
    nats_server: EmbeddedServer, bus: Bus, prefix: str
) -> None:
    on_bus = ("--nats", nats_server.url, "--prefix", prefix)
    old = OldLayout()
    await old.write(bus)
    chunks = await key_value(bus, "session_chunks")
    await chunks.delete("clerk.chunked.7.0")

    code, out, err = await fleetbus("sessions", "migrate", "--drop", *on_bus)
    assert code == 1, out
    assert "carried over clerk.inblob" in out
    assert "carried over clerk.whole" in out
    assert "not carried over: clerk.chunked: memory chunk clerk.chunked.7.0 is missing" in err
    assert "the old buckets are kept" in err
    heads = await key_value(bus, "sessions", create=False)
    assert await heads.get_or_none("clerk.chunked") is not None
    store = await SessionStore.open(bus, owner="test")
    assert await store.get("clerk", "chunked") is None
