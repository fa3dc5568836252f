"""A population host's instructions per reply, counted by callgrind
(``valgrind --tool=callgrind``): repeatable on a busy machine, where times
are not.

One embedded nats-server, one tool worker (``bench._noop_tools``), and a
host of ``bench._sim_population`` (each reply: one step calling the ``noop``
tool on the worker, then the answer; a new session, as in a simulation's
first round) run under callgrind. The runner asks ``N`` agents, 64 in
flight, then stops the host; the same again with ``4N``. The figure is the
difference divided by ``3N``: start-up and shutdown cancel out. Only the
host is counted. ``--rounds R`` asks every agent R times (its session one
reply longer each round, as in a simulation's later rounds), the counters
dumped after each round (``callgrind_control --dump``): one figure a round.
``--tree DIR`` runs the host from another tree (a ``git archive`` of
another commit, to compare two in one run); ``--profile DIR`` keeps
callgrind's profiles of the ``4N`` run there (one file a round).

Needs valgrind (else it says it skipped). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Awaitable, Callable, Iterator
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


async def _count(url: str, n: int, tree: Path, rounds: int, out: Path) -> list[int]:
    """The host's instructions in each of ``rounds`` rounds of ``n`` agents
    (the first from start-up on, the last until it stopped; ``out``: the
    directory callgrind writes its profiles to)."""
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
            ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out / 'callgrind.out'}",
             sys.executable,
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
        for number in range(rounds):
            pending = iter(names)
            async with asyncio.TaskGroup() as tg:
                for _ in range(64):
                    tg.create_task(_asking(pending, ask))
            if number < rounds - 1:  # the round's counters, to a file of their own
                dump = ["callgrind_control", "--dump", str(host.pid)]
                await asyncio.to_thread(subprocess.run, dump, check=True, capture_output=True)
                # Written once the host next runs (a timer wakes it): the
                # next round starts after, or its first replies would count
                # in this one.
                await _written(out / f"callgrind.out.{number + 1}", host)
        host.send_signal(signal.SIGTERM)
        await asyncio.to_thread(host.wait, 600)
        log.seek(0)
        err = log.read().decode(errors="replace")
        counts = _totals(out)
        if len(counts) != rounds:
            raise RuntimeError(f"{len(counts)} profiles for {rounds} rounds: {err[-2000:]}")
        return counts
    finally:
        if host is not None and host.poll() is None:
            host.kill()
        worker.terminate()
        worker.wait()
        log.close()
        await bus.close()


async def _written(path: Path, host: subprocess.Popen[bytes]) -> None:
    """Wait until callgrind has written the dump ``path`` whole."""

    def whole() -> bool:
        return path.exists() and re.search(r"^totals: ", path.read_text(), re.MULTILINE) is not None

    for _ in range(1200):
        if await asyncio.to_thread(whole):
            return
        if host.poll() is not None:
            raise RuntimeError(f"the host exited with {host.returncode} before its dump")
        await asyncio.sleep(0.1)
    raise RuntimeError(f"callgrind wrote no {path.name} in 120 s")


async def _asking(pending: Iterator[str], ask: Callable[[str, float], Awaitable[None]]) -> None:
    for name in pending:
        await ask(name, 600.0)


def _totals(out: Path) -> list[int]:
    """The instructions of each profile callgrind wrote to ``out``, in the
    order written: a dump's file is numbered ``.1``, ``.2``…; the one written
    at exit has no number (the last)."""

    def order(path: Path) -> float:
        suffix = path.name.rpartition(".")[2]
        return int(suffix) if suffix.isdigit() else math.inf

    counts = []
    for path in sorted(out.glob("callgrind.out*"), key=order):
        match = re.search(r"^(?:totals|summary): (\d+)", path.read_text(), re.MULTILINE)
        if match is None:
            raise RuntimeError(f"{path} holds no totals")
        counts.append(int(match[1]))
    return counts


async def measure(n: int, rounds: int, tree: Path, profile: Path | None) -> dict[str, Any]:
    with EmbeddedServer() as server, tempfile.TemporaryDirectory() as tmp:
        (small_dir := Path(tmp, "small")).mkdir()
        small = await _count(server.url, n, tree, rounds, small_dir)
        large_dir = profile or Path(tmp, "large")
        large_dir.mkdir(parents=True, exist_ok=True)
        for stale in large_dir.glob("callgrind.out*"):
            stale.unlink()
        large = await _count(server.url, 4 * n, tree, rounds, large_dir)
    per_round = [round((b - a) / (3 * n)) for a, b in zip(small, large, strict=True)]
    return {"instructions_per_reply": per_round[0], "instructions_per_reply_by_round": per_round}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replies", type=int, default=200, help="N (the runs serve N and 4N)")
    parser.add_argument("--rounds", type=int, default=1, help="replies asked of each agent")
    parser.add_argument("--tree", type=Path, default=ROOT, help="the tree the host runs from")
    parser.add_argument(
        "--profile",
        type=Path,
        help="keep callgrind's profiles of the 4N run in this directory (callgrind_annotate "
        "reads them)",
    )
    parser.add_argument("--results", type=Path, help="append the JSON line to this file too")
    args = parser.parse_args()
    line: dict[str, object] = {
        "date": datetime.now(UTC).strftime("%Y-%m-%dT%H:%MZ"),
        "bench": "sim_host_instructions",
        "python": platform.python_version(),
        "replies": args.replies,
        "rounds": args.rounds,
    }
    if shutil.which("valgrind") is None:
        line["skipped"] = "valgrind not found"
    else:
        if args.rounds < 1:
            parser.error("--rounds must be at least 1")
        line.update(
            asyncio.run(measure(args.replies, args.rounds, args.tree.resolve(), args.profile))
        )
    emit(line, args.results)


if __name__ == "__main__":
    main()
