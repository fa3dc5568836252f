"""What each private path of ``fleetbus/bus/_seam.py`` buys: tool calls with
every path taken against calls with one path (or all) left off
(``FLEETBUS_PRIVATE_OFF``), in the same run.

Each variant runs in a child process of its own (the paths are chosen once
per process, at import) with a worker process of its own, both with the
variant's setting, against one embedded nats-server: throughput of a no-op
tool and of a tool that takes 1 ms with 64 calls in flight, and the p50 of
sequential no-op calls. The variants take turns, ``--rounds`` times, so the
machine's changing load falls on all of them; each figure is the median over
the rounds, and each variant's is also given as a ratio to the variant with
every path taken (throughput: ``taken / variant``, latency: ``variant /
taken``; above 1, the private path is faster).

Prints one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
VARIANTS = {
    "taken": "",
    "all_off": "all",
    "route_off": "route",
    "publish_now_off": "publish_now",
    "headers_off": "headers",
    "places_off": "places",
}


async def child(url: str, prefix: str, calls: int, sequential: int, in_flight: int) -> None:
    from fleetbus.bus import Bus, ToolClient
    from fleetbus.bus._seam import AVAILABLE

    worker = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "fleetbus",
        "worker",
        "bench._seam_tools",
        "--nats",
        url,
        "--prefix",
        prefix,
        "--concurrency",
        str(in_flight),
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
    )
    bus = await Bus.connect(url, prefix=prefix)
    client = ToolClient(bus, attempts=1)
    try:
        deadline = time.monotonic() + 30
        while "one_ms" not in await client.discover(timeout=0.3):
            if time.monotonic() > deadline:
                raise RuntimeError("the worker did not come up")

        async def call(name: str) -> None:
            result = await client.call(name, {})
            if not result.ok:
                raise RuntimeError(f"{name} failed: {result.error_detail}")

        async def rate(name: str) -> float:
            per = calls // in_flight

            async def one() -> None:
                for _ in range(per):
                    await call(name)

            await asyncio.gather(*(one() for _ in range(in_flight)))  # warm
            started = time.perf_counter()
            await asyncio.gather(*(one() for _ in range(in_flight)))
            return per * in_flight / (time.perf_counter() - started)

        latencies = []
        for _ in range(sequential):
            started = time.perf_counter()
            await call("noop")
            latencies.append(time.perf_counter() - started)
        report = {
            "paths": sorted(AVAILABLE),
            "noop_calls_per_s": await rate("noop"),
            "one_ms_calls_per_s": await rate("one_ms"),
            "noop_p50_us": statistics.median(latencies) * 1e6,
        }
    finally:
        await bus.close()
        worker.terminate()
        await worker.wait()
    print(json.dumps(report))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=6400, help="calls per throughput run")
    parser.add_argument("--sequential", type=int, default=1000)
    parser.add_argument("--in-flight", type=int, default=64)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--child", nargs=2, metavar=("URL", "PREFIX"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        url, prefix = args.child
        asyncio.run(child(url, prefix, args.calls, args.sequential, args.in_flight))
        return

    from fleetbus.bus import EmbeddedServer

    variants = args.variants.split(",")
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in variants}
    with EmbeddedServer() as server:
        for round_ in range(args.rounds):
            for name in variants:
                env = {
                    **os.environ,
                    "PYTHONPATH": str(ROOT),
                    "FLEETBUS_PRIVATE_OFF": VARIANTS[name],
                }
                out = subprocess.run(
                    [
                        sys.executable,
                        str(Path(__file__).resolve()),
                        "--calls",
                        str(args.calls),
                        "--sequential",
                        str(args.sequential),
                        "--in-flight",
                        str(args.in_flight),
                        "--child",
                        server.url,
                        f"seam{round_}{name.replace('_', '')}",
                    ],
                    env=env,
                    check=True,
                    capture_output=True,
                    text=True,
                    timeout=300,
                )
                runs[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
    report: dict[str, Any] = {"bench": "seam", "cpus": os.cpu_count(), "rounds": args.rounds}
    for name, results in runs.items():
        report[name] = {
            "paths": results[0]["paths"],
            **{
                key: round(statistics.median(r[key] for r in results), 1)
                for key in ("noop_calls_per_s", "one_ms_calls_per_s", "noop_p50_us")
            },
        }
    taken = report.get("taken")
    if taken is not None:
        for name in variants:
            if name == "taken":
                continue
            figures = report[name]
            figures["ratios"] = {
                "noop_throughput": round(
                    taken["noop_calls_per_s"] / figures["noop_calls_per_s"], 3
                ),
                "one_ms_throughput": round(
                    taken["one_ms_calls_per_s"] / figures["one_ms_calls_per_s"], 3
                ),
                "noop_p50": round(figures["noop_p50_us"] / taken["noop_p50_us"], 3),
            }
    print(json.dumps(report, separators=(",", ":")))


if __name__ == "__main__":
    main()
