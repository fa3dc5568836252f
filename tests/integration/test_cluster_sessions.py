"""Agent sessions on a real 3-node NATS cluster: the session assets are
replicated (R3), and killing the node that leads the sessions bucket in the
middle of replies loses nothing: every reply finishes with its answer and
every tool call is answered."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest

from fleetbus.agents import Agent, AgentService
from fleetbus.agents.serving.remote import RemoteAgent
from fleetbus.agents.serving.sessions import SessionStore
from fleetbus.bus import Bus
from fleetbus.bus import journal as journal_module
from fleetbus.errors import NoRespondersError, StoreError
from fleetbus.protocol import AnyMessage, FinalAnswer, UserRequest, to_builtins
from fleetbus.tools_workers import Toolkit
from tests.integration.agent_specs import CommandModel
from tests.integration.cluster import NatsCluster, stream_info
from tests.integration.test_sessions_durable import (
    AGENT,
    StepModel,
    answers,
    assert_consistent,
    expected,
    make_agent,
    serving,
    step_worker,
    wait_until,
)

pytestmark = pytest.mark.slow

WAITING = "waiting for the session store"

CLUSTER_READY = 30.0
"""Seconds an agent service may take to be ready: its buckets are made (R3)
while a node that an earlier test killed may still be catching up."""


async def open_store(bus: Bus, timeout: float = 30.0) -> SessionStore:
    """The session store, once every bucket has a leader again (the other
    buckets' leaders may have been on the killed node too)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        try:
            return await SessionStore.open(bus, owner="test")
        except StoreError:
            if asyncio.get_running_loop().time() > deadline:
                raise
            await asyncio.sleep(0.2)


async def warm_up(bus: Bus, session: str, timeout: float = 30.0) -> AnyMessage:
    """The agent's answer to an empty request, once the node this client is
    connected to knows the agent's inbox: on a cluster under load, the
    host's subscription reaches the other nodes over their routes a moment
    after the host is ready (until then a request has no responders)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        try:
            return await bus.request(
                bus.subjects.agent_inbox(AGENT),
                UserRequest(session_id=session, content=""),
                timeout=timeout,
            )
        except NoRespondersError:
            if asyncio.get_running_loop().time() > deadline:
                raise
            await asyncio.sleep(0.1)


@pytest.mark.timeout(150)
async def test_replies_finish_when_the_sessions_leader_is_killed(
    cluster: NatsCluster, cluster_bus: Bus
) -> None:
    nats_cluster = cluster
    bus = cluster_bus
    runs: list[str] = []
    gate = asyncio.Event()
    texts = {f"k{i}": f"a{i} b{i}" for i in range(4)}
    got: dict[str, list[AnyMessage]] = {}
    async with (
        step_worker(nats_cluster.urls, bus.prefix, runs, gate),
        serving(
            nats_cluster.urls,
            bus.prefix,
            await make_agent(bus, StepModel()),
            lease_ttl=15.0,
            recover_interval=0.5,
            ready_timeout=CLUSTER_READY,
        ) as service,
    ):
        assert service.store is not None
        for stream in (
            bus.subjects.kv_bucket("session"),
            f"KV_{bus.subjects.kv_bucket('session_leases')}",
        ):
            info = await stream_info(bus, stream)
            assert info["config"]["num_replicas"] == 3
        # Every node knows the agent's inbox before the requests go out.
        warm = await warm_up(bus, "warm-up")
        assert isinstance(warm, FinalAnswer)
        for session, text in texts.items():
            inbox = bus.nc.new_inbox()
            got[session], _ = await answers(bus, inbox)
            await bus.nc.publish(
                bus.subjects.agent_inbox(AGENT),
                json.dumps(to_builtins(UserRequest(session_id=session, content=text))).encode(),
                reply=inbox,
            )
        await wait_until(lambda: len(runs) == len(texts))  # every first call is running
        stream = bus.subjects.kv_bucket("session")  # the journal
        leader = await nats_cluster.stream_leader(bus, stream)
        nats_cluster.kill(leader)  # mid-run: the results will be saved across the fail-over
        gate.set()
        await wait_until(
            lambda: all(any(isinstance(m, FinalAnswer) for m in g) for g in got.values()),
            timeout=120,
        )
        new_leader = await nats_cluster.stream_leader(bus, stream, exclude=leader)
    assert new_leader != leader
    store = await open_store(bus)
    for session, text in texts.items():
        finals = [m for m in got[session] if isinstance(m, FinalAnswer)]
        assert len(finals) == 1
        assert finals[0].content == expected(text)
        record = await store.get(AGENT, session)
        assert record is not None
        assert record.status == "done"
        assert_consistent(record.state.memory)
    assert sorted(runs) == sorted(w for t in texts.values() for w in t.split())


@pytest.mark.timeout(150)
async def test_requests_that_come_while_the_leases_leader_is_killed_wait_for_the_next_one(
    cluster: NatsCluster, cluster_bus: Bus
) -> None:
    """Requests that reach a replica while the lease bucket has no leader
    (its node was just killed, the other two are electing one) wait for it:
    each is answered, none gets a store error."""
    bus = cluster_bus
    runs: list[str] = []
    gate = asyncio.Event()
    gate.set()
    texts = {f"e{i}": f"x{i}" for i in range(4)}
    async with (
        step_worker(cluster.urls, bus.prefix, runs, gate),
        serving(
            cluster.urls,
            bus.prefix,
            await make_agent(bus, StepModel()),
            ready_timeout=CLUSTER_READY,
        ),
    ):
        inbox = bus.subjects.agent_inbox(AGENT)
        warm = await warm_up(bus, "warm")
        assert isinstance(warm, FinalAnswer)
        stream = f"KV_{bus.subjects.kv_bucket('session_leases')}"
        cluster.kill(await cluster.stream_leader(bus, stream))
        got = await asyncio.gather(
            *(
                # (attempts: a replica connected to the killed node is back
                # on another within a second; nobody serves it meanwhile)
                bus.request(
                    inbox,
                    UserRequest(session_id=session, content=text),
                    timeout=60,
                    attempts=3,
                    retry_backoff=0.5,
                )
                for session, text in texts.items()
            )
        )
    for (_, text), answer in zip(texts.items(), got, strict=True):
        assert isinstance(answer, FinalAnswer), answer
        assert answer.content == expected(text)


@pytest.mark.timeout(150)
async def test_a_host_started_while_jetstream_has_no_quorum_waits_for_it(
    cluster: NatsCluster,
    cluster_bus: Bus,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A host that starts while the cluster cannot make its session streams
    (two nodes of three are down: no JetStream meta leader) waits for the
    store, saying so once, and serves once the nodes are back."""
    bus = cluster_bus
    # Unanswered, a stream's creation waits 15 s before it is tried again.
    monkeypatch.setattr(journal_module, "ADMIN_TIMEOUT", 3.0)
    caplog.set_level(logging.WARNING, logger="fleetbus.agents.serving.host")
    cluster.kill(2)
    cluster.kill(3)
    agent = Agent("echo", "", CommandModel(), toolkit=Toolkit())
    host_bus = await Bus.connect(cluster.node(1).url, prefix=bus.prefix, name="agent-late")
    service = AgentService(host_bus, agent, replica_id="echo@late", store_wait=120.0)
    try:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(service.run())
            try:
                await wait_until(
                    lambda: any(WAITING in r.getMessage() for r in caplog.records), timeout=60
                )
                assert not service._ready.is_set()
                cluster.restart(2)
                cluster.restart(3)
                await service.wait_ready(120)
                answer = await RemoteAgent(bus, "echo", session_id="late").reply("hi", timeout=60)
            finally:
                service.stop()
    finally:
        await host_bus.close()
    assert isinstance(answer, FinalAnswer), answer
    waits = [r.getMessage() for r in caplog.records if WAITING in r.getMessage()]
    assert len(waits) == 1, waits
    assert "(up to 120 s)" in waits[0]
