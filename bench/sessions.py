"""Durable sessions: what a step writes to JetStream, what idle recovery costs,
and what ``sync_interval: always`` costs, in one run.

1. **Bytes and time per step against conversation length.** One session is
   driven through 10, 100 and 1,000 ReAct steps with ``SessionStore`` directly,
   saving the way the reply loop does (``_reply.py``, ``_tool_running.py``):
   the assistant message with one tool call goes into memory and is saved
   (write-ahead), the tool result goes into ``reply.arrived`` and is saved,
   then it moves into memory (its ``call_id`` into ``reply.answered``, kept
   per step) and
   the end of the step is saved: 3 saves a step, each message 300-500 bytes
   of JSON. Every KV and object-store write of the fleet's session buckets
   is counted by a plain core subscription to ``$KV.<bucket>.>`` and
   ``$O.<bucket>.>`` (``len(msg.data)``; headers not counted). Reported over
   the last 10 steps of each run, next to what the previous design wrote: the
   whole state JSON at every save (measured over the same saves, outside the
   timed part). Two series: each run **one reply** (the worst case, a
   ``max_iters`` as long as the conversation), and the same lengths as
   **replies of 10 steps** (the default ``max_iters``; the 10-step run is the
   same in both).
2. **Idle recovery with 1,000 sessions.** 1,000 sessions are created and
   released (``idle`` / ``done``), then 4 ``AgentService`` replicas of their
   agent run in one child process (``bench/_sessions_child.py``) with the
   default ``recover_interval``, idle for ``--idle`` seconds (the default
   covers one ``resync_interval`` of 30 s, the only periodic work that grows
   with the number of sessions). Reported: the child's CPU as a percentage of
   one core, the consumers on the server (``consumer_count`` over
   ``streams_info``) before the services and while they idle, and the
   server's ``subscriptions`` (monitoring endpoint ``/varz``).
3. **``sync_interval: always`` against a flush every 120 s.** The 100-step
   run of (1) on two servers, alternating (``--rounds`` each), median ms a
   step of each.

Prints one JSON line. Targets: bytes a step at 1,000 steps within 2x of
that at 10 steps (each series; the whole state grows ~170x); idle recovery
under 2 % of a core; no consumer added.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Literal

from _ports import free_port

from fleetbus.agents.messages import Msg
from fleetbus.agents.serving.sessions import Lease, SessionStore
from fleetbus.agents.state import AgentState, ReplyState
from fleetbus.bus import Bus, EmbeddedServer
from fleetbus.protocol import TextBlock, ToolResultBlock, ToolUseBlock, new_id

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
AGENT = "bench"
LENGTHS = (10, 100, 1000)
WINDOW = 10
"""Steps at the end of each run the bytes are reported over."""
SESSIONS = 1000
REPLICAS = 4
TARGET_BYTES_RATIO = 2.0
TARGET_IDLE_CPU_PERCENT = 2.0

THOUGHT = (
    "The user wants the quarterly figures for the northern region. The last search "
    "returned the January report only; I will search again for February and March "
    "and then compare the three months before answering."
)
RESULT = (
    "Found 3 documents. 1) 'Northern region, February sales report' (2024-03-04): "
    "revenue 1.92M EUR, up 4.1% on January; 2) 'Northern region, March sales report' "
    "(2024-04-02): revenue 2.07M EUR, up 7.8% on February; 3) 'Q1 summary draft' "
    "(2024-04-10): quarter total 5.83M EUR, margin 18.2%, two open questions on returns."
)


# -- the steps -------------------------------------------------------------------------


def assistant_message(step: int) -> tuple[Msg, ToolUseBlock]:
    """A model turn with a thought and one tool call (about 450 bytes of JSON)."""
    use = ToolUseBlock(
        id=new_id(),
        name="search",
        input={"query": f"northern region sales report, step {step}", "limit": 5},
    )
    return Msg(role="assistant", name=AGENT, content=[TextBlock(text=THOUGHT), use]), use


def tool_message(use: ToolUseBlock) -> Msg:
    """The tool's result (about 500 bytes of JSON)."""
    return Msg(
        role="tool",
        name=use.name,
        content=[ToolResultBlock(id=use.id, name=use.name, output=RESULT)],
    )


def new_reply(state: AgentState, session_id: str) -> None:
    state.memory.append(Msg.text_message("user", "How did the northern region do in Q1?"))
    state.reply = ReplyState(reply_id=new_id(), session_id=session_id)


class WriteCounter:
    """Bytes of every write to the fleet's session buckets, as the server
    forwards them to a plain core subscription."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self.bytes = 0
        self.writes = 0
        self._subs: list[Any] = []

    async def start(self) -> None:
        kv = self.bus.subjects.kv_bucket

        async def count(msg: Any) -> None:
            self.bytes += len(msg.data)
            self.writes += 1

        subjects = [f"$KV.{kv(b)}.>" for b in ("sessions", "session_chunks", "session_leases")]
        subjects.append(f"$O.{kv('session_blobs')}.>")
        for subject in subjects:
            self._subs.append(await self.bus.nc.subscribe(subject, cb=count))
        await self.bus.flush()

    async def settle(self) -> tuple[int, int]:
        """The counts once every write published so far has been delivered."""
        await self.bus.flush()
        await asyncio.sleep(0.02)  # let the subscription callbacks run
        return self.bytes, self.writes

    async def close(self) -> None:
        for sub in self._subs:
            await sub.unsubscribe()


@dataclass
class Window:
    """The figures of the last :data:`WINDOW` steps."""

    bytes: int = 0
    writes: int = 0
    whole_state_bytes: int = 0
    saves: int = 0
    seconds: float = 0.0


async def drive(
    store: SessionStore,
    counter: WriteCounter,
    session_id: str,
    steps: int,
    *,
    reply_steps: int | None = None,
) -> dict[str, Any]:
    """One session through ``steps`` ReAct steps (3 saves each); a new reply
    every ``reply_steps`` steps (one reply for all when ``None``)."""
    lease = await store.acquire(AGENT, session_id, fresh=AgentState(agent_name=AGENT))
    state = lease.record.state
    window = Window()
    total_seconds = 0.0
    run_bytes, run_writes = before = await counter.settle()

    async def save(measure: bool) -> None:
        nonlocal total_seconds
        started = time.perf_counter()
        await store.save(lease, state=state, status="running")
        elapsed = time.perf_counter() - started
        total_seconds += elapsed
        if measure:
            window.seconds += elapsed
            # What the previous design wrote: the whole state, every save.
            window.whole_state_bytes += len(state.model_dump_json().encode())
            window.saves += 1

    for step in range(steps):
        measure = step >= steps - WINDOW
        if measure and step == steps - WINDOW:
            before = await counter.settle()
        if step == 0 or (reply_steps is not None and step % reply_steps == 0):
            new_reply(state, session_id)
        reply = state.reply
        assert reply is not None
        started = time.perf_counter()
        message, use = assistant_message(step)
        state.memory.append(message)
        reply.iteration += 1
        reply.answered.clear()  # as the loop does: kept per step
        total_seconds += time.perf_counter() - started
        await save(measure)  # write-ahead: the call is durable before it is sent
        reply.arrived.append(tool_message(use))
        await save(measure)  # the result, as it arrives
        reply.arrived = []
        state.memory.append(tool_message(use))
        reply.answered.append(use.id)
        await save(measure)  # the end of the step
    after = await counter.settle()
    window.bytes, window.writes = after[0] - before[0], after[1] - before[1]
    head = await store.heads.get_or_none(f"{AGENT}.{session_id}")
    await store.save(lease, state=state, status="idle", release=True)
    return {
        "bytes_per_step": round(window.bytes / WINDOW),
        "writes_per_step": round(window.writes / WINDOW, 1),
        "whole_state_bytes_per_save": round(window.whole_state_bytes / window.saves),
        "whole_state_bytes_per_step": round(window.whole_state_bytes / WINDOW),
        "ms_per_step": round(total_seconds / steps * 1e3, 3),
        "ms_per_step_last": round(window.seconds / WINDOW * 1e3, 3),
        "run_bytes_per_step": round((after[0] - run_bytes) / steps),
        "run_writes": after[1] - run_writes,
        "head_bytes": len(head.value) if head is not None else None,
        "answered_bytes": len(json.dumps(state.reply.answered if state.reply else [])),
        "messages": len(state.memory),
    }


async def conversation_lengths(url: str, prefix: str) -> dict[str, Any]:
    bus = await Bus.connect(url, prefix=prefix, name="bench-sessions")
    counter = WriteCounter(bus)
    try:
        store = await SessionStore.open(bus, owner="bench@steps")
        await counter.start()
        runs = {str(n): await drive(store, counter, f"len{n}", n) for n in LENGTHS}
        short = {str(LENGTHS[0]): runs[str(LENGTHS[0])]}
        for n in LENGTHS[1:]:
            short[str(n)] = await drive(store, counter, f"chat{n}", n, reply_steps=10)
    finally:
        await counter.close()
        await bus.close()
    return {"runs": runs, "replies_of_10": short}


async def step_times(url: str, prefix: str, steps: int, session_id: str) -> float:
    """Milliseconds a step of one ``steps``-long session (no byte counting)."""
    bus = await Bus.connect(url, prefix=prefix, name="bench-sync")
    counter = WriteCounter(bus)  # not started: counts nothing
    try:
        store = await SessionStore.open(bus, owner="bench@sync")
        result = await drive(store, counter, session_id, steps)
    finally:
        await bus.close()
    return float(result["ms_per_step"])


# -- idle recovery -----------------------------------------------------------------------


async def create_sessions(url: str, prefix: str, count: int) -> float:
    """``count`` sessions of :data:`AGENT`, each acquired, saved and released."""
    bus = await Bus.connect(url, prefix=prefix, name="bench-create")
    started = time.perf_counter()
    try:
        store = await SessionStore.open(bus, owner="bench@create")
        limiter = asyncio.Semaphore(32)

        async def one(n: int) -> None:
            async with limiter:
                lease: Lease = await store.acquire(
                    AGENT, f"idle{n}", fresh=AgentState(agent_name=AGENT)
                )
                state = lease.record.state
                state.memory.append(Msg.text_message("user", "Hello."))
                state.memory.append(Msg.text_message("assistant", "Hello! How can I help?"))
                status: Literal["idle", "done"] = "idle" if n % 2 else "done"
                await store.save(lease, state=state, status=status, release=True)

        async with asyncio.TaskGroup() as tg:
            for n in range(count):
                tg.create_task(one(n))
    finally:
        await bus.close()
    return time.perf_counter() - started


async def consumers(url: str) -> int:
    bus = await Bus.connect(url, name="bench-consumers")
    try:
        infos = await bus.nc.jetstream().streams_info()
        return sum(info.state.consumer_count for info in infos)
    finally:
        await bus.close()


def server_subscriptions(monitor_port: int) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{monitor_port}/varz", timeout=5) as answer:
        return int(json.load(answer)["subscriptions"])


def cpu_ticks(pid: int | None) -> int | None:
    """User + system clock ticks of a process (Linux ``/proc``), or ``None``."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[11]) + int(fields[12])


@contextmanager
def child_process(args: list[str]) -> Iterator[subprocess.Popen[str]]:
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "_sessions_child.py"), *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


def read_report(stdout: IO[str]) -> dict[str, Any]:
    """The next JSON line of the child (log lines before it are skipped)."""
    skipped: list[str] = []
    for line in stdout:
        if line.startswith("{"):
            report: dict[str, Any] = json.loads(line)
            return report
        skipped.append(line)
    raise RuntimeError("the idle services exited early:\n" + "".join(skipped[-20:]))


def idle_recovery(server: EmbeddedServer, monitor_port: int, idle: float) -> dict[str, Any]:
    prefix = "benchidle"
    created_s = asyncio.run(create_sessions(server.url, prefix, SESSIONS))
    before = asyncio.run(consumers(server.url))
    subs_before = server_subscriptions(monitor_port)
    args = [server.url, prefix, AGENT, str(REPLICAS), str(idle)]
    with child_process(args) as proc:
        assert proc.stdout is not None
        ready = read_report(proc.stdout)
        server_ticks = cpu_ticks(server.pid)
        server_started = time.monotonic()
        time.sleep(min(5.0, idle / 2))
        during = asyncio.run(consumers(server.url))
        subs_during = server_subscriptions(monitor_port)
        figures = read_report(proc.stdout)
        server_wall = time.monotonic() - server_started
        server_end = cpu_ticks(server.pid)
    server_percent = None
    if server_ticks is not None and server_end is not None:
        tick = os.sysconf("SC_CLK_TCK")
        server_percent = round(100 * (server_end - server_ticks) / tick / server_wall, 2)
    after_stop = asyncio.run(consumers(server.url))
    return {
        "sessions": SESSIONS,
        "replicas": REPLICAS,
        "create_sessions_s": round(created_s, 2),
        "services_startup_s": ready["startup_s"],
        "services_startup_cpu_s": ready["startup_cpu_s"],
        "idle_s": figures["idle_s"],
        "cpu_percent": figures["cpu_percent"],
        "peak_1s_cpu_percent": figures["peak_1s_cpu_percent"],
        "server_cpu_percent": server_percent,
        "consumers_before": before,
        "consumers_after": during,
        "consumers_after_stop": after_stop,
        "subscriptions_before": subs_before,
        "subscriptions_after": subs_during,
    }


# -- sync_interval ---------------------------------------------------------------------


def sync_cost(always_url: str, periodic_url: str, steps: int, rounds: int) -> dict[str, Any]:
    """Median ms a step of ``rounds`` runs on each server, alternating."""
    always: list[float] = []
    periodic: list[float] = []
    for n in range(rounds):
        runs = [(always_url, always), (periodic_url, periodic)]
        for url, times in runs if n % 2 == 0 else runs[::-1]:
            times.append(asyncio.run(step_times(url, "benchsync", steps, f"sync{n}")))
    always_ms, periodic_ms = statistics.median(always), statistics.median(periodic)
    return {
        "steps": steps,
        "rounds": rounds,
        "always_ms_per_step": round(always_ms, 3),
        "periodic_120s_ms_per_step": round(periodic_ms, 3),
        "ratio": round(always_ms / periodic_ms, 2),
    }


# -- main ------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--idle", type=float, default=34.0, help="seconds the services idle")
    parser.add_argument("--rounds", type=int, default=5, help="100-step runs per sync setting")
    args = parser.parse_args()
    # SIGTERM (a CI timeout) unwinds like Ctrl-C, so the servers and the
    # child are stopped on the way out.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    started = time.perf_counter()
    monitor_port = free_port()
    with (
        EmbeddedServer(extra_args=["-m", str(monitor_port)]) as always,
        EmbeddedServer(sync_interval=120) as periodic,
    ):
        lengths = asyncio.run(conversation_lengths(always.url, "benchsteps"))
        sync = sync_cost(always.url, periodic.url, 100, args.rounds)
        idle = idle_recovery(always, monitor_port, args.idle)
    runs: dict[str, dict[str, Any]] = lengths["runs"]
    short: dict[str, dict[str, Any]] = lengths["replies_of_10"]
    first, last = str(LENGTHS[0]), str(LENGTHS[-1])

    def per_length(key: str, series: dict[str, dict[str, Any]] = runs) -> dict[str, Any]:
        return {n: run[key] for n, run in series.items()}

    def ratio(key: str, series: dict[str, dict[str, Any]] = runs) -> float:
        return float(series[last][key] / series[first][key])

    bytes_ratio, short_ratio = ratio("bytes_per_step"), ratio("bytes_per_step", short)
    report: dict[str, Any] = {
        "bench": "sessions",
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "window_steps": WINDOW,
        "bytes_per_step": per_length("bytes_per_step"),
        "bytes_ratio_1000_vs_10": round(bytes_ratio, 2),
        "whole_state_bytes_per_save": per_length("whole_state_bytes_per_save"),
        "whole_state_bytes_per_step": per_length("whole_state_bytes_per_step"),
        "whole_state_ratio_1000_vs_10": round(ratio("whole_state_bytes_per_save"), 1),
        "writes_per_step": per_length("writes_per_step"),
        "run_bytes_per_step": per_length("run_bytes_per_step"),
        "head_bytes_at_end": per_length("head_bytes"),
        "answered_bytes_at_end": per_length("answered_bytes"),
        "ms_per_step": per_length("ms_per_step"),
        "ms_per_step_last": per_length("ms_per_step_last"),
        "ms_ratio_1000_vs_10": round(ratio("ms_per_step"), 2),
        "replies_of_10_steps": {
            "bytes_per_step": per_length("bytes_per_step", short),
            "bytes_ratio_1000_vs_10": round(short_ratio, 2),
            "run_bytes_per_step": per_length("run_bytes_per_step", short),
            "head_bytes_at_end": per_length("head_bytes", short),
            "whole_state_bytes_per_save": per_length("whole_state_bytes_per_save", short),
            "ms_per_step": per_length("ms_per_step", short),
            "ms_ratio_1000_vs_10": round(ratio("ms_per_step", short), 2),
        },
        "idle_recovery": idle,
        "idle_recovery_cpu_percent": idle["cpu_percent"],
        "consumers_before": idle["consumers_before"],
        "consumers_after": idle["consumers_after"],
        "sync": sync,
        "sync_always_vs_periodic_ms_ratio": sync["ratio"],
    }
    report["targets_met"] = {
        "bytes_per_step_1000_within_2x_of_10_one_reply": bytes_ratio <= TARGET_BYTES_RATIO,
        "bytes_per_step_1000_within_2x_of_10_replies_of_10": short_ratio <= TARGET_BYTES_RATIO,
        "idle_recovery_under_2pct_core": idle["cpu_percent"] < TARGET_IDLE_CPU_PERCENT,
        "no_consumers_added": idle["consumers_after"] <= idle["consumers_before"],
    }
    report["seconds"] = round(time.perf_counter() - started, 1)
    print(json.dumps(report, separators=(",", ":")))


if __name__ == "__main__":
    main()
