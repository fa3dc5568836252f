"""``fleetbus worker --mcp`` as separate OS processes: an MCP server's tools
(``tests/mcp_server.py`` over stdio) served on the bus and called through
:class:`~fleetbus.bus.ToolClient`."""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from fleetbus.bus import Bus, EmbeddedServer, ToolClient
from fleetbus.cli.main import main
from fleetbus.protocol import ToolResult
from tests.helpers import ROOT, output, running, spawn, stop, wait_for_workers

MCP_SERVER = shlex.join([sys.executable, str(ROOT / "tests" / "mcp_server.py")])
NAMES = {"echo", "count", "fail", "sleep", "whoami", "getenv", "stats", "picture", "util_pid"}


@contextmanager
def mcp_workers(
    url: str, prefix: str, count: int, *extra: str
) -> Iterator[list[subprocess.Popen[bytes]]]:
    """``count`` workers serving the test MCP server's tools (and ``extra`` options)."""
    with running(
        [
            [
                *("worker", "--mcp", MCP_SERVER, "--nats", url, "--prefix", prefix),
                *("--worker-id", f"w{i}", *extra),
            ]
            for i in range(1, count + 1)
        ]
    ) as procs:
        yield procs


async def gone(pid: int, timeout: float) -> bool:
    """Whether process ``pid`` is gone (within ``timeout`` seconds)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        await asyncio.sleep(0.05)
    return False


def pid_of(result: ToolResult) -> int:
    """The MCP server process a ``whoami`` call answered from."""
    assert result.ok, result
    assert isinstance(result.content, str), result
    return int(result.content)


async def test_the_tools_answer_through_a_worker(nats_server: EmbeddedServer, bus: Bus) -> None:
    with mcp_workers(nats_server.url, bus.prefix, 1):
        await wait_for_workers(bus, "echo", 1)
        client = ToolClient(bus, timeout=10)
        echoed = await client.call("echo", {"text": "over the bus"})
        counted = await client.call("count", {"n": 2})
        stats = await client.call("stats", {"values": [2, 4]})
        picture = await client.call("picture", {})
        failed = await client.call("fail", {"message": "no such file"}, attempts=1)
    assert (echoed.status, echoed.content, echoed.sender) == ("success", "over the bus", "w1")
    assert counted.content == "1\n2"
    assert stats.content == {"count": 2, "total": 6.0, "mean": 3.0}
    assert isinstance(picture.content, list)
    assert [block["type"] for block in picture.content] == ["text", "data", "text"]
    assert picture.content[1]["url"].startswith("data:image/png;base64,iVBOR")
    assert failed.status == "error"
    assert failed.error_detail is not None
    assert failed.error_detail.code == "tool_error"
    assert "no such file" in failed.error_detail.message


async def test_discovery_carries_the_mcp_schemas(nats_server: EmbeddedServer, bus: Bus) -> None:
    with mcp_workers(nats_server.url, bus.prefix, 1):
        await wait_for_workers(bus, "echo", 1)
        tools = await ToolClient(bus).discover()
        connection = ["--nats", nats_server.url, "--prefix", bus.prefix]
        listing = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-m", "fleetbus", "tools", "--json", *connection],
            cwd=ROOT,
            capture_output=True,
            timeout=60,
            check=True,
        )
    assert set(tools) == NAMES
    assert tools["echo"].description == "Answer the text it is given."
    assert tools["echo"].parameters == {
        "type": "object",
        "properties": {"text": {"title": "Text", "type": "string"}},
        "required": ["text"],
        "title": "echoArguments",
    }
    printed = json.loads(listing.stdout)
    assert printed["stats"]["parameters"]["properties"]["values"]["type"] == "array"
    assert printed["stats"]["worker_ids"] == ["w1"]


@pytest.mark.slow
async def test_slow_calls_time_out_and_the_next_works(
    nats_server: EmbeddedServer, bus: Bus
) -> None:
    with mcp_workers(nats_server.url, bus.prefix, 1, "--timeout", "1"):
        await wait_for_workers(bus, "sleep", 1)
        client = ToolClient(bus, timeout=10)
        asked = await client.call("sleep", {"seconds": 5}, timeout=0.3, attempts=1)
        by_default = await client.call("sleep", {"seconds": 5}, attempts=1)
        quick = await client.call("sleep", {"seconds": 0.01})
    assert asked.status == "timeout"
    assert asked.error_detail is not None
    assert asked.error_detail.message == "sleep did not finish within 0.3s"
    assert by_default.status == "timeout"
    assert by_default.error_detail is not None
    assert by_default.error_detail.message == "sleep did not finish within 1s"
    assert quick.content == "slept 0.01s"


@pytest.mark.slow
async def test_two_workers_front_two_copies_of_the_server(
    nats_server: EmbeddedServer, bus: Bus
) -> None:
    with mcp_workers(nats_server.url, bus.prefix, 2):
        await wait_for_workers(bus, "whoami", 2)
        client = ToolClient(bus, timeout=10)
        results = await asyncio.gather(*(client.call("whoami", {}) for _ in range(100)))
    by_worker = Counter(r.sender for r in results)
    assert set(by_worker) == {"w1", "w2"}
    assert min(by_worker.values()) >= 15  # a queue group splits randomly
    # Each worker has its own MCP server process, and one session to it.
    servers = {r.sender: {pid_of(s) for s in results if s.sender == r.sender} for r in results}
    assert all(len(pids) == 1 for pids in servers.values())
    assert servers["w1"] != servers["w2"]


@pytest.mark.slow
async def test_a_killed_mcp_server_fails_calls_then_is_started_again(
    nats_server: EmbeddedServer, bus: Bus
) -> None:
    with mcp_workers(nats_server.url, bus.prefix, 1) as procs:
        await wait_for_workers(bus, "whoami", 1)
        client = ToolClient(bus, timeout=10)
        first = pid_of(await client.call("whoami", {}))
        slow = asyncio.create_task(client.call("sleep", {"seconds": 5}, attempts=1))
        await asyncio.sleep(0.5)
        os.kill(first, signal.SIGKILL)
        failed = await asyncio.wait_for(slow, 10)
        second = pid_of(await client.call("whoami", {}))
        assert procs[0].poll() is None
    assert failed.status == "error"
    assert failed.error_detail is not None
    assert failed.error_detail.code == "tool_error"
    assert "(did the server exit?)" in failed.error_detail.message
    assert second != first


@pytest.mark.slow
async def test_a_module_and_several_mcp_servers_in_one_worker(
    nats_server: EmbeddedServer, bus: Bus
) -> None:
    prefixed = f"{MCP_SERVER} --name-prefix b_"
    with mcp_workers(
        nats_server.url, bus.prefix, 1, "fleetbus.tools_workers.builtin", "--mcp", prefixed
    ):
        await wait_for_workers(bus, "b_echo", 1)
        client = ToolClient(bus, timeout=10)
        tools = await client.discover()
        calculated = await client.call("calculator", {"expr": "6 * 7"})
        pids = {pid_of(await client.call(name, {})) for name in ("whoami", "b_whoami")}
    assert {"calculator", "current_time"} <= set(tools)
    assert NAMES | {f"b_{n}" for n in NAMES} <= set(tools)
    assert calculated.content == 42
    assert len(pids) == 2


@pytest.mark.slow
def test_two_tools_of_one_name_stop_the_worker_with_one_line(nats_server: EmbeddedServer) -> None:
    proc = spawn(["worker", "--mcp", MCP_SERVER, "--mcp", MCP_SERVER, "--nats", nats_server.url])
    code = proc.wait(60)
    log = output(proc)
    assert code == 1
    assert "a tool named 'echo' is already in the toolkit" in log
    assert "Traceback" not in log


def test_a_server_that_cannot_start_stops_the_worker_with_one_line(
    nats_server: EmbeddedServer,
) -> None:
    proc = spawn(["worker", "--mcp", "no-such-mcp-server", "--nats", nats_server.url])
    code = proc.wait(60)
    log = output(proc)
    assert code == 1
    assert "cannot connect to the MCP server no-such-mcp-server: no such command" in log
    assert "Traceback" not in log


async def test_sigterm_stops_the_worker_and_its_mcp_server(
    nats_server: EmbeddedServer, bus: Bus
) -> None:
    proc = spawn(["worker", "--mcp", MCP_SERVER, "--nats", nats_server.url, "--prefix", bus.prefix])
    try:
        await wait_for_workers(bus, "whoami", 1)
        server_pid = pid_of(await ToolClient(bus, timeout=10).call("whoami", {}))
        proc.send_signal(signal.SIGTERM)
        code = await asyncio.to_thread(proc.wait, 15)
        log = output(proc)
    finally:
        stop(proc)
    assert code == 0, log
    assert "drained and stopped" in log
    assert await gone(server_pid, 5), f"the MCP server {server_pid} outlived its worker"


def test_without_arguments_or_sdk_the_worker_says_what_is_missing(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert main(["worker"]) == 1
    assert (
        "give the tools to serve: MODULE[:ATTR], --mcp, --mcp-url or --a2a"
        in capsys.readouterr().err
    )
    monkeypatch.setitem(sys.modules, "mcp", None)
    assert main(["worker", "--mcp", MCP_SERVER]) == 1
    err = capsys.readouterr().err
    assert "pip install 'fleetbus[mcp]'" in err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.slow
async def test_mcp_env_passes_the_variables_named(nats_server: EmbeddedServer, bus: Bus) -> None:
    env = {"FLEETBUS_MCP_INHERITED": "inherited", "FLEETBUS_MCP_NOT_NAMED": "kept back"}
    options = ["--mcp-env", "FLEETBUS_MCP_INHERITED", "--mcp-env", "FLEETBUS_MCP_SET=given"]
    args = ["worker", "--mcp", MCP_SERVER, *options, "--nats", nats_server.url]
    with running([[*args, "--prefix", bus.prefix]], env=env):
        await wait_for_workers(bus, "getenv", 1)
        client = ToolClient(bus, timeout=10)
        seen = {
            name: (await client.call("getenv", {"name": name})).content
            for name in ("FLEETBUS_MCP_INHERITED", "FLEETBUS_MCP_SET", "FLEETBUS_MCP_NOT_NAMED")
        }
    assert seen == {
        "FLEETBUS_MCP_INHERITED": "inherited",
        "FLEETBUS_MCP_SET": "given",
        "FLEETBUS_MCP_NOT_NAMED": "",
    }


def test_mcp_env_of_a_variable_not_set_is_refused(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("FLEETBUS_TEST_UNSET", raising=False)
    assert main(["worker", "--mcp", MCP_SERVER, "--mcp-env", "FLEETBUS_TEST_UNSET"]) == 1
    assert "--mcp-env FLEETBUS_TEST_UNSET: no such variable" in capsys.readouterr().err
