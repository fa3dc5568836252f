"""``examples/guess_two_thirds.py`` as people run it, with the offline model:
each agent's guess goes through the calculator on a tool worker process, and
the backgrounds make the guesses differ."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fleetbus.bus import EmbeddedServer
from fleetbus.sim import RunFiles
from tests.helpers import ROOT


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_guess_two_thirds_with_the_offline_model(
    nats_server: EmbeddedServer, prefix: str, tmp_path: Path
) -> None:
    out = tmp_path / "g23"
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEETBUS_")}
    args = ["--agents", "12", "--rounds", "3", "--out", str(out)]
    args += ["--nats", nats_server.url, "--prefix", prefix]
    proc = subprocess.run(
        [sys.executable, "examples/guess_two_thirds.py", *args],
        cwd=ROOT,
        env={**env, "COLUMNS": "200"},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = re.findall(r"│ +(\d) │ +12 │ +([\d.]+) │ +[\d.]+ │ +([\d.]+) │ (p-\d+)", proc.stdout)
    assert [r[0] for r in rows] == ["1", "2", "3"], proc.stdout
    means = [float(r[1]) for r in rows]
    assert 25 < means[0] < 45
    assert means[0] > means[1] > means[2]

    # Every child (server, host, tools) stopped cleanly: none aborted at exit.
    logs = {log.name: log.read_text() for log in (out / "logs").glob("*.log")}
    assert logs
    assert not [name for name, text in logs.items() if "Fatal Python error" in text], logs

    records = list(RunFiles(out).records())
    assert len(records) == 36
    assert all(r["status"] == "ok" for r in records)
    first = [r for r in records if r["round"] == 1]
    for record in first:  # one calculator call: 50 * (2/3)**k plus a hunch of at most 2
        assert record["answer"].startswith("(offline model) calculator: 50.00 * (2/3)**")
        k = record["params"]["k"]
        assert abs(record["value"] - 50 * (2 / 3) ** k) <= 2.005, record
    assert len({r["params"]["k"] for r in first}) > 1
    assert len({r["value"] for r in first}) == 12


def test_a_round_of_a_million_has_the_time_it_takes() -> None:
    """A round of a million agents took 605 s on 2 cores (1,600 answers a
    second): a ten-minute deadline left 30,000 agents unasked. The deadline
    grows with the population; small ones keep ten minutes."""
    from fleetbus.sim import load_simulation

    spec = f"{ROOT / 'examples' / 'guess_two_thirds.py'}:simulation"
    assert load_simulation(spec, agents=10_000).deadline == 600.0
    million = load_simulation(spec, agents=1_000_000)
    assert len(million.population) == 1_000_000
    assert million.deadline >= 1_000_000 / 1_000  # a million at 1,000 answers a second
