"""Agent-loop overhead: fleetbus's ReAct loop against a hand-written loop, in one run.

A scripted model (``fleetbus.testing.ScriptedModel``: no network, no tokens)
calls a no-op tool ``iterations - 1`` times, one call a step, then answers.
Measured: the time of one ``Agent.reply()`` divided by its iterations (model
steps), the median of ``--runs`` replies after ``--warmup`` ones, for

- ``local``: the tool in-process (``Toolkit([noop])``);
- ``remote``: the same tool served by one ``fleetbus worker`` process over an
  embedded nats-server (the toolkit gets it with ``add_remote``);

each next to a hand-written loop doing the bare minimum with the same model
script and the same tool: stream the model's turn to its ``ModelResponse``,
run the tool (``Tool.run`` locally, ``ToolClient.call`` remotely), append to a
plain list of chat messages. Replies of both kinds alternate, so drift on a
shared machine hits both alike. Each event loop (standard asyncio, uvloop) is
measured on its own, the worker running the same loop.

The scripted turns carry their token usage, as real models report it:
without it ``ScriptedModel`` estimates usage from the repr of the whole
history on every call, a model-side cost that grows with the conversation and
would blur the loop's own. Memory grows by two messages an iteration and is
part of the cost: whatever the loop does over the whole conversation each
step makes the figures grow with ``--iterations``. The script calls the same
tool with the same arguments every step, so these agents run without loop
detection (``max_repeated_calls=None``), as the hand-written loop does.

``memory``: the cost of a step against the length of the conversation. One
agent for each of ``--memory-sizes`` (10, 100 and 1,000) prior messages
(earlier replies: a request, a noop call, its result, an answer) replies with
``--memory-iterations`` steps (two noop calls, then the answer; the tool
in-process, loop detection on), the sizes taking turns; before each reply its
memory is cut back to its prior messages, so each reply starts at its size.
The first replies (warm-up) are not measured: an agent works on each message
of its memory once, and the figures are its steady state, as for an agent
that has answered many requests. Measured: the median of reply time /
steps, for each size, and ``ratio_1000_10``, the figure at 1,000 messages
over the one at 10 (the largest size over the smallest): 1 when a step does
not grow with memory. The prior messages are frozen out of the garbage
collector (``gc.freeze``): a larger heap makes full collections slower, which
is not the loop's work.

``fresh``: what a reply costs beyond its steps. A new agent for each
reply, as a host serving a new session makes it (a clone of the agent's
definition with the state a new session starts from,
``definition.clone(state=definition.initial_state())``), answers at once
(``reply_1step``: one model step, no tool call) or after four noop calls
(``reply_5step``: five steps), the tool in-process; the two kinds
alternate, ``--fresh-runs`` replies of each after ``--fresh-warmup`` not
measured, timed from the clone to the answer. ``step_us`` is the ``local``
figure of the same event loop (a step of a long reply), and the fixed cost a
reply is derived from it: ``fixed_from_1step_us`` is ``reply_1step_us``
minus ``step_us``, ``fixed_from_5step_us`` is ``reply_5step_us`` minus 5
times ``step_us``. Both understate it: a step of a long reply makes a tool
call, which the last step of a reply does not, and costs a little more than
a step of a short reply (a longer memory, colder caches), which takes most
from the 5-step figure.

Prints one JSON line. Targets: the remote case under 1 ms an iteration
(median, uvloop when measured); ``ratio_1000_10`` at most 1.5; a fresh
agent's fixed cost a reply under 0.2 ms (both derivations).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import importlib.util
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

# The tool the worker serves too (``fleetbus worker bench._noop_tools``); this
# script runs from bench/, where the module is top-level.
from _noop_tools import noop

from fleetbus.agents import Agent, AgentSettings, Msg
from fleetbus.bus import Bus, EmbeddedServer, ToolClient
from fleetbus.models.model import ModelRequest, ModelResponse
from fleetbus.protocol import ChatMessage, TextBlock, ToolResultBlock, ToolUseBlock, Usage
from fleetbus.testing import ScriptedModel, Turn
from fleetbus.tools_workers import Tool, Toolkit

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SYSTEM_PROMPT = "You call noop until you are done."
PROMPT = "Call noop."
TARGET_REMOTE_US = 1000.0
TARGET_MEMORY_RATIO = 1.5
TARGET_FIXED_US = 200.0

RunTool = Callable[[ToolUseBlock], Awaitable[ToolResultBlock]]


# -- processes ----------------------------------------------------------------------


@contextmanager
def worker_process(
    url: str, prefix: str, loop_kind: str
) -> Iterator[tuple[subprocess.Popen[bytes], IO[bytes]]]:
    """One ``fleetbus worker`` serving the no-op tool; always stopped on exit."""
    cmd = [
        sys.executable,
        "-m",
        "fleetbus",
        "worker",
        "bench._noop_tools",
        "--nats",
        url,
        "--prefix",
        prefix,
    ]
    env = {
        **os.environ,
        "FLEETBUS_UVLOOP": "1" if loop_kind == "uvloop" else "0",
        "PYTHONPATH": str(ROOT),
    }
    with tempfile.TemporaryFile() as output:
        proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=output,
            stderr=subprocess.STDOUT,
        )
        try:
            yield proc, output
        finally:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def tail(output: IO[bytes], limit: int = 2000) -> str:
    output.seek(0)
    return output.read().decode(errors="replace")[-limit:]


async def wait_for_worker(
    client: ToolClient, proc: subprocess.Popen[bytes], output: IO[bytes], timeout: float = 20.0
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the worker exited with {proc.returncode}:\n{tail(output)}")
        tools = await client.discover(timeout=0.3)
        if "noop" in tools:
            return
        await asyncio.sleep(0.05)
    raise RuntimeError(f"the worker did not serve noop within {timeout:g}s:\n{tail(output)}")


# -- the two loops ----------------------------------------------------------------------


def script(iterations: int) -> list[Turn]:
    """``iterations - 1`` single noop calls, then an answer.

    Make a new script for every reply: each call gets a new ``call_id``, as a
    model's calls do (a worker answers a ``call_id`` it has seen from its
    record, without running the tool).
    """
    usage = Usage(input_tokens=100, output_tokens=10)
    turns: list[Turn] = [
        dataclasses.replace(ScriptedModel.call("noop", {}), usage=usage)
        for _ in range(iterations - 1)
    ]
    turns.append(dataclasses.replace(ScriptedModel.text("Done."), usage=usage))
    return turns


async def agent_reply(toolkit: Toolkit, iterations: int) -> float:
    """Seconds of one ``Agent.reply()``; checks it ran every call and answered."""
    model = ScriptedModel(script(iterations))
    agent = Agent(
        "bench",
        SYSTEM_PROMPT,
        model,
        toolkit=toolkit,
        settings=AgentSettings(max_iters=iterations, max_repeated_calls=None),
    )
    started = time.perf_counter()
    final = await agent.reply(PROMPT)
    elapsed = time.perf_counter() - started
    results = [b for m in agent.memory for b in m.tool_results]
    if final.finished_reason != "completed" or len(results) != iterations - 1:
        raise RuntimeError(f"the agent ended {final.finished_reason!r}: {final.content!r}")
    failed = [b.output for b in results if b.state != "success"]
    if failed:
        raise RuntimeError(f"{len(failed)} tool call(s) failed, e.g. {failed[0]!r}")
    return elapsed


async def fresh_reply(definition: Agent, iterations: int) -> float:
    """Seconds of one reply of a new session's agent (a clone of ``definition``
    with a fresh state), from the clone to the answer; checks it ran every
    call and answered."""
    model = ScriptedModel(script(iterations))
    started = time.perf_counter()
    agent = definition.clone(state=definition.initial_state())
    agent.model = model
    final = await agent.reply(PROMPT)
    elapsed = time.perf_counter() - started
    results = [b for m in agent.memory for b in m.tool_results]
    if final.finished_reason != "completed" or len(results) != iterations - 1:
        raise RuntimeError(f"the agent ended {final.finished_reason!r}: {final.content!r}")
    if any(b.state != "success" for b in results):
        raise RuntimeError("a tool call of a fresh agent failed")
    return elapsed


async def hand_loop(model: ScriptedModel, run_tool: RunTool, iterations: int) -> str:
    """The bare minimum of a ReAct loop: model turn, tool, append, repeat."""
    tools = [noop.spec()]
    history = [
        ChatMessage(role="system", content=[TextBlock(text=SYSTEM_PROMPT)]),
        ChatMessage(role="user", content=[TextBlock(text=PROMPT)]),
    ]
    for _ in range(iterations):
        request = ModelRequest(messages=list(history), tools=tools, tool_choice="auto")
        final: ModelResponse | None = None
        async for item in model.stream(request):
            if isinstance(item, ModelResponse):
                final = item
        if final is None:
            raise RuntimeError("the model ended its stream without a response")
        history.append(ChatMessage(role="assistant", content=final.content))
        uses = final.tool_uses
        if not uses:
            return final.text
        for use in uses:
            history.append(ChatMessage(role="tool", content=[await run_tool(use)]))
    raise RuntimeError("the hand-written loop got no answer")


async def hand_reply(run_tool: RunTool, iterations: int) -> float:
    """Seconds of one reply of :func:`hand_loop`."""
    model = ScriptedModel(script(iterations))
    started = time.perf_counter()
    await hand_loop(model, run_tool, iterations)
    return time.perf_counter() - started


def local_tool(tool: Tool) -> RunTool:
    async def run(use: ToolUseBlock) -> ToolResultBlock:
        outcome = await tool.run(use.input, call_id=use.id)
        if outcome.status != "success":
            raise RuntimeError(f"noop failed: {outcome.error_detail}")
        return ToolResultBlock(id=use.id, name=use.name, output=outcome.content)

    return run


def remote_tool(client: ToolClient) -> RunTool:
    async def run(use: ToolUseBlock) -> ToolResultBlock:
        result = await client.call(use.name, use.input, call_id=use.id)
        if not result.ok:
            raise RuntimeError(f"noop failed: {result.error_detail}")
        return ToolResultBlock(id=use.id, name=use.name, output=result.content)

    return run


# -- measuring ----------------------------------------------------------------------


async def compare(
    fleet: Callable[[], Awaitable[float]],
    hand: Callable[[], Awaitable[float]],
    iterations: int,
    runs: int,
    warmup: int,
) -> dict[str, Any]:
    """Median microseconds an iteration of each, replies alternating (AB BA AB…).

    ``ratio`` divides the medians; ``paired_ratio`` is the median of the
    ratios of the two replies of each round, which drift between rounds (a
    shared machine) cancels out of.
    """
    fleet_times: list[float] = []
    hand_times: list[float] = []
    # Once, before the warm-up: a collection right before a timed reply makes
    # it start with cold caches and fresh arenas (+0.3 ms a reply here).
    gc.collect()
    for index in range(warmup + runs):
        if index % 2:
            hand_time, fleet_time = await hand(), await fleet()
        else:
            fleet_time, hand_time = await fleet(), await hand()
        if index >= warmup:
            fleet_times.append(fleet_time / iterations * 1e6)
            hand_times.append(hand_time / iterations * 1e6)
    fleet_us, hand_us = statistics.median(fleet_times), statistics.median(hand_times)
    paired = statistics.median(f / h for f, h in zip(fleet_times, hand_times, strict=True))
    return {
        "fleetbus_us": round(fleet_us, 1),
        "hand_us": round(hand_us, 1),
        "ratio": round(fleet_us / hand_us, 2),
        "paired_ratio": round(paired, 2),
        "fleetbus_overhead_us": round(fleet_us - hand_us, 1),
        "fleetbus_min_max_us": [round(min(fleet_times), 1), round(max(fleet_times), 1)],
        "hand_min_max_us": [round(min(hand_times), 1), round(max(hand_times), 1)],
    }


async def measure_fresh(
    toolkit: Toolkit, step_us: float, args: argparse.Namespace
) -> dict[str, Any]:
    """Median microseconds of a fresh agent's 1-step and 5-step replies, and
    the fixed cost a reply derived with ``step_us`` (see the module docstring)."""
    definition = Agent(
        "bench",
        SYSTEM_PROMPT,
        ScriptedModel(),
        toolkit=toolkit,
        settings=AgentSettings(max_iters=5, max_repeated_calls=None),
    )
    times: dict[int, list[float]] = {1: [], 5: []}
    gc.collect()
    for index in range(args.fresh_warmup + args.fresh_runs):
        for steps in (1, 5) if index % 2 == 0 else (5, 1):
            elapsed = await fresh_reply(definition, steps)
            if index >= args.fresh_warmup:
                times[steps].append(elapsed * 1e6)
    one, five = statistics.median(times[1]), statistics.median(times[5])
    return {
        "reply_1step_us": round(one, 1),
        "reply_5step_us": round(five, 1),
        "step_us": step_us,
        "fixed_from_1step_us": round(one - step_us, 1),
        "fixed_from_5step_us": round(five - 5 * step_us, 1),
        "reply_1step_min_max_us": [round(min(times[1]), 1), round(max(times[1]), 1)],
        "reply_5step_min_max_us": [round(min(times[5]), 1), round(max(times[5]), 1)],
    }


async def measure(
    url: str,
    prefix: str,
    worker: tuple[subprocess.Popen[bytes], IO[bytes]],
    args: argparse.Namespace,
) -> dict[str, Any]:
    iterations, runs, warmup = args.iterations, args.runs, args.warmup
    results: dict[str, Any] = {}
    async with asyncio.timeout(args.deadline):
        local_kit, run_local = Toolkit([noop]), local_tool(noop)
        results["local"] = await compare(
            lambda: agent_reply(local_kit, iterations),
            lambda: hand_reply(run_local, iterations),
            iterations,
            runs,
            warmup,
        )
        results["fresh"] = await measure_fresh(local_kit, results["local"]["fleetbus_us"], args)
        bus = await Bus.connect(url, prefix=prefix)
        try:
            client = ToolClient(bus, timeout=5.0, attempts=1)
            await wait_for_worker(client, *worker)
            remote_kit, run_remote = Toolkit(), remote_tool(client)
            await remote_kit.add_remote(client, ["noop"])
            results["remote"] = await compare(
                lambda: agent_reply(remote_kit, iterations),
                lambda: hand_reply(run_remote, iterations),
                iterations,
                runs,
                warmup,
            )
        finally:
            await bus.close()
    return results


# -- a step against the length of memory ---------------------------------------------


def prior_messages(count: int) -> list[Msg]:
    """``count`` messages of earlier replies: a request, a noop call, its
    result, an answer; a request and an answer to make up the count."""
    messages: list[Msg] = []
    while len(messages) + 4 <= count:
        use = ToolUseBlock(id=f"call_prior_{len(messages)}", name="noop", input={})
        result = ToolResultBlock(id=use.id, name="noop", output=None)
        messages += [
            Msg.text_message("user", PROMPT),
            Msg(role="assistant", name="bench", content=[use]),
            Msg(role="tool", name="noop", content=[result]),
            Msg.text_message("assistant", "Done.", name="bench"),
        ]
    while len(messages) < count:
        if len(messages) % 2 == 0:
            messages.append(Msg.text_message("user", PROMPT))
        else:
            messages.append(Msg.text_message("assistant", "Done.", name="bench"))
    return messages


async def memory_reply(agent: Agent, prior: int, iterations: int) -> float:
    """Seconds of one reply of ``agent`` with its memory cut back to ``prior`` messages."""
    del agent.memory[prior:]
    agent.model = ScriptedModel(script(iterations))
    started = time.perf_counter()
    final = await agent.reply(PROMPT)
    elapsed = time.perf_counter() - started
    results = [b for m in agent.memory[prior:] for b in m.tool_results]
    if final.finished_reason != "completed" or len(results) != iterations - 1:
        raise RuntimeError(f"the agent ended {final.finished_reason!r}: {final.content!r}")
    return elapsed


async def measure_memory(args: argparse.Namespace) -> dict[str, Any]:
    """Median microseconds a step at each memory size (see the module docstring)."""
    sizes, iterations = args.memory_sizes, args.memory_iterations
    toolkit = Toolkit([noop])
    agents: dict[int, Agent] = {}
    for size in sizes:
        agent = Agent(
            "bench",
            SYSTEM_PROMPT,
            ScriptedModel(),
            toolkit=toolkit,
            settings=AgentSettings(max_iters=iterations),
        )
        agent.memory.extend(prior_messages(size))
        agents[size] = agent
    times: dict[int, list[float]] = {size: [] for size in sizes}
    gc.collect()
    gc.freeze()
    try:
        async with asyncio.timeout(args.deadline):
            for index in range(args.warmup + args.runs):
                order = sizes if index % 2 == 0 else sizes[::-1]
                for size in order:
                    elapsed = await memory_reply(agents[size], size, iterations)
                    if index >= args.warmup:
                        times[size].append(elapsed / iterations * 1e6)
    finally:
        gc.unfreeze()
    step_us = {str(size): round(statistics.median(times[size]), 1) for size in sizes}
    smallest, largest = min(sizes), max(sizes)
    ratio = statistics.median(times[largest]) / statistics.median(times[smallest])
    return {
        "iterations": iterations,
        "tool_calls": iterations - 1,
        "step_us": step_us,
        "step_min_max_us": {
            str(size): [round(min(times[size]), 1), round(max(times[size]), 1)] for size in sizes
        },
        f"ratio_{largest}_{smallest}": round(ratio, 2),
    }


async def measure_tracing(args: argparse.Namespace) -> dict[str, Any]:
    """A reply with a local tool, tracing off then on (an OpenTelemetry SDK
    provider with an in-memory exporter behind the SDK's batch span
    processor, as ``fleetbus`` commands install it: a span for the reply, each
    step, each model call and each tool call). Installs the provider for
    good: the last measurement of a run."""
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    kit = Toolkit([noop])
    iterations, runs, warmup = args.iterations, args.runs, args.warmup
    times: dict[str, list[float]] = {"off": [], "on": []}
    exporter = InMemorySpanExporter()
    for mode in ("off", "on"):
        if mode == "on":
            provider = TracerProvider()
            provider.add_span_processor(BatchSpanProcessor(exporter))
            trace.set_tracer_provider(provider)
        gc.collect()
        for index in range(warmup + runs):
            elapsed = await agent_reply(kit, iterations)
            if index >= warmup:
                times[mode].append(elapsed / iterations * 1e6)
    off, on = statistics.median(times["off"]), statistics.median(times["on"])
    trace.get_tracer_provider().force_flush()  # type: ignore[attr-defined]
    return {
        "off_us": round(off, 1),
        "on_us": round(on, 1),
        "on_vs_off": round(on / off, 2),
        "spans_per_reply": len(exporter.get_finished_spans()) // (warmup + runs),
    }


def run_loop(kind: str, coro: Coroutine[Any, Any, dict[str, Any]]) -> dict[str, Any]:
    if kind == "uvloop":
        import uvloop

        return uvloop.run(coro)
    return asyncio.run(coro)


def default_loops() -> str:
    """Both loops, or only asyncio when uvloop is not installed."""
    return "asyncio,uvloop" if importlib.util.find_spec("uvloop") else "asyncio"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--iterations", type=int, default=50, help="model steps a reply")
    parser.add_argument("--runs", type=int, default=21, help="measured replies (median)")
    parser.add_argument("--warmup", type=int, default=3, help="replies not measured")
    parser.add_argument(
        "--loops", default=default_loops(), help="event loops to measure (default: %(default)s)"
    )
    parser.add_argument("--deadline", type=float, default=25.0, help="seconds a loop may take")
    parser.add_argument(
        "--memory-sizes",
        type=lambda text: sorted({int(n) for n in text.split(",")}),
        default=[10, 100, 1000],
        help="prior messages in memory, comma-separated (default: 10,100,1000)",
    )
    parser.add_argument(
        "--memory-iterations", type=int, default=3, help="model steps a reply at each memory size"
    )
    parser.add_argument(
        "--fresh-runs", type=int, default=301, help="measured fresh-agent replies of each kind"
    )
    parser.add_argument(
        "--fresh-warmup", type=int, default=30, help="fresh-agent replies of each kind not measured"
    )
    args = parser.parse_args()
    if args.iterations < 2 or args.runs < 1 or args.warmup < 0:
        parser.error("need --iterations >= 2, --runs >= 1, --warmup >= 0")
    if args.memory_iterations < 2 or len(args.memory_sizes) < 2 or min(args.memory_sizes) < 0:
        parser.error("need --memory-iterations >= 2 and two --memory-sizes or more, >= 0")
    if args.fresh_runs < 1 or args.fresh_warmup < 0:
        parser.error("need --fresh-runs >= 1, --fresh-warmup >= 0")
    # SIGTERM (a CI timeout) unwinds like Ctrl-C, so the worker and the
    # server are stopped on the way out.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    started = time.perf_counter()
    report: dict[str, Any] = {
        "bench": "agent_loop",
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "iterations": args.iterations,
        "tool_calls": args.iterations - 1,
        "runs": args.runs,
        "warmup": args.warmup,
        "unit": "median microseconds per iteration (reply time / iterations)",
        "loops": "each event-loop key: the loop of this process and of the worker",
    }
    kinds = args.loops.split(",")
    with EmbeddedServer() as server:
        for kind in kinds:
            prefix = f"benchloop{kind}"
            with worker_process(server.url, prefix, kind) as worker:
                report[kind] = run_loop(kind, measure(server.url, prefix, worker, args))
    target_loop = "uvloop" if "uvloop" in kinds else kinds[0]
    memory = run_loop(target_loop, measure_memory(args))
    report["memory"] = {"loop": target_loop, **memory}
    memory_ratio = memory[f"ratio_{max(args.memory_sizes)}_{min(args.memory_sizes)}"]
    report["tracing_local"] = {"loop": target_loop, **run_loop(target_loop, measure_tracing(args))}
    report["targets_loop"] = target_loop
    report["targets_met"] = {
        "remote_under_1ms": report[target_loop]["remote"]["fleetbus_us"] < TARGET_REMOTE_US,
        "memory_ratio_at_most_1_5": memory_ratio <= TARGET_MEMORY_RATIO,
        "fresh_fixed_under_0_2ms": max(
            report[target_loop]["fresh"]["fixed_from_1step_us"],
            report[target_loop]["fresh"]["fixed_from_5step_us"],
        )
        < TARGET_FIXED_US,
    }
    report["seconds"] = round(time.perf_counter() - started, 1)
    print(json.dumps(report, separators=(",", ":")))


if __name__ == "__main__":
    main()
