"""A simulation's runtime at scale: N agents served by host processes.

In one run, over one embedded nats-server started as ``fleetbus sim run``
starts its own (JetStream flushed as ``--sync`` says, once a second by
default; a quarter of the cores: ``fleetbus.sim.processes.server_threads``)
or, with ``--cluster 3``, three nats-servers with routes on this machine:
a tool worker process serving a no-op tool, ``--hosts`` host processes in
one group serving N agents (``fleetbus agent
bench._sim_population:population --checkpoints reply``:
each reply is one ReAct step with one call of the tool on the worker), and
this process as the runner. Measured:

- start-up: from starting the host processes to every agent answering;
- idle: the main host's RSS (per agent, against a host of one agent started
  the same way) and CPU over ``--idle`` s, before and after the rounds;
- memory: the RSS of every process of the run (each host, the tool worker,
  each nats-server, the runner) and their total, at ready and after the
  rounds, and its peak while the rounds run (sampled every second: the peak
  of each process, and the peak of the sum of one sample) — ``rss_mb``; the
  host of one agent and the raw responder are instruments, not counted;
- one round: every agent gets a prompt, runs its step with its remote tool
  call, answers; with at most ``--in-flight`` requests out at once. For each
  round: its seconds, the CPU per reply of each process and of all of them
  (``cpu_ms_per_answer_total``: hosts, worker, server(s), runner), the answer
  rate in each tenth of the round (answers counted by completion time; the
  first tenth holds the ramp-up of the first ``--in-flight`` requests, the
  last the drain of the last ones) and the first tenth's rate over the
  last's; what the server stored per reply in each of the fleet's streams
  (journal appends, lease writes: ``--checkpoints reply`` writes a session
  when a request is taken and when it is answered — 2 lease writes, and 1
  append, the end, on a released session, 2 on a new one, its ``taken``
  fact too), and the JetStream API requests per reply (reads);
- against a smaller round (``--compare-agents``, 10,000 by default when
  ``--agents`` is larger): before each round, the first 10,000 agents play a
  round of their own (their own session, as long as the big round's), with
  the same requests in flight; ``vs_10k`` is the big round's time over the
  small one's (linear: ``--agents`` / 10,000), ``rate_vs_10k`` its answers a
  second over the small one's (linear: 1);
- disk, after the rounds: the bytes the JetStream store of each server
  takes (``du``), and each fleet stream's messages and bytes (stream info),
  copies and leader;
- a broadcast on a topic every agent observes, until it is recorded in the
  session of every agent;
- the floor: the same number of raw nats-py request/replies between this
  process and a trivial responder process, with the same requests in flight
  (requests and answers the size of a round's request and of a tool result);
- the protocol floor: the same rounds served by as many raw nats-py hosts
  (``bench/_raw_host.py``) doing a reply's bus work and nothing else on the
  session layout of journals (take the lease, read the journal when its end
  is not known, append ``taken``, call the tool, append ``end``, answer,
  release: messages of the sizes fleetbus sends, the ``end`` a snapshot
  rolling the journal up as fleetbus's does), on streams fleetbus made; its
  CPU per reply (its hosts, the server(s), the raw responder serving its
  tool calls and the runner: the fleet's four) and its JetStream API
  requests per reply, counted by the same tap as the fleet's rounds (a copy
  of every API request reaches this process: both pay for it). What is
  above it is the work of fleetbus's host in Python (the agent, its
  session's records) and of fleetbus's client in the runner. It
  runs after the fleet, on a server the fleet's processes and streams are
  gone from, so that no marker of the fleet's released leases expires
  beside it; its streams are removed after it. A released lease's marker
  expires 5 s after the release, and the server's expiry of one costs
  about what a write does: a round that starts within 5 s of the one
  before plays through the expiry of some of that round's markers. The
  floor's round N (N > 1) is placed so that the same share of its round
  N - 1's markers expires while it runs as of the fleet's (its length
  taken to be its round N - 1's): ``protocol_floor.marker_expiry_share``
  gives both. With ``--compare-agents``, the floor too plays its first
  10,000 agents' round just before each round, and its own ``vs_10k``
  (``protocol_floor.vs_10k``, with its answer rate by tenth and its CPU per
  reply in the small rounds) says how far from linear the same messages on
  the same server are, beside the fleet's.

With ``--cluster 3`` the three nodes run ``deploy/nats-cluster/*.conf`` made
fit for this machine (``bench/_sim_cluster.py``; JetStream flushed as
``--sync`` says). Host ``i`` connects to node ``i % 3 + 1`` (the protocol
floor's hosts too); the runner, the tool worker and the host of one agent to
node 1; the raw responder to node 2 (the floor's request/replies cross a
route). Assets get ``--js-replicas`` copies (default: fleetbus's, 3 on a
cluster). Also measured on a cluster: the CPU of each node, and the messages
and bytes the nodes sent each other over their routes per reply (the API
tap's copies of JetStream API requests among them: ``api_requests_per_reply``).

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
``make bench-100k``, ``make bench-100k-cluster`` and ``make bench-1m`` run
100,000 agents (one server, then three nodes) and a million.

``BENCH_PROFILE=DIR`` runs each design's host under cProfile
(``DIR/<design>.prof``, written when it stops).

Prints one JSON line (``--results FILE`` appends it there too). Targets (2
cores): ready <= 10 s, <= 2 KB per idle agent, idle CPU < 5 % of a core, a
round of 10,000 agents <= 10 s, nothing lost; rounds no slower than the
previous design's. At 100,000 agents: every process together <= 1 GB of
RSS, a round <= 2x the protocol floor and <= 10x the round of 10,000 (no
slow-down as it goes on), <= 1 ms of CPU per answer across the processes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import os
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nats
import orjson
from _results import commit, emit, head
from _sim_cluster import LocalCluster
from _sim_designs import ApiTap, Writes, exported
from _sim_resources import Memory, Rate, cpu_seconds, disk_bytes, rss_kb

from fleetbus.bus import Bus, EmbeddedServer, key_value
from fleetbus.bus.journal import journal
from fleetbus.bus.store import stream_subjects
from fleetbus.protocol import AgentMessage, FinalAnswer, TextBlock, UserRequest
from fleetbus.sim.processes import server_threads

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
OLD_COMMIT = "4557175"
CHECKPOINTS = "reply"
EVENTS = "final"

_started = 0
MARKER_TTL_S = 5.0
"""Seconds a released lease's marker lives (fleetbus's leases, and the floor's)."""


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


TOOL_RESULT_BYTES = 290
"""The size of the ``noop`` tool's result a fleetbus tool worker sends (on
the wire): the raw responder's answers have it."""


def request_bytes(bus: Bus, session: str) -> bytes:
    """A round's request as the runner sends it to the fleet: the floors send
    requests of its size."""
    return bus.encode(UserRequest(sender="runner", session_id=session, content="play"))


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


async def idle_cpu(pid: int, seconds: float) -> float:
    """Share of one core the process used over ``seconds``."""
    before = cpu_seconds(pid)
    await asyncio.sleep(seconds)
    return (cpu_seconds(pid) - before) / seconds


@dataclass
class Topology:
    """The server(s) the run's processes connect to: one embedded nats-server,
    or the nodes of a local cluster (process ``i`` of a kind to node ``i %
    nodes``)."""

    urls: list[str]
    pids: list[int]
    stores: list[Path]
    cluster: LocalCluster | None = None

    def url(self, i: int) -> str:
        return self.urls[i % len(self.urls)]

    def labels(self) -> list[str]:
        """The servers' labels in the RSS figures."""
        if self.cluster is None:
            return ["server"]
        return [f"nats{i + 1}" for i in range(len(self.pids))]

    def cpu(self) -> list[float]:
        """Each server's CPU seconds so far."""
        return [cpu_seconds(pid) for pid in self.pids]

    async def routes(self) -> tuple[int, int]:
        """Messages and bytes sent over the cluster's routes so far (none on one server)."""
        if self.cluster is None:
            return 0, 0
        return await asyncio.to_thread(self.cluster.routes_sent)


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
    starts: list[float] = field(default_factory=list)
    """When each of its big rounds started (monotonic seconds)."""

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
    send: Callable[[str, float], Awaitable[bool]],
    names: list[str],
    in_flight: int,
    deadline: float,
    rate: Rate | None = None,
) -> tuple[float, int, int, int]:
    """Send to every name with ``in_flight`` at most; (seconds, answered,
    errors, late). Each answer is counted in ``rate`` when given."""
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
                    if rate is not None:
                        rate.answered()
                else:
                    errors += 1

    if rate is not None:
        rate.start()
    started = time.perf_counter()
    async with asyncio.TaskGroup() as tg:
        for _ in range(min(in_flight, len(names))):
            tg.create_task(worker())
    return time.perf_counter() - started, answered, errors, late


CPU_PARTS = ("host", "server", "worker", "runner")
"""The processes whose CPU a protocol floor's round counts."""


async def protocol_floor(
    top: Topology,
    prefix: str,
    names: list[str],
    args: argparse.Namespace,
    fleet: list[tuple[float, float]],
    responder: subprocess.Popen[bytes],
) -> list[dict[str, Any]]:
    """The rounds served by raw nats-py hosts doing a reply's bus work only:
    for each round, its seconds, the CPU milliseconds per agent of the
    hosts, the servers, the raw responder that serves their tool calls and
    this process (the runner), the JetStream API requests per reply (the
    same tap as the fleet's rounds, at the same cost), and (on a cluster)
    the route traffic per agent. ``fleet``: when each of the fleet's
    rounds started (seconds after its first) and how long it took; the
    floor's round N starts when as large a share of its round N - 1's lease
    markers expires while it runs as of the fleet's (see
    :func:`expiry_share`), and never before its round N - 1 ends."""
    floor = f"{prefix}floor"
    bus = await Bus.connect(top.url(0), prefix=floor, name="sim-floor")
    tap = ApiTap(bus.nc, [floor])
    # The journal stream and the lease bucket, as fleetbus's session store
    # opens them.
    journals = await journal(bus, "session")
    await key_value(bus, "session_leases", ttl=24 * 3600.0, expiring_markers=True, republish=True)
    concurrency = os.environ.get("BENCH_HOST_CONCURRENCY", "64")
    raw_host = [sys.executable, str(HERE / "_raw_host.py")]
    hosts = [
        start([*raw_host, top.url(i), floor, f"{prefix}.raw", concurrency])
        for i in range(args.hosts)
    ]
    try:
        await asyncio.sleep(1.0)  # (started with the interpreter alone: no imports to wait for)
        out: list[dict[str, Any]] = []
        requests = {session: request_bytes(bus, session) for session in ("game", "compare")}

        async def measured(players: list[str], session: str) -> dict[str, Any]:
            request = requests[session]

            async def play(name: str, timeout: float) -> bool:
                inbox = f"{floor}.agent.{name}.inbox"
                await bus.nc.request(inbox, request, timeout=timeout)
                return True

            m = len(players)
            before = sum(cpu_seconds(h.pid) for h in hosts)
            worker_before, runner_before = cpu_seconds(responder.pid), time.process_time()
            server_before = top.cpu()
            routes_before = await top.routes()
            api = tap.snapshot(floor)
            rate = Rate()
            round_s, answered, *_ = await fan_out(
                play, players, args.in_flight, args.deadline, rate
            )
            if answered != m:
                raise RuntimeError(f"the protocol floor answered {answered} of {m}")
            spent = sum(cpu_seconds(h.pid) for h in hosts) - before
            worker = cpu_seconds(responder.pid) - worker_before
            runner = time.process_time() - runner_before
            servers = [a - b for a, b in zip(top.cpu(), server_before, strict=True)]
            routes = await top.routes()
            await asyncio.sleep(0.2)  # the last requests' copies reach the tap
            entry: dict[str, Any] = {
                "s": round_s,
                "host_cpu_ms": spent * 1000 / m,
                "server_cpu_ms": sum(servers) * 1000 / m,
                "worker_cpu_ms": worker * 1000 / m,
                "runner_cpu_ms": runner * 1000 / m,
                "api_requests_per_reply": ApiTap.per(api, tap.snapshot(floor), m),
                "answers_per_s_by_tenth": rate.tenths(round_s),
            }
            if top.cluster is not None:
                entry["server_cpu_ms_by_node"] = [round(c * 1000 / m, 3) for c in servers]
                entry["route_msgs"] = round((routes[0] - routes_before[0]) / m, 2)
                entry["route_bytes"] = round((routes[1] - routes_before[1]) / m)
            return entry

        await tap.start()
        first = 0.0  # when its first round started (after its first agents' round)
        spans: list[tuple[float, float]] = []  # (start, seconds) of each round played
        for number in range(args.rounds):
            if number:
                at = floor_start(spans[-1], fleet[number - 1 : number + 1])
                # Its first agents' round just before, as the fleet's
                # (started as long before as the last one took).
                ahead = out[-1]["round_10k"]["s"] if args.compare_agents else 0.0
                await asyncio.sleep(max(0.0, first + at - ahead - time.monotonic()))
            compare = None
            if args.compare_agents:
                compare = await measured(names[: args.compare_agents], "compare")
            if not number:
                first = time.monotonic()
            started = time.monotonic() - first
            entry = await measured(names, "game")
            entry["start_s"] = started
            spans.append((started, entry["s"]))
            if compare is not None:
                entry["round_10k"] = compare
            out.append(entry)
        return out
    finally:
        await tap.stop()
        for proc in hosts:
            stop(proc)
        js = bus.nc.jetstream()
        for stream in (journals.stream, f"KV_{floor}_session_leases"):
            await js.delete_stream(stream)
        await bus.close()


def expiry_share(before: tuple[float, float], this: tuple[float, float]) -> float:
    """The share of round ``before``'s lease markers (released evenly through
    it) that expire while round ``this`` runs; each round as (start, seconds)."""
    start, length = before
    first, last = start + MARKER_TTL_S, start + length + MARKER_TTL_S
    overlap = min(last, this[0] + this[1]) - max(first, this[0])
    return max(0.0, overlap) / length if length > 0 else 0.0


def floor_start(before: tuple[float, float], fleet: list[tuple[float, float]]) -> float:
    """When the floor's next round starts (seconds after its first), its
    round before being ``before`` (start, seconds): so that as large a share
    of that round's markers expires while it runs (its length taken to be
    the round before's) as of the fleet's round before while the fleet's
    next round ran (``fleet``: those two rounds), and not before the round
    before ends."""
    start, length = before
    ended, expiring = start + length, start + MARKER_TTL_S
    share = expiry_share(*fleet)
    if share == 0.0:  # as soon as possible without overlapping, or at the fleet's offset
        at = max(ended, fleet[1][0])
        if at + length <= expiring or at >= expiring + length:
            return at
        return max(ended, expiring + length)
    at = expiring - length * (1.0 - share)
    return at if at >= ended else expiring + length * (1.0 - share)


async def delete_streams(bus: Bus) -> None:
    """Delete every stream on the server (the fleet's, once it stopped)."""
    js = bus.nc.jetstream()
    for info in await js.streams_info():
        if info.config.name:
            await js.delete_stream(info.config.name)


async def wait_ready(
    design: Design, top: Topology, names: list[str], args: argparse.Namespace
) -> None:
    """Start the design's host(s); the seconds until the last agent answers."""
    started = time.perf_counter()
    design.hosts = [
        design.host(top.url(i), design.prefix, "bench", len(names)) for i in range(args.hosts)
    ]
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
    one_bus = await Bus.connect(top.url(0), prefix=f"{design.prefix}one")
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


async def played(
    design: Design, names: list[str], session: str, args: argparse.Namespace, top: Topology
) -> dict[str, Any]:
    """One round of ``names`` on ``session``: its seconds, answers, CPU per
    agent of each process and of all, answer rate by tenth, route traffic."""
    assert design.worker is not None
    n = len(names)
    worker = design.worker

    def cpu_now() -> dict[str, float]:
        return {
            "hosts": sum(cpu_seconds(h.pid) for h in design.hosts),
            "worker": cpu_seconds(worker.pid),
            "server": sum(top.cpu()),
            "runner": time.process_time(),
        }

    async def play(name: str, timeout: float) -> bool:
        return await design.ask(name, timeout, session=session)

    before, nodes_before, routes_before = cpu_now(), top.cpu(), await top.routes()
    rate = Rate()
    round_s, answered, errors, late = await fan_out(
        play, names, args.in_flight, args.deadline, rate
    )
    after, nodes, routes = cpu_now(), top.cpu(), await top.routes()
    cpu = {k: (after[k] - before[k]) * 1000 / n for k in after}
    tenths = rate.tenths(round_s)
    out: dict[str, Any] = {
        "s": round(round_s, 2),
        "answered": answered,
        "errors": errors,
        "late": late,
        "cpu_ms_per_agent": {k: round(v, 3) for k, v in cpu.items()},
        "cpu_ms_per_answer_total": round(sum(cpu.values()), 3),
        "answers_per_s_by_tenth": tenths,
        "rate_first_over_last_tenth": round(tenths[0] / tenths[-1], 2) if tenths[-1] else None,
    }
    if top.cluster is not None:
        out["server_cpu_ms_per_agent_by_node"] = [
            round((a - b) * 1000 / n, 3) for a, b in zip(nodes, nodes_before, strict=True)
        ]
        out["route_msgs_per_reply"] = round((routes[0] - routes_before[0]) / n, 2)
        out["route_bytes_per_reply"] = round((routes[1] - routes_before[1]) / n)
    return out


async def play_round(
    design: Design,
    number: int,
    names: list[str],
    args: argparse.Namespace,
    floor_s: float,
    tap: ApiTap,
    top: Topology,
) -> None:
    assert design.bus is not None
    n = len(names)
    writes = Writes(design.bus.nc, design.prefix)
    compare: dict[str, Any] | None = None
    if args.compare_agents:
        compare = await played(design, names[: args.compare_agents], "compare", args, top)
        progress(
            f"round {number} of {design.name}, its first {args.compare_agents} agents: "
            f"{compare['s']:.2f} s, {compare['answered']} answered"
        )
    stored, api = await writes.snapshot(), tap.snapshot(design.prefix)
    design.starts.append(time.monotonic())
    figures = await played(design, names, "game", args, top)
    round_s = figures["s"]
    progress(f"round {number} of {design.name}: {round_s:.2f} s, {figures['answered']} answered")
    await asyncio.sleep(0.2)  # the last requests' copies reach the tap
    entry: dict[str, Any] = {
        "round": number,
        **figures,
        "agents_per_s": round(n / round_s),
        "vs_floor": round(round_s / floor_s, 1),
        "stored_per_reply": Writes.per(stored, await writes.snapshot(), n),
        "api_requests_per_reply": ApiTap.per(api, tap.snapshot(design.prefix), n),
    }
    if compare is not None:
        entry["round_10k_s"] = compare["s"]
        entry["vs_10k"] = round(round_s / compare["s"], 2)
        entry["rate_vs_10k"] = round((n / round_s) / (args.compare_agents / compare["s"]), 2)
        entry["round_10k"] = compare
    design.rounds.append(entry)


async def broadcast(design: Design, names: list[str], deadline: float) -> None:
    """A broadcast, until every agent's session "news" holds it."""
    assert design.bus is not None
    bus = design.bus
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
        # (every page of the listing: the server gives 100,000 subjects a request)
        reached = len(
            await stream_subjects(bus.nc, stream, pattern, timeout=10.0, what="count the sessions")
        )
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
        "lost": sum(
            r["errors"]
            + r["late"]
            + r.get("round_10k", {}).get("errors", 0)
            + r.get("round_10k", {}).get("late", 0)
            for r in rounds
        ),
        "broadcast_s": f.get("broadcast_s"),
        "broadcast_reached": f.get("broadcast_reached"),
        "broadcast_recorded": f.get("broadcast_recorded"),
        "rounds": rounds,
    }


@contextlib.contextmanager
def topology(args: argparse.Namespace) -> Iterator[Topology]:
    """One embedded nats-server, or a local cluster of ``--cluster`` nodes."""
    sync: float | str = "always" if args.sync == "always" else float(args.sync)
    if args.cluster:
        with LocalCluster(sync) as cluster:
            yield Topology(cluster.urls, cluster.pids, cluster.store_dirs, cluster)
    else:
        with EmbeddedServer(sync_interval=sync, threads=server_threads()) as server:  # type: ignore[arg-type]
            yield Topology([server.url], [server.pid or 0], [server.state_dir])


async def measure(
    args: argparse.Namespace, new_tree: Path, old_tree: Path | None
) -> dict[str, Any]:
    n = args.agents
    names = [f"sim-{i:05d}" for i in range(n)]
    base = f"sim{uuid.uuid4().hex[:8]}"
    designs = [Design("new", new_tree, f"{base}n", commit(args.new_commit))]
    if old_tree is not None:
        designs.append(Design("old", old_tree, f"{base}o", commit(args.old_commit)))
    memory = Memory()
    with topology(args) as top:
        bus = await Bus.connect(top.url(0), prefix=base, name="sim-runner")
        raw = start(
            [
                sys.executable,
                str(HERE / "_raw_responder.py"),
                top.url(1),
                f"{base}.raw",
                str(TOOL_RESULT_BYTES),
            ]
        )
        procs = [raw]
        played_all = False
        try:
            for d in designs:
                d.bus = await Bus.connect(top.url(0), prefix=d.prefix, name=f"sim-runner-{d.name}")
                worker = ["-m", "fleetbus", "worker", "bench._noop_tools"]
                d.worker = start(
                    [sys.executable, *worker, "--nats", top.url(0), "--prefix", d.prefix]
                )
                d.one = d.host(top.url(0), f"{d.prefix}one", "one", 1)
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
                await wait_ready(d, top, names, args)
            for d in designs:
                mark = "" if d.name == "new" else f"{d.name}_"
                assert d.worker is not None
                memory.pids[f"{mark}worker"] = d.worker.pid
                for i, h in enumerate(d.hosts):
                    memory.pids[f"{mark}host{i + 1}"] = h.pid
            memory.pids.update(zip(top.labels(), top.pids, strict=True))
            memory.pids["runner"] = os.getpid()
            await asyncio.sleep(1.0)
            rss_ready = memory.now()
            for d in designs:
                d.figures["idle_cpu"] = await idle_cpu(d.main.pid, args.idle)
                assert d.one is not None
                d.figures["rss"], d.figures["rss_one"] = rss_kb(d.main.pid), rss_kb(d.one.pid)

            request = request_bytes(bus, "game")

            async def raw_call(name: str, timeout: float) -> bool:
                await bus.nc.request(f"{base}.raw", request, timeout=timeout)
                return True

            floor_s, *_ = await fan_out(raw_call, names, args.in_flight, args.deadline)
            tap = ApiTap(bus.nc, [d.prefix for d in designs])
            await tap.start()
            async with memory.sampling():
                for number in range(1, args.rounds + 1):
                    # new, old, old, new, new, old…: neither always goes first.
                    order = designs if number % 2 else designs[::-1]
                    for d in order:
                        await play_round(d, number, names, args, floor_s, tap, top)
            await tap.stop()
            await asyncio.sleep(1.0)
            rss_after = memory.now()
            stores = [disk_bytes(store) for store in top.stores]
            disk: dict[str, Any] = {"store_bytes": stores, "store_bytes_total": sum(stores)}
            for d in designs:
                assert d.bus is not None
                mark = "" if d.name == "new" else f"{d.name}_"
                disk[f"{mark}streams"] = await Writes(d.bus.nc, d.prefix).streams()
            for d in designs:
                d.figures["rss_after"] = rss_kb(d.main.pid)
                d.figures["idle_cpu_after"] = await idle_cpu(d.main.pid, args.idle)
            if args.broadcast:
                for d in designs:
                    await broadcast(d, names, args.deadline)
                    progress(f"broadcast of {d.name}: {d.figures['broadcast_s']} s")
            meta_leader = top.cluster.meta_leader() if top.cluster is not None else None
            played_all = True
        finally:
            for d in designs:
                if d.bus is not None:
                    await d.bus.close()
                for proc in d.procs:
                    stop(proc)
            if not played_all:
                await bus.close()
                for proc in procs:
                    stop(proc)
        try:
            # After the fleet, on a server that holds no stream but the
            # floor's own: the fleet's deleted, with the markers its releases
            # left, which would expire beside the floor's rounds. Its rounds
            # are spaced as the new design's were.
            await delete_streams(bus)
            starts = designs[0].starts
            fleet = [
                (t - starts[0], r["s"]) for t, r in zip(starts, designs[0].rounds, strict=True)
            ]
            protocol = await protocol_floor(top, base, names, args, fleet, raw)
            floor_text = ", ".join(f"{p['s']:.2f} s" for p in protocol)
            progress(f"protocol floor: {floor_text}")
        finally:
            await bus.close()
            for proc in procs:
                stop(proc)
    floor_rounds = [p["s"] for p in protocol]
    for d in designs:
        for entry, floor_round_s in zip(d.rounds, floor_rounds, strict=True):
            entry["vs_protocol_floor"] = round(entry["s"] / floor_round_s, 2)
    summaries = {d.name: _summary(d, n) for d in designs}
    new = summaries["new"]
    stored = [r["stored_per_reply"] for r in new["rounds"]]
    appends = max(s.get("session", 0.0) for s in stored)
    lease_writes = max(s.get("session_leases", 0.0) for s in stored)
    session_stream = disk["streams"].get("session", {})
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
            "host_cpu_ms_per_agent": [round(p["host_cpu_ms"], 3) for p in protocol],
            "server_cpu_ms_per_agent": [round(p["server_cpu_ms"], 3) for p in protocol],
            "worker_cpu_ms_per_agent": [round(p["worker_cpu_ms"], 3) for p in protocol],
            "runner_cpu_ms_per_agent": [round(p["runner_cpu_ms"], 3) for p in protocol],
            "cpu_ms_per_answer_total": [
                round(sum(p[f"{k}_cpu_ms"] for k in CPU_PARTS), 3) for p in protocol
            ],
            "api_requests_per_reply": [p["api_requests_per_reply"] for p in protocol],
            "round_starts_s": [round(p["start_s"], 1) for p in protocol],
            "fleet_round_starts_s": [round(t - designs[0].starts[0], 1) for t in designs[0].starts],
            "marker_expiry_share": {
                "fleet": [None]
                + [round(expiry_share(a, b), 2) for a, b in itertools.pairwise(fleet)],
                "floor": [None]
                + [
                    round(expiry_share((a["start_s"], a["s"]), (b["start_s"], b["s"])), 2)
                    for a, b in itertools.pairwise(protocol)
                ],
            },
        },
        "servers": len(top.pids),
        "js_replicas": session_stream.get("replicas"),
        "cpu_ms_per_answer_total": round(
            statistics.median(r["cpu_ms_per_answer_total"] for r in new["rounds"]), 3
        ),
        "rate_first_over_last_tenth": [r["rate_first_over_last_tenth"] for r in new["rounds"]],
        "rss_mb": {
            "at_ready": Memory.mb(rss_ready),
            "after_rounds": Memory.mb(rss_after),
            "peak_in_rounds": memory.peak_mb(),
        },
        "disk": disk,
    }
    if args.compare_agents:
        small = [r["round_10k_s"] for r in new["rounds"]]
        out.update(
            compare_agents=args.compare_agents,
            round_10k_s_median=round(statistics.median(small), 2),
            vs_10k=[r["vs_10k"] for r in new["rounds"]],
            vs_10k_linear=round(n / args.compare_agents, 2),
            rate_vs_10k=[r["rate_vs_10k"] for r in new["rounds"]],
        )
        # The floor's own: how far the same messages on the same server are
        # from linear, beside the fleet's.
        out["protocol_floor"]["vs_10k"] = [round(p["s"] / p["round_10k"]["s"], 2) for p in protocol]
        out["protocol_floor"]["answers_per_s_by_tenth"] = [
            {
                "round": p["answers_per_s_by_tenth"],
                "round_10k": p["round_10k"]["answers_per_s_by_tenth"],
            }
            for p in protocol
        ]
        out["protocol_floor"]["cpu_ms_per_answer_10k"] = [
            round(sum(p["round_10k"][f"{k}_cpu_ms"] for k in CPU_PARTS), 3) for p in protocol
        ]
    if top.cluster is not None:
        floor = out["protocol_floor"]
        floor["server_cpu_ms_per_agent_by_node"] = [p["server_cpu_ms_by_node"] for p in protocol]
        floor["route_msgs_per_reply"] = [p["route_msgs"] for p in protocol]
        floor["route_bytes_per_reply"] = [p["route_bytes"] for p in protocol]
        out["cluster"] = {
            "nodes": len(top.pids),
            "runner_node": 1,
            "worker_node": 1,
            "raw_responder_node": 2,
            "host_nodes": [i % len(top.pids) + 1 for i in range(args.hosts)],
            "meta_leader_node": meta_leader,
            "js_replicas_asked": args.js_replicas,
        }
    if "old" in summaries:
        old = summaries["old"]
        out["new_vs_old"] = {
            what: round(new[what] / old[what], 2) if old[what] else None
            for what in ("round_s_median", "ready_s", "idle_rss_per_agent_bytes")
        }
    out["designs"] = summaries
    return out


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
    parser.add_argument(
        "--compare-agents",
        type=int,
        help="before each round, a round of this many of the agents, to compare with "
        "(default: 10,000 when --agents is more, else none; 0: none)",
    )
    parser.add_argument(
        "--cluster",
        type=int,
        choices=(0, 3),
        default=0,
        help="3: three nats-servers with routes on this machine (default 0: one server)",
    )
    parser.add_argument(
        "--js-replicas",
        type=int,
        help="copies of the fleet's streams (default: fleetbus's, 3 on a cluster, 1 on a server)",
    )
    parser.add_argument("--results", type=Path, help="append the JSON line to this file too")
    args = parser.parse_args()
    if args.compare_agents is None:
        args.compare_agents = 10_000 if args.agents > 10_000 else 0
    if not 0 <= args.compare_agents < args.agents and args.compare_agents:
        parser.error("--compare-agents is fewer than --agents")
    if args.js_replicas is not None:
        if args.js_replicas > 1 and not args.cluster:
            parser.error("--js-replicas above 1 needs --cluster 3")
        # Read by every fleetbus process of the run (and this one's buses).
        os.environ["FLEETBUS_JS_REPLICAS"] = str(args.js_replicas)
    first = head()
    with contextlib.ExitStack() as stack:
        old = stack.enter_context(exported(ROOT, args.old_commit)) if args.compare_old else None
        new = stack.enter_context(exported(ROOT, args.new_commit)) if args.new_commit else ROOT
        figures = asyncio.run(measure(args, new, old))
    emit({**first, **figures}, args.results)


if __name__ == "__main__":
    main()
