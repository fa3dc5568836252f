"""A machine cut off by the network, not stopped: the shipped configs
(``deploy/nats-cluster``) have the other nodes close their routes to the
node on it, and the node a replica on it connected to close that client,
within seconds; the fleet goes on answering on the rest. When the link is
back, the cluster is whole again and answers.

Node 3 runs in a network namespace of its own, joined by a veth pair whose
link is set down, then up (no connection is reset: the servers learn of the
cut only from their pings). Two replicas of the agent run in that namespace
too, one on node 3 and one on node 1; a third in the test's process, on
nodes 1 and 2. A client outside, connected to node 3, must go on through
another node. Needs root and ``ip`` (skipped otherwise).
"""

from __future__ import annotations

import asyncio
import random
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from fleetbus.agents import Agent
from fleetbus.agents.serving import RemoteAgent
from fleetbus.bus import Bus
from fleetbus.testing import ScriptedModel
from tests.helpers import serving
from tests.integration.cluster import Apart, NatsCluster
from tests.integration.test_session_partition import (
    _can_make_namespaces,
    _ip,
    namespace,
    start_in,
    wait_for_line,
)

pytestmark = pytest.mark.slow

AGENT = "echo"
DROPPED_WITHIN = 30.0
"""Seconds the servers may take to close their routes to a node cut off
and their connections from a client cut off: the shipped configs' pings
take about 8 and 15; nats-server's defaults (routes pinged every 30 s,
clients every 2 minutes, 2 unanswered pings each) took 80 s and minutes,
while requests kept going into the cut."""
FAILOVER_WITHIN = 45.0
"""Seconds a client of the node cut off may take to be answered through
another: fleetbus's pings (every 5 s, 3 unanswered) find its connection
dead in about 20 s; at 20 s a ping it took 70."""
WAIT = 60.0


def echo() -> Agent:
    """The agent both replicas serve: it answers "ok"."""
    return Agent(AGENT, "", ScriptedModel(["ok"], repeat_last=True))


async def until(what: str, holds: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not await asyncio.to_thread(holds):
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:g} s: {what}")
        await asyncio.sleep(0.2)


def dropped(cluster: NatsCluster, far: str) -> bool:
    """Whether nodes 1 and 2 have neither a route to node 3 nor a client
    from its namespace (at ``far``) now."""
    return all(
        cluster.node(3).name not in cluster.route_names(n)
        and far not in cluster.client_addresses(n)
        for n in (1, 2)
    )


async def all_answered(bus: Bus, count: int, *, resend_after: float | None) -> None:
    """``count`` new sessions asked at once, each answered "ok"."""
    tag = random.randrange(10**6)

    async def ask(i: int) -> object:
        agent = RemoteAgent(bus, AGENT, session_id=f"s{tag}-{i}", resend_after=resend_after)
        return (await agent.reply("hi", timeout=WAIT)).content

    assert await asyncio.gather(*(ask(i) for i in range(count))) == ["ok"] * count


async def test_a_machine_cut_off_is_dropped_and_the_fleet_answers_on_the_rest(
    tmp_path: Path,
) -> None:
    why = _can_make_namespaces()
    if why is not None:
        pytest.skip(why)
    prefix = f"cut{random.randrange(10**8)}"
    with namespace() as (netns, link, near, far):
        cluster = NatsCluster(tmp_path, apart=Apart(netns, near, far))
        await asyncio.to_thread(cluster.start, WAIT)
        apart: list[subprocess.Popen[bytes]] = []
        try:
            urls = [cluster.node(1).url, cluster.node(2).url]
            bus = await Bus.connect(urls, prefix=prefix, name="test-client")
            try:
                async with serving(urls, prefix, echo(), replica="near", ready_timeout=WAIT):
                    node1 = f"nats://{near}:{cluster.node(1).client_port}"
                    for replica, url in (("apart3", cluster.node(3).url), ("apart1", node1)):
                        log = tmp_path / f"{replica}.log"
                        spec = "tests.integration.test_cluster_partition:echo"
                        apart.append(start_in(netns, spec, url, prefix, replica, log))
                        await wait_for_line(log, "serving", apart[-1])
                    assert far in cluster.client_addresses(1)
                    # A client of node 3, outside the namespace: cut off with it.
                    stranded = await Bus.connect(cluster.node(3).url, prefix=prefix, name="far")
                    await all_answered(bus, 20, resend_after=None)
                    _ip("link", "set", link, "down")
                    cut_at = asyncio.get_running_loop().time()
                    failing_over = asyncio.create_task(all_answered(stranded, 5, resend_after=3.0))
                    try:
                        await until(
                            "nodes 1 and 2 close their routes and clients to the namespace",
                            lambda: dropped(cluster, far),
                            DROPPED_WITHIN,
                        )
                        # Each request is answered as sent: none goes to a
                        # replica cut off, no read to node 3's copies.
                        await all_answered(bus, 40, resend_after=None)
                        # The client of node 3 finds its connection dead, goes
                        # to another node and sends its requests again there.
                        async with asyncio.timeout_at(cut_at + FAILOVER_WITHIN):
                            await failing_over
                    finally:
                        failing_over.cancel()
                        await stranded.close()
                        _ip("link", "set", link, "up")
                    await asyncio.to_thread(cluster.wait_ready, WAIT)
                    # Whole again (its leaders may be elected anew meanwhile).
                    await all_answered(bus, 20, resend_after=3.0)
            finally:
                await bus.close()
        finally:
            for proc in apart:
                proc.terminate()
            for proc in apart:
                try:
                    await asyncio.to_thread(proc.wait, 30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(30)
            cluster.stop()
