"""A simulation's runtime at scale: N agents served by one host process.

In one run, over one embedded nats-server: a tool worker process serving a
no-op tool, a host process serving N agents (``fleetbus agent
bench._sim_population:population --checkpoints reply``: each reply is one
ReAct step with one call of the tool on the worker), and this process as the
runner. Measured:

- start-up: from starting the host process to every agent answering;
- idle: the host's RSS (per agent, against a host of one agent started the
  same way) and CPU over 10 s, before and after the rounds;
- one round: every agent gets a prompt, runs its step with its remote tool
  call, answers; with at most ``--in-flight`` requests out at once. For each
  round, what the server stored per reply in each of the fleet's streams
  (journal appends, lease writes: ``--checkpoints reply`` writes a session
  when a request is taken and when it is answered — 2 lease writes, and 1
  append, the end, on a released session, 2 on a new one, its ``taken``
  fact too), and the JetStream API requests per reply (reads);
- a broadcast on a topic every agent observes, until it is recorded in the
  session of every agent;
- the floor: the same number of raw nats-py request/replies between this
  process and a trivial responder process, with the same requests in flight;
- the protocol floor: the same rounds served by as many raw nats-py hosts
  (``bench/_raw_host.py``) doing a reply's bus work and nothing else on the
  session layout of journals (take the lease, read the journal when its end
  is not known, append ``taken``, call the tool, append ``end``, answer,
  release), on streams fleetbus made. What is above it is the work of
  fleetbus's host in Python (the agent, its session's records).

With ``--compare-old`` (the default), the previous session design (KV heads
and chunks, commit 4557175: ``--old-commit``) is measured in the same run:
its tree exported with ``git archive`` into a temporary directory, its host
run from there (the runner and the tool worker are this tree's: they only
speak the protocol), on a fleet of its own on the same server. Both hosts
start one after the other; their rounds alternate (new, old, old, new…), so
that both see the same machine. Reported per design: round time (median of
the rounds), ready time, idle RSS per agent; and new/old ratios. The new
design is the work tree's, or ``--new-commit``'s exported the same way (a
tree others edit meanwhile is not measured half-changed).

Every round plays the same sessions: each is one reply longer per round, and
what a reply reads of its session grows with it (``--rounds`` many to see
how). About 2 minutes at 10,000 agents with both designs on 2 cores.

``BENCH_PROFILE=DIR`` runs each design's host under cProfile
(``DIR/<design>.prof``, written when it stops).

Prints one JSON line (``--results FILE`` appends it there too). Targets (2
cores): ready <= 10 s, <= 2 KB per idle agent, idle CPU < 5 % of a core, a
round of 10,000 agents <= 10 s, nothing lost; rounds no slower than the
previous design's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import nats
import orjson
from _sim_designs import ApiTap, Writes, exported

from fleetbus.bus import Bus, EmbeddedServer, key_value
from fleetbus.bus.journal import journal
from fleetbus.protocol import AgentMessage, FinalAnswer, TextBlock, UserRequest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
TICKS = os.sysconf("SC_CLK_TCK")
OLD_COMMIT = "4557175"
CHECKPOINTS = "reply"
EVENTS = "final"

_started = 0


def start(
    command: list[str], env: dict[str, str] | None = None, tree: Path = ROOT
) -> subprocess.Popen[bytes]:
    """Start a process from ``tree`` (its working directory and
    ``PYTHONPATH``); its output goes to ``$BENCH_LOGS/<n>.log`` if set."""
    global _started
    _started += 1
    logs = os.environ.get("BENCH_LOGS")
    out: Any = subprocess.DEVNULL
    if logs:
        Path(logs).mkdir(parents=True, exist_ok=True)
        out = open(Path(logs) / f"{_started}.log", "wb")  # noqa: SIM115 (the child keeps it)
    return subprocess.Popen(
        command,
        cwd=tree,
        env={**os.environ, **(env or {}), "PYTHONPATH": str(tree)},
        stdin=subprocess.DEVNULL,
        stdout=out,
        stderr=subprocess.STDOUT,
    )


def progress(line: str) -> None:
    """A line on stderr (the JSON line is stdout's)."""
    print(f"{time.strftime('%H:%M:%S')} {line}", file=sys.stderr, flush=True)


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


async def idle_cpu(pid: int, seconds: float) -> float:
    """Share of one core the process used over ``seconds``."""
    before = cpu_seconds(pid)
    await asyncio.sleep(seconds)
    return (cpu_seconds(pid) - before) / seconds


@dataclass
class Design:
    """One session design measured: its tree, its fleet, its processes."""

    name: str
    tree: Path
    prefix: str
    commit: str
    bus: Bus | None = None
    worker: subprocess.Popen[bytes] | None = None
    one: subprocess.Popen[bytes] | None = None
    hosts: list[subprocess.Popen[bytes]] = field(default_factory=list)
    figures: dict[str, Any] = field(default_factory=dict)
    rounds: list[dict[str, Any]] = field(default_factory=list)

    @property
    def procs(self) -> list[subprocess.Popen[bytes]]:
        return [p for p in (self.worker, self.one, *self.hosts) if p is not None]

    @property
    def main(self) -> subprocess.Popen[bytes]:
        return self.hosts[0]

    def host(self, url: str, prefix: str, group: str, agents: int) -> subprocess.Popen[bytes]:
        profile = os.environ.get("BENCH_PROFILE")
        python = [sys.executable]
        if profile and group != "one":
            Path(profile).mkdir(parents=True, exist_ok=True)
            python += ["-m", "cProfile", "-o", str(Path(profile) / f"{self.name}.prof")]
        command = [
            *python,
            "-m",
            "fleetbus",
            "agent",
            "bench._sim_population:population",
            "--group",
            group,
            "--topic",
            "all",
            "--checkpoints",
            CHECKPOINTS,
            "--concurrency",
            os.environ.get("BENCH_HOST_CONCURRENCY", "64"),
            "--events",
            EVENTS,
            "--nats",
            url,
            "--prefix",
            prefix,
        ]
        return start(command, env={"SIM_AGENTS": str(agents)}, tree=self.tree)

    async def ask(self, name: str, timeout: float, session: str) -> bool:
        assert self.bus is not None
        answer = await self.bus.request(
            self.bus.subjects.agent_inbox(name),
            UserRequest(sender="runner", session_id=session, content="play"),
            timeout=timeout,
            attempts=1,
        )
        return isinstance(answer, FinalAnswer) and answer.finished_reason == "completed"


async def fan_out(
    send: Callable[[str, float], Awaitable[bool]], names: list[str], in_flight: int, deadline: float
) -> tuple[float, int, int, int]:
    """Send to every name with ``in_flight`` at most; (seconds, answered, errors, late)."""
    pending = iter(names)
    answered = errors = late = 0
    loop = asyncio.get_running_loop()
    end = loop.time() + deadline

    async def worker() -> None:
        nonlocal answered, errors, late
        for name in pending:
            remaining = end - loop.time()
            if remaining <= 0:
                late += 1
                continue
            try:
                ok = await send(name, remaining)
            except (TimeoutError, nats.errors.TimeoutError):
                late += 1
            except Exception:
                errors += 1
            else:
                if ok:
                    answered += 1
                else:
                    errors += 1

    started = time.perf_counter()
    async with asyncio.TaskGroup() as tg:
        for _ in range(min(in_flight, len(names))):
            tg.create_task(worker())
    return time.perf_counter() - started, answered, errors, late


async def protocol_floor(
    url: str, prefix: str, names: list[str], args: argparse.Namespace, server_pid: int
) -> list[tuple[float, float, float]]:
    """The rounds served by raw nats-py hosts doing a reply's bus work only:
    for each round, its seconds, and the hosts' and the server's CPU
    milliseconds per agent."""
    floor = f"{prefix}floor"
    bus = await Bus.connect(url, prefix=floor, name="sim-floor")
    # The journal stream and the lease bucket, as fleetbus's session store
    # opens them.
    journals = await journal(bus, "session")
    await key_value(bus, "session_leases", ttl=24 * 3600.0, expiring_markers=True, republish=True)
    concurrency = os.environ.get("BENCH_HOST_CONCURRENCY", "64")
    command = [sys.executable, str(HERE / "_raw_host.py"), url, floor, f"{prefix}.raw"]
    hosts = [start([*command, concurrency]) for _ in range(args.hosts)]
    try:
        await asyncio.sleep(1.0)  # (started with the interpreter alone: no imports to wait for)
        out = []
        for number in range(1, args.rounds + 1):

            async def play(name: str, timeout: float, number: int = number) -> bool:
                inbox = f"{floor}.agent.{name}.inbox"
                await bus.nc.request(inbox, str(number).encode(), timeout=timeout)
                return True

            before = sum(cpu_seconds(h.pid) for h in hosts)
            server_before = cpu_seconds(server_pid)
            round_s, answered, *_ = await fan_out(play, names, args.in_flight, args.deadline)
            if answered != len(names):
                raise RuntimeError(f"the protocol floor answered {answered} of {len(names)}")
            spent = sum(cpu_seconds(h.pid) for h in hosts) - before
            server = cpu_seconds(server_pid) - server_before
            out.append((round_s, spent * 1000 / len(names), server * 1000 / len(names)))
        return out
    finally:
        for proc in hosts:
            stop(proc)
        js = bus.nc.jetstream()
        for stream in (journals.stream, f"KV_{floor}_session_leases"):
            await js.delete_stream(stream)
        await bus.close()


async def wait_ready(design: Design, url: str, names: list[str], args: argparse.Namespace) -> None:
    """Start the design's host(s); the seconds until the last agent answers."""
    started = time.perf_counter()
    design.hosts = [design.host(url, design.prefix, "bench", len(names)) for _ in range(args.hosts)]
    while True:  # every agent is served once one answers: the host subscribes once
        try:
            if await design.ask(names[-1], 2.0, session="ready"):
                break
        except Exception:
            pass
        if design.main.poll() is not None:
            raise RuntimeError(f"the {design.name} host exited with {design.main.returncode}")
        await asyncio.sleep(0.05)
    design.figures["ready_s"] = round(time.perf_counter() - started, 2)
    progress(f"{design.name} host ready in {design.figures['ready_s']} s")
    # The host of one agent, for the per-agent figure (also answered once).
    one_bus = await Bus.connect(url, prefix=f"{design.prefix}one")
    try:
        while True:
            try:
                answer = await one_bus.request(
                    one_bus.subjects.agent_inbox("sim-00000"),
                    UserRequest(session_id="ready", content="play"),
                    timeout=2.0,
                    attempts=1,
                )
                if isinstance(answer, FinalAnswer):
                    break
            except Exception:
                await asyncio.sleep(0.1)
    finally:
        await one_bus.close()


async def play_round(
    design: Design,
    number: int,
    names: list[str],
    args: argparse.Namespace,
    floor_s: float,
    tap: ApiTap,
    server_pid: int,
) -> None:
    assert design.bus is not None
    assert design.worker is not None
    n = len(names)
    writes = Writes(design.bus.nc, design.prefix)
    worker = design.worker

    def cpu_now() -> dict[str, float]:
        return {
            "hosts": sum(cpu_seconds(h.pid) for h in design.hosts),
            "worker": cpu_seconds(worker.pid),
            "server": cpu_seconds(server_pid),
            "runner": time.process_time(),
        }

    stored, api = await writes.snapshot(), tap.snapshot(design.prefix)
    before = cpu_now()

    async def play(name: str, timeout: float) -> bool:
        return await design.ask(name, timeout, session="game")

    round_s, answered, errors, late = await fan_out(play, names, args.in_flight, args.deadline)
    after = cpu_now()
    progress(f"round {number} of {design.name}: {round_s:.2f} s, {answered} answered")
    await asyncio.sleep(0.2)  # the last requests' copies reach the tap
    design.rounds.append(
        {
            "round": number,
            "s": round(round_s, 2),
            "answered": answered,
            "errors": errors,
            "late": late,
            "agents_per_s": round(n / round_s),
            "vs_floor": round(round_s / floor_s, 1),
            "cpu_ms_per_agent": {k: round((after[k] - before[k]) * 1000 / n, 3) for k in after},
            "stored_per_reply": Writes.per(stored, await writes.snapshot(), n),
            "api_requests_per_reply": ApiTap.per(api, tap.snapshot(design.prefix), n),
        }
    )


async def broadcast(design: Design, names: list[str], deadline: float) -> None:
    """A broadcast, until every agent's session "news" holds it."""
    assert design.bus is not None
    bus = design.bus
    js = bus.nc.jetstream()
    if design.name == "old":  # KV heads
        stream, pattern = f"KV_{design.prefix}_sessions", f"$KV.{design.prefix}_sessions.*.news"
    else:  # journals
        stream, pattern = f"{design.prefix}_session", f"{design.prefix}.session.*.news"
    started = time.perf_counter()
    await bus.publish(
        bus.subjects.topic("all"),
        AgentMessage(
            sender="runner",
            session_id="news",
            content=[TextBlock(text="the market opens")],
            reply=False,
        ),
    )
    reached = 0
    broadcast_s: float | None = None
    limit = time.perf_counter() + deadline
    while time.perf_counter() < limit:
        info = await js.stream_info(stream, subjects_filter=pattern)
        reached = len(info.state.subjects or {})
        if reached >= len(names):
            broadcast_s = time.perf_counter() - started
            break
        await asyncio.sleep(0.2)
    # The session exists from the request taken; wait for the last writes.
    recorded = None
    if broadcast_s is not None:
        for _ in range(100):
            if await _recorded(design, names[-1]):
                recorded = True
                break
            await asyncio.sleep(0.1)
    design.figures.update(
        broadcast_s=round(broadcast_s, 2) if broadcast_s is not None else None,
        broadcast_reached=reached,
        broadcast_recorded=recorded,
    )


async def _recorded(design: Design, agent: str) -> bool:
    """Whether ``agent``'s session "news" holds the broadcast, released."""
    assert design.bus is not None
    if design.name == "old":  # a head: owner cleared, the message in its tail
        kv = await design.bus.nc.jetstream().key_value(f"{design.prefix}_sessions")
        with contextlib.suppress(nats.js.errors.KeyNotFoundError):
            entry = await kv.get(f"{agent}.news")
            head = orjson.loads(entry.value or b"{}")
            return head.get("owner") is None and head.get("tail") not in (None, [])
        return False
    # The journal's last fact: the end of the observation, memory added, released.
    subject = f"{design.prefix}.session.{agent}.news"
    msg = await design.bus.nc.request(
        f"$JS.API.DIRECT.GET.{design.prefix}_session.{subject}", b"", timeout=5.0
    )
    if (msg.headers or {}).get("Status"):
        return False
    fact = orjson.loads(msg.data)
    return fact.get("k") == "end" and fact.get("clear") is True and bool(fact.get("add"))


def _summary(design: Design, n: int) -> dict[str, Any]:
    f = design.figures
    rounds = design.rounds
    return {
        "commit": design.commit,
        "round_s_median": round(statistics.median(r["s"] for r in rounds), 2),
        "round_s_max": max(r["s"] for r in rounds),
        "ready_s": f["ready_s"],
        "idle_rss_per_agent_bytes": round((f["rss"] - f["rss_one"]) * 1024 / max(1, n - 1)),
        "rss_per_agent_after_round_bytes": round(
            (f["rss_after"] - f["rss_one"]) * 1024 / max(1, n - 1)
        ),
        "host_rss_mb": round(f["rss"] / 1024, 1),
        "host_rss_after_round_mb": round(f["rss_after"] / 1024, 1),
        "idle_cpu_core_share": round(f["idle_cpu"], 4),
        "idle_cpu_after_round_core_share": round(f["idle_cpu_after"], 4),
        "lost": sum(r["errors"] + r["late"] for r in rounds),
        "broadcast_s": f.get("broadcast_s"),
        "broadcast_reached": f.get("broadcast_reached"),
        "broadcast_recorded": f.get("broadcast_recorded"),
        "rounds": rounds,
    }


async def measure(
    args: argparse.Namespace, new_tree: Path, old_tree: Path | None
) -> dict[str, Any]:
    n = args.agents
    names = [f"sim-{i:05d}" for i in range(n)]
    sync: float | str = "always" if args.sync == "always" else float(args.sync)
    base = f"sim{uuid.uuid4().hex[:8]}"
    designs = [Design("new", new_tree, f"{base}n", _commit(args.new_commit))]
    if old_tree is not None:
        designs.append(Design("old", old_tree, f"{base}o", _commit(args.old_commit)))
    with EmbeddedServer(sync_interval=sync) as server:  # type: ignore[arg-type]
        url = server.url
        bus = await Bus.connect(url, prefix=base, name="sim-runner")
        raw = start([sys.executable, str(HERE / "_raw_responder.py"), url, f"{base}.raw"])
        procs = [raw]
        try:
            for d in designs:
                d.bus = await Bus.connect(url, prefix=d.prefix, name=f"sim-runner-{d.name}")
                worker = ["-m", "fleetbus", "worker", "bench._noop_tools"]
                d.worker = start([sys.executable, *worker, "--nats", url, "--prefix", d.prefix])
                d.one = d.host(url, f"{d.prefix}one", "one", 1)
            await asyncio.sleep(0.5)
            # The tool workers must be up before the hosts read the tools served.
            for d in designs:
                while True:
                    try:
                        await bus.nc.request(f"{d.prefix}.tool.noop", b"{}", timeout=0.5)
                        break
                    except Exception:
                        await asyncio.sleep(0.1)
            for d in designs:  # one after the other: each starts on a quiet machine
                await wait_ready(d, url, names, args)
            await asyncio.sleep(1.0)
            for d in designs:
                d.figures["idle_cpu"] = await idle_cpu(d.main.pid, args.idle)
                assert d.one is not None
                d.figures["rss"], d.figures["rss_one"] = rss_kb(d.main.pid), rss_kb(d.one.pid)

            async def raw_call(name: str, timeout: float) -> bool:
                await bus.nc.request(f"{base}.raw", b"x" * 200, timeout=timeout)
                return True

            floor_s, *_ = await fan_out(raw_call, names, args.in_flight, args.deadline)
            tap = ApiTap(bus.nc, [d.prefix for d in designs])
            await tap.start()
            for number in range(1, args.rounds + 1):
                # new, old, old, new, new, old…: neither always goes first.
                order = designs if number % 2 else designs[::-1]
                for d in order:
                    await play_round(d, number, names, args, floor_s, tap, server.pid or 0)
            await tap.stop()
            await asyncio.sleep(1.0)
            for d in designs:
                d.figures["rss_after"] = rss_kb(d.main.pid)
                d.figures["idle_cpu_after"] = await idle_cpu(d.main.pid, args.idle)
            if args.broadcast:
                for d in designs:
                    await broadcast(d, names, args.deadline)
                    progress(f"broadcast of {d.name}: {d.figures['broadcast_s']} s")
            protocol = await protocol_floor(url, base, names, args, server.pid or 0)
            progress(f"protocol floor: {', '.join(f'{p[0]:.2f} s' for p in protocol)}")
        finally:
            for d in designs:
                if d.bus is not None:
                    await d.bus.close()
                procs += d.procs
            await bus.close()
            for proc in procs:
                stop(proc)
    floor_rounds = [p[0] for p in protocol]
    for d in designs:
        for entry, floor_round_s in zip(d.rounds, floor_rounds, strict=True):
            entry["vs_protocol_floor"] = round(entry["s"] / floor_round_s, 2)
    summaries = {d.name: _summary(d, n) for d in designs}
    new = summaries["new"]
    stored = [r["stored_per_reply"] for r in new["rounds"]]
    appends = max(s.get("session", 0.0) for s in stored)
    lease_writes = max(s.get("session_leases", 0.0) for s in stored)
    out: dict[str, Any] = {
        "bench": "simulation",
        "agents": n,
        "jetstream_sync": args.sync,
        "in_flight": args.in_flight,
        "hosts": args.hosts,
        "checkpoints": CHECKPOINTS,
        "events": EVENTS,
        "floor_s": round(floor_s, 3),
        "round_s_median": new["round_s_median"],
        "ready_s": new["ready_s"],
        "idle_rss_per_agent_bytes": new["idle_rss_per_agent_bytes"],
        "lost": sum(s["lost"] for s in summaries.values()),
        "checkpoints_reply": {
            "journal_appends_per_reply": appends,
            "lease_writes_per_reply": lease_writes,
            "holds": appends <= 2.0 and lease_writes == 2.0,
        },
        "protocol_floor": {
            "round_s_median": round(statistics.median(floor_rounds), 2),
            "rounds_s": [round(s, 2) for s in floor_rounds],
            "host_cpu_ms_per_agent": [round(p[1], 3) for p in protocol],
            "server_cpu_ms_per_agent": [round(p[2], 3) for p in protocol],
        },
    }
    if "old" in summaries:
        old = summaries["old"]
        out["new_vs_old"] = {
            what: round(new[what] / old[what], 2) if old[what] else None
            for what in ("round_s_median", "ready_s", "idle_rss_per_agent_bytes")
        }
    out["designs"] = summaries
    return out


def _commit(commit: str | None = None) -> str:
    """``commit``'s short hash; without one, the work tree's: its commit,
    marked when its fleetbus sources differ from it."""
    head = subprocess.run(
        ["git", "rev-parse", "--short", commit or "HEAD"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    if commit is not None:
        return head
    changed = subprocess.run(
        ["git", "status", "--porcelain", "--", "fleetbus"], cwd=ROOT, capture_output=True
    ).stdout
    return f"{head}+changes" if changed.strip() else head


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agents", type=int, default=10_000)
    parser.add_argument("--in-flight", type=int, default=2_000)
    parser.add_argument("--deadline", type=float, default=120.0)
    parser.add_argument("--rounds", type=int, default=2, help="rounds played per design")
    parser.add_argument("--hosts", type=int, default=1, help="host processes in the group")
    parser.add_argument("--idle", type=float, default=10.0, help="seconds of idle CPU measured")
    parser.add_argument(
        "--sync",
        default="1",
        help="the server's JetStream fsync: 'always' or seconds (default 1, as `fleetbus sim run`)",
    )
    parser.add_argument(
        "--compare-old",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="measure the previous session design in the same run (default: yes)",
    )
    parser.add_argument("--old-commit", default=OLD_COMMIT, help="the previous design's commit")
    parser.add_argument(
        "--new-commit",
        help="run the new design's host from this commit (exported) rather than the work tree",
    )
    parser.add_argument(
        "--broadcast",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="measure a broadcast to every agent (default: yes)",
    )
    parser.add_argument("--results", type=Path, help="append the JSON line to this file too")
    args = parser.parse_args()
    head = {
        "date": datetime.now(UTC).strftime("%Y-%m-%dT%H:%MZ"),
        "commit": _commit(),
        "load": round(os.getloadavg()[0], 2),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
    }
    with contextlib.ExitStack() as stack:
        old = stack.enter_context(exported(ROOT, args.old_commit)) if args.compare_old else None
        new = stack.enter_context(exported(ROOT, args.new_commit)) if args.new_commit else ROOT
        figures = asyncio.run(measure(args, new, old))
    line = json.dumps({**head, **figures}, separators=(",", ":"))
    print(line, flush=True)
    if args.results is not None:
        with args.results.open("a") as out:
            out.write(line + "\n")


if __name__ == "__main__":
    main()
