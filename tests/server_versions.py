"""nats-server releases other than the installed one, for the tests of the
supported range: where ``scripts/test-server-versions.sh`` keeps them, and
which ones the tests use. No test fetches anything: one whose release is not
cached is skipped, and says how to fetch it."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from fleetbus.bus import find_server_binary

CACHE = Path(os.environ.get("FLEETBUS_NATS_CACHE") or Path.home() / ".cache" / "fleetbus-nats")
"""Where the releases are kept: ``<CACHE>/<version>/nats-server``."""

REFUSED = "2.10.26"
"""A release older than the minimum, which fleetbus refuses: the last of 2.10,
which takes a stream update asking for per-message TTLs and drops it."""


def cached_server(version: str) -> Path:
    """The cached ``nats-server`` of release ``version``; the test is skipped
    when it is not there."""
    binary = CACHE / version / "nats-server"
    if not (binary.is_file() and os.access(binary, os.X_OK)):
        pytest.skip(
            f"nats-server {version} is not in {CACHE}: `scripts/test-server-versions.sh fetch` "
            "fetches it (tests fetch nothing)"
        )
    return binary


def binary_version(binary: Path | None = None) -> str:
    """The release a ``nats-server`` binary says it is (``2.15.1``); the one
    fleetbus finds by default."""
    run = subprocess.run(
        [str(binary or find_server_binary()), "--version"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    # "nats-server: v2.15.1"
    return run.stdout.strip().rpartition(" ")[2].removeprefix("v")
