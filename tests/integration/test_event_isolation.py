"""A session's events are readable by whoever asked for them, on the bus:
on a server that runs the authorization block of ``fleetbus auth``, a client
reads the events of its own replies, another client is refused them (and a
request naming someone else's reply subject sends its answer and events to
that someone), and the gateway reads sessions without writing them."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Iterator
from contextlib import asynccontextmanager

import pytest

from fleetbus.agents import Agent, AgentService, RemoteAgent
from fleetbus.agents.serving import SessionStore
from fleetbus.bus import (
    Bus,
    ConnectOptions,
    EmbeddedServer,
    MicroService,
    discover,
    key_value,
    object_store,
)
from fleetbus.bus.subjects import ANY_OWNER
from fleetbus.cli.auth_cmd import AGENT_SERVICE, User, authorization
from fleetbus.errors import PermissionDeniedError
from fleetbus.protocol import Event, FinalAnswer, TextBlock, UserRequest, encode
from fleetbus.testing import ScriptedModel

PREFIX = f"iso{uuid.uuid4().hex[:8]}"
PASSWORD = "pw-" + uuid.uuid4().hex
USERS = [
    User(role="agent", user="agent-clerk", password=PASSWORD, name="clerk"),
    User(role="client", user="alice", password=PASSWORD, name="alice"),
    User(role="client", user="bob", password=PASSWORD, name="bob"),
    User(role="gateway", user="gw", password=PASSWORD),
]
REFUSED_WITHIN = 2.0
"""Seconds a refusal may take: far below every timeout involved (5 s and up)."""


@pytest.fixture(scope="module")
def secured() -> Iterator[EmbeddedServer]:
    """A server whose only users are those of the fleet's authorization block."""
    with EmbeddedServer(config=authorization(PREFIX, USERS)) as server:
        yield server


@asynccontextmanager
async def connected(server: EmbeddedServer, user: str) -> AsyncIterator[Bus]:
    options = ConnectOptions(
        servers=[server.url], prefix=PREFIX, user=user, password=PASSWORD, name=user
    )
    bus = await Bus.connect(options=options, timeout=5.0)
    try:
        yield bus
    finally:
        await bus.close()


@asynccontextmanager
async def clerk_served(server: EmbeddedServer) -> AsyncIterator[None]:
    """The agent ``clerk``, served by its own user, answering every request
    (its session stores made: the blobs' on first use, which only a serving
    role may do)."""
    model = ScriptedModel([ScriptedModel.text("Noted.")], repeat_last=True)
    async with connected(server, "agent-clerk") as agent_bus:
        await object_store(agent_bus, "session_blobs")
        service = AgentService(agent_bus, Agent(name="clerk", model=model), drain_timeout=5.0)
        async with asyncio.TaskGroup() as tg:
            tg.create_task(service.run())
            try:
                await service.wait_ready()
                yield
            finally:
                service.stop()


async def refused(call: Awaitable[object]) -> PermissionDeniedError:
    """The refusal ``call`` ends with, checked to come fast."""
    started = time.monotonic()
    with pytest.raises(PermissionDeniedError) as caught:
        await call
    assert time.monotonic() - started < REFUSED_WITHIN
    return caught.value


async def streamed(bus: Bus, session: str) -> tuple[list[Event], FinalAnswer]:
    events: list[Event] = []
    async for item in RemoteAgent(bus, "clerk", session_id=session, timeout=30).reply_stream("hi"):
        if isinstance(item, FinalAnswer):
            return events, item
        events.append(item)
    raise AssertionError("the stream ended without an answer")


async def test_a_client_reads_its_own_events_and_no_one_elses(secured: EmbeddedServer) -> None:
    async with (
        clerk_served(secured),
        connected(secured, "alice") as alice,
        connected(secured, "bob") as bob,
    ):
        subjects = alice.subjects
        events, answer = await streamed(alice, "sa")
        assert answer.content == "Noted."
        assert "reply_start" in [e.event for e in events]

        # Bob may not listen to alice's events, nor to the session's, nor to all.
        for subject in (
            subjects.events("clerk", "sa", "alice"),
            subjects.events("clerk", "sa", ANY_OWNER),
            subjects.all_events("clerk"),
            subjects.all_events(),
        ):
            denial = await refused(bob.observe(subject))
            assert str(denial) == f"permission denied: subscription to {subject}"

        # A request of bob's naming alice's reply subject: its answer and its
        # events go to alice, who may read them, and nothing to bob.
        spoofed = f"{alice.inbox_prefix}.spoofed"
        async with (
            await alice.observe(spoofed) as answers,
            await alice.observe(subjects.events("clerk", "sb", "alice")) as alices,
            await bob.observe(subjects.events("clerk", "sb", "bob")) as bobs,
        ):
            await alice.flush()
            await bob.flush()
            request = UserRequest(
                sender="bob", session_id="sb", call_id="c-spoof", content=[TextBlock(text="hi")]
            )
            await bob.publish_bytes(subjects.agent_inbox("clerk"), encode(request), reply=spoofed)
            async with asyncio.timeout(30):
                got = await anext(aiter(answers))
            assert isinstance(got, FinalAnswer)
            assert got.call_id == "c-spoof"
            await alice.flush()
            assert "reply_start" in [
                e.event for e in await alices.received() if isinstance(e, Event)
            ]
            # Whatever the agent published for bob was published before the
            # answer: one round trip on bob's connection lets it in.
            await bob.flush()
            assert await bobs.received() == []


async def test_an_agent_reads_the_events_of_what_it_asks(secured: EmbeddedServer) -> None:
    """An agent asks other agents (here the one it serves) as a client does."""
    async with clerk_served(secured), connected(secured, "agent-clerk") as asking:
        events, answer = await streamed(asking, "s-agent")
        assert answer.content == "Noted."
        assert "reply_start" in [e.event for e in events]
        subject = asking.subjects.all_events()
        denial = await refused(asking.observe(subject))
        assert str(denial) == f"permission denied: subscription to {subject}"


async def test_the_gateway_reads_sessions_and_writes_none(secured: EmbeddedServer) -> None:
    async with (
        clerk_served(secured),
        connected(secured, "alice") as alice,
        connected(secured, "gw") as gw,
    ):
        subjects = gw.subjects
        _, answer = await streamed(alice, "s-alice")
        assert answer.content == "Noted."

        # It asks agents for the people it serves, and reads its replies' events.
        events, answer = await streamed(gw, "s-gw")
        assert answer.content == "Noted."
        assert "reply_start" in [e.event for e in events]

        # It reads every session's journal, and the leases and blobs.
        store = await SessionStore.open(gw, owner="gateway")
        sessions = {(r.agent, r.session_id) for r in await store.records()}
        assert {("clerk", "s-alice"), ("clerk", "s-gw")} <= sessions
        record = await store.get("clerk", "s-alice")
        assert record is not None
        assert record.status == "done"
        facts = await store.history("clerk", "s-alice")
        assert facts[-1].kind == "end"
        leases = await key_value(gw, "session_leases")
        assert await leases.keys() is not None
        await object_store(gw, "session_blobs")

        # It writes none of them.
        journal = store.journal
        last = facts[-1].seq
        await refused(journal.append("clerk.s-alice", b"{}", expected=last))
        denial = await refused(leases.put("clerk.s-alice", b"{}"))
        assert "$KV." in str(denial)
        assert (await store.get("clerk", "s-alice")) == record

        # It reads neither all events nor others' replies, and serves nothing.
        denial = await refused(gw.observe(subjects.all_events()))
        assert str(denial) == f"permission denied: subscription to {subjects.all_events()}"
        await refused(gw.observe(subjects.events("clerk", "s-alice", "alice")))
        await refused(gw.observe(f"{alice.inbox_prefix}.>"))
        await refused(gw.observe(subjects.agent_inbox("clerk")))


async def test_the_gateway_discovers_agents(secured: EmbeddedServer) -> None:
    async with connected(secured, "agent-clerk") as agent_bus, connected(secured, "gw") as gw:
        service = MicroService(agent_bus, name=AGENT_SERVICE, version="0.0.1")
        stop, ready = asyncio.Event(), asyncio.Event()
        async with asyncio.TaskGroup() as tg:
            tg.create_task(service.run(stop, ready=ready))
            try:
                await ready.wait()
                found = await discover(gw, AGENT_SERVICE, timeout=1.0)
            finally:
                stop.set()
        assert service.id in {info.id for info in found}
