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
  tool call makes, through the SDK's provider and batch span processor;
- ``per_call``: whole no-op tool calls, the caller's and the worker's sides
  in one process (``bench/_traced_calls.py``: one call at a time, each under
  a client span), in each mode: ``off`` (no provider), ``header`` (no
  provider, a fixed unsampled ``traceparent`` on every request),
  ``ratio_0`` and ``ratio_0.1`` (an SDK provider with
  ``parentbased_traceidratio`` at 0 and 0.1, exporting through the batch
  processor to an exporter that encodes OTLP and drops it); ``vs_off``, the
  same as ratios. Only the python process is counted (not nats-server).

Needs valgrind (else it says it skipped). Prints one JSON line.
"""

from __future__ import annotations

import json
import os
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


CALL_MODES: dict[str, dict[str, str]] = {
    "off": {"BENCH_TRACE": "off"},
    "header": {"BENCH_TRACE": "header"},
    "ratio_0": {
        "BENCH_TRACE": "on",
        "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
        "OTEL_TRACES_SAMPLER_ARG": "0",
    },
    "ratio_0.1": {
        "BENCH_TRACE": "on",
        "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
        "OTEL_TRACES_SAMPLER_ARG": "0.1",
    },
}


def call_instructions(calls: int, env: dict[str, str]) -> int:
    """Instructions of ``bench/_traced_calls.py`` making ``calls`` calls."""
    valgrind = ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null"]
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "BENCH_"))}
    done = subprocess.run(
        [*valgrind, sys.executable, str(ROOT / "bench" / "_traced_calls.py"), str(calls)],
        cwd=ROOT,
        env={**clean, "PYTHONPATH": str(ROOT), **env},
        capture_output=True,
        text=True,
        check=True,
    )
    match = re.search(r"Collected : (\d+)", done.stderr)
    if match is None:
        raise RuntimeError(done.stderr[-2000:])
    return int(match[1])


def per_call(calls: int, env: dict[str, str]) -> float:
    return (call_instructions(4 * calls, env) - call_instructions(calls, env)) / (3 * calls)


def main() -> None:
    report: dict[str, object] = {"bench": "tracing_instructions"}
    if shutil.which("valgrind") is None:
        report["skipped"] = "valgrind not found"
        print(json.dumps(report, separators=(",", ":")))
        return
    loop = per_iteration(100_000, "empty")
    for what, n in (("off_hooks", 100_000), ("stub_hooks", 100_000), ("span", 2_000)):
        report[what] = round(per_iteration(n, what) - loop)
    calls = {mode: round(per_call(300, env)) for mode, env in CALL_MODES.items()}
    report["per_call"] = calls
    report["vs_off"] = {mode: round(count / calls["off"], 3) for mode, count in calls.items()}
    print(json.dumps(report, separators=(",", ":")))


if __name__ == "__main__":
    main()
