"""Tool calls across the death of their worker's node, on a real 3-node
cluster: the worker is connected to node 1, its callers to node 2, and node
1 is killed while calls flow. A call or reply the dead node had taken but
not passed on is found and sent again within seconds (the worker's replies
sent again once it reconnects, the callers' checks of calls with no reply):
no call waits out its attempt's timeout."""

from __future__ import annotations

import asyncio
import time

import pytest

from fleetbus.bus import Bus, ToolClient
from fleetbus.tools_workers import Toolkit, ToolWorker, tool
from tests.helpers import worker_running
from tests.integration.cluster import NatsCluster

pytestmark = pytest.mark.slow

ATTEMPT_TIMEOUT = 20.0
"""A call's attempt waits this long (plus the grace) for its reply."""


@tool
def echo(n: int) -> int:
    """Give ``n`` back.

    Args:
        n: any number.
    """
    return n


@pytest.mark.timeout(120)
async def test_calls_cross_the_death_of_their_workers_node_without_waiting_out_a_timeout(
    cluster: NatsCluster, prefix: str
) -> None:
    worker_bus = await Bus.connect(cluster.node(1).url, prefix=prefix, name="worker-on-1")
    caller = await Bus.connect(cluster.node(2).url, prefix=prefix, name="caller-on-2")
    worker = ToolWorker(worker_bus, Toolkit([echo]), worker_id="worker-on-1")
    client = ToolClient(caller, timeout=ATTEMPT_TIMEOUT)
    took: list[float] = []
    wrong: list[object] = []
    try:
        async with worker_running(worker), asyncio.TaskGroup() as tg:
            while "echo" not in await client.discover(timeout=0.5):  # noqa: ASYNC110
                await asyncio.sleep(0.1)  # until node 2 knows the worker
            stop_at = time.monotonic() + 4.5

            async def keep_calling(start: int) -> None:
                n = start
                while time.monotonic() < stop_at:
                    began = time.monotonic()
                    result = await client.call("echo", {"n": n})
                    took.append(time.monotonic() - began)
                    if not result.ok or result.content != n:
                        wrong.append(result)
                    n += 1000

            callers = [tg.create_task(keep_calling(i)) for i in range(32)]
            await asyncio.sleep(2.0)
            cluster.kill(1)  # with whatever calls and replies it holds
            await asyncio.gather(*callers)
    finally:
        await caller.close()
        await worker_bus.close()
    assert not wrong, wrong[:3]
    assert len(took) > 100
    # 31 s is what a lost call or reply cost before: its attempt's timeout.
    assert max(took) < ATTEMPT_TIMEOUT / 2, sorted(took)[-5:]
