"""A caller that names no timeout waits as long as the tool may run: the
timeout the tool declares (its workers say it in their ``$SRV`` discovery
metadata), not the caller's own default, on every path: a
:class:`ToolClient` call, a :class:`RemoteToolProxy` in an agent's toolkit,
and ``fleetbus call``.

The ``slow`` tool declares ``timeout=8`` and sleeps 2 s, four times the
callers' own wait (0.5 s); ``patient``, in the worker process, declares 45
and sleeps 33 s, longer than ``fleetbus call``'s own 30 s.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import AsyncIterator

import orjson
import pytest
from nats.aio.msg import Msg

from fleetbus.bus import Bus, EmbeddedServer, RemoteTool, ToolClient
from fleetbus.protocol import ToolCall, decode
from fleetbus.tools_workers import RemoteToolProxy, Toolkit, ToolWorker, tool
from tests.helpers import ROOT, wait_for_workers, worker_running, workers

SLEEP = 2.0
DECLARED = 8.0
CLIENT_TIMEOUT = 0.5
"""The callers' own wait: far shorter than the tool runs."""


@tool(timeout=DECLARED)
async def slow(tag: str) -> str:
    """Sleep a while, then say the tag.

    Args:
        tag: said back.
    """
    await asyncio.sleep(SLEEP)
    return f"{tag} after {SLEEP:g}s"


@tool(timeout=45.0)
async def patient() -> str:
    """Sleep 33 s (longer than ``fleetbus call``'s own 30 s), then answer."""
    await asyncio.sleep(33.0)
    return "patient done"


patient_tools = Toolkit([patient])


@pytest.fixture
async def slow_worker(bus: Bus) -> AsyncIterator[ToolWorker]:
    async with worker_running(ToolWorker(bus, Toolkit([slow]), worker_id="w-slow")) as worker:
        yield worker


async def test_a_client_waits_the_timeout_the_tool_declares(
    bus: Bus, slow_worker: ToolWorker
) -> None:
    client = ToolClient(bus, timeout=CLIENT_TIMEOUT, attempts=1)
    result = await client.call("slow", {"tag": "client"})
    assert result.status == "success", result
    assert result.content == "client after 2s"
    assert await client.declared_timeout("slow") == DECLARED


async def test_a_discovered_tool_s_timeout_is_known_without_another_discovery(
    bus: Bus, slow_worker: ToolWorker
) -> None:
    client = ToolClient(bus, timeout=CLIENT_TIMEOUT, attempts=1, discovery_timeout=0.01)
    found = await client.discover(timeout=1.0)
    assert found["slow"].timeout == DECLARED
    result = await client.call("slow", {"tag": "known"})
    assert result.status == "success", result


async def test_a_remote_tool_proxy_waits_the_timeout_the_tool_declares(
    bus: Bus, slow_worker: ToolWorker
) -> None:
    # Described by hand (as a program that knows the tool's schema may):
    # no timeout known until the client learns it from the workers.
    remote = RemoteTool(
        name="slow",
        description="sleeps",
        parameters={"type": "object"},
        subject=bus.subjects.tool("slow"),
    )
    client = ToolClient(bus, timeout=CLIENT_TIMEOUT, attempts=1)
    toolkit = Toolkit([RemoteToolProxy(remote, client)])
    outcome = await toolkit.run("slow", {"tag": "proxy"}, call_id="p-1")
    assert outcome.status == "success", outcome
    assert outcome.content == "proxy after 2s"


async def test_an_explicit_timeout_is_still_the_caller_s(bus: Bus, slow_worker: ToolWorker) -> None:
    client = ToolClient(bus, timeout=30.0, attempts=1)
    result = await client.call("slow", {"tag": "short"}, timeout=1.0)
    assert result.status == "timeout", result


async def test_a_tool_nobody_serves_is_learned_once(bus: Bus) -> None:
    client = ToolClient(bus, timeout=CLIENT_TIMEOUT, attempts=1, discovery_timeout=0.2)
    asked = 0

    async def count(_msg: Msg) -> None:
        nonlocal asked
        asked += 1

    sub = await bus.nc.subscribe("$SRV.INFO.fleetbus", cb=count)
    try:
        assert await client.declared_timeout("nobody") is None
        assert await client.declared_timeout("nobody") is None
        await bus.nc.flush()
    finally:
        await sub.unsubscribe()
    assert asked == 1


@pytest.mark.slow
async def test_fleetbus_call_waits_the_timeout_the_tool_declares(
    bus: Bus, nats_server: EmbeddedServer, prefix: str
) -> None:
    url = nats_server.url
    sent: list[ToolCall] = []

    async def seen(msg: Msg) -> None:
        message = decode(msg.data)
        if isinstance(message, ToolCall):
            sent.append(message)

    sub = await bus.nc.subscribe(bus.subjects.tool("patient"), cb=seen)
    spec = "tests.integration.test_declared_timeouts:patient_tools"
    with workers(url, prefix, 1, spec=spec):
        await wait_for_workers(bus, "patient", 1, timeout=60)
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "fleetbus",
            "call",
            "patient",
            "{}",
            "--nats",
            url,
            "--prefix",
            prefix,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        out, _ = await asyncio.wait_for(proc.communicate(), 120)
    await sub.unsubscribe()
    text = out.decode(errors="replace")
    assert proc.returncode == 0, text
    result = orjson.loads(text[text.index("{") :])
    assert result["status"] == "success", text
    assert result["content"] == "patient done"
    # Sent once and waited for: not given up on after 31 s and sent again.
    assert len(sent) == 1, [m.call_id for m in sent]
