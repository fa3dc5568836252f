"""A serving process's log lines carry their correlation ids: as JSON lines
with ``--log-format json`` given after the subcommand, ``-v`` before it."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from fleetbus.bus import Bus, EmbeddedServer
from tests.helpers import ROOT, stop, wait_for_workers


async def test_a_worker_logs_json_lines_with_the_request_and_worker_ids(
    nats_server: EmbeddedServer, bus: Bus, tmp_path: Path
) -> None:
    log = tmp_path / "worker.log"
    command = [sys.executable, "-m", "fleetbus", "-v", "worker", "fleetbus.tools_workers.builtin"]
    command += ["--nats", nats_server.url, "--prefix", bus.prefix, "--worker-id", "w-log"]
    command += ["--log-format", "json"]
    with log.open("wb") as out:
        worker = subprocess.Popen(  # noqa: ASYNC220 - started, not waited on
            command,
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=out,
        )
        try:
            await wait_for_workers(bus, "calculator", 1)
            # A tool_call without its tool_name: answered malformed, and logged.
            bad = b'{"type": "tool_call", "version": 1, "call_id": "c-log", "session_id": "s-log"}'
            reply = await bus.nc.request(bus.subjects.tool("calculator"), bad, timeout=5)
            assert b"malformed" in reply.data
            deadline = time.monotonic() + 5
            while b"c-log" not in log.read_bytes() and time.monotonic() < deadline:  # noqa: ASYNC110 - a file, not an event
                await asyncio.sleep(0.05)
        finally:
            stop(worker)
    lines = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    bad_request = [line for line in lines if line.get("call_id") == "c-log"]
    assert bad_request, log.read_text()[-2000:]
    assert bad_request[0]["level"] == "warning"
    assert bad_request[0]["worker"] == "w-log"
    assert any(line["level"] == "info" for line in lines)  # -v before the subcommand
