"""Richer confirmations on the bus, across processes: ``fleetbus confirm
--edit --accept-rules`` runs the edited call, and the accepted rule lets the
later sessions' similar calls through, whichever of two ``fleetbus agent``
replica processes serves them."""

from __future__ import annotations

import asyncio
import re
import subprocess
import time
from pathlib import Path

import pytest

from fleetbus.agents.permissions import PermissionRule
from fleetbus.agents.serving.rules import stored_rules
from fleetbus.agents.serving.sessions import SessionStore
from fleetbus.bus import Bus, EmbeddedServer
from fleetbus.bus.subjects import ANY_OWNER
from fleetbus.protocol import Confirmation, ConfirmResult, Event, FinalAnswer, UserRequest
from tests.helpers import agents, spawn, wait_for_workers, workers

pytestmark = pytest.mark.slow

TOOLS = "tests.integration.worker_tools"
CLI_ENV = {"FLEETBUS_CONNECT_TIMEOUT": "2", "COLUMNS": "1000"}


async def ask(bus: Bus, text: str, session: str) -> FinalAnswer:
    answer = await bus.request(
        bus.subjects.agent_inbox("careful"),
        UserRequest(content=text, session_id=session),
        timeout=30,
        attempts=1,
    )
    assert isinstance(answer, FinalAnswer), answer
    return answer


def pid_of(answer: FinalAnswer) -> int:
    found = re.search(r"from (\d+)$", str(answer.content))
    assert found, answer.content
    return int(found.group(1))


async def cli(*args: str) -> tuple[int, str]:
    proc = spawn(list(args), env=CLI_ENV)
    try:
        out, _ = await asyncio.to_thread(proc.communicate, timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
    return proc.returncode, out.decode(errors="replace")


def ran(directory: Path, tag: str) -> int:
    return len(list(directory.glob(f"{tag}.*.done")))


async def test_an_edited_call_runs_and_an_accepted_rule_holds_on_every_replica(
    nats_server: EmbeddedServer, bus: Bus, tmp_path: Path
) -> None:
    url, prefix = nats_server.url, bus.prefix
    on_bus = ("--nats", url, "--prefix", prefix)
    env = {"FLEETBUS_TEST_DIR": str(tmp_path)}
    with workers(url, prefix, 1, spec=TOOLS, env=env):
        # The agents take the tools served on the bus when they start.
        await wait_for_workers(bus, "record", 1)
        with agents(url, prefix, "careful", 2):
            await check_the_flow(bus, on_bus, tmp_path, await until_both_replicas_answer(bus))


async def check_the_flow(
    bus: Bus, on_bus: tuple[str, ...], tmp_path: Path, replicas: set[int]
) -> None:
    # A call that asks: its pause suggests rules.
    events = await bus.observe(bus.subjects.events("careful", "first", ANY_OWNER))
    await bus.flush()
    paused = await ask(bus, 'tool record {"tag": "draft"}', "first")
    assert paused.finished_reason == "paused", paused.content
    async with events, asyncio.timeout(10):
        async for message in events:
            if isinstance(message, Event) and message.event == "require_user_confirm":
                (call,) = message.data["calls"]
                break
    assert call["suggested_rules"] == ["record(tag=draft)", "record"]

    # Edited and allowed from the command line, with a rule accepted.
    code, out = await cli(
        "confirm",
        "first",
        "--edit",
        call["call_id"],
        '{"tag": "t-edited"}',
        "--accept-rules",
        "record(tag=t-*)",
        *on_bus,
    )
    assert code == 0, out
    assert "completed" in out
    assert ran(tmp_path, "t-edited") == 1
    assert ran(tmp_path, "draft") == 0  # the model's input never ran
    store = await SessionStore.open(bus, owner="test")
    record = await store.get("careful", "first")
    assert record is not None
    uses = [u for m in record.state.memory for u in m.tool_uses]
    assert [u.input for u in uses] == [{"tag": "t-edited"}]
    assert await stored_rules(bus, "careful").load() == [
        PermissionRule.parse("allow", "record(tag=t-*)")
    ]

    # Later sessions' similar calls go through on both replicas, unasked.
    served: set[int] = set()
    for n in range(40):
        if served == replicas:
            break
        answer = await ask(bus, f'tool record {{"tag": "t-{n}"}}', f"later-{n}")
        assert answer.finished_reason == "completed", answer.content
        assert ran(tmp_path, f"t-{n}") == 1
        served.add(pid_of(answer))
    assert served == replicas
    # A call the rule does not cover still asks.
    other = await ask(bus, 'tool record {"tag": "other"}', "other")
    assert other.finished_reason == "paused"

    # A confirmation that cannot be taken says why; the session stays paused.
    wrong = ConfirmResult(
        session_id="other", confirmations=[Confirmation(call_id="nope", confirmed=True)]
    )
    refused = await bus.request(bus.subjects.agent_inbox("careful"), wrong, timeout=30, attempts=1)
    assert isinstance(refused, FinalAnswer)
    assert refused.finished_reason == "error"
    assert "no call 'nope' waits for a confirmation" in str(refused.content)
    record = await store.get("careful", "other")
    assert record is not None
    assert record.status == "paused"
    assert ran(tmp_path, "other") == 0


async def until_both_replicas_answer(bus: Bus, timeout: float = 30.0) -> set[int]:
    """The pids of the two replicas, once each has answered (warm)."""
    seen: set[int] = set()
    deadline = time.monotonic() + timeout
    n = 0
    while time.monotonic() < deadline and len(seen) < 2:
        n += 1
        try:
            seen.add(pid_of(await ask(bus, "ping", f"ready-{n}")))
        except Exception:  # not serving yet
            await asyncio.sleep(0.1)
    assert len(seen) == 2, f"only {len(seen)} replicas answered"
    return seen
