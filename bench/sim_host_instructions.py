"""A population host's instructions per reply, counted by callgrind
(``valgrind --tool=callgrind``): repeatable on a busy machine, where times
are not.

One embedded nats-server, one tool worker (``bench._noop_tools``), and a
host of ``bench._sim_population`` (each reply: one step calling the ``noop``
tool on the worker, then the answer; a new session, as in a simulation's
first round) run under callgrind. The runner asks ``N`` agents, 64 in
flight, then stops the host; the same again with ``4N``. The figure is the
difference divided by ``3N``: start-up and shutdown cancel out. Only the
host is counted. ``--tree DIR`` runs the host from another tree (a
``git archive`` of another commit, to compare two in one run);
``--profile FILE`` keeps callgrind's profile of the ``4N`` run.

Needs valgrind (else it says it skipped). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from _results import emit

from fleetbus.bus import Bus, EmbeddedServer
from fleetbus.protocol import FinalAnswer, UserRequest

ROOT = Path(__file__).resolve().parent.parent


def _spawn(
    command: list[str], tree: Path, env: dict[str, str], err: Any = subprocess.DEVNULL
) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        command, cwd=tree, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err
    )


async def _count(url: str, n: int, tree: Path, out: str = "/dev/null") -> int:
    """The host's instructions over serving ``n`` new sessions, start and stop
    included (``out``: where callgrind writes its profile)."""
    prefix = f"ic{uuid.uuid4().hex[:8]}"
    env = {**os.environ, "PYTHONPATH": str(tree), "SIM_AGENTS": str(n)}
    worker = _spawn(
        [sys.executable, "-m", "fleetbus", "worker", "bench._noop_tools", "--nats", url,
         "--prefix", prefix],
        ROOT, {**env, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    log = tempfile.TemporaryFile()  # noqa: SIM115 (callgrind writes its summary there; closed below)
    bus = await Bus.connect(url, prefix=prefix, name="ic-runner")
    host = None
    try:
        while True:  # the worker serves before the host reads the tools served
            try:
                await bus.nc.request(f"{prefix}.tool.noop", b"{}", timeout=0.5)
                break
            except Exception:
                await asyncio.sleep(0.2)
        host = _spawn(
            ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", sys.executable,
             "-m", "fleetbus", "agent", "bench._sim_population:population", "--checkpoints",
             "reply", "--events", "final", "--nats", url, "--prefix", prefix],
            tree, env, log,
        )  # fmt: skip
        names = [f"sim-{i:05d}" for i in range(n)]

        async def ask(name: str, timeout: float) -> None:
            answer = await bus.request(
                bus.subjects.agent_inbox(name),
                UserRequest(sender="runner", session_id="game", content="play"),
                timeout=timeout,
                attempts=1,
            )
            if not isinstance(answer, FinalAnswer) or answer.finished_reason != "completed":
                raise RuntimeError(f"{name} answered {answer!r}")

        while True:  # ready: the last agent answers (its session is the warm-up's)
            try:
                await bus.request(
                    bus.subjects.agent_inbox(names[-1]),
                    UserRequest(sender="runner", session_id="ready", content="play"),
                    timeout=10.0,
                    attempts=1,
                )
                break
            except Exception:
                if host.poll() is not None:
                    raise RuntimeError(f"the host exited with {host.returncode}") from None
        pending = iter(names)

        async def worker_task() -> None:
            for name in pending:
                await ask(name, 600.0)

        async with asyncio.TaskGroup() as tg:
            for _ in range(64):
                tg.create_task(worker_task())
        host.send_signal(signal.SIGTERM)
        await asyncio.to_thread(host.wait, 600)
        log.seek(0)
        err = log.read().decode(errors="replace")
        match = re.search(r"Collected : (\d+)", err)
        if match is None:
            raise RuntimeError(err[-2000:])
        return int(match[1])
    finally:
        if host is not None and host.poll() is None:
            host.kill()
        worker.terminate()
        worker.wait()
        log.close()
        await bus.close()


async def measure(n: int, tree: Path, profile: Path | None) -> dict[str, float]:
    with EmbeddedServer() as server:
        small = await _count(server.url, n, tree)
        out = str(profile) if profile is not None else "/dev/null"
        large = await _count(server.url, 4 * n, tree, out)
    return {"instructions_per_reply": round((large - small) / (3 * n))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replies", type=int, default=200, help="N (the runs serve N and 4N)")
    parser.add_argument("--tree", type=Path, default=ROOT, help="the tree the host runs from")
    parser.add_argument(
        "--profile",
        type=Path,
        help="write callgrind's profile of the 4N run here (callgrind_annotate reads it)",
    )
    parser.add_argument("--results", type=Path, help="append the JSON line to this file too")
    args = parser.parse_args()
    line: dict[str, object] = {
        "date": datetime.now(UTC).strftime("%Y-%m-%dT%H:%MZ"),
        "bench": "sim_host_instructions",
        "python": platform.python_version(),
        "replies": args.replies,
    }
    if shutil.which("valgrind") is None:
        line["skipped"] = "valgrind not found"
    else:
        line.update(asyncio.run(measure(args.replies, args.tree.resolve(), args.profile)))
    emit(line, args.results)


if __name__ == "__main__":
    main()
