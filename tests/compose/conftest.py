"""The tests of tests/compose run docker-compose.yml for real, on a Docker
engine: they build the image and start containers, for minutes. They run only
when asked (``make test-compose`` sets ``FLEETBUS_TEST_COMPOSE=1``), and skip
when no engine or no ``docker compose`` answers."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ASKED = "FLEETBUS_TEST_COMPOSE"
HERE = Path(__file__).parent


def _engine_problem() -> str | None:
    """Why docker-compose.yml cannot be run here, or None."""
    if shutil.which("docker") is None:
        return "no docker command"
    for argv in (["docker", "info"], ["docker", "compose", "version"]):
        try:
            done = subprocess.run(argv, capture_output=True, timeout=60, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"{' '.join(argv)}: {exc}"
        if done.returncode != 0:
            return f"{' '.join(argv)} failed: {done.stderr.decode(errors='replace').strip()}"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    mine = [item for item in items if HERE in item.path.parents]
    if not mine:
        return
    if os.environ.get(ASKED) != "1":
        reason = f"runs containers for minutes: make test-compose ({ASKED}=1)"
    else:
        problem = _engine_problem()
        if problem is None:
            return
        reason = f"no Docker engine with Compose v2 ({problem}): bash scripts/ensure-docker.sh"
    for item in mine:
        item.add_marker(pytest.mark.skip(reason=reason))
