"""A fleet on a server that runs the authorization block of ``fleetbus
auth``: each role does its job, and is refused the rest with one line,
``permission denied: …``, at once rather than after a timeout."""

from __future__ import annotations

import asyncio
import io
import os
import sys
import time
import uuid
from collections.abc import Awaitable, Iterator
from dataclasses import dataclass

import pytest
from rich.console import Console

from fleetbus.agents import Agent, AgentService, RemoteAgent
from fleetbus.agents.offload import ObjectStoreOffloader
from fleetbus.bus import (
    Bus,
    ConnectOptions,
    EmbeddedServer,
    ToolClient,
    key_value,
    object_store,
)
from fleetbus.cli.auth_cmd import User, authorization
from fleetbus.cli.watch import watch
from fleetbus.errors import PermissionDeniedError
from fleetbus.models.bus_model import BusChatModel
from fleetbus.models.model_worker import ModelWorker
from fleetbus.protocol import Event
from fleetbus.testing import ScriptedModel
from fleetbus.tools_workers import Toolkit, ToolWorker, tool
from tests.helpers import ROOT, worker_running

PREFIX = f"sec{uuid.uuid4().hex[:8]}"
PASSWORD = "pw-" + uuid.uuid4().hex
USERS = [
    User(role="tool-worker", user="worker", password=PASSWORD),
    User(role="agent", user="agent-a1", password=PASSWORD, name="a1"),
    User(role="model-worker", user="models", password=PASSWORD),
    User(role="client", user="alice", password=PASSWORD, name="alice"),
    User(role="client", user="bob", password=PASSWORD, name="bob"),
    User(role="watcher", user="watcher", password=PASSWORD),
]
REFUSED_WITHIN = 2.0
"""Seconds a refusal may take: far below every timeout involved (5 s and up)."""


@tool
async def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first addend.
        b: the second addend.
    """
    return a + b


@pytest.fixture(scope="module")
def secured() -> Iterator[EmbeddedServer]:
    """A server whose only users are those of the fleet's authorization block."""
    with EmbeddedServer(config=authorization(PREFIX, USERS)) as server:
        yield server


@dataclass
class Fleet:
    server: EmbeddedServer

    async def connect(self, user: str) -> Bus:
        options = ConnectOptions(
            servers=[self.server.url], prefix=PREFIX, user=user, password=PASSWORD, name=user
        )
        return await Bus.connect(options=options, timeout=5.0)


@pytest.fixture
def fleet(secured: EmbeddedServer) -> Fleet:
    return Fleet(secured)


async def refused(call: Awaitable[object]) -> PermissionDeniedError:
    """The refusal ``call`` ends with, checked to come fast and in one line."""
    started = time.monotonic()
    with pytest.raises(PermissionDeniedError) as caught:
        await call
    assert time.monotonic() - started < REFUSED_WITHIN
    assert "\n" not in str(caught.value)
    return caught.value


async def test_each_role_does_its_job_and_nothing_else(fleet: Fleet) -> None:
    worker_bus = await fleet.connect("worker")
    model_bus = await fleet.connect("models")
    alice = await fleet.connect("alice")
    bob = await fleet.connect("bob")
    watcher_bus = await fleet.connect("watcher")
    buses = [worker_bus, model_bus, alice, bob, watcher_bus]
    try:
        assert alice.inbox_prefix == f"_INBOX_{PREFIX}.alice"
        worker = ToolWorker(worker_bus, Toolkit([add]), worker_id="w-sec")
        model = ScriptedModel(
            [ScriptedModel.call("add", {"a": 2, "b": 3}), ScriptedModel.text("It is 5.")]
        )
        models = ModelWorker(model_bus, model, name="scripted")
        console = Console(record=True, width=200, file=io.StringIO())
        stop_watch = asyncio.Event()
        watching = asyncio.Event()
        async with asyncio.TaskGroup() as tg:
            tg.create_task(worker.run())
            tg.create_task(models.run())
            tg.create_task(
                watch(
                    watcher_bus,
                    session=None,
                    agent=None,
                    json_output=False,
                    console=console,
                    stop=stop_watch,
                    ready=watching,
                )
            )
            await worker.wait_ready()
            await models.wait_ready()
            await watching.wait()
            try:
                await _scenario(fleet, worker_bus, model_bus, alice, bob, watcher_bus)
            finally:
                stop_watch.set()
                worker.stop()
                models.stop()
        text = console.export_text()
        # The watcher read the fleet's calls and the replies on the clients' inboxes.
        assert any("tool_call" in line and "add(" in line for line in text.splitlines())
        assert any("tool_result" in line and "@ reply" in line for line in text.splitlines())
    finally:
        for bus in buses:
            await bus.close()


async def _scenario(
    fleet: Fleet, worker_bus: Bus, model_bus: Bus, alice: Bus, bob: Bus, watcher_bus: Bus
) -> None:
    subjects = alice.subjects

    # A client calls a tool (served by the tool worker, answered once).
    result = await ToolClient(alice, timeout=5.0).call("add", {"a": 1, "b": 2})
    assert result.ok
    assert result.content == 3

    # An agent serves its inbox; it reasons on the model worker (which streams
    # its answer back) and calls the tool; a client asks it, and reads the events.
    agent_bus = await fleet.connect("agent-a1")
    try:
        toolkit = Toolkit()
        assert await toolkit.add_remote(ToolClient(agent_bus, timeout=5.0)) == ["add"]
        # It keeps long tool results whole in the offload store (as served).
        offloader = await ObjectStoreOffloader.open(agent_bus)
        ref = await offloader.store("call-1", "a long result")
        assert await offloader.load(ref, offset=7) == "result"
        agent = Agent(name="a1", model=BusChatModel(agent_bus, "scripted"), toolkit=toolkit)
        service = AgentService(agent_bus, agent, lease_ttl=2.0, drain_timeout=5.0)
        async with asyncio.TaskGroup() as tg:
            tg.create_task(service.run())
            try:
                await service.wait_ready()
                answer = await RemoteAgent(alice, "a1", timeout=30.0).reply("What is 2 + 3?")
                assert answer.content == "It is 5."
                # It serves its own inbox, not another agent's.
                denial = await refused(agent_bus.observe(subjects.agent_inbox("a2")))
                assert str(denial) == (
                    f"permission denied: subscription to {subjects.agent_inbox('a2')}"
                )
            finally:
                service.stop()
    finally:
        await agent_bus.close()

    # The tool worker serves, but calls no tool and reads no session.
    denial = await refused(ToolClient(worker_bus, timeout=10.0).call("add", {"a": 1, "b": 1}))
    assert str(denial) == f"permission denied: publish to {subjects.tool('add')}"
    denial = await refused(key_value(worker_bus, "session_leases"))
    assert str(denial) == (
        f"permission denied: publish to $JS.API.STREAM.INFO.KV_{PREFIX}_session_leases"
    )

    # The model worker answers prompts and does nothing else.
    await refused(ToolClient(model_bus, timeout=10.0).call("add", {"a": 1, "b": 1}))

    # A client cannot read another client's replies, nor serve a tool.
    denial = await refused(bob.observe(f"{alice.inbox_prefix}.>"))
    assert str(denial) == f"permission denied: subscription to {alice.inbox_prefix}.>"
    await refused(bob.observe(subjects.tool("add")))
    # …nor read the sessions.
    await refused(object_store(bob, "session_blobs"))

    # The watcher reads, and publishes nothing.
    await watcher_bus.publish(subjects.events("a1", "s1", "alice"), Event(sender="w", event="x"))
    denial = await refused(watcher_bus.flush())
    assert str(denial) == f"permission denied: publish to {subjects.events('a1', 's1', 'alice')}"


async def test_a_user_named_in_the_url_reads_its_own_replies(fleet: Fleet) -> None:
    """``fleetbus call --nats nats://alice:PW@host`` reads its replies on
    alice's inboxes: the identity comes from the URL as from ``--user``."""
    worker_bus = await fleet.connect("worker")
    try:
        async with worker_running(ToolWorker(worker_bus, Toolkit([add]), worker_id="w-url")):
            host = fleet.server.url.removeprefix("nats://")
            url = f"nats://alice:{PASSWORD}@{host}"
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "fleetbus",
                "call",
                "add",
                '{"a": 2, "b": 3}',
                "--nats",
                url,
                "--prefix",
                PREFIX,
                cwd=ROOT,
                env={**os.environ, "PYTHONPATH": str(ROOT)},
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
            )
            printed, _ = await asyncio.wait_for(proc.communicate(), 60.0)
    finally:
        await worker_bus.close()
    text = printed.decode(errors="replace")
    assert proc.returncode == 0, text
    assert "permission denied" not in text
    assert "5" in text
    assert ConnectOptions(servers=[url], prefix=PREFIX).identity() == "alice"
