"""MCP over streamable HTTP: ``tests/mcp_server.py --http PORT`` (a real
server process on a free port) used in-process through :class:`MCPTools`,
and served on the bus by ``fleetbus worker --mcp-url``."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from fleetbus.bus import Bus, EmbeddedServer, ToolClient
from fleetbus.errors import ToolError
from fleetbus.tools_workers import MCPTools, Toolkit
from tests.helpers import ROOT, free_port, running, wait_for_workers


def start_http_server(port: int) -> subprocess.Popen[bytes]:
    """The test MCP server on ``port``, once it accepts connections."""
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "tests" / "mcp_server.py"), "--http", str(port)],
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
        except OSError:
            if proc.poll() is not None:
                raise AssertionError(f"the MCP HTTP server exited with {proc.returncode}") from None
            time.sleep(0.05)
        else:
            return proc
    proc.kill()
    proc.wait()
    raise AssertionError(f"the MCP HTTP server does not listen on {port} after 30s")


def end(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def mcp_url() -> Iterator[str]:
    """The endpoint of one MCP HTTP server for the module's tests."""
    port = free_port()
    proc = start_http_server(port)
    try:
        yield f"http://127.0.0.1:{port}/mcp"
    finally:
        end(proc)


async def test_the_tools_answer_over_http(mcp_url: str) -> None:
    async with MCPTools(url=mcp_url, connect_timeout=20) as server:
        kit = Toolkit(server.tools)
        assert server.label == mcp_url
        assert "util_pid" in kit.names
        assert kit.get("echo").parameters["required"] == ["text"]
        echoed = await kit.run("echo", {"text": "over http"})
        stats = await kit.run("stats", {"values": [1, 3]})
        failed = await kit.run("fail", {"message": "refused"})
        slow = await kit.run("sleep", {"seconds": 5}, timeout=0.3)
        after = await kit.run("echo", {"text": "after the timeout"})
    assert echoed.content == "over http"
    assert stats.content == {"count": 2, "total": 4.0, "mean": 2.0}
    assert failed.status == "error"
    assert failed.error_detail is not None
    assert "refused" in failed.error_detail.message
    assert slow.status == "timeout"
    assert after.content == "after the timeout"


async def test_a_restarted_http_server_fails_a_call_then_is_reached_again() -> None:
    port = free_port()
    proc = start_http_server(port)
    first_pid = proc.pid
    try:
        async with MCPTools(url=f"http://127.0.0.1:{port}/mcp", connect_timeout=20) as server:
            whoami = next(t for t in server.tools if t.name == "whoami")
            before = await whoami.run({})
            end(proc)
            failed = await whoami.run({}, timeout=10)
            proc = start_http_server(port)
            after = await whoami.run({}, timeout=10)
    finally:
        end(proc)
    assert before.content == str(first_pid)
    assert failed.status == "error"
    assert failed.error_detail is not None
    assert "is closed (did the server exit?)" in failed.error_detail.message
    assert after.content == str(proc.pid)
    assert server.connections == 2


async def test_a_url_nobody_serves_cannot_connect() -> None:
    url = f"http://127.0.0.1:{free_port()}/mcp"
    with pytest.raises(ToolError, match=f"cannot connect to the MCP server {url}: ConnectError"):
        async with MCPTools(url=url, connect_timeout=5):
            pass


async def test_a_worker_serves_the_tools_of_a_url(
    nats_server: EmbeddedServer, bus: Bus, mcp_url: str
) -> None:
    args = ["worker", "--mcp-url", mcp_url, "--nats", nats_server.url, "--prefix", bus.prefix]
    with running([[*args, "--worker-id", "h1"]]):
        await wait_for_workers(bus, "stats", 1)
        client = ToolClient(bus, timeout=10)
        tools = await client.discover()
        stats = await client.call("stats", {"values": [5]})
        slow = await client.call("sleep", {"seconds": 5}, timeout=0.3, attempts=1)
    assert tools["stats"].parameters["properties"]["values"]["type"] == "array"
    assert tools["stats"].worker_ids == ("h1",)
    assert (stats.sender, stats.content) == ("h1", {"count": 1, "total": 5.0, "mean": 5.0})
    assert slow.status == "timeout"
