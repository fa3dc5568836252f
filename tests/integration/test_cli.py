"""The ``fleetbus`` commands, run as people run them: as processes."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import time

import pytest

from fleetbus.bus import Bus, EmbeddedServer
from fleetbus.cli import build_parser
from tests.helpers import output, spawn, wait_for_workers, workers

COMMANDS = ["server", "worker", "tools", "call", "schema", "demo"]


def run_cli(*args: str, timeout: float = 60) -> tuple[int, str]:
    proc = spawn(list(args), env={"FLEETBUS_CONNECT_TIMEOUT": "1"})
    try:
        code = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise
    return code, output(proc)


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_help(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args([command, "--help"])
    assert exited.value.code == 0
    assert "usage: fleetbus" in capsys.readouterr().out


async def test_call_and_tools_against_workers(nats_server: EmbeddedServer, bus: Bus) -> None:
    with workers(nats_server.url, bus.prefix, 2, spec="fleetbus.tools_workers.builtin"):
        await wait_for_workers(bus, "calculator", 2)
        code, out = run_cli(
            "call",
            "calculator",
            '{"expr": "2026 - 1991"}',
            "--nats",
            nats_server.url,
            "--prefix",
            bus.prefix,
        )
        assert code == 0, out
        result = json.loads(out)
        assert (result["type"], result["status"], result["content"]) == (
            "tool_result",
            "success",
            35,
        )

        code, out = run_cli(
            "call",
            "calculator",
            '{"expr": "__import__(\\"os\\")"}',
            "--nats",
            nats_server.url,
            "--prefix",
            bus.prefix,
        )
        assert code == 1
        assert json.loads(out)["error_detail"]["code"] == "tool_error"

        # (a generous discovery window: a worker busy elsewhere answers late)
        code, out = run_cli(
            "tools", "--json", "--wait", "3", "--nats", nats_server.url, "--prefix", bus.prefix
        )
        assert code == 0, out
        listed = json.loads(out)
        assert listed["calculator"]["workers"] == 2
        assert {"calculator", "current_time", "read_file", "write_file", "list_dir"} <= set(listed)

        code, out = run_cli(
            "tools", "--wait", "3", "--nats", nats_server.url, "--prefix", bus.prefix
        )
        assert code == 0
        assert re.search(r"calculator\s*│\s*2", out), out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["call", "calculator", "{not json"], "parameters are not JSON"),
        (["call", "calculator", "[1]"], "parameters must be a JSON object"),
        (["call", "calculator", "{}", "--nats", "nats://127.0.0.1:1"], "cannot connect to NATS"),
        (["call", "no such", "{}", "--nats", "{url}"], "invalid tool name"),
    ],
)
def test_mistakes_get_one_clear_line(
    nats_server: EmbeddedServer, args: list[str], message: str
) -> None:
    code, out = run_cli(*[a.replace("{url}", nats_server.url) for a in args])
    assert code == 1
    assert message in out
    assert "Traceback" not in out
    assert len(out.strip().splitlines()) <= 2, out


def test_calling_a_tool_nobody_serves(nats_server: EmbeddedServer) -> None:
    code, out = run_cli("call", "ghost", "{}", "--nats", nats_server.url, "--prefix", "nobody")
    assert code == 1
    assert out.startswith("error: no worker serves the tool 'ghost' with prefix 'nobody'; ")
    assert "no responders on nobody.tool.ghost after 3 attempt(s)" in " ".join(out.split())


def test_server_runs_in_the_foreground_until_sigterm() -> None:
    proc = spawn(["server", "--port", "0"])
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 20
        line = ""
        while time.monotonic() < deadline and "listening on" not in line:
            line = proc.stdout.readline().decode()
        assert re.search(r"listening on nats://127\.0\.0\.1:\d+", line), line
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "nats-server stopped" in output(proc)


def test_the_demo_runs_and_leaves_nothing_running() -> None:
    code, out = run_cli("demo", "--calls", "300", timeout=120)
    assert code == 0, out
    assert "demo-worker-1" in out
    assert "demo-worker-2" in out
    assert re.search(r"failures\s+0", out), out
    assert "exit codes [0, 0]" in out
    # The fleet part: tools used, a broadcast observed, a confirmation granted.
    assert "calculator: 2026 - 1991 = 35" in out
    assert "recorded it in session 'demo': True" in out
    assert "paused (session demo)" in out
    assert "wrote notes/demo.md" in out
    assert "agent stopped (exit code 0)" in out
    pids = [int(p) for p in re.findall(r"pids (\d+), (\d+)", out)[0]]
    for pid in pids:
        assert not _alive(pid), f"worker {pid} still running"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


async def test_js_replicas_chooses_the_copies_of_the_session_buckets(
    nats_server: EmbeddedServer, bus: Bus
) -> None:
    """``--js-replicas`` wins over the default: 1 works on a single server; 3
    is refused there in one clear line, no traceback."""
    code, text = run_cli(
        "sessions", "--nats", nats_server.url, "--prefix", bus.prefix, "--js-replicas", "1"
    )
    assert code == 0, text
    code, text = run_cli(
        "sessions", "--nats", nats_server.url, "--prefix", f"{bus.prefix}x", "--js-replicas", "3"
    )
    assert code == 1
    assert "replica" in text
    assert "Traceback" not in text
