"""A replica that loses its session stops waiting for the tool calls of its
reply without cancelling them on the workers: the session's next owner sends
them again with the same ``call_id`` and gets the tool's real result, and the
tool runs once. Only a user's cancel reaches the workers.

The tool (``gated``) runs on a real :class:`ToolWorker` in this process: it
counts its runs and waits for the test to open its gate. The replicas are
:class:`AgentHost`\\ s on connections of their own; the session is taken from
under a live one by writing its lease as another owner (a replica that
stalled and lost it), or by stopping the host (a drain that runs out).
A network partition of a replica process: ``test_session_partition.py``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import orjson
import pytest

from fleetbus.agents import Agent, AgentHost, AgentSettings
from fleetbus.agents.serving import RemoteAgent
from fleetbus.agents.serving.sessions import SessionStore, session_key
from fleetbus.bus import Bus, EmbeddedServer, ToolClient
from fleetbus.errors import RevisionMismatchError, StoreError
from fleetbus.models import ModelRequest, ModelResponse
from fleetbus.protocol import (
    AnyMessage,
    Cancel,
    ToolCall,
    ToolResultBlock,
    ToolUseBlock,
    encode,
)
from fleetbus.testing import ScriptedModel
from fleetbus.tools_workers import Toolkit, ToolWorker, tool
from tests.helpers import worker_running

AGENT = "asker"
SENDER = f"agent.{AGENT}"
"""The tool client's sender, the same in every replica (as ``fleetbus agent`` makes it)."""
LEASE_TTL = 1.0
WAIT = 60.0
"""Seconds a test waits for an event: generous, CI shares a loaded machine."""


@dataclass
class Gate:
    """The state of the ``gated`` tool, for the test to see and steer."""

    opened: asyncio.Event = field(default_factory=asyncio.Event)
    started: asyncio.Event = field(default_factory=asyncio.Event)
    runs: int = 0
    ran: list[str] = field(default_factory=list)
    """The tags of the runs, in order."""
    by_tag: dict[str, asyncio.Event] = field(default_factory=dict)
    """Gates of their own for some tags (the others wait for ``opened``)."""

    async def until_started(self, count: int) -> None:
        """Wait until ``count`` runs have started."""
        async with asyncio.timeout(WAIT):
            while len(self.ran) < count:
                self.started.clear()
                await self.started.wait()


def gated_tools(gate: Gate) -> Toolkit:
    @tool
    async def gated(tag: str) -> str:
        """Count this run, wait for the gate, say which run it was.

        Args:
            tag: said back.
        """
        gate.runs += 1
        run = gate.runs
        gate.ran.append(tag)
        gate.started.set()
        await gate.by_tag.get(tag, gate.opened).wait()
        return f"{tag}: run {run}"

    return Toolkit([gated])


def last_result(request: ModelRequest) -> ToolResultBlock | None:
    for message in reversed(request.messages):
        for block in message.content:
            if isinstance(block, ToolResultBlock):
                return block
    return None


def think(request: ModelRequest) -> ModelResponse:
    """What a real model does: call the tool; when its result is not a
    success (cancelled, say), call it again; answer with its result."""
    result = last_result(request)
    if result is not None and result.state == "success":
        return ScriptedModel.text(f"got {result.output}")
    calls = sum(
        isinstance(block, ToolUseBlock) for message in request.messages for block in message.content
    )
    return ScriptedModel.call("gated", {"tag": "x"}, call_id=f"g{calls + 1}")


def think_in_parallel(request: ModelRequest) -> ModelResponse:
    """Call the tool twice at once (tags ``a`` and ``b``); call again each
    whose result is not a success; answer with both results."""
    results = {
        block.id: block
        for message in request.messages
        for block in message.content
        if isinstance(block, ToolResultBlock)
    }
    uses = [
        block
        for message in request.messages
        for block in message.content
        if isinstance(block, ToolUseBlock)
    ]
    done: dict[str, Any] = {}
    for use in uses:
        result = results.get(use.id)
        if result is not None and result.state == "success":
            done[use.input["tag"]] = result.output
    if len(done) == 2:
        return ScriptedModel.text(f"got {done['a']}, {done['b']}")
    again = [tag for tag in ("a", "b") if tag not in done]
    return ScriptedModel.calls(*(("gated", {"tag": tag}, f"{tag}{len(uses) + 1}") for tag in again))


@asynccontextmanager
async def replica(
    url: str,
    prefix: str,
    name: str,
    *,
    turn: Callable[[ModelRequest], ModelResponse] = think,
    parallel: bool = False,
    **options: Any,
) -> AsyncIterator[AgentHost]:
    """A host of the agent, with the ``gated`` tool from the bus, on a
    connection of its own, until the block ends; its model plays ``turn``."""
    host_bus = await Bus.connect(url, prefix=prefix, name=f"host-{name}")
    options.setdefault("lease_ttl", LEASE_TTL)
    options.setdefault("drain_timeout", 5.0)
    try:
        toolkit = Toolkit()
        await toolkit.add_remote(ToolClient(host_bus, sender=SENDER, timeout=WAIT), ["gated"])
        agent = Agent(
            AGENT,
            "",
            ScriptedModel([turn], repeat_last=True),
            toolkit=toolkit,
            settings=AgentSettings(parallel_tool_calls=parallel),
        )
        host = AgentHost(host_bus, [agent], replica_id=name, **options)
        async with asyncio.TaskGroup() as tg:
            tg.create_task(host.run())
            try:
                await host.wait_ready(WAIT)
                yield host
            finally:
                host.stop()
    finally:
        await host_bus.close()


async def left_in_its_tool_call(
    url: str, prefix: str, bus: Bus, gate: Gate, session: str
) -> asyncio.Task[Any]:
    """A request of ``session`` to a replica that stops while the reply is in
    its tool call (its drain runs out): the request, still waiting."""
    async with replica(url, prefix, "leaving", drain_timeout=0.5, recover_interval=3600):
        asking = asyncio.create_task(
            RemoteAgent(bus, AGENT, session_id=session).reply("go", timeout=WAIT)
        )
        async with asyncio.timeout(WAIT):
            await gate.started.wait()
    return asking


async def steal_lease(bus: Bus, session: str) -> None:
    """Write the session's lease as another owner that then goes silent: its
    holder has lost it (as a replica that stalled past its lease does)."""
    store = await SessionStore.open(bus, owner="thief", lease_ttl=LEASE_TTL)
    key = session_key(AGENT, session)
    async with asyncio.timeout(WAIT):
        while True:
            entry = await store.leases.get_or_none(key)
            assert entry is not None, "the session has no lease"
            value = orjson.loads(entry.value)
            # (A lease not yet renewed says epoch 0: its epoch is its revision.)
            value.update(owner="thief", epoch=value.get("epoch") or entry.revision)
            try:
                await store.leases.update(key, orjson.dumps(value), revision=entry.revision)
            except RevisionMismatchError:
                continue  # renewed meanwhile: again
            return


@dataclass
class Seen:
    """The messages seen on a subject so far."""

    messages: list[AnyMessage] = field(default_factory=list)
    arrived: asyncio.Event = field(default_factory=asyncio.Event)

    async def until(self, check: Callable[[list[AnyMessage]], bool]) -> None:
        """Wait until ``check`` holds for the messages seen."""
        async with asyncio.timeout(WAIT):
            while not check(self.messages):
                self.arrived.clear()
                await self.arrived.wait()


@asynccontextmanager
async def seen(bus: Bus, subject: str) -> AsyncIterator[Seen]:
    """Every message on ``subject`` while the block runs, as it comes."""
    got = Seen()
    async with await bus.observe(subject) as observation:
        await bus.flush()

        async def read() -> None:
            async for message in observation:
                got.messages.append(message)
                got.arrived.set()

        async with asyncio.TaskGroup() as tg:
            reading = tg.create_task(read())
            try:
                yield got
            finally:
                reading.cancel()


def calls_of(messages: list[AnyMessage]) -> list[ToolCall]:
    return [m for m in messages if isinstance(m, ToolCall)]


def cancels(messages: list[AnyMessage]) -> list[Cancel]:
    return [m for m in messages if isinstance(m, Cancel)]


async def assert_recorded_success(bus: Bus, call_id: str, content: str, tag: str = "x") -> None:
    """The worker's record of the call: a success (a retry is answered from it)."""
    replay = await ToolClient(bus, sender=SENDER, timeout=5, attempts=1).call(
        "gated", {"tag": tag}, call_id=call_id
    )
    assert (replay.status, replay.content) == ("success", content)


async def test_a_replica_whose_lease_is_taken_leaves_its_tool_call_to_the_new_owner(
    nats_server: EmbeddedServer, bus: Bus, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    gate = Gate()
    url, prefix = nats_server.url, bus.prefix
    worker = ToolWorker(bus, gated_tools(gate), worker_id="w1")
    tools, control = bus.subjects.tool("gated"), bus.subjects.tool_control("gated")
    async with (
        worker_running(worker),
        seen(bus, tools) as sent,
        seen(bus, control) as controlled,
        # The loser never takes a session over itself (its recovery sleeps).
        replica(url, prefix, "loser", recover_interval=3600),
    ):
        asking = asyncio.create_task(
            RemoteAgent(bus, AGENT, session_id="s1").reply("go", timeout=WAIT)
        )
        try:
            async with asyncio.timeout(WAIT):
                await gate.started.wait()
            async with replica(url, prefix, "successor", recover_interval=0.1):
                await steal_lease(bus, "s1")
                # The successor takes the session over and sends the call again.
                await sent.until(lambda m: len(calls_of(m)) >= 2)
                gate.opened.set()
                answer = await asyncio.wait_for(asking, WAIT)
        finally:
            asking.cancel()
        first, again = calls_of(sent.messages)[:2]
        await assert_recorded_success(bus, first.call_id or "", "x: run 1")
    assert "taking over session s1 from loser" in caplog.text
    assert "session s1 was lost" in caplog.text
    # The same call, sent again by the new owner: joined, not run again, not cancelled.
    assert (again.call_id, again.sender) == (first.call_id, SENDER)
    assert cancels(controlled.messages) == []
    assert worker.cancelled == 0
    assert gate.runs == 1
    assert worker.executed == 1
    # (the loser's, the successor's, and the test's look at the record)
    assert [c.call_id for c in calls_of(sent.messages)] == [first.call_id] * 3
    assert answer.finished_reason == "completed"
    assert answer.content == "got x: run 1"


async def test_a_host_that_stops_leaves_its_tool_call_to_the_replica_taking_over(
    nats_server: EmbeddedServer, bus: Bus, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    gate = Gate()
    url, prefix = nats_server.url, bus.prefix
    worker = ToolWorker(bus, gated_tools(gate), worker_id="w1")
    tools, control = bus.subjects.tool("gated"), bus.subjects.tool_control("gated")
    async with worker_running(worker), seen(bus, tools) as sent, seen(bus, control) as controlled:
        asking: asyncio.Task[Any] | None = None
        try:
            asking = await left_in_its_tool_call(url, prefix, bus, gate, "s2")
            # Stopped: its drain ran out with the reply still in its tool call.
            async with replica(url, prefix, "successor", recover_interval=0.1):
                await sent.until(lambda m: len(calls_of(m)) >= 2)
                gate.opened.set()
                answer = await asyncio.wait_for(asking, WAIT)
        finally:
            if asking is not None:
                asking.cancel()
        first = calls_of(sent.messages)[0]
        await assert_recorded_success(bus, first.call_id or "", "x: run 1")
    assert "taking over session s2 from leaving" in caplog.text
    assert cancels(controlled.messages) == []
    assert worker.cancelled == 0
    assert gate.runs == 1
    assert answer.content == "got x: run 1"


async def test_a_take_over_the_store_fails_is_tried_again_and_the_host_serves_on(
    nats_server: EmbeddedServer,
    bus: Bus,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A store that does not answer a take-over (a cluster node cut off) must
    not end the host: recovery finds the silent lease again and takes it."""
    caplog.set_level(logging.INFO)
    gate = Gate()
    url, prefix = nats_server.url, bus.prefix
    take = SessionStore._take
    failed: list[str] = []

    async def first_take_over_fails(
        self: SessionStore, key: str, *args: Any, **options: Any
    ) -> Any:
        # The lease is taken; reading the journal then fails.
        if options.get("take_over") and not failed:
            failed.append(key)
            raise StoreError(f"read '{key}' failed: nats: timeout", transient=True)
        return await take(self, key, *args, **options)

    worker = ToolWorker(bus, gated_tools(gate), worker_id="w1")
    async with worker_running(worker):
        asking: asyncio.Task[Any] | None = None
        try:
            asking = await left_in_its_tool_call(url, prefix, bus, gate, "s9")
            monkeypatch.setattr(SessionStore, "_take", first_take_over_fails)
            async with replica(url, prefix, "successor", recover_interval=0.1):
                gate.opened.set()
                answer = await asyncio.wait_for(asking, WAIT)
                # The host that met the failure still serves new sessions.
                other = await RemoteAgent(bus, AGENT, session_id="s10").reply("go", timeout=WAIT)
        finally:
            if asking is not None:
                asking.cancel()
    assert failed == [session_key(AGENT, "s9")]
    assert "taking over session s9 failed, tried again once its lease is silent" in caplog.text
    assert "taking over session s9 from leaving" in caplog.text
    assert answer.finished_reason == "completed"
    assert other.finished_reason == "completed"


async def test_a_users_cancel_of_a_served_reply_still_cancels_its_tool_call(
    nats_server: EmbeddedServer, bus: Bus
) -> None:
    gate = Gate()
    url, prefix = nats_server.url, bus.prefix
    worker = ToolWorker(bus, gated_tools(gate), worker_id="w1")
    control = bus.subjects.tool_control("gated")
    async with (
        worker_running(worker),
        seen(bus, control) as controlled,
        replica(url, prefix, "only"),
    ):
        remote = RemoteAgent(bus, AGENT, session_id="s3")
        asking = asyncio.create_task(remote.reply("go", timeout=WAIT))
        try:
            async with asyncio.timeout(WAIT):
                await gate.started.wait()
            await remote.cancel("changed my mind")
            answer = await asyncio.wait_for(asking, WAIT)
        finally:
            asking.cancel()
        await controlled.until(lambda m: bool(cancels(m)))
        (cancel,) = cancels(controlled.messages)
        # The worker recorded the call as cancelled (a retry joins or replays it).
        replay = await ToolClient(bus, sender=SENDER, timeout=WAIT, attempts=1).call(
            "gated", {"tag": "x"}, call_id=cancel.call_id
        )
    assert answer.finished_reason == "interrupted"
    assert cancel.sender == SENDER
    assert (cancel.call_id or "").endswith(".g1")
    assert replay.status == "cancelled"
    assert worker.cancelled == 1
    assert gate.runs == 1


class _Heard(logging.Handler):
    """Sets ``event`` when a log line containing ``text`` is emitted."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text
        self.event = asyncio.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if self.text in record.getMessage():
            self.event.set()


async def test_a_replica_that_finds_its_session_taken_when_a_result_arrives_leaves_the_other_calls(
    nats_server: EmbeddedServer, bus: Bus
) -> None:
    # Two calls run at once; the session is taken over while they run, and
    # the loser learns it when the first result arrives (its write of the
    # result fails: the new owner appended its taken fact) before its lease renewal
    # would tell it. The other call, cut short by that, is left running.
    gate = Gate(by_tag={"a": asyncio.Event(), "b": asyncio.Event()})
    url, prefix = nats_server.url, bus.prefix
    worker = ToolWorker(bus, gated_tools(gate), worker_id="w1")
    tools, control = bus.subjects.tool("gated"), bus.subjects.tool_control("gated")
    lost = _Heard("session s4 was lost")
    host_log = logging.getLogger("fleetbus.agents.serving")
    host_log.addHandler(lost)
    try:
        async with (
            worker_running(worker),
            seen(bus, tools) as sent,
            seen(bus, control) as controlled,
            # A lease renewed every 20 s: the loss is found by the write.
            replica(
                url,
                prefix,
                "loser",
                turn=think_in_parallel,
                parallel=True,
                lease_ttl=60,
                recover_interval=3600,
            ),
        ):
            remote = RemoteAgent(bus, AGENT, session_id="s4")
            asking = asyncio.create_task(remote.reply("go", timeout=WAIT))
            try:
                await gate.until_started(2)
                async with replica(
                    url,
                    prefix,
                    "successor",
                    turn=think_in_parallel,
                    parallel=True,
                    recover_interval=0.1,
                ):
                    await steal_lease(bus, "s4")
                    await sent.until(lambda m: len(calls_of(m)) >= 4)  # both sent again
                    gate.by_tag["b"].set()
                    async with asyncio.timeout(WAIT):
                        await lost.event.wait()
                    # Any cancel the loser sent is at the worker before this check.
                    first_a = next(c for c in calls_of(sent.messages) if c.parameters["tag"] == "a")
                    await bus.nc.request(control, encode(first_a), timeout=WAIT)
                    gate.by_tag["a"].set()
                    answer = await asyncio.wait_for(asking, WAIT)
            finally:
                asking.cancel()
            run_a = gate.ran.index("a") + 1
            await assert_recorded_success(bus, first_a.call_id or "", f"a: run {run_a}", tag="a")
    finally:
        host_log.removeHandler(lost)
    assert cancels(controlled.messages) == []
    assert worker.cancelled == 0
    assert sorted(gate.ran) == ["a", "b"]
    assert answer.content in ("got a: run 1, b: run 2", "got a: run 2, b: run 1")
