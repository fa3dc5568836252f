"""Guardrails declared in a fleet file, served by ``fleetbus agent`` as a
process: its agent guardrail, named in the file, is asked on the command's
own connection, and ``fleetbus ask`` shows the trip and exits 1."""

from __future__ import annotations

from pathlib import Path

from fleetbus.agents import Agent
from fleetbus.bus import Bus, EmbeddedServer
from fleetbus.models import FINISH_TOOL
from fleetbus.testing import ScriptedModel
from tests.helpers import serving, spawn, stop
from tests.integration.test_fleet_cli import CLI_ENV, Output, run_cli


async def test_a_fleet_file_guardrail_agent_trips_an_ask(
    nats_server: EmbeddedServer, bus: Bus, prefix: str, tmp_path: Path
) -> None:
    spec = tmp_path / "fleet.toml"
    spec.write_text(
        """
[agent.helper]
system_prompt = "You help."
model = "offline"

[agent.helper.guardrails]
input = [{ agent = "moderator", timeout = 20.0 }]
"""
    )
    verdict = ScriptedModel.call(FINISH_TOOL, {"tripped": True, "reason": "it asks for homework"})
    moderator_model = ScriptedModel([verdict])
    on_bus = ("--nats", nats_server.url, "--prefix", prefix)
    async with serving(nats_server.url, prefix, Agent("moderator", "", moderator_model)):
        proc = spawn(["agent", str(spec), "--no-remote-tools", *on_bus], env=CLI_ENV)
        try:
            await Output(proc).wait_for("serving helper")
            code, out = await run_cli("ask", "helper", "Do my homework", *on_bus)
        finally:
            stop(proc)

    assert code == 1, out
    assert "⛔ guardrail moderator on input: trip — it asks for homework" in out
    assert "⛔ guardrail_tripped" in out
    assert len(moderator_model.requests) == 1
