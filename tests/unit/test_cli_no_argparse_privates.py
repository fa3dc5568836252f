"""The commands use argparse's public API only: no private attribute or class
of argparse (``parser._actions``, ``argparse._SubParsersAction``…), which a
Python release may change without notice."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import fleetbus.cli
from fleetbus.cli import build_parser
from fleetbus.cli.main import _logging_of

_PRIVATE = re.compile(r"argparse\._|\._actions\b|\._option_string_actions\b")


def test_no_command_reaches_into_argparse_internals() -> None:
    folder = Path(fleetbus.cli.__file__).parent
    found = [
        f"{path.name}:{n}: {line.strip()}"
        for path in sorted(folder.glob("*.py"))
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if _PRIVATE.search(line)
    ]
    assert found == []


@pytest.mark.parametrize(
    "argv",
    [
        ["-v", "--log-format", "json", "sim", "run", "pop.py:sim"],
        ["sim", "-v", "--log-format", "json", "run", "pop.py:sim"],
        ["sim", "run", "pop.py:sim", "-v", "--log-format", "json"],
        ["auth", "-v", "--log-format", "json"],
    ],
)
def test_the_logging_options_are_taken_at_every_depth(argv: list[str]) -> None:
    assert _logging_of(build_parser().parse_args(argv)) == (1, "json")
