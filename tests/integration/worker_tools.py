"""Tools that the worker-process tests serve (``fleetbus worker
tests.integration.worker_tools``).

Each run of ``record`` leaves files in ``$FLEETBUS_TEST_DIR`` so a test can
count, across processes, how many times a call really ran and where.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from fleetbus.tools_workers import Toolkit, tool


def _marks() -> Path:
    path = Path(os.environ["FLEETBUS_TEST_DIR"])
    path.mkdir(parents=True, exist_ok=True)
    return path


@tool
async def record(tag: str, delay: float = 0.0) -> dict[str, object]:
    """Leave a start mark, wait, leave a done mark; return who ran it.

    Args:
        tag: names the marks.
        delay: seconds to wait between the marks.
    """
    marks = _marks()
    pid = os.getpid()
    (marks / f"{tag}.{pid}.start").write_text(str(pid))
    await asyncio.sleep(delay)
    (marks / f"{tag}.{pid}.done").write_text(str(pid))
    return {"tag": tag, "pid": pid}


@tool
def echo(text: str) -> str:
    """Return the text."""
    return text


toolkit = Toolkit([record, echo])
