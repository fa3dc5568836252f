"""AgentHost in the test's process: what its constructor refuses, and host
groups on one prefix, each answering only the agents of its own source.
The host as separate OS processes: ``test_host_processes.py``."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

import pytest

from fleetbus.agents import Agent, AgentHost
from fleetbus.agents.serving.sessions import SessionStore, session_key
from fleetbus.agents.state import AgentState
from fleetbus.bus import Bus, EmbeddedServer
from fleetbus.errors import CallTimeoutError, ConfigError, SessionBusyError
from fleetbus.models.model import ModelResponse
from fleetbus.protocol import (
    AgentMessage,
    ErrorMessage,
    FinalAnswer,
    TextBlock,
    UserRequest,
    decode,
    encode,
    to_builtins,
)
from fleetbus.testing import ScriptedModel
from fleetbus.tools_workers import Toolkit
from tests.helpers import lease_only


@asynccontextmanager
async def hosting(
    url: str,
    prefix: str,
    agents: Any,
    *,
    replica: str = "test",
    **options: Any,
) -> AsyncIterator[AgentHost]:
    """``agents`` served by an :class:`AgentHost` in this process, on a
    connection of its own, until the block ends (a 1 s lease, a 5 s drain)."""
    host_bus = await Bus.connect(url, prefix=prefix, name=f"host-{replica}")
    options.setdefault("lease_ttl", 1.0)
    options.setdefault("drain_timeout", 5.0)
    try:
        host = AgentHost(host_bus, agents, replica_id=replica, **options)
        async with asyncio.TaskGroup() as tg:
            tg.create_task(host.run())
            try:
                await host.wait_ready()
                yield host
            finally:
                host.stop()
    finally:
        await host_bus.close()


def scripted(name: str, answer: str) -> Agent:
    """An agent that answers ``answer`` to everything."""
    return Agent(name, "", ScriptedModel([answer], repeat_last=True), toolkit=Toolkit())


class Unlisted:
    """Every agent whose name starts with ``<start>-``: a source that cannot
    list its agents; counts the definitions it builds."""

    def __init__(self, start: str) -> None:
        self.start = start
        self.built: list[str] = []

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name.startswith(f"{self.start}-")

    def agent(self, name: str) -> Agent:
        self.built.append(name)
        return scripted(name, f"{name} of {self.start}")


class Liar(Unlisted):
    """Builds an agent of another name than the one asked for."""

    def agent(self, name: str) -> Agent:
        return scripted(f"{name}-x", "never")


async def ask(bus: Bus, agent: str, text: str, session: str, *, timeout: float = 10.0) -> Any:
    return await bus.request(
        bus.subjects.agent_inbox(agent),
        UserRequest(content=text, session_id=session),
        timeout=timeout,
    )


# -- the constructor -------------------------------------------------------------


def test_a_source_that_cannot_list_its_agents_needs_a_group(bus: Bus) -> None:
    with pytest.raises(ConfigError, match="cannot list its agents needs a group"):
        AgentHost(bus, Unlisted("n"))
    AgentHost(bus, Unlisted("n"), group="north")  # one wildcard subscription: no list needed


def test_a_source_that_cannot_list_its_agents_observes_no_topics(bus: Bus) -> None:
    with pytest.raises(ConfigError, match="and no topics"):
        AgentHost(bus, Unlisted("n"), group="north", topics=["news"])


@pytest.mark.parametrize(
    "agents",
    [
        [scripted("twin", "a"), scripted("twin", "b")],
        {"first": scripted("twin", "a"), "second": scripted("twin", "b")},
    ],
    ids=["sequence", "mapping"],
)
def test_two_agents_with_one_name_are_refused(
    bus: Bus, agents: Iterable[Agent] | Mapping[str, Agent]
) -> None:
    with pytest.raises(ConfigError, match="two agents are named 'twin'"):
        AgentHost(bus, agents)


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"checkpoints": "never"}, "checkpoints is 'step' or 'reply'"),
        ({"events": "some"}, "events is 'all', 'final' or 'none'"),
        ({"group": "two.tokens"}, "host group"),
        ({"topics": ["a.b"]}, "topic"),
    ],
)
def test_bad_settings_are_refused(bus: Bus, options: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        AgentHost(bus, [scripted("solo", "a")], **options)


def test_an_agent_name_that_cannot_be_a_subject_token_is_refused(bus: Bus) -> None:
    with pytest.raises(ConfigError, match="agent name"):
        AgentHost(bus, [scripted("two.tokens", "a")])


# -- host groups -------------------------------------------------------------------


async def test_host_groups_on_one_prefix_answer_only_their_own_agents(
    nats_server: EmbeddedServer, bus: Bus
) -> None:
    north, south = Unlisted("n"), Unlisted("s")
    async with (
        hosting(nats_server.url, bus.prefix, north, group="north", replica="north-1"),
        hosting(nats_server.url, bus.prefix, south, group="south", replica="south-1"),
    ):
        answers = await asyncio.gather(
            *(ask(bus, name, "hi", f"g-{i}") for i, name in enumerate(["n-1", "s-1", "n-2"]))
        )
        again = await ask(bus, "n-1", "hi again", "g-0")
        with pytest.raises(CallTimeoutError):
            await ask(bus, "w-1", "anyone?", "nobody", timeout=0.5)
    assert [a.content for a in answers] == ["n-1 of n", "s-1 of s", "n-2 of n"]
    assert all(isinstance(a, FinalAnswer) and a.finished_reason == "completed" for a in answers)
    assert isinstance(again, FinalAnswer)
    assert again.content == "n-1 of n"
    # Built on demand, once per agent while cached; never for another group's names.
    assert sorted(north.built) == ["n-1", "n-2"]
    assert south.built == ["s-1"]


async def test_definitions_past_the_cache_are_built_again(
    nats_server: EmbeddedServer, bus: Bus
) -> None:
    source = Unlisted("n")
    async with hosting(nats_server.url, bus.prefix, source, group="north", cache_size=1):
        for name in ("n-a", "n-b", "n-a"):
            answer = await ask(bus, name, "hi", "cache")
            assert isinstance(answer, FinalAnswer)
            assert answer.content == f"{name} of n"
    assert source.built == ["n-a", "n-b", "n-a"]


async def test_a_source_that_builds_another_agent_gets_an_error_answer(
    nats_server: EmbeddedServer, bus: Bus
) -> None:
    async with hosting(nats_server.url, bus.prefix, Liar("n"), group="north"):
        answer = await ask(bus, "n-1", "hi", "liar")
    assert isinstance(answer, ErrorMessage)
    assert answer.code == "internal"
    assert "the agent source built 'n-1-x' for 'n-1'" in answer.message


async def test_a_broadcast_naming_no_session_is_recorded_in_the_topics_session(
    nats_server: EmbeddedServer, bus: Bus
) -> None:
    agents = [scripted("ann", "a"), scripted("ben", "b")]
    async with hosting(nats_server.url, bus.prefix, agents, topics=["news"]):
        await bus.publish(
            bus.subjects.topic("news"),
            AgentMessage(sender="ann", name="ann", content=[TextBlock(text="rain")], reply=False),
        )
        await bus.flush()
        store = await SessionStore.open(bus, owner="test")
        deadline = time.monotonic() + 10
        record = None
        while time.monotonic() < deadline and (record is None or record.owner is not None):
            record = await store.get("ben", "news")
            await asyncio.sleep(0.02)
        sessions = list(await store.journal.keys("*.news"))
    assert record is not None
    assert [(m.name, m.text) for m in record.state.memory] == [("ann", "rain")]
    assert sessions == ["ben.news"]  # not recorded by its sender


class Listed(Unlisted):
    """A population of ``size`` agents ``<start>-0`` …: it lists them, and
    counts the names it gave out."""

    def __init__(self, start: str, size: int) -> None:
        super().__init__(start)
        self.size = size
        self.listed = 0

    def __iter__(self) -> Iterator[str]:
        for i in range(self.size):
            self.listed += 1
            yield f"{self.start}-{i}"


async def test_a_group_lists_its_observers_when_a_broadcast_comes_not_before(
    nats_server: EmbeddedServer, bus: Bus
) -> None:
    # A population of a million would be 70 MB as a list kept by every host.
    population = Listed("p", 3)
    async with hosting(nats_server.url, bus.prefix, population, group="g", topics=["news"]):
        assert population.listed <= 1  # (a look at the first: the source is not empty)
        before = population.listed
        await bus.publish(
            bus.subjects.topic("news"),
            AgentMessage(sender="p-0", name="p-0", content=[TextBlock(text="rain")], reply=False),
        )
        await bus.flush()
        store = await SessionStore.open(bus, owner="test")
        deadline = time.monotonic() + 10
        recorded: list[str] = []
        while time.monotonic() < deadline and len(recorded) < 2:
            records = [await store.get(name, "news") for name in ("p-1", "p-2")]
            recorded = [r.agent for r in records if r is not None and r.owner is None]
            await asyncio.sleep(0.02)
        sessions = sorted(await store.journal.keys("*.news"))
    assert sessions == ["p-1.news", "p-2.news"]  # not recorded by its sender
    assert population.listed - before == 3  # listed once, as the broadcast was recorded


def test_an_empty_population_is_refused_in_a_group_with_topics(bus: Bus) -> None:
    with pytest.raises(ConfigError, match="at least one agent"):
        AgentHost(bus, Listed("p", 0), group="g", topics=["news"])


def test_a_host_of_no_agents_is_refused(bus: Bus) -> None:
    with pytest.raises(ConfigError, match="at least one agent"):
        AgentHost(bus, [])


async def test_a_confirmation_for_a_session_that_does_not_exist_does_not_start_it(
    nats_server: EmbeddedServer, bus: Bus
) -> None:
    from fleetbus.protocol import Confirmation, ConfirmResult, ExternalOutput, ExternalResult

    async with hosting(nats_server.url, bus.prefix, [scripted("ann", "a")]):
        inbox = bus.subjects.agent_inbox("ann")
        confirm = ConfirmResult(
            sender="cli",
            session_id="nosuch",
            confirmations=[Confirmation(call_id="c1", confirmed=True)],
        )
        external = ExternalResult(
            sender="cli",
            session_id="nosuch",
            results=[ExternalOutput(call_id="c1", content="x")],
        )
        answers = [await bus.request(inbox, m, timeout=10) for m in (confirm, external)]
        store = await SessionStore.open(bus, owner="test")
        record = await store.get("ann", "nosuch")
        leases = await store.leases.keys("ann.>")
    for answer, what in zip(answers, ["a confirmation", "an external result"], strict=True):
        assert isinstance(answer, FinalAnswer)
        assert answer.finished_reason == "error"
        assert answer.content == f"Nothing is waiting for {what}: agent ann has no session nosuch."
    assert record is None
    assert leases == []


# -- a request sent or asked again -----------------------------------------------


async def test_a_request_asked_again_after_its_answer_gets_the_stored_answer(
    nats_server: EmbeddedServer, bus: Bus
) -> None:
    """A request that asked for a receipt sent again once answered (its
    receipt was lost): the answer stored is sent again, and the model is not
    asked again."""
    model = ScriptedModel(["first", "second"])
    agent = Agent("bea", "", model, toolkit=Toolkit())
    async with hosting(nats_server.url, bus.prefix, [agent]):
        inbox = bus.subjects.agent_inbox("bea")
        request = UserRequest(content="hello", session_id="s", call_id="q-1", receipt=True)
        first = await bus.request(inbox, request, timeout=10, resend=5)
        again = await bus.request(inbox, request, timeout=10, resend=5)
        other = await bus.request(
            inbox, UserRequest(content="hello", session_id="s", call_id="q-2"), timeout=10
        )
        store = await SessionStore.open(bus, owner="test")
        record = await store.get("bea", "s")
    assert isinstance(first, FinalAnswer)
    assert isinstance(again, FinalAnswer)
    assert (again.id, again.content, again.call_id) == (first.id, "first", "q-1")
    assert isinstance(other, FinalAnswer)
    assert other.content == "second"
    assert len(model.requests) == 2
    assert record is not None
    assert [m.text for m in record.state.memory] == ["hello", "first", "hello", "second"]
    assert record.status == "done"


async def test_a_request_sent_again_while_it_waits_for_its_session_is_taken_once(
    nats_server: EmbeddedServer, bus: Bus
) -> None:
    """A request that asked for a receipt waits behind its session's running
    reply, and its client sends it again (the same message, the same reply
    subject) before its receipt: the replica holding it takes it once; the
    receipt comes when it is taken, and the answer once."""
    release = asyncio.Event()

    class Slow(ScriptedModel):
        async def stream(self, request: Any) -> AsyncIterator[Any]:
            if not self.requests:
                await release.wait()
            async for item in super().stream(request):
                yield item

    model = Slow(["busy done", "held done"])
    agent = Agent("cid", "", model, toolkit=Toolkit())
    async with hosting(nats_server.url, bus.prefix, [agent]):
        inbox = bus.subjects.agent_inbox("cid")
        busy = asyncio.create_task(
            bus.request(inbox, UserRequest(content="busy", session_id="s"), timeout=20)
        )
        await asyncio.sleep(0.3)
        replies: list[bytes] = []
        answered = asyncio.Event()

        async def on_reply(msg: Any) -> None:
            replies.append(msg.data)
            if len(replies) >= 2:
                answered.set()

        reply_to = bus.nc.new_inbox()
        sub = await bus.nc.subscribe(reply_to, cb=on_reply)
        held = UserRequest(content="held", session_id="s", call_id="q-9", receipt=True)
        for _ in range(3):  # sent again twice while it waits
            await bus.nc.publish(inbox, encode(held), reply=reply_to)
            await asyncio.sleep(0.2)
        assert replies == []  # not taken yet: no receipt
        release.set()
        await busy
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(answered.wait(), 10)
        await asyncio.sleep(0.5)  # a second answer would come now
        await sub.unsubscribe()
        store = await SessionStore.open(bus, owner="test")
        record = await store.get("cid", "s")
    assert replies[0] == b""  # the receipt, then the answer, once
    assert len(replies) == 2, replies
    answer = decode(replies[1])
    assert isinstance(answer, FinalAnswer)
    assert (answer.content, answer.call_id) == ("held done", "q-9")
    assert len(model.requests) == 2
    assert record is not None
    assert [m.text for m in record.state.memory] == ["busy", "busy done", "held", "held done"]


async def test_with_checkpoints_per_reply_a_small_session_is_one_snapshot(
    nats_server: EmbeddedServer, bus: Bus
) -> None:
    """A population's host writes a session when it takes a request and when
    it answers; a small session ends each reply as one snapshot, so that the
    next reply, on any host, reads it in one message."""
    store = await SessionStore.open(bus, owner="reader")
    async with hosting(nats_server.url, bus.prefix, [scripted("pop", "hi")], checkpoints="reply"):
        for n in range(5):
            answer = await bus.request(
                bus.subjects.agent_inbox("pop"),
                UserRequest(session_id="p1", content=f"round {n}"),
                timeout=20,
            )
            assert isinstance(answer, FinalAnswer)
            kinds = [f.kind for f in await store.history("pop", "p1")]
            assert kinds == ["snapshot"], kinds
    record = await store.get("pop", "p1")
    assert record is not None
    assert [m.text for m in record.state.memory if m.role == "user"] == [
        f"round {n}" for n in range(5)
    ]


class Slow:
    """A model that takes ``seconds`` to answer (``started``: its call began)."""

    name = "slow"

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.started = asyncio.Event()

    async def stream(self, request: Any) -> AsyncIterator[Any]:
        self.started.set()
        await asyncio.sleep(self.seconds)
        yield ModelResponse([TextBlock(text="at last")], finish_reason="stop", model=self.name)


async def test_a_reply_longer_than_its_lease_renews_it_and_keeps_it(
    nats_server: EmbeddedServer, bus: Bus
) -> None:
    """Renewed every third of its TTL from the first renewal on: a reply of
    five TTLs keeps its session, and nobody else can take it meanwhile."""
    model = Slow(2.5)
    slow = Agent("slow", "", model, toolkit=Toolkit())
    async with hosting(nats_server.url, bus.prefix, [slow], lease_ttl=0.5):
        asking = asyncio.create_task(ask(bus, "slow", "take your time", "s1"))
        store = await SessionStore.open(bus, owner="other", lease_ttl=0.5)
        key = session_key("slow", "s1")
        async with asyncio.timeout(10):
            await model.started.wait()
        first = await store.leases.get_or_none(key)
        await asyncio.sleep(1.5)  # three TTLs: a lease left alone would be silent
        renewed = await store.leases.get_or_none(key)
        with pytest.raises(SessionBusyError):
            await store.acquire("slow", "s1", fresh=AgentState(agent_name="slow"))
        answer = await asking
    assert isinstance(answer, FinalAnswer)
    assert answer.content == "at last"
    assert first is not None
    assert renewed is not None
    assert renewed.revision > first.revision  # renewed while the reply ran


async def test_a_new_session_whose_replica_died_before_its_first_fact_is_taken_over(
    nats_server: EmbeddedServer, bus: Bus
) -> None:
    """A replica took a new session's lease for a request and died before it
    appended anything (its journal is empty, the request is in the lease):
    another replica's recovery takes the session over and answers the
    request's reply subject, which nobody asks again."""
    dead = await SessionStore.open(bus, owner="dead", lease_ttl=0.3)
    inbox = bus.nc.new_inbox()
    sub = await bus.nc.subscribe(inbox)
    request = UserRequest(content="hi", session_id="s", call_id="q-1", receipt=True)
    await lease_only(dead, "ann", to_builtins(request), inbox)
    async with hosting(
        nats_server.url,
        bus.prefix,
        [scripted("ann", "served at last")],
        lease_ttl=0.3,
        recover_interval=0.1,
    ):
        answer = decode((await sub.next_msg(timeout=20)).data)
    await sub.unsubscribe()
    assert isinstance(answer, FinalAnswer)
    assert (answer.call_id, answer.content) == ("q-1", "served at last")
