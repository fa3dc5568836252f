"""The commands that read the session store, and the dashboard, on a real
3-node NATS cluster whose node leading the store has just been killed: they
wait for the new leader (saying so once on stderr) instead of failing."""

from __future__ import annotations

import asyncio
import json
import logging
import time

import pytest

from fleetbus.agents import Agent
from fleetbus.agents.serving.remote import RemoteAgent
from fleetbus.bus import Bus
from fleetbus.protocol import FinalAnswer
from fleetbus.tools_workers import Toolkit
from tests.helpers import fleetbus_process, serving
from tests.integration.agent_specs import CommandModel
from tests.integration.cluster import NatsCluster
from tests.integration.test_cluster_store import wait_current_replicas
from tests.integration.test_dashboard import dashboard

pytestmark = pytest.mark.slow

WAITING = "waiting for the session store"


async def fleetbus(*args: str, timeout: float = 90.0) -> tuple[int, str, str]:
    """``fleetbus ARGS`` as a process: exit code, stdout, stderr."""
    return await fleetbus_process(*args, timeout=timeout)


async def a_session(cluster: NatsCluster, bus: Bus, session_id: str) -> None:
    """A session of the agent ``echo`` in the store (served only to make it)."""
    agent = Agent("echo", "", CommandModel(), toolkit=Toolkit())
    async with serving(cluster.urls, bus.prefix, agent, ready_timeout=30):
        answer = await RemoteAgent(bus, "echo", session_id=session_id).reply("hi", timeout=30)
    assert isinstance(answer, FinalAnswer)


@pytest.mark.timeout(180)
async def test_sessions_waits_for_the_new_leader_of_the_session_store(
    cluster: NatsCluster, cluster_bus: Bus
) -> None:
    bus = cluster_bus
    on_bus = ("--nats", ",".join(cluster.urls), "--prefix", bus.prefix)
    await a_session(cluster, bus, "w1")
    code, out, err = await fleetbus("sessions", "echo", *on_bus, "--json")
    assert code == 0, out + err
    assert [s["session"] for s in json.loads(out)] == ["w1"]
    assert WAITING not in err

    stream = bus.subjects.kv_bucket("session")
    await wait_current_replicas(bus, stream, 3)
    leader = await cluster.stream_leader(bus, stream)
    cluster.kill(leader)  # the other two elect a new leader: seconds without one
    code, out, err = await fleetbus("sessions", "echo", *on_bus, "--json")
    assert code == 0, out + err
    assert [s["session"] for s in json.loads(out)] == ["w1"]
    assert err.count(WAITING) == 1, err
    assert "(up to 30 s)" in err

    # The same for a command that finds a session's agent in the store.
    cluster.restart(leader)
    cluster.wait_ready()
    await wait_current_replicas(bus, stream, 3, timeout=60)
    cluster.kill(await cluster.stream_leader(bus, stream))
    code, out, err = await fleetbus("cancel", "w1", *on_bus)
    assert code == 0, out + err
    assert "cancel sent to echo for session w1" in out
    assert err.count(WAITING) == 1, err


@pytest.mark.timeout(180)
async def test_the_dashboard_waits_for_the_new_leader_of_the_session_store(
    cluster: NatsCluster, cluster_bus: Bus, caplog: pytest.LogCaptureFixture
) -> None:
    bus = cluster_bus
    await a_session(cluster, bus, "d1")
    stream = bus.subjects.kv_bucket("session")
    await wait_current_replicas(bus, stream, 3)
    async with dashboard(bus) as board:
        await board.until(lambda s: [x["session"] for x in s["sessions"]] == ["d1"])
        with caplog.at_level(logging.WARNING, logger="fleetbus.dashboard"):
            leader = await cluster.stream_leader(bus, stream)
            cluster.kill(leader)
            await cluster.stream_leader(bus, stream, exclude=leader, timeout=60)
            # Polled every 0.3 s from the kill until a few polls after the new
            # leader: the page never says the store cannot be read.
            until = time.monotonic() + 3
            while time.monotonic() < until or not caplog.records:
                snap = await board.fleet()
                assert "sessions" not in snap["errors"], snap["errors"]
                assert [x["session"] for x in snap["sessions"]] == ["d1"]
                assert time.monotonic() < until + 60, "the dashboard never waited"
                await asyncio.sleep(0.1)
        waited = [r.getMessage() for r in caplog.records if WAITING in r.getMessage()]
        assert len(waited) == 1, waited
        assert "(up to 30 s)" in waited[0]


@pytest.mark.timeout(180)
async def test_ask_is_answered_across_the_election(cluster: NatsCluster, cluster_bus: Bus) -> None:
    """``ask`` reads no store itself: the agent it asks waits for the new
    leader (``AgentHost.store_wait``, the same helper), and the reply comes."""
    bus = cluster_bus
    on_bus = ("--nats", ",".join(cluster.urls), "--prefix", bus.prefix)
    agent = Agent("echo", "", CommandModel(), toolkit=Toolkit())
    async with serving(cluster.urls, bus.prefix, agent, ready_timeout=30):
        await RemoteAgent(bus, "echo", session_id="a0").reply("warm", timeout=30)
        stream = bus.subjects.kv_bucket("session")
        await wait_current_replicas(bus, stream, 3)
        cluster.kill(await cluster.stream_leader(bus, stream))
        code, out, err = await fleetbus("ask", "echo", "hello", *on_bus, "--session", "a1")
    assert code == 0, out + err
    assert "echo hello from" in out
    assert "✓ completed (session a1)" in out
