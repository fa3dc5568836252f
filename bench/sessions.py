"""Durable sessions: what a reply writes to JetStream and what it costs, next
to the previous design in the same run; what idle recovery costs; what
``sync_interval: always`` costs.

1. **Writes and time per reply against conversation length.** One agent is
   served by a real ``AgentService`` on an embedded server, in a child
   process (``bench/_sessions_replies.py``, which says how): a
   ``ScriptedModel`` answers each request with a thought and one call of a
   local tool, then with a text (4 messages a reply, ~1.5 KB of JSON). For
   each of 10, 100 and 1,000 prior messages, sessions are seeded through the
   service by earlier replies of the same shape (``N // 4`` of them, and a
   reply without a tool call for ``N % 4``), so that the store holds what a
   conversation of that length leaves (the journal's snapshots included),
   then ``--replies`` replies are measured, spread over as many such
   sessions as keep each within 40 % of its length. Counted on the server: the
   session streams' ``last_seq`` (writes stored: appends to the journal,
   lease writes), every write published to their subjects (a plain core
   subscription: data + subject + headers; a snapshot is known by its
   ``Nats-Rollup`` header), and the session's fold (``SessionStore.get``,
   its state as JSON) before and after, whose growth is what the replies
   add. The journal stream's own ``bytes`` is not used: a rollup removes
   what it replaces. Figures per length:

   - ``appends_per_reply``: journal appends (every fact, snapshots
     included); ``facts_per_reply`` says which (the journal's writes as
     ``SessionStore.history`` names them), ``snapshots_per_reply`` the
     rollups; ``lease_writes_per_reply`` (take and release);
   - ``ratio``: bytes written (journal, leases, blobs) over bytes added, in
     the measured window; ``ratio_between_snapshots`` without the snapshots
     written in it; ``ratio_amortized``, the steady state at that length: a
     snapshot of the session (about its fold at that length, ``S``) every
     time the facts since the last one pass ``max(SNAPSHOT_BYTES, M S)``
     (``M``: ``SNAPSHOT_MULTIPLE``), as the store does, i.e.
     ``S * f / max(SNAPSHOT_BYTES, M S)`` bytes
     more a reply for ``f`` bytes of facts a reply (the measured window
     holds a snapshot or none by chance); ``lifetime_ratio``, everything
     written while seeding the sessions from empty over their folds then;
   - ``ms_per_step``: median reply time (request to final answer, from the
     client) over its 2 model steps.

   The previous design (commit ``4557175``: a head rewritten at every write
   plus chunks, three KV buckets) is measured the same way in the same run:
   the commit's ``fleetbus`` is exported (``git archive``) to a temporary
   directory, removed at the end (``--old-tree`` names a checkout instead,
   e.g. ``git worktree add /tmp/bench-old 4557175``), and the same driver
   runs with ``PYTHONPATH`` on it, counting its buckets ``<prefix>_sessions``,
   ``<prefix>_session_chunks`` and ``<prefix>_session_leases`` alike. The
   designs take turns, ``--rounds`` runs each; figures pool the rounds.
2. **Idle recovery with 1,000 sessions.** 1,000 sessions are created and
   released (``idle`` / ``done``) through ``SessionStore``, then 4
   ``AgentService`` replicas of their agent run in one child process
   (``bench/_sessions_child.py``) with the default ``recover_interval``,
   idle for ``--idle`` seconds (the default covers one ``resync_interval``
   of 30 s, the only periodic work that grows with the number of sessions
   held: here, none holds a lease). Reported: the child's CPU as a
   percentage of one core, the consumers on the server (``consumer_count``
   over ``streams_info``) before the services and while they idle, and the
   server's ``subscriptions`` (monitoring endpoint ``/varz``).
3. **``sync_interval: always`` against a flush every 120 s.** The replies of
   (1) at 100 prior messages, in this process, on two servers taking turns
   (``--sync-rounds`` each), median ms a step of each.

Prints one JSON line. Targets (this tree): at most 4 journal appends a reply
besides snapshots, ``ratio_amortized`` at most 3, both flat (largest over
smallest across the lengths at most 1.25); idle recovery under 2 % of a
core; no consumer added.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, Literal

from _ports import free_port
from _sessions_replies import SNAPSHOTS, STEPS, measure

from fleetbus.agents.messages import Msg
from fleetbus.agents.serving.sessions import SNAPSHOT_BYTES, SNAPSHOT_MULTIPLE, Lease, SessionStore
from fleetbus.agents.state import AgentState
from fleetbus.bus import Bus, EmbeddedServer

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
AGENT = "bench"
OLD_COMMIT = "4557175"
"""The last commit of the previous session store (heads and chunks in KV)."""
LENGTHS = (10, 100, 1000)
SYNC_LENGTH = 100
SESSIONS = 1000
REPLICAS = 4
TARGET_APPENDS = 4.0
TARGET_RATIO = 3.0
TARGET_FLAT = 1.25
TARGET_IDLE_CPU_PERCENT = 2.0


# -- writes and time per reply ----------------------------------------------------------


@contextmanager
def old_tree(given: str | None) -> Iterator[Path | None]:
    """A tree holding the previous design's ``fleetbus``: ``given``, or the
    commit exported to a temporary directory (``None`` when git cannot)."""
    if given:
        yield Path(given)
        return
    try:
        archive = subprocess.run(
            ["git", "-C", str(ROOT), "archive", OLD_COMMIT, "fleetbus"],
            capture_output=True,
            check=True,
            timeout=60,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        yield None
        return
    with tempfile.TemporaryDirectory(prefix="bench-old-") as tmp:
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            tar.extractall(tmp, filter="data")
        yield Path(tmp)


def drive(url: str, prefix: str, tree: Path, replies: int) -> dict[str, Any]:
    """One run of the driver in a child process importing ``tree``'s ``fleetbus``."""
    lengths = ",".join(str(n) for n in LENGTHS)
    done = subprocess.run(
        [sys.executable, str(HERE / "_sessions_replies.py"), url, prefix, lengths, str(replies)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(tree)},
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"the driver failed ({done.returncode}):\n{done.stderr[-3000:]}")
    report: dict[str, Any] = json.loads(lines[-1])
    if Path(report["tree"]).resolve() != tree.resolve():
        raise RuntimeError(f"the driver ran {report['tree']}, not {tree}")
    return report


def pooled(runs: list[dict[str, Any]], length: str) -> dict[str, Any]:
    """The rounds of one length, added up (times listed together)."""
    total: dict[str, Any] = {"seconds": [], "replies": 0, "added": 0, "fold_before": 0}
    counters: dict[str, Counter[str]] = {}
    seed = Counter[str]()
    for run in runs:
        figures = run["lengths"][length]
        total["seconds"] += figures["seconds"]
        total["replies"] += figures["replies"]
        total["added"] += figures["fold_after"] - figures["fold_before"]
        total["fold_before"] += figures["fold_before"]
        total["sessions"] = total.get("sessions", 0) + figures["sessions"]
        for what in ("facts", "writes", "bytes", "last_seq", "messages"):
            counters.setdefault(what, Counter()).update(figures[what])
        seed.update(figures["seed"])
        total.setdefault("history", Counter()).update(figures.get("history") or {})
    total.update(counters)
    total["seed"] = seed
    total["rounds"] = len(runs)
    return total


def figures(runs: list[dict[str, Any]], length: str, snapshot_min: int | None) -> dict[str, Any]:
    """The figures of one design at one length, over its rounds."""
    p = pooled(runs, length)
    n = p["replies"]
    writes, stored, written = p["writes"], p["last_seq"], p["bytes"]
    session = [r for r in stored if r != "leases"]
    appends = sum(stored[r] for r in session)
    snapshots = writes.get(SNAPSHOTS, 0)
    total = sum(v for r, v in written.items() if r != SNAPSHOTS)
    added = p["added"]
    between = total - written.get(SNAPSHOTS, 0)
    result: dict[str, Any] = {
        "replies": n,
        "appends_per_reply": round(appends / n, 2),
        "appends_besides_snapshots_per_reply": round((appends - snapshots) / n, 2),
        "snapshots_per_reply": round(snapshots / n, 3),
        "stored_per_reply": {r: round(stored[r] / n, 2) for r in sorted(stored)},
        "removed_per_reply": {
            r: round((stored[r] - p["messages"][r]) / n, 2)
            for r in sorted(stored)
            if stored[r] != p["messages"][r]
        },
        "lease_writes_per_reply": round(stored.get("leases", 0) / n, 2),
        "bytes_written_per_reply": round(total / n),
        "bytes_by_stream_per_reply": {
            r: round(v / n) for r, v in sorted(written.items()) if r != SNAPSHOTS
        },
        "bytes_added_per_reply": round(added / n),
        "ratio": round(total / added, 2),
        "ratio_between_snapshots": round(between / added, 2),
    }
    if snapshot_min is not None:
        # The steady state: a snapshot of the whole session (about its fold)
        # each time the facts since the last pass max(SNAPSHOT_BYTES, M S).
        size = p["fold_before"] / p["sessions"]
        facts = (between - written.get("leases", 0)) / n
        every = max(snapshot_min, SNAPSHOT_MULTIPLE * size) / facts
        result["snapshot_every_replies"] = round(every, 1)
        result["ratio_amortized"] = round((between / n + size / every) / (added / n), 2)
        result["fold_bytes"] = round(size)
        if snapshots:
            result["snapshot_bytes_seen"] = round(written[SNAPSHOTS] / snapshots)
        result["facts_per_reply"] = {k: round(v / n, 3) for k, v in sorted(p["facts"].items()) if v}
        result["history_kinds_per_reply"] = {
            k: round(v / n, 3) if v else v for k, v in sorted(p["history"].items())
        }
    else:
        result["ratio_amortized"] = result["ratio"]  # nothing is rolled up
    seed = p["seed"]
    result["lifetime_ratio"] = round(seed["bytes"] / seed["fold"], 2)
    result["ms_per_step"] = round(statistics.median(p["seconds"]) / STEPS * 1e3, 3)
    result["ms_per_reply"] = round(statistics.median(p["seconds"]) * 1e3, 3)
    return result


def compare(url: str, old: Path | None, replies: int, rounds: int) -> dict[str, Any]:
    """Both designs, taking turns, ``rounds`` runs each."""
    runs: dict[str, list[dict[str, Any]]] = {"new": [], "old": []}
    for n in range(rounds):
        trees = [("new", ROOT)] + ([("old", old)] if old is not None else [])
        for name, tree in trees if n % 2 == 0 else trees[::-1]:
            runs[name].append(drive(url, f"bench{name}{n}", tree, replies))
    report: dict[str, Any] = {}
    for name, done in runs.items():
        if done:
            snapshot_min = done[0]["snapshot_bytes_min"]
            report[name] = {str(n): figures(done, str(n), snapshot_min) for n in LENGTHS}
            report[name]["design"] = done[0]["design"]
    return report


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


def sync_cost(always_url: str, periodic_url: str, replies: int, rounds: int) -> dict[str, Any]:
    """Median ms a step of the replies at :data:`SYNC_LENGTH` prior messages,
    ``rounds`` runs on each server, taking turns."""
    always: list[float] = []
    periodic: list[float] = []
    for n in range(rounds):
        runs = [(always_url, always), (periodic_url, periodic)]
        for url, times in runs if n % 2 == 0 else runs[::-1]:
            report = asyncio.run(measure(url, f"benchsync{n}", [SYNC_LENGTH], replies))
            times += report["lengths"][str(SYNC_LENGTH)]["seconds"]
    always_ms = statistics.median(always) / STEPS * 1e3
    periodic_ms = statistics.median(periodic) / STEPS * 1e3
    return {
        "messages": SYNC_LENGTH,
        "replies": replies,
        "rounds": rounds,
        "always_ms_per_step": round(always_ms, 3),
        "periodic_120s_ms_per_step": round(periodic_ms, 3),
        "ratio": round(always_ms / periodic_ms, 2),
    }


# -- main ------------------------------------------------------------------------------


def per_length(report: dict[str, Any], key: str) -> dict[str, Any]:
    return {str(n): report[str(n)].get(key) for n in LENGTHS}


def flat(values: dict[str, Any]) -> float:
    numbers = [float(v) for v in values.values()]
    return round(max(numbers) / min(numbers), 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--replies", type=int, default=40, help="replies measured a length")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each design")
    parser.add_argument("--old-tree", help=f"a checkout of {OLD_COMMIT} (default: exported)")
    parser.add_argument("--idle", type=float, default=34.0, help="seconds the services idle")
    parser.add_argument("--sync-rounds", type=int, default=3, help="runs per sync setting")
    args = parser.parse_args()
    # SIGTERM (a CI timeout) unwinds like Ctrl-C, so the servers and the
    # children are stopped on the way out.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    started = time.perf_counter()
    monitor_port = free_port()
    with (
        EmbeddedServer(extra_args=["-m", str(monitor_port)]) as always,
        EmbeddedServer(sync_interval=120) as periodic,
    ):
        with old_tree(args.old_tree) as old:
            designs = compare(always.url, old, args.replies, args.rounds)
        sync = sync_cost(always.url, periodic.url, args.replies, args.sync_rounds)
        idle = idle_recovery(always, monitor_port, args.idle)
    new = designs["new"]
    report: dict[str, Any] = {
        "bench": "sessions",
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "replies_per_length": args.replies * args.rounds,
        "snapshot_bytes_min": SNAPSHOT_BYTES,
        "appends_per_reply": per_length(new, "appends_per_reply"),
        "appends_besides_snapshots_per_reply": per_length(
            new, "appends_besides_snapshots_per_reply"
        ),
        "facts_per_reply": per_length(new, "facts_per_reply"),
        "lease_writes_per_reply": per_length(new, "lease_writes_per_reply"),
        "bytes_written_per_reply": per_length(new, "bytes_written_per_reply"),
        "bytes_added_per_reply": per_length(new, "bytes_added_per_reply"),
        "ratio": per_length(new, "ratio"),
        "ratio_between_snapshots": per_length(new, "ratio_between_snapshots"),
        "ratio_amortized": per_length(new, "ratio_amortized"),
        "lifetime_ratio": per_length(new, "lifetime_ratio"),
        "ms_per_step": per_length(new, "ms_per_step"),
    }
    old_figures = designs.get("old")
    if old_figures is not None:
        report["old"] = {
            "commit": OLD_COMMIT,
            "appends_per_reply": per_length(old_figures, "appends_per_reply"),
            "lease_writes_per_reply": per_length(old_figures, "lease_writes_per_reply"),
            "bytes_written_per_reply": per_length(old_figures, "bytes_written_per_reply"),
            "bytes_added_per_reply": per_length(old_figures, "bytes_added_per_reply"),
            "ratio": per_length(old_figures, "ratio"),
            "lifetime_ratio": per_length(old_figures, "lifetime_ratio"),
            "ms_per_step": per_length(old_figures, "ms_per_step"),
        }
        report["new_vs_old"] = {
            str(n): {
                "ms_per_step": round(
                    new[str(n)]["ms_per_step"] / old_figures[str(n)]["ms_per_step"], 2
                ),
                "bytes_written": round(
                    new[str(n)]["bytes_written_per_reply"]
                    / old_figures[str(n)]["bytes_written_per_reply"],
                    3,
                ),
            }
            for n in LENGTHS
        }
    else:
        report["old"] = None  # git could not export the commit
    report["designs"] = designs
    report["idle_recovery"] = idle
    report["idle_recovery_cpu_percent"] = idle["cpu_percent"]
    report["consumers_before"] = idle["consumers_before"]
    report["consumers_after"] = idle["consumers_after"]
    report["sync"] = sync
    report["sync_always_vs_periodic_ms_ratio"] = sync["ratio"]
    appends = per_length(new, "appends_besides_snapshots_per_reply")
    ratios = per_length(new, "ratio_amortized")
    report["targets_met"] = {
        "appends_at_most_4_besides_snapshots": max(appends.values()) <= TARGET_APPENDS,
        "ratio_amortized_at_most_3": max(ratios.values()) <= TARGET_RATIO,
        "appends_flat": flat(appends) <= TARGET_FLAT,
        "ratio_flat": flat(ratios) <= TARGET_FLAT,
        "idle_recovery_under_2pct_core": idle["cpu_percent"] < TARGET_IDLE_CPU_PERCENT,
        "no_consumers_added": idle["consumers_after"] <= idle["consumers_before"],
    }
    report["seconds"] = round(time.perf_counter() - started, 1)
    print(json.dumps(report, separators=(",", ":")))


if __name__ == "__main__":
    main()
