"""Start-up of many agents from a factory: ``fleetbus agent
bench._factory_agents:agents``, whose ``agents()`` returns N agents (a
list, the documented SPEC form), each with a model of its own and the tools
served on the bus (one tool worker serving a no-op tool).

Measured from starting the process: ``serving_s``, until it prints its
``serving`` line; ``answer_s``, until the last agent of the list answers a
request. Bounded: the run fails after ``--deadline`` seconds. With
``--group G`` the agents are served in a host group (a constant number of
wildcard subscriptions) instead of each on its own subjects.

Prints one JSON line. Target (2 cores): 10,000 agents ready (answering)
in <= 10 s, as a population is (``bench/simulation.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from fleetbus.bus import Bus, EmbeddedServer
from fleetbus.protocol import FinalAnswer, UserRequest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def start(command: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        command,
        cwd=ROOT,
        env={**os.environ, **(env or {}), "PYTHONPATH": str(ROOT)},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


async def serving_line(proc: subprocess.Popen[bytes], started: float, out: list[str]) -> float:
    """Seconds from ``started`` until ``proc`` prints its ``serving`` line."""
    assert proc.stdout is not None
    loop = asyncio.get_running_loop()
    while True:
        line = (await loop.run_in_executor(None, proc.stdout.readline)).decode(errors="replace")
        if not line:
            raise RuntimeError(f"the agent process exited: {''.join(out)[-2000:]}")
        out.append(line)
        if line.startswith("serving "):
            return time.perf_counter() - started


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    n = args.agents
    last = f"fac-{n - 1:05d}"
    with EmbeddedServer() as server:
        url = server.url
        prefix = f"fac{uuid.uuid4().hex[:8]}"
        bus = await Bus.connect(url, prefix=prefix, name="factory-bench")
        fleet = [sys.executable, "-m", "fleetbus"]
        where = ["--nats", url, "--prefix", prefix]
        worker = start([*fleet, "worker", "bench._noop_tools", *where])
        procs = [worker]
        group = ["--group", args.group] if args.group else []
        try:
            # The tool worker is up before the agents look for tools.
            async with asyncio.timeout(args.deadline):
                while True:
                    try:
                        await bus.nc.request(f"{prefix}.tool.noop", b"{}", timeout=0.5)
                        break
                    except Exception:
                        if worker.poll() is not None:
                            raise RuntimeError("the tool worker exited") from None
                        await asyncio.sleep(0.1)
            started = time.perf_counter()
            host = start(
                [*fleet, "agent", "bench._factory_agents:agents", *where, *group],
                env={"FACTORY_AGENTS": str(n)},
            )
            procs.append(host)
            out: list[str] = []
            async with asyncio.timeout(args.deadline):
                serving_s = await serving_line(host, started, out)
                while True:
                    try:
                        answer = await bus.request(
                            bus.subjects.agent_inbox(last),
                            UserRequest(sender="bench", session_id="ready", content="here?"),
                            timeout=2.0,
                            attempts=1,
                        )
                    except Exception:
                        await asyncio.sleep(0.05)
                        continue
                    if isinstance(answer, FinalAnswer):
                        break
                answer_s = time.perf_counter() - started
        finally:
            await bus.close()
            for proc in procs:
                stop(proc)
    return {
        "bench": "agent_factory",
        "agents": n,
        "group": args.group,
        "serving_s": round(serving_s, 2),
        "answer_s": round(answer_s, 2),
        "agents_per_s": round(n / answer_s),
        "answer": str(answer.content),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agents", type=int, default=10_000)
    parser.add_argument("--deadline", type=float, default=120.0, help="seconds the run may take")
    parser.add_argument("--group", help="serve the agents in this host group (default: none)")
    args = parser.parse_args()
    print(json.dumps(asyncio.run(measure(args))), flush=True)


if __name__ == "__main__":
    main()
