"""What fleetbus's tracing costs in instructions, counted by callgrind
(``valgrind --tool=callgrind``): repeatable on a busy machine, where times
are not. Each figure is the difference between a run of ``N`` iterations
and one of ``4N``, divided by ``3N``, less the empty loop's count.

- ``off_hooks``: what a tool call runs of fleetbus's tracing with no
  provider: the caller's ``tracing.inject(None)`` and the worker's
  ``tracing.enabled()``;
- ``stub_hooks``: the same two calls to functions that return at once (the
  floor: the call sites themselves);
- ``span``: a span with two attributes and one set later, as an agent's
  tool call makes, through the SDK's provider and batch span processor.

Needs valgrind (else it says it skipped). Prints one JSON line.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CHILD = """
import sys
n, what = int(sys.argv[1]), sys.argv[2]
if what == "span":
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(
        InMemorySpanExporter(), max_queue_size=1 << 22, schedule_delay_millis=10**9,
        max_export_batch_size=1 << 22))
    trace.set_tracer_provider(provider)
from fleetbus import tracing
inject, enabled = tracing.inject, tracing.enabled
def stub_inject(headers=None):
    return headers
def stub_enabled():
    return False
attributes = {"fleetbus.tool": "noop", "fleetbus.call_id": "c-1"}
def loop(n):
    if what == "off_hooks":
        for _ in range(n):
            inject(None)
            enabled()
    elif what == "stub_hooks":
        for _ in range(n):
            stub_inject(None)
            stub_enabled()
    elif what == "span":
        for _ in range(n):
            with tracing.span("fleetbus tool call", attributes=attributes) as span:
                span.set_attribute("fleetbus.tool_status", "success")
    else:
        for _ in range(n):
            pass
loop(200)
loop(n)
import os
os._exit(0)
"""


def instructions(n: int, what: str) -> int:
    valgrind = ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null"]
    done = subprocess.run(
        [*valgrind, sys.executable, "-c", CHILD, str(n), what],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    match = re.search(r"Collected : (\d+)", done.stderr)
    if match is None:
        raise RuntimeError(done.stderr[-2000:])
    return int(match[1])


def per_iteration(n: int, what: str) -> float:
    return (instructions(4 * n, what) - instructions(n, what)) / (3 * n)


def main() -> None:
    report: dict[str, object] = {"bench": "tracing_instructions"}
    if shutil.which("valgrind") is None:
        report["skipped"] = "valgrind not found"
        print(json.dumps(report, separators=(",", ":")))
        return
    loop = per_iteration(100_000, "empty")
    for what, n in (("off_hooks", 100_000), ("stub_hooks", 100_000), ("span", 2_000)):
        report[what] = round(per_iteration(n, what) - loop)
    print(json.dumps(report, separators=(",", ":")))


if __name__ == "__main__":
    main()
