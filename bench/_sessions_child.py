"""Idle ``AgentService`` replicas for ``bench/sessions.py``, in their own process.

Runs ``replicas`` services of one agent (each on its own connection, with the
default ``recover_interval``), waits until all are ready, prints
``{"ready": ...}``, then idles for ``idle`` seconds while sampling this
process's CPU time (``time.process_time()``: every thread) once a second,
prints the figures as one JSON line, stops the services and exits.

Usage: ``python bench/_sessions_child.py URL PREFIX AGENT REPLICAS IDLE``
"""

from __future__ import annotations

import asyncio
import itertools
import json
import sys
import time

from fleetbus.agents import Agent
from fleetbus.agents.serving import AgentService
from fleetbus.bus import Bus
from fleetbus.testing import ScriptedModel


def emit(report: dict[str, object]) -> None:
    print(json.dumps(report, separators=(",", ":")), flush=True)


async def main(url: str, prefix: str, agent_name: str, replicas: int, idle: float) -> None:
    cpu_started, wall_started = time.process_time(), time.monotonic()
    buses = [
        await Bus.connect(url, prefix=prefix, name=f"{agent_name}-{n}") for n in range(replicas)
    ]
    agent = Agent(agent_name, "You idle.", ScriptedModel())
    services = [
        AgentService(bus, agent, replica_id=f"{agent_name}@bench-{n}", drain_timeout=2.0)
        for n, bus in enumerate(buses)
    ]
    try:
        async with asyncio.TaskGroup() as tg:
            for service in services:
                tg.create_task(service.run())
            try:
                for service in services:
                    await service.wait_ready(timeout=60.0)
                emit(
                    {
                        "ready": True,
                        "startup_s": round(time.monotonic() - wall_started, 3),
                        "startup_cpu_s": round(time.process_time() - cpu_started, 3),
                    }
                )
                samples = [(time.monotonic(), time.process_time())]
                deadline = samples[0][0] + idle
                while samples[-1][0] < deadline:
                    await asyncio.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
                    samples.append((time.monotonic(), time.process_time()))
                wall = samples[-1][0] - samples[0][0]
                cpu = samples[-1][1] - samples[0][1]
                slices = [
                    (c1 - c0) / (w1 - w0)
                    for (w0, c0), (w1, c1) in itertools.pairwise(samples)
                    if w1 > w0
                ]
                emit(
                    {
                        "idle_s": round(wall, 2),
                        "cpu_s": round(cpu, 4),
                        "cpu_percent": round(100 * cpu / wall, 3),
                        "peak_1s_cpu_percent": round(100 * max(slices, default=0.0), 2),
                    }
                )
            finally:
                for service in services:
                    service.stop()
    finally:
        for bus in buses:
            await bus.close()


if __name__ == "__main__":
    url, prefix, agent_name, replicas, idle = sys.argv[1:6]
    asyncio.run(main(url, prefix, agent_name, int(replicas), float(idle)))
