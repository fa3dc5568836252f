"""Sessions that hold: write-ahead state, take-over exactly where the dead owner
stopped, recovery that leaves nothing behind on the server, state past
``max_payload``, and a replica that loses its session staying quiet.

A *ghost* owner stands for a replica killed at a chosen point: it takes a
request like :class:`AgentService` does (the lease, with the request recorded),
runs the reply with checkpoints that save to the store, and freezes — stops
writing and renewing, like a SIGKILLed process — after a chosen number of
saves. A real service of the same agent must then take the session over.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import orjson
import pytest

from fleetbus.agents import Agent, AgentService, AgentSettings, AgentState, ContextConfig, Msg
from fleetbus.agents.serving.sessions import SessionStore, session_key
from fleetbus.bus import Bus, EmbeddedServer, ToolClient
from fleetbus.bus.subjects import ANY_OWNER
from fleetbus.models import ModelRequest
from fleetbus.models.model import ModelResponse, ModelStreamItem
from fleetbus.protocol import (
    AnyMessage,
    Cancel,
    FinalAnswer,
    TextBlock,
    ToolCall,
    ToolResultBlock,
    ToolUseBlock,
    UserRequest,
    decode,
    to_builtins,
)
from fleetbus.tools_workers import Toolkit, ToolWorker, tool
from tests.helpers import ghost_reply, wait_for_workers
from tests.helpers import serving as serve_agent

AGENT = "keeper"


class StepModel:
    """Calls ``step`` once per word of the user's last request (one call per
    step, id ``s<n>``), then answers with the outputs: a pure function of the
    conversation, so a taken-over reply must end exactly as an unbroken one."""

    name = "step-model"

    def __init__(self) -> None:
        self.calls = 0

    async def stream(self, request: ModelRequest) -> AsyncIterator[ModelStreamItem]:
        self.calls += 1
        last_user = max((i for i, m in enumerate(request.messages) if m.role == "user"), default=-1)
        if last_user < 0:  # nothing asked (a warm-up)
            yield ModelResponse(content=[TextBlock(text="answer: ")])
            return
        words = "".join(
            b.text for b in request.messages[last_user].content if isinstance(b, TextBlock)
        ).split()
        done = [
            b
            for m in request.messages[last_user + 1 :]
            for b in m.content
            if isinstance(b, ToolResultBlock)
        ]
        if len(done) < len(words):
            n = len(done)
            yield ModelResponse(
                content=[ToolUseBlock(id=f"s{n}", name="step", input={"word": words[n]})]
            )
            return
        yield ModelResponse(
            content=[TextBlock(text="answer: " + ",".join(str(b.output) for b in done))]
        )


def ask(session: str, text: str) -> UserRequest:
    return UserRequest(sender="test", session_id=session, content=text, call_id=f"r-{session}")


def assert_consistent(memory: list[Msg]) -> None:
    """Every tool_use has exactly one tool_result, and every result its call."""
    used = [u.id for m in memory for u in m.tool_uses]
    answered = [r.id for m in memory for r in m.tool_results]
    assert sorted(used) == sorted(answered)
    assert len(set(used)) == len(used)


def expected(text: str) -> str:
    return "answer: " + ",".join(w.upper() for w in text.split())


@contextlib.asynccontextmanager
async def step_worker(
    url: str | list[str], prefix: str, runs: list[str], gate: asyncio.Event | None = None
) -> AsyncIterator[None]:
    """A worker serving ``step`` (upper-cases a word) on its own connection;
    each real execution is appended to ``runs``; ``gate`` holds every call."""

    @tool
    async def step(word: str) -> str:
        """Upper-case a word."""
        runs.append(word)
        if gate is not None:
            await gate.wait()
        return word.upper()

    worker_bus = await Bus.connect(url, prefix=prefix, name="step-worker")
    worker = ToolWorker(worker_bus, Toolkit([step]), worker_id="worker.step", drain_timeout=2)
    try:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(worker.run())
            await worker.wait_ready()
            try:
                yield
            finally:
                worker.stop()
    finally:
        await worker_bus.close()


def serving(
    url: str | list[str], prefix: str, agent: Agent, **options: Any
) -> contextlib.AbstractAsyncContextManager[AgentService]:
    """The agent served in this process, recovering every 0.2 s."""
    options.setdefault("recover_interval", 0.2)
    return serve_agent(url, prefix, agent, replica="live", **options)


async def make_agent(bus: Bus, model: StepModel, **kwargs: Any) -> Agent:
    toolkit = Toolkit()
    await wait_for_workers(bus, "step", 1)  # on a cluster, interest takes a moment to spread
    await toolkit.add_remote(ToolClient(bus, sender=f"agent.{AGENT}"), ["step"])
    return Agent(AGENT, "", model, toolkit=toolkit, **kwargs)


async def answers(bus: Bus, subject: str) -> tuple[list[AnyMessage], Callable[[], Awaitable[None]]]:
    got: list[AnyMessage] = []

    async def cb(msg: Any) -> None:
        got.append(decode(msg.data))

    sub = await bus.nc.subscribe(subject, cb=cb)
    await bus.flush()
    return got, sub.unsubscribe


async def wait_until(check: Callable[[], bool], timeout: float = 15.0) -> None:
    async with asyncio.timeout(timeout):
        while not check():  # noqa: ASYNC110 - state filled by subscription callbacks
            await asyncio.sleep(0.05)


@pytest.mark.parametrize(
    ("freeze_after", "handed_over", "host_points"),
    [(n, False, False) for n in range(6)]
    + [(0, True, False), (1, True, False), (3, True, False)]
    + [(n, False, True) for n in range(5)],
)
async def test_a_replica_killed_at_any_save_is_taken_over_exactly_there(
    nats_server: EmbeddedServer,
    bus: Bus,
    freeze_after: int,
    handed_over: bool,
    host_points: bool,
) -> None:
    """Saves: 0 the request taken, 1 the input, 2 step 1's call, 3 its result,
    4 the step, 5 step 2's call. Killed after any of them, the session ends
    with the unbroken answer, every call ran once and travelled with one id.

    ``host_points``: the facts a host writes — 0 taken, 1 step 1's call,
    2 the step (with its result), 3 step 2's call, 4 the step: killed after
    each, the same holds.

    ``handed_over``: the ghost released the session before, so it takes it
    back from its own cache, reading nothing. A clean take (that, or a new
    session) appends nothing: killed before its first save, the ghost leaves
    its request in its lease only, and the taker finds it there."""
    runs: list[str] = []
    text = "alpha beta"
    async with step_worker(nats_server.url, bus.prefix, runs):
        wire, stop_wire = await answers(bus, bus.subjects.tool("step"))
        inbox = bus.nc.new_inbox()
        got, stop_got = await answers(bus, inbox)
        store = None
        if handed_over:
            store = await SessionStore.open(bus, owner=f"{AGENT}@ghost", lease_ttl=1.0)
            before = await store.acquire(AGENT, "s1", fresh=AgentState(agent_name=AGENT))
            await store.save(before, status="idle", release=True)
        ghost = await ghost_reply(
            bus,
            await make_agent(bus, StepModel()),
            ask("s1", text),
            inbox,
            freeze_after=freeze_after,
            store=store,
            host_points=host_points,
        )
        if freeze_after == 0:  # a clean take: the request is in the lease, not the journal
            reader = store or await SessionStore.open(bus, owner="test")
            facts = await reader.history(AGENT, "s1") if handed_over else []
            assert [f.kind for f in facts] == (["taken", "end"] if handed_over else [])
            lease = await reader.leases.get(session_key(AGENT, "s1"))
            carried = orjson.loads(lease.value)["request"]
            assert carried["input"]["content"] == text
        taker_model = StepModel()
        async with serving(nats_server.url, bus.prefix, await make_agent(bus, taker_model)):
            await wait_until(lambda: any(isinstance(m, FinalAnswer) for m in got))
            await asyncio.sleep(0.3)  # a second answer would come now
        await ghost.stop()
        await stop_wire()
        await stop_got()
        record = await (await SessionStore.open(bus, owner="test")).get(AGENT, "s1")
    finals = [m for m in got if isinstance(m, FinalAnswer)]
    assert len(finals) == 1
    assert finals[0].content == expected(text)
    assert finals[0].call_id == "r-s1"  # the request's, after a take-over too
    assert record is not None
    assert record.status == "done"
    assert record.pending_input is None
    assert_consistent(record.state.memory)
    assert [m.text for m in record.state.memory if m.role == "user"] == [text]
    assert sorted(runs) == ["alpha", "beta"]  # each call ran exactly once
    ids = {m.call_id for m in wire if isinstance(m, ToolCall)}
    assert len(ids) == 2  # re-sent, if at all, with the original call_id
    # The taker asked the model only for what was not stored yet.
    asked = {0: 3, 1: 2, 2: 2, 3: 1, 4: 1} if host_points else {0: 3, 1: 3, 2: 2, 3: 2, 4: 2, 5: 1}
    assert taker_model.calls == asked[freeze_after]


async def test_an_in_flight_call_is_resent_with_its_call_id_and_runs_once(
    nats_server: EmbeddedServer, bus: Bus
) -> None:
    runs: list[str] = []
    gate = asyncio.Event()
    async with step_worker(nats_server.url, bus.prefix, runs, gate):
        wire, stop_wire = await answers(bus, bus.subjects.tool("step"))
        inbox = bus.nc.new_inbox()
        got, stop_got = await answers(bus, inbox)
        # Frozen after saving the call: the worker runs it, the owner dies.
        ghost = await ghost_reply(
            bus, await make_agent(bus, StepModel()), ask("s2", "solo"), inbox, freeze_after=2
        )
        await wait_until(lambda: runs == ["solo"])
        async with serving(nats_server.url, bus.prefix, await make_agent(bus, StepModel())):
            await wait_until(lambda: len([m for m in wire if isinstance(m, ToolCall)]) >= 2)
            gate.set()  # the first run finishes; the retry joined it
            await wait_until(lambda: any(isinstance(m, FinalAnswer) for m in got))
        await ghost.stop()
        await stop_wire()
        await stop_got()
    calls = [m for m in wire if isinstance(m, ToolCall)]
    assert len({c.call_id for c in calls}) == 1
    assert runs == ["solo"]
    final = next(m for m in got if isinstance(m, FinalAnswer))
    assert final.content == "answer: SOLO"


async def count_consumers(bus: Bus) -> int:
    """The consumers on this test's streams (those of its prefix: another
    test's, on the same server, may still be going away)."""
    js = bus.nc.jetstream()
    count = 0
    for info in await js.streams_info():
        if bus.prefix in (info.config.name or "").split("_"):
            count += info.state.consumer_count or 0
    return count


async def test_fifty_idle_agents_leave_no_consumers_and_still_recover(
    nats_server: EmbeddedServer, bus: Bus
) -> None:
    """Recovery rounds (many, at 50 ms) and listings add no consumer on the
    server; a session left by a dead owner afterwards is still taken over."""
    runs: list[str] = []
    async with step_worker(nats_server.url, bus.prefix, runs):
        agent = await make_agent(bus, StepModel())
        server_bus = await Bus.connect(nats_server.url, prefix=bus.prefix, name="fifty")
        services = [
            AgentService(
                server_bus,
                agent.clone(),
                replica_id=f"{AGENT}@r{i}",
                lease_ttl=1.0,
                recover_interval=0.05,
                drain_timeout=2,
            )
            for i in range(50)
        ]
        counts = []
        try:
            async with asyncio.TaskGroup() as tg:
                for service in services:
                    tg.create_task(service.run())
                for service in services:
                    await service.wait_ready()
                store = await SessionStore.open(bus, owner="test")
                for _ in range(6):
                    await asyncio.sleep(0.5)  # ten recovery rounds per service
                    await store.records(AGENT)
                    counts.append(await count_consumers(bus))
                inbox = bus.nc.new_inbox()
                got, stop_got = await answers(bus, inbox)
                ghost = await ghost_reply(bus, agent, ask("late", "gamma"), inbox, freeze_after=1)
                await wait_until(lambda: any(isinstance(m, FinalAnswer) for m in got))
                counts.append(await count_consumers(bus))
                await ghost.stop()
                await stop_got()
                for service in services:
                    service.stop()
        finally:
            await server_bus.close()
    assert counts == [0] * len(counts)
    final = next(m for m in got if isinstance(m, FinalAnswer))
    assert final.content == "answer: GAMMA"


async def test_a_session_larger_than_max_payload_completes_and_resumes(
    nats_server: EmbeddedServer, bus: Bus
) -> None:
    """Tool results of ~54 KB of CJK text, kept whole, grow the state past
    1 MiB: every reply completes, and a take-over reads the state back."""
    big = "漢字" * 9_000  # 54 KB of UTF-8

    @tool
    def essay(n: int) -> str:
        """A long text."""
        return f"{n}:{big}"

    class EssayModel:
        name = "essay-model"

        async def stream(self, request: ModelRequest) -> AsyncIterator[ModelStreamItem]:
            last = request.messages[-1]
            if last.role == "tool":
                yield ModelResponse(content=[TextBlock(text=f"read {len(request.messages)}")])
                return
            n = len(request.messages)
            yield ModelResponse(content=[ToolUseBlock(id=f"e{n}", name="essay", input={"n": n})])

    context = ContextConfig(context_length=10_000_000, tool_result_limit=1_000_000)
    agent = Agent(
        AGENT, "", EssayModel(), toolkit=Toolkit([essay]), settings=AgentSettings(context=context)
    )
    async with serving(nats_server.url, bus.prefix, agent) as service:
        for i in range(24):
            answer = await bus.request(
                bus.subjects.agent_inbox(AGENT),
                UserRequest(session_id="big", content=f"more {i}"),
                timeout=30,
                attempts=1,
            )
            assert isinstance(answer, FinalAnswer), answer
            assert answer.finished_reason == "completed"
        assert service.store is not None
        entries = await service.store.journal.read(session_key(AGENT, "big"))
    store = await SessionStore.open(bus, owner="test")
    record = await store.get(AGENT, "big")
    assert record is not None
    size = len(record.state.model_dump_json().encode())
    assert size > nats_server_max_payload(bus)
    # No message of the journal is the whole session, and a rollup removed
    # the facts before its snapshot.
    assert all(len(e.data) <= nats_server_max_payload(bus) for e in entries)
    assert b'"k":"snapshot"' in entries[0].data
    assert entries[0].seq > 1
    assert record.messages == 24 * 4
    assert_consistent(record.state.memory)
    # A take-over of the large session: killed right after recording the input.
    inbox = bus.nc.new_inbox()
    got, stop_got = await answers(bus, inbox)
    ghost = await ghost_reply(bus, agent, ask("big", "last one"), inbox, freeze_after=1)
    async with serving(nats_server.url, bus.prefix, agent.clone()):
        await wait_until(lambda: any(isinstance(m, FinalAnswer) for m in got))
    await ghost.stop()
    await stop_got()
    final = next(m for m in got if isinstance(m, FinalAnswer))
    assert final.content == f"read {24 * 4 + 3}"


def nats_server_max_payload(bus: Bus) -> int:
    return bus.max_payload


async def test_a_replica_that_loses_its_session_answers_nothing(
    nats_server: EmbeddedServer, bus: Bus, caplog: pytest.LogCaptureFixture
) -> None:
    """Another owner takes the session while the replica runs it: the replica
    stops with one log line; no internal-error answer is ever published."""
    runs: list[str] = []
    gate = asyncio.Event()
    caplog.set_level(logging.WARNING, logger="fleetbus.agents.serving")
    async with step_worker(nats_server.url, bus.prefix, runs, gate):
        events, stop_events = await answers(bus, bus.subjects.events(AGENT, "s3", ANY_OWNER))
        inbox = bus.nc.new_inbox()
        got, stop_got = await answers(bus, inbox)
        async with serving(
            nats_server.url,
            bus.prefix,
            await make_agent(bus, StepModel()),
            lease_ttl=30.0,
            recover_interval=30.0,
        ) as service:
            await bus.nc.publish(
                bus.subjects.agent_inbox(AGENT),
                json.dumps(to_builtins(UserRequest(session_id="s3", content="x"))).encode(),
                reply=inbox,
            )
            await wait_until(lambda: runs == ["x"])
            assert service.store is not None
            lease = await service.store.leases.get(session_key(AGENT, "s3"))
            thief = await SessionStore.open(bus, owner=f"{AGENT}@thief", lease_ttl=30.0)
            stolen = await thief.acquire(AGENT, "s3", take_over=True, lease_revision=lease.revision)
            gate.set()  # the replica's next save finds the session gone
            await asyncio.sleep(1.0)
            await thief.save(stolen, status="idle", release=True)
        await stop_events()
        await stop_got()
    assert got == []
    finals = [m for m in events if isinstance(m, FinalAnswer)]
    assert finals == []
    lost = [r for r in caplog.records if "lost" in r.getMessage()]
    assert len(lost) == 1
    assert not any(r.levelno >= logging.ERROR for r in caplog.records)


async def test_a_cancel_at_any_moment_gets_exactly_one_interrupted_answer(
    nats_server: EmbeddedServer, bus: Bus
) -> None:
    """With one replica, a cancel sent at every moment of a reply's start —
    before the lease, with it, mid-model-call — ends it once, lease released."""
    runs: list[str] = []
    async with (
        step_worker(nats_server.url, bus.prefix, runs),
        serving(nats_server.url, bus.prefix, await make_agent(bus, StepModel())) as service,
    ):
        assert service.store is not None
        for i in range(12):
            session = f"c{i}"
            inbox = bus.nc.new_inbox()
            got, stop_got = await answers(bus, inbox)
            await bus.nc.publish(
                bus.subjects.agent_inbox(AGENT),
                json.dumps(
                    to_builtins(UserRequest(session_id=session, content="a b c d e f"))
                ).encode(),
                reply=inbox,
            )
            await asyncio.sleep(0.004 * i)
            await bus.publish(bus.subjects.agent_control(AGENT), Cancel(session_id=session))
            await wait_until(_has(got))
            await asyncio.sleep(0.2)
            await stop_got()
            assert len(got) == 1, got
            final = got[0]
            assert isinstance(final, FinalAnswer)
            assert final.finished_reason in ("interrupted", "completed")
            record = await service.store.get(AGENT, session)
            assert record is not None
            assert record.status in ("idle", "done")
            assert_consistent(record.state.memory)
            assert await service.store.leases.get_or_none(session_key(AGENT, session)) is None


def _has(items: list[AnyMessage]) -> Callable[[], bool]:
    return lambda: bool(items)


async def test_a_save_cancelled_in_flight_does_not_pass_for_the_next_one(bus: Bus) -> None:
    """A save cancelled after its write went out (an interrupt during a
    checkpoint) lands all the same; the next save must then write over it,
    not mistake it for its own (found by a cancel arriving as a reply started:
    the session stayed running with no answer stored)."""
    store = await SessionStore.open(bus, owner="test")
    lease = await store.acquire(AGENT, "cut", fresh=AgentState(agent_name=AGENT))
    state = lease.record.state
    state.memory.append(Msg.text_message("user", "hello"))
    real_append = store.journal.append
    calls = 0

    async def landed_then_cancelled(key: str, data: bytes, **how: Any) -> int:
        nonlocal calls
        calls += 1
        seq = await real_append(key, data, **how)
        if calls == 1:
            raise asyncio.CancelledError  # the caller stopped waiting: the ack is lost
        return seq

    store.journal.append = landed_then_cancelled  # type: ignore[method-assign]
    with contextlib.suppress(asyncio.CancelledError):
        await store.save(lease, state=state, status="running")
    await store.save(lease, state=state, status="idle", final={"content": "bye"})
    await store.release(lease)
    record = await (await SessionStore.open(bus, owner="reader")).get(AGENT, "cut")
    assert record is not None
    assert (record.status, record.final) == ("idle", {"content": "bye"})


async def test_a_session_released_by_one_replica_is_taken_by_another_in_one_write(
    bus: Bus,
) -> None:
    first = await SessionStore.open(bus, owner="replica-a")
    second = await SessionStore.open(bus, owner="replica-b")

    async def never(agent: str, session_id: str, revision: int) -> None:
        raise AssertionError("nothing is dead here")

    recovery = second.recovery(None, never)
    await recovery.start()
    try:
        lease = await first.acquire(AGENT, "handed", fresh=AgentState(agent_name=AGENT))
        await first.save(lease, status="idle", release=True)
        key = session_key(AGENT, "handed")
        for _ in range(100):  # the release is heard with its marker's revision
            if key in second._leases._released:
                break
            await asyncio.sleep(0.02)
        requests: list[str] = []
        request = second.leases._request

        async def counted(subject: str, *args: Any) -> Any:
            requests.append(subject)
            return await request(subject, *args)

        second.leases._request = counted  # type: ignore[method-assign,assignment]
        taken = await second.acquire(AGENT, "handed", fresh=AgentState(agent_name=AGENT))
        # One compare-and-set over the marker took it; the lease was not read.
        assert requests == [f"$KV.{second.leases.bucket}.{key}"]
        assert taken.record.owner == "replica-b"
        await second.save(taken, status="idle", release=True)
    finally:
        await recovery.close()
