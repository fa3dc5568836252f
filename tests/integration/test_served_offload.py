"""An agent served by ``fleetbus agent`` offloads a tool result too long for
its context to the fleet's object store: the model sees the beginning and a
reference, and reads the rest with ``read_offloaded`` (the agent:
``tests.integration.offload_specs:reader``, whose tool returns 2 MB)."""

from __future__ import annotations

import asyncio
import subprocess
import time

import pytest

from fleetbus.bus import Bus, EmbeddedServer
from fleetbus.protocol import FinalAnswer, UserRequest
from tests.helpers import running

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
async def test_a_served_agent_reads_the_rest_of_a_long_result_from_the_object_store(
    nats_server: EmbeddedServer, bus: Bus, prefix: str
) -> None:
    command = [
        "agent",
        "tests.integration.offload_specs:reader",
        "--no-remote-tools",
        "--nats",
        nats_server.url,
        "--prefix",
        prefix,
    ]
    with running([command]) as (proc,):
        await serving_line(proc, WAIT)
        answer = await bus.request(
            bus.subjects.agent_inbox("reader"),
            UserRequest(session_id="s-1", content="read it all"),
            timeout=WAIT,
            attempts=1,
        )
    assert isinstance(answer, FinalAnswer), answer
    text = str(answer.content)
    assert text.startswith(f"ref=nats-object://{prefix}_offload/"), text
    # The last 100 characters of the 2 MB result, read back by the model.
    assert text.endswith("x" * 79 + "THE-END-OF-THE-RESULT"), text[-300:]
