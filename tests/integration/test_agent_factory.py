"""Many agents from a factory (``fleetbus agent module:factory`` whose
factory returns a list of agents) are served by one process that looks for
the tools served on the bus once, not once per agent: all are ready at
once, and every agent gets the tools.

The agents: ``tests.integration.factory_specs:agents``.
"""

from __future__ import annotations

import asyncio
import subprocess
import time

import pytest
from nats.aio.msg import Msg

from fleetbus.bus import Bus, EmbeddedServer
from fleetbus.protocol import FinalAnswer, UserRequest
from tests.helpers import running, wait_for_workers, workers

AGENTS = 300
WAIT = 60.0
"""Seconds a step may take: generous, CI shares a loaded machine."""


async def serving_line(proc: subprocess.Popen[bytes], timeout: float) -> str:
    """The ``serving …`` line the agent process prints once it serves."""
    stdout = proc.stdout
    assert stdout is not None
    loop = asyncio.get_running_loop()
    seen: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = (await loop.run_in_executor(None, stdout.readline)).decode(errors="replace")
        if not line:
            break
        seen.append(line)
        if line.startswith("serving "):
            return line
    raise AssertionError(f"no serving line within {timeout}s: {''.join(seen)[-3000:]}")


@pytest.mark.slow
async def test_a_factory_of_many_agents_discovers_the_tools_once() -> None:
    with EmbeddedServer() as server:
        prefix = "factory"
        bus = await Bus.connect(server.url, prefix=prefix, name="factory-test")
        try:
            with workers(server.url, prefix, 1, spec="tests.integration.worker_tools:toolkit"):
                await wait_for_workers(bus, "echo", 1, timeout=WAIT)
                asked: list[str] = []

                async def count(msg: Msg) -> None:
                    asked.append(msg.subject)

                sub = await bus.nc.subscribe("$SRV.INFO.>", cb=count)
                await bus.nc.flush()
                command = [
                    "agent",
                    "tests.integration.factory_specs:agents",
                    "--nats",
                    server.url,
                    "--prefix",
                    prefix,
                ]
                with running([command], env={"FACTORY_AGENTS": str(AGENTS)}) as (proc,):
                    line = await serving_line(proc, WAIT)
                    gate = asyncio.Semaphore(32)

                    async def ask(i: int) -> str:
                        async with gate:
                            answer = await bus.request(
                                bus.subjects.agent_inbox(f"many-{i:05d}"),
                                UserRequest(session_id="s", content="tools?"),
                                timeout=WAIT,
                                attempts=1,
                            )
                        assert isinstance(answer, FinalAnswer), answer
                        return str(answer.content)

                    answers = await asyncio.gather(*(ask(i) for i in range(AGENTS)))
                    await bus.nc.flush()
                    await sub.unsubscribe()
        finally:
            await bus.close()
    # Each has the worker's tools (and the offload store's reader).
    tools = "echo,read_offloaded,record"
    assert answers == [f"many-{i:05d} heard {tools}" for i in range(AGENTS)]
    # One discovery for the process, shared by its 300 agents.
    assert asked == ["$SRV.INFO.fleetbus"], asked
    # Many agents are counted, not named one by one.
    assert f"{AGENTS} agents (many-00000 … many-{AGENTS - 1:05d})" in line
