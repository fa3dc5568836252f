"""``fleetbus sessions history`` and ``fleetbus sessions fork``, run as
processes against sessions an agent served here made: the facts of a reply
in order, and a fork that goes on from one of them while the original stays
as it was. The listing keeps working beside them."""

from __future__ import annotations

import json
import re

from fleetbus.agents import Agent, RemoteAgent
from fleetbus.agents.serving.sessions import SessionRecord, SessionStore
from fleetbus.bus import Bus, EmbeddedServer
from fleetbus.protocol import FinalAnswer, TextBlock
from fleetbus.testing import ScriptedModel
from fleetbus.tools_workers import Toolkit, tool
from tests.helpers import fleetbus_process, serving


async def fleetbus(*args: str, timeout: float = 90.0) -> tuple[int, str, str]:
    """``fleetbus ARGS`` as a process: exit code, stdout, stderr."""
    return await fleetbus_process(*args, timeout=timeout, env={"FLEETBUS_CONNECT_TIMEOUT": "5"})


@tool
def add(a: int, b: int) -> int:
    """Add two numbers."""
    return a + b


def calc(model: ScriptedModel) -> Agent:
    return Agent("calc", "", model, toolkit=Toolkit([add]))


def texts(model: ScriptedModel) -> list[str]:
    """The texts of the conversation the model was last sent."""
    return [
        block.text
        for message in model.requests[-1].messages
        for block in message.content
        if isinstance(block, TextBlock)
    ]


async def stored(store: SessionStore, session: str) -> SessionRecord:
    record = await store.get("calc", session)
    assert record is not None
    return record


async def test_history_lists_the_facts_of_a_reply_in_order(
    nats_server: EmbeddedServer, bus: Bus, prefix: str
) -> None:
    on_bus = ("--nats", nats_server.url, "--prefix", prefix)
    model = ScriptedModel([ScriptedModel.call("add", {"a": 1, "b": 2}), "it is three"])
    async with serving(nats_server.url, prefix, calc(model)):
        answer = await RemoteAgent(bus, "calc", session_id="h1", timeout=30).reply("add 1 and 2")
    assert isinstance(answer, FinalAnswer)
    assert answer.content == "it is three"
    record = await stored(await SessionStore.open(bus, owner="test"), "h1")

    code, out, err = await fleetbus("sessions", "history", "calc", "h1", *on_bus, "--json")
    assert code == 0, err
    facts = [json.loads(line) for line in out.splitlines()]
    assert [f["n"] for f in facts] == list(range(1, len(facts) + 1))
    assert [f["seq"] for f in facts] == sorted({f["seq"] for f in facts})
    assert facts[0]["kind"] == "taken"
    assert (facts[0]["owner"], facts[0]["status"]) == ("calc@test", "running")
    assert facts[-1]["kind"] == "end"
    assert facts[-1]["status"] == "done"
    assert facts[-1]["final"]["content"] == "it is three"
    assert all(f["time"] for f in facts)
    # Together the facts added memory as it is, in its order.
    added = [m for f in facts for m in f["added"]]
    assert [m["msg_id"] for m in added] == [m.msg_id for m in record.state.memory]
    assert [m["role"] for m in added] == ["user", "assistant", "tool", "assistant"]

    code, out, err = await fleetbus("sessions", "history", "calc", "h1", *on_bus)
    assert code == 0, err
    rows = [line for line in out.splitlines() if re.match(r"^│ \d+ ", line)]
    assert len(rows) == len(facts), out
    assert re.search(r"│ 1 .*│ taken .*│ running calc@test", rows[0]), out
    assert "user: 'add 1 and 2'" in out
    assert "assistant: → add(" in out
    assert "tool: ← add: success" in out
    assert re.search(r"│ end .*│ done .*it is three", rows[-1]), out

    code, out, err = await fleetbus("sessions", "history", "calc", "nope", *on_bus)
    assert code == 1
    assert "agent calc has no session nope" in err

    # The listing is as it was.
    code, out, err = await fleetbus("sessions", "calc", *on_bus, "--json")
    assert code == 0, err
    assert [(s["session"], s["status"]) for s in json.loads(out)] == [("h1", "done")]
    code, out, err = await fleetbus("sessions", *on_bus)
    assert code == 0, err
    assert re.search(r"│ calc\s*│ h1\s*│ done\s*│", out), out
    code, out, err = await fleetbus("sessions", "--agent", "history", *on_bus, "--json")
    assert code == 0, err
    assert json.loads(out) == []


async def test_fork_goes_on_from_a_fact_and_leaves_the_original_as_it_was(
    nats_server: EmbeddedServer, bus: Bus, prefix: str
) -> None:
    on_bus = ("--nats", nats_server.url, "--prefix", prefix)
    store = await SessionStore.open(bus, owner="test")
    model = ScriptedModel(["one", "two", "three, in the fork"])
    async with serving(nats_server.url, prefix, calc(model)):
        original = RemoteAgent(bus, "calc", session_id="f1", timeout=30)
        await original.reply("first")
        await original.reply("second")
        facts = await store.history("calc", "f1")
        at = next(f.n for f in facts if f.kind == "end")  # the end of the first reply
        kept = [m["msg_id"] for f in facts[:at] for m in f.added]
        before = await stored(store, "f1")
        assert len(kept) == 2 < len(before.state.memory)

        code, out, err = await fleetbus(
            "sessions", "fork", "calc", "f1", "--at", str(at), "--as", "f2", *on_bus, "--json"
        )
        assert code == 0, err
        summary = json.loads(out)
        assert (summary["session"], summary["status"], summary["last_answer"]) == (
            "f2",
            "done",
            "one",
        )
        fork = await stored(store, "f2")
        assert [m.msg_id for m in fork.state.memory] == kept
        assert [f.kind for f in await store.history("calc", "f2")] == ["snapshot"]

        answer = await RemoteAgent(bus, "calc", session_id="f2", timeout=30).reply("third")
        assert isinstance(answer, FinalAnswer)
        assert answer.content == "three, in the fork"
        assert texts(model) == ["first", "one", "third"]  # what the fork's next reply saw
        after = await stored(store, "f2")
        assert [m.msg_id for m in after.state.memory][:2] == kept
        assert [m.text for m in after.state.memory[2:]] == ["third", "three, in the fork"]

        original_now = await stored(store, "f1")
        assert original_now.seq == before.seq
        assert original_now.state.memory == before.state.memory

        # Without --as, a new id.
        code, out, err = await fleetbus("sessions", "fork", "calc", "f1", "--at", "1", *on_bus)
        assert code == 0, err
        found = re.match(r"session (\S+): f1 of calc up to fact 1 ", out)
        assert found, out
        assert (await stored(store, found.group(1))).session_id == found.group(1)

    for bad in ("0", str(len(facts) + 1)):
        code, out, err = await fleetbus("sessions", "fork", "calc", "f1", "--at", bad, *on_bus)
        assert code == 1, out
        assert f"--at {bad}: session f1 of calc has facts 1 to {len(facts)}" in err
    code, out, err = await fleetbus(
        "sessions", "fork", "calc", "f1", "--at", "1", "--as", "f2", *on_bus
    )
    assert code == 1, out
    assert "agent calc has a session f2 already" in err
    assert (await stored(store, "f2")).state.memory == after.state.memory
    code, out, err = await fleetbus("sessions", "fork", "calc", "f9", "--at", "1", *on_bus)
    assert code == 1, out
    assert "agent calc has no session f9" in err
    code, out, err = await fleetbus(
        "sessions", "fork", "calc", "f1", "--at", "1", "--as", "a.b", *on_bus
    )
    assert code == 1, out
    assert "invalid session id 'a.b'" in err


async def test_a_misused_sessions_command_exits_2_with_its_usage() -> None:
    for args, problem in [
        (["history", "calc"], "history takes AGENT SESSION"),
        (["fork", "calc", "s1"], "fork needs --at N"),
        (["calc", "s1"], "give one AGENT"),
        (["calc", "--at", "3"], "--at and --as go with fork"),
        (["history", "calc", "s1", "--drop"], "--drop goes with migrate"),
        (["migrate", "calc"], "migrate takes no AGENT or SESSION"),
        (["fork", "calc", "s1", "--at", "1", "--agent", "x"], "--agent is for the listing"),
    ]:
        code, out, err = await fleetbus("sessions", *args, "--nats", "nats://127.0.0.1:1")
        assert code == 2, (args, out, err)
        assert "usage: fleetbus sessions" in err
        assert f"fleetbus sessions: error: {problem}" in err, err
