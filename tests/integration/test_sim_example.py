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
