"""``fleetbus resume``: a reply paused for a tool run outside the agent is
resumed with the command ``fleetbus ask`` prints, as people run it."""

from __future__ import annotations

import json
import re
import shlex

import pytest

from fleetbus.bus import Bus, EmbeddedServer
from tests.helpers import spawn, stop
from tests.integration.test_fleet_cli import Output, run_cli

pytestmark = pytest.mark.slow

SPEC = "tests.integration.resume_specs:desk"


def _command(out: str, verb: str) -> str:
    found = re.search(rf"^\s*{verb}:\s+(fleetbus resume \S+ .+)$", out, re.M)
    assert found, out
    return found.group(1)


async def test_a_reply_paused_for_an_external_tool_resumes_with_the_printed_command(
    nats_server: EmbeddedServer, bus: Bus
) -> None:
    on_bus = ("--nats", nats_server.url, "--prefix", bus.prefix)
    proc = spawn(["agent", SPEC, *on_bus, "--lease-ttl", "1", "--no-remote-tools"])
    try:
        await Output(proc).wait_for("serving desk")

        code, out = await run_cli(
            "ask", "desk", 'tool lookup {"query": "rows"}', *on_bus, "--session", "x1"
        )
        assert code == 0, out
        assert "⏸ paused (session x1)" in out
        assert "1 tool call(s) to run outside the agent" in out
        result = _command(out, "result")
        *printed, placeholder = shlex.split(result)
        assert printed[:5] == ["fleetbus", "resume", "x1", "--result", "t0"], result
        assert placeholder == "JSON"
        assert _command(out, "failed") == "fleetbus resume x1 --error t0 MESSAGE"

        code, out = await run_cli("sessions", "desk", *on_bus, "--json")
        assert code == 0, out
        ((pending,),) = [s["pending"] for s in json.loads(out)]
        assert (pending["call_id"], pending["kind"]) == ("t0", "external")

        # The command as printed, its JSON placeholder filled in.
        code, out = await run_cli(*printed[1:], json.dumps({"rows": 3}), *on_bus)
        assert code == 0, out
        assert '← lookup: success — {"rows": 3}' in out
        assert "done lookup={'rows': 3} from" in out
        assert "✓ completed (session x1)" in out

        # Nothing waits any more: said, and the exit code says so.
        code, out = await run_cli(*printed[1:], "4", *on_bus)
        assert code == 1, out
        assert "Nothing is waiting for an external result" in out

        code, out = await run_cli(*printed[1:], "rows: 3", *on_bus)
        assert code == 1, out
        assert "the result is not JSON" in out
        assert "'\"rows: 3\"'" in out
    finally:
        stop(proc)


async def test_a_failed_external_call_reaches_the_model_as_a_tool_error(
    nats_server: EmbeddedServer, bus: Bus
) -> None:
    on_bus = ("--nats", nats_server.url, "--prefix", bus.prefix)
    proc = spawn(["agent", SPEC, *on_bus, "--lease-ttl", "1", "--no-remote-tools"])
    try:
        await Output(proc).wait_for("serving desk")
        code, out = await run_cli(
            "ask", "desk", 'tool lookup {"query": "rows"}', *on_bus, "--session", "x2"
        )
        assert code == 0, out
        failed = shlex.split(_command(out, "failed"))
        code, out = await run_cli(*failed[1:-1], "the disk is full", *on_bus)
        assert code == 0, out
        assert "lookup: error" in out, out
        assert "the disk is full" in out
        assert "✓ completed (session x2)" in out
    finally:
        stop(proc)
