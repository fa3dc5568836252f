"""The tools of an MCP server (``tests/mcp_server.py``, a real subprocess over
stdio) used in-process through :class:`MCPTools`."""

from __future__ import annotations

import asyncio
import base64
import os
import signal
import sys
from collections.abc import AsyncIterator

import pytest

from fleetbus.errors import ConfigError, ToolDefinitionError, ToolError
from fleetbus.protocol import ToolResult
from fleetbus.tools_workers import MCPTool, MCPTools, Toolkit
from tests.helpers import ROOT

SERVER = [sys.executable, str(ROOT / "tests" / "mcp_server.py")]
NAMES = ["echo", "count", "fail", "sleep", "whoami", "getenv", "stats", "picture", "util_pid"]


@pytest.fixture
async def server() -> AsyncIterator[MCPTools]:
    async with MCPTools(SERVER, connect_timeout=20) as opened:
        yield opened


def by_name(server: MCPTools, name: str) -> MCPTool:
    return next(t for t in server.tools if t.name == name)


def pid_of(outcome: ToolResult) -> str:
    """The process id a ``whoami`` call answered."""
    assert isinstance(outcome.content, str), outcome
    assert outcome.content.isdigit(), outcome
    return outcome.content


async def test_every_tool_is_listed_with_its_schema(server: MCPTools) -> None:
    assert [t.name for t in server.tools] == NAMES
    stats = by_name(server, "stats")
    assert stats.mcp_name == "stats"
    assert stats.description == "The count, total and mean of some numbers."
    assert stats.parameters["properties"]["values"] == {
        "items": {"type": "number"},
        "title": "Values",
        "type": "array",
    }
    assert stats.parameters["required"] == ["values"]
    assert stats.spec().parameters == stats.parameters
    # A dot cannot be in a fleetbus tool name; the MCP name is kept for calls.
    assert by_name(server, "util_pid").mcp_name == "util.pid"
    assert {t.group for t in server.tools} == {"mcp"}


async def test_results_become_tool_outputs(server: MCPTools) -> None:
    kit = Toolkit()
    assert kit.add_mcp(server) == [t.name for t in server.tools]
    echoed = await kit.run("echo", {"text": "hello"})
    assert (echoed.status, echoed.content) == ("success", "hello")
    counted = await kit.run("count", {"n": 3})
    assert counted.content == "1\n2\n3"
    stats = await kit.run("stats", {"values": [1, 2, 6]})
    assert stats.content == {"count": 3, "total": 9.0, "mean": 3.0}
    pid = await kit.run("util_pid", {})
    assert pid.content == pid_of(await kit.run("whoami", {}))


async def test_an_image_becomes_a_data_block(server: MCPTools) -> None:
    outcome = await by_name(server, "picture").run({})
    assert outcome.status == "success"
    assert isinstance(outcome.content, list)
    caption, image, resource = outcome.content
    assert caption == {"type": "text", "text": "a red dot"}
    assert image["type"] == "data"
    assert image["media_type"] == "image/png"
    header, _, data = image["url"].partition(",")
    assert header == "data:image/png;base64"
    png = base64.b64decode(data)
    assert png.startswith(b"\x89PNG")
    assert image["size"] == len(png)
    assert resource == {"type": "text", "text": "dot"}


async def test_a_raising_tool_is_an_error_outcome(server: MCPTools) -> None:
    outcome = await by_name(server, "fail").run({"message": "the disk is full"})
    assert outcome.status == "error"
    assert outcome.error_detail is not None
    assert outcome.error_detail.code == "tool_error"
    assert "the disk is full" in outcome.error_detail.message


async def test_bad_parameters_are_error_outcomes(server: MCPTools) -> None:
    not_an_object = await by_name(server, "echo").run(["hello"])
    assert not_an_object.error_detail is not None
    assert not_an_object.error_detail.code == "invalid_parameters"
    wrong_type = await by_name(server, "echo").run({"text": 3})
    assert wrong_type.status == "error"
    assert wrong_type.error_detail is not None
    assert "text" in wrong_type.error_detail.message


async def test_a_slow_call_times_out_and_the_session_goes_on(server: MCPTools) -> None:
    sleep = by_name(server, "sleep")
    outcome = await sleep.run({"seconds": 5}, timeout=0.3)
    assert outcome.status == "timeout"
    assert outcome.error_detail is not None
    assert outcome.error_detail.message == "sleep did not finish within 0.3s"
    assert (await sleep.run({"seconds": 0.01}, timeout=5)).content == "slept 0.01s"
    assert server.connections == 1


async def test_a_tool_timeout_applies_when_the_call_gives_none() -> None:
    async with MCPTools(SERVER, timeout=0.3, connect_timeout=20) as server:
        assert {t.timeout for t in server.tools} == {0.3}
        outcome = await by_name(server, "sleep").run({"seconds": 5})
    assert outcome.status == "timeout"


async def test_a_cancelled_call_is_cancelled_and_the_session_goes_on(server: MCPTools) -> None:
    call = asyncio.create_task(by_name(server, "sleep").run({"seconds": 5}))
    await asyncio.sleep(0.3)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    assert (await by_name(server, "echo").run({"text": "still"})).content == "still"
    assert server.connections == 1


async def test_concurrent_calls_share_one_session(server: MCPTools) -> None:
    echo = by_name(server, "echo")
    outcomes = await asyncio.gather(*(echo.run({"text": str(i)}) for i in range(50)))
    assert [o.content for o in outcomes] == [str(i) for i in range(50)]
    assert server.connections == 1


async def test_a_killed_server_fails_the_call_then_is_started_again(server: MCPTools) -> None:
    whoami = by_name(server, "whoami")
    first = int(pid_of(await whoami.run({})))
    call = asyncio.create_task(by_name(server, "sleep").run({"seconds": 5}))
    await asyncio.sleep(0.3)
    os.kill(first, signal.SIGKILL)
    failed = await asyncio.wait_for(call, 5)
    assert failed.status == "error"
    assert failed.error_detail is not None
    assert "is closed (did the server exit?)" in failed.error_detail.message
    second = int(pid_of(await whoami.run({})))
    assert second != first
    assert server.connections == 2

    # Killed while idle: the next call finds the connection gone, the one after works.
    os.kill(second, signal.SIGKILL)
    await asyncio.sleep(0.3)
    assert (await whoami.run({})).status == "error"
    assert int(pid_of(await whoami.run({}))) not in (first, second)
    assert server.connections == 3


async def test_calls_after_close_fail() -> None:
    async with MCPTools(SERVER, connect_timeout=20) as server:
        echo = by_name(server, "echo")
    outcome = await echo.run({"text": "late"})
    assert outcome.status == "error"
    assert outcome.error_detail is not None
    assert outcome.error_detail.message == f"the MCP server {server.label} is closed"


async def test_a_name_prefix_keeps_two_servers_apart() -> None:
    async with (
        MCPTools(SERVER, connect_timeout=20) as plain,
        MCPTools(SERVER, name_prefix="b_", connect_timeout=20) as prefixed,
    ):
        kit = Toolkit([*plain.tools, *prefixed.tools])
        assert kit.names == NAMES + [f"b_{n}" for n in NAMES]
        assert by_name(prefixed, "b_echo").mcp_name == "echo"
        pids = {pid_of(await kit.run(n, {})) for n in ("whoami", "b_whoami")}
    assert len(pids) == 2


async def test_a_name_prefix_that_cannot_be_a_tool_name_is_refused() -> None:
    with pytest.raises(ToolDefinitionError, match="invalid name for the MCP tool 'echo'"):
        async with MCPTools(SERVER, name_prefix="a.", connect_timeout=20):
            pass


async def test_a_command_that_does_not_exist_cannot_connect() -> None:
    with pytest.raises(ToolError, match="no such command: no-such-mcp-server"):
        async with MCPTools("no-such-mcp-server --flag"):
            pass


async def test_a_server_that_exits_at_once_cannot_connect() -> None:
    with pytest.raises(ToolError, match="it closed the connection"):
        async with MCPTools([sys.executable, "-c", "raise SystemExit(3)"], connect_timeout=20):
            pass


async def test_a_server_that_never_answers_times_out() -> None:
    with pytest.raises(ToolError, match=r"no MCP handshake within 0\.5s"):
        async with MCPTools(
            [sys.executable, "-c", "import time; time.sleep(30)"], connect_timeout=0.5
        ):
            pass


@pytest.mark.parametrize(
    ("args", "kwargs", "message"),
    [
        ((), {}, "command or its URL"),
        (("x",), {"url": "http://h/mcp"}, "command or its URL"),
        (("",), {}, "command is empty"),
        (("a 'b",), {}, "cannot split"),
        ((), {"url": "ftp://h/mcp"}, "starts with http"),
        (("x",), {"timeout": 0}, "timeout: Input should be greater than 0, not 0"),
        (("x",), {"connect_timeout": -1}, "connect_timeout: Input should be greater than 0"),
    ],
)
def test_wrong_arguments_are_config_errors(
    args: tuple[str, ...], kwargs: dict[str, object], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        MCPTools(*args, **kwargs)  # type: ignore[arg-type]


def test_without_the_sdk_it_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "mcp", None)
    with pytest.raises(ConfigError, match=r"pip install 'fleetbus\[mcp\]'"):
        MCPTools(SERVER)
