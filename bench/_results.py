"""A benchmark's JSON line: its head (when, which commit, how loaded the
machine was), printed, and appended to a results file when given."""

from __future__ import annotations

import json
import os
import platform
import subprocess
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def commit(ref: str | None = None, *, watched: tuple[str, ...] = ("fleetbus",)) -> str:
    """``ref``'s short hash; without one, the work tree's: its commit, marked
    ``+changes`` when the ``watched`` paths differ from it."""
    short = subprocess.run(
        ["git", "rev-parse", "--short", ref or "HEAD"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    if ref is not None:
        return short
    changed = subprocess.run(
        ["git", "status", "--porcelain", "--", *watched], cwd=ROOT, capture_output=True
    ).stdout
    return f"{short}+changes" if changed.strip() else short


def head(**fields: Any) -> dict[str, Any]:
    """The first fields of a results line: date, commit, load, cpus, python,
    then ``fields``."""
    return {
        "date": datetime.now(UTC).strftime("%Y-%m-%dT%H:%MZ"),
        "commit": commit(),
        "load": round(os.getloadavg()[0], 2),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        **fields,
    }


def emit(line: dict[str, Any], results: Path | None) -> None:
    """Print ``line`` as one compact JSON line; append it to ``results`` too."""
    text = json.dumps(line, separators=(",", ":"))
    print(text, flush=True)
    if results is not None:
        with results.open("a") as out:
            out.write(text + "\n")
