"""Agents as separate OS processes on the bus: replicas, sessions in
JetStream, a replica killed mid-reply, pause in one process and confirm from
another, observe and broadcast, direct messages, agent-as-tool, cancel."""

from __future__ import annotations

import asyncio
import re
import signal
import time
from pathlib import Path

import pytest

from fleetbus.agents.serving.sessions import SessionStore
from fleetbus.bus import Bus, EmbeddedServer
from fleetbus.protocol import (
    AgentMessage,
    Cancel,
    Confirmation,
    ConfirmResult,
    ErrorMessage,
    Event,
    FinalAnswer,
    TextBlock,
    ToolCall,
    ToolResult,
    UserRequest,
    decode,
)
from tests.helpers import agents, stop, wait_for_workers, workers

TOOLS = "tests.integration.worker_tools"


async def ask(
    bus: Bus, agent: str, text: str, session: str, *, timeout: float = 30.0
) -> FinalAnswer:
    reply = await bus.request(
        bus.subjects.agent_inbox(agent),
        UserRequest(content=text, session_id=session),
        timeout=timeout,
        attempts=1,
    )
    assert isinstance(reply, FinalAnswer), reply
    return reply


def pid_of(answer: FinalAnswer) -> int:
    found = re.search(r"from (\d+)$", str(answer.content))
    assert found, answer.content
    return int(found.group(1))


async def wait_for_replicas(bus: Bus, agent: str, count: int, timeout: float = 30.0) -> set[int]:
    seen: set[int] = set()
    deadline = time.monotonic() + timeout
    n = 0
    while time.monotonic() < deadline and len(seen) < count:
        n += 1
        try:
            answer = await bus.request(
                bus.subjects.agent_inbox(agent),
                UserRequest(content="ping", session_id=f"ready-{n}"),
                timeout=5,
                attempts=1,
            )
        except Exception:
            await asyncio.sleep(0.1)
            continue
        if isinstance(answer, FinalAnswer):
            seen.add(pid_of(answer))
    assert len(seen) >= count, f"only {len(seen)} of {count} replicas answered"
    return seen


def marks(directory: Path, tag: str) -> list[str]:
    return sorted(p.name for p in directory.glob(f"{tag}.*.done"))


async def test_replicas_share_the_sessions(nats_server: EmbeddedServer, bus: Bus) -> None:
    with agents(nats_server.url, bus.prefix, "echo", 2, "--no-remote-tools") as procs:
        await wait_for_replicas(bus, "echo", 2)
        answers = await asyncio.gather(
            *(ask(bus, "echo", f"hello {i}", f"share-{i}") for i in range(30))
        )
    assert {pid_of(a) for a in answers} == {p.pid for p in procs}
    assert [str(a.content).split(" from ")[0] for a in answers] == [
        f"echo hello {i}" for i in range(30)
    ]


async def test_a_session_survives_its_replica_being_killed_mid_reply(
    nats_server: EmbeddedServer, bus: Bus, tmp_path: Path
) -> None:
    """Step 1 runs a tool; the model is slow on step 2; the replica serving it
    is killed there. The other replica takes the session over from its saved
    step: the tool is not run again, and the answer reaches the asker."""
    env = {"FLEETBUS_TEST_DIR": str(tmp_path)}
    with workers(nats_server.url, bus.prefix, 1, spec=TOOLS, env=env):
        await wait_for_workers(bus, "record", 1)
        with agents(nats_server.url, bus.prefix, "echo", 2) as procs:
            await wait_for_replicas(bus, "echo", 2)
            asking = asyncio.create_task(
                ask(bus, "echo", 'tool record {"tag": "once"}; sleep 2', "crash", timeout=60)
            )
            # Find the replica running the session, then kill it during step 2.
            store = await SessionStore.open(bus, owner="test")
            owner = None
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and owner is None:
                record = await store.get("echo", "crash")
                if record is not None and marks(tmp_path, "once") and record.step >= 1:
                    owner = record.owner
                await asyncio.sleep(0.05)
            assert owner is not None
            victim = next(p for p in procs if owner.endswith(f"@r{procs.index(p) + 1}"))
            victim.send_signal(signal.SIGKILL)
            answer = await asyncio.wait_for(asking, 60)
            # The answer is written once in the journal, by the replica that took over.
            finals = [f.final for f in await store.history("echo", "crash") if f.final]
            record = await store.get("echo", "crash")
    assert answer.finished_reason == "completed"
    assert "record=" in str(answer.content)
    assert pid_of(answer) != victim.pid
    assert len(marks(tmp_path, "once")) == 1  # the tool ran once
    assert len(finals) == 1
    assert finals[0]["content"] == answer.content
    assert record is not None
    assert record.status == "done"


async def test_messages_for_one_session_never_interleave(
    nats_server: EmbeddedServer, bus: Bus
) -> None:
    with agents(nats_server.url, bus.prefix, "echo", 2, "--no-remote-tools"):
        await wait_for_replicas(bus, "echo", 2)
        answers = await asyncio.gather(
            *(ask(bus, "echo", f"sleep 0.3; m{i}", "shared") for i in range(4))
        )
        store = await SessionStore.open(bus, owner="test")
        record = await store.get("echo", "shared")
    assert all(a.finished_reason == "completed" for a in answers)
    assert record is not None
    roles = [m.role for m in record.state.memory]
    assert roles == ["user", "assistant"] * 4
    texts = [m.text for m in record.state.memory]
    for user, assistant in zip(texts[::2], texts[1::2], strict=True):
        assert assistant.startswith(f"echo {user} from")


async def test_pause_in_one_replica_and_confirm_through_another(
    nats_server: EmbeddedServer, bus: Bus, tmp_path: Path
) -> None:
    env = {"FLEETBUS_TEST_DIR": str(tmp_path)}
    with workers(nats_server.url, bus.prefix, 1, spec=TOOLS, env=env):
        await wait_for_workers(bus, "record", 1)
        with agents(nats_server.url, bus.prefix, "careful", 2) as procs:
            await wait_for_replicas(bus, "careful", 2)
            paused = await ask(bus, "careful", 'tool record {"tag": "asked"}', "hitl")
            assert paused.finished_reason == "paused"
            store = await SessionStore.open(bus, owner="test")
            record = await store.get("careful", "hitl")
            assert record is not None
            assert record.status == "paused"
            assert record.state.reply is not None
            call_id = record.state.reply.pending[0].call_id
            # Stop one replica: whichever paused it, the confirmation may be
            # taken by the other.
            stop(procs[0])
            confirm = ConfirmResult(
                session_id="hitl", confirmations=[Confirmation(call_id=call_id, confirmed=True)]
            )
            final = await bus.request(
                bus.subjects.agent_inbox("careful"), confirm, timeout=30, attempts=3
            )
    assert isinstance(final, FinalAnswer)
    assert final.finished_reason == "completed"
    assert pid_of(final) == procs[1].pid
    assert len(marks(tmp_path, "asked")) == 1


async def test_broadcasts_are_observed_by_one_replica_into_memory(
    nats_server: EmbeddedServer, bus: Bus
) -> None:
    with agents(nats_server.url, bus.prefix, "echo", 2, "--no-remote-tools", "--topic", "news"):
        await wait_for_replicas(bus, "echo", 2)
        for text in ("the office closes at 5", "bring snacks"):
            await bus.publish(
                bus.subjects.topic("news"),
                AgentMessage(
                    sender="herald", session_id="town", content=[TextBlock(text=text)], reply=False
                ),
            )
        await bus.flush()
        store = await SessionStore.open(bus, owner="test")
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            record = await store.get("echo", "town")
            if record is not None and len(record.state.memory) == 2 and record.owner is None:
                break
            await asyncio.sleep(0.05)
        answer = await ask(bus, "echo", "heard?", "town")
    # Each broadcast is recorded by one replica; two replicas may record two
    # broadcasts in either order.
    assert str(answer.content).startswith("heard: ")
    heard = set(str(answer.content).removeprefix("heard: ").split(" | "))
    assert heard == {"the office closes at 5", "bring snacks"}


async def test_direct_messages_reply_or_are_only_observed(
    nats_server: EmbeddedServer, bus: Bus
) -> None:
    with agents(nats_server.url, bus.prefix, "echo", 1, "--no-remote-tools"):
        await wait_for_replicas(bus, "echo", 1)
        inbox = bus.subjects.agent_inbox("echo")
        observed = await bus.request(
            inbox,
            AgentMessage(
                sender="peer", session_id="dm", content=[TextBlock(text="psst")], reply=False
            ),
            timeout=10,
        )
        replied = await bus.request(
            inbox,
            AgentMessage(sender="peer", session_id="dm", content=[TextBlock(text="hi")]),
            timeout=10,
        )
    assert isinstance(observed, Event)
    assert observed.event == "observed"
    assert isinstance(replied, FinalAnswer)
    assert str(replied.content).startswith("echo hi from")


async def test_an_agent_called_as_a_tool(nats_server: EmbeddedServer, bus: Bus) -> None:
    with agents(nats_server.url, bus.prefix, "echo", 1, "--no-remote-tools"):
        await wait_for_replicas(bus, "echo", 1)
        call = ToolCall(tool_name="echo", call_id="as-tool-1", parameters={"request": "summarize"})
        result = await bus.request(bus.subjects.agent_inbox("echo"), call, timeout=10)
        again = await bus.request(bus.subjects.agent_inbox("echo"), call, timeout=10)
        bad = await bus.request(
            bus.subjects.agent_inbox("echo"),
            ToolCall(tool_name="echo", call_id="as-tool-2", parameters={}),
            timeout=10,
        )
    assert isinstance(result, ToolResult)
    assert result.ok
    assert str(result.content).startswith("echo summarize from")
    assert isinstance(again, ToolResult)
    assert again.content == result.content  # the retry is answered from the session
    assert isinstance(bad, ToolResult)
    assert bad.error_detail is not None
    assert bad.error_detail.code == "invalid_parameters"


async def test_cancel_interrupts_a_running_reply(nats_server: EmbeddedServer, bus: Bus) -> None:
    with agents(nats_server.url, bus.prefix, "echo", 2, "--no-remote-tools"):
        await wait_for_replicas(bus, "echo", 2)
        asking = asyncio.create_task(ask(bus, "echo", "sleep 20; slow", "cancel-me"))
        store = await SessionStore.open(bus, owner="test")
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            record = await store.get("echo", "cancel-me")
            if record is not None and record.status == "running":
                break
            await asyncio.sleep(0.05)
        await bus.publish(bus.subjects.agent_control("echo"), Cancel(session_id="cancel-me"))
        answer = await asyncio.wait_for(asking, 15)
        record = await store.get("echo", "cancel-me")
    assert answer.finished_reason == "interrupted"
    assert record is not None
    assert record.status == "idle"


@pytest.mark.parametrize(
    ("payload", "code"),
    [
        (b"{broken", "malformed"),
        (b'{"type": "user_request", "content": "x", "version": 3}', "unsupported_version"),
        (b'{"type": "tool_result", "tool_name": "x", "status": "success"}', "malformed"),
    ],
)
async def test_a_bad_message_to_an_inbox_gets_an_error_and_the_agent_keeps_serving(
    nats_server: EmbeddedServer, bus: Bus, payload: bytes, code: str
) -> None:
    with agents(nats_server.url, bus.prefix, "echo", 1, "--no-remote-tools"):
        await wait_for_replicas(bus, "echo", 1)
        raw = await bus.nc.request(bus.subjects.agent_inbox("echo"), payload, timeout=10)
        error = decode(raw.data)
        answer = await ask(bus, "echo", "still there?", "after-bad")
    assert isinstance(error, ErrorMessage)
    assert error.code == code
    assert str(answer.content).startswith("echo still there? from")
