"""A simulation's runtime at scale: N agents served by one host process.

In one run, over one embedded nats-server: a tool worker process serving a
no-op tool, a host process serving N agents (``fleetbus agent
bench._sim_population:population``: each reply is one ReAct step with one
call of the tool on the worker), and this process as the runner. Measured:

- start-up: from starting the host process to every agent answering;
- idle: the host's RSS (per agent, against a host of one agent started the
  same way) and CPU over 10 s, before and after a round;
- one round: every agent gets a prompt, runs its step with its remote tool
  call, answers; with at most ``--in-flight`` requests out at once;
- a broadcast on a topic every agent observes, until it is recorded in the
  session of every agent;
- the floor: the same number of raw nats-py request/replies between this
  process and a trivial responder process, with the same requests in flight;
- the protocol floor: the same rounds served by as many raw nats-py hosts
  (``bench/_raw_host.py``) doing a reply's bus work and nothing else: take
  the lease, read the head (from round 2), call the tool, write the head,
  release the lease, answer, all on streams configured as fleetbus's, the
  lease writes republished to every host. What is above it is the work of
  fleetbus's host in Python (the agent, its session's records).

Prints one JSON line. Targets (2 cores): ready <= 10 s, <= 2 KB per idle
agent, idle CPU < 5 % of a core, a round of 10,000 agents <= 10 s, nothing
lost.
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
from dataclasses import replace
from pathlib import Path
from typing import Any

import nats

from fleetbus.bus import Bus, EmbeddedServer
from fleetbus.bus.store import key_value
from fleetbus.protocol import AgentMessage, FinalAnswer, TextBlock, UserRequest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
TICKS = os.sysconf("SC_CLK_TCK")


_started = 0


def start(command: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """Start a process; its output goes to ``$BENCH_LOGS/<n>.log`` if set."""
    global _started
    _started += 1
    logs = os.environ.get("BENCH_LOGS")
    out: Any = subprocess.DEVNULL
    if logs:
        Path(logs).mkdir(parents=True, exist_ok=True)
        out = open(Path(logs) / f"{_started}.log", "wb")  # noqa: SIM115 (the child keeps it)
    return subprocess.Popen(
        command,
        cwd=ROOT,
        env={**os.environ, **(env or {}), "PYTHONPATH": str(ROOT)},
        stdin=subprocess.DEVNULL,
        stdout=out,
        stderr=subprocess.STDOUT,
    )


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


CHECKPOINTS = "reply"
EVENTS = "final"


def host(url: str, prefix: str, group: str, agents: int) -> subprocess.Popen[bytes]:
    return start(
        [
            sys.executable,
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
        ],
        env={"SIM_AGENTS": str(agents)},
    )


async def fan_out(
    send: Any, names: list[str], in_flight: int, deadline: float
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
    bus: Bus, url: str, prefix: str, names: list[str], args: argparse.Namespace
) -> list[tuple[float, float]]:
    """The rounds served by raw nats-py hosts doing a reply's bus work only:
    for each round, its seconds and the hosts' CPU milliseconds per agent."""
    from _raw_host import streams
    from nats.js.api import RePublish, StorageType, StreamConfig

    floor = f"{prefix}floor"
    heads, leases = streams(floor)
    js = bus.nc.jetstream()
    kv_like = StreamConfig(
        max_msgs_per_subject=1,
        allow_rollup_hdrs=True,
        deny_delete=True,
        allow_direct=True,
        storage=StorageType.FILE,
    )
    await js.add_stream(replace(kv_like, name=heads, subjects=[f"$KV.{floor}_heads.>"]))
    await js.add_stream(
        replace(
            kv_like,
            name=leases,
            subjects=[f"$KV.{floor}_leases.>"],
            republish=RePublish(src=f"$KV.{floor}_leases.>", dest=f"{floor}.kv.leases.>"),
        )
    )
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
            round_s, answered, *_ = await fan_out(play, names, args.in_flight, args.deadline)
            if answered != len(names):
                raise RuntimeError(f"the protocol floor answered {answered} of {len(names)}")
            spent = sum(cpu_seconds(h.pid) for h in hosts) - before
            out.append((round_s, spent * 1000 / len(names)))
        return out
    finally:
        for proc in hosts:
            stop(proc)
        for stream in (heads, leases):
            await js.delete_stream(stream)


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    n = args.agents
    names = [f"sim-{i:05d}" for i in range(n)]
    sync: float | str = "always" if args.sync == "always" else float(args.sync)
    with EmbeddedServer(sync_interval=sync) as server:  # type: ignore[arg-type]
        url = server.url
        prefix = f"sim{uuid.uuid4().hex[:8]}"
        bus = await Bus.connect(url, prefix=prefix, name="sim-runner")
        raw = start([sys.executable, str(HERE / "_raw_responder.py"), url, f"{prefix}.raw"])
        worker = start(
            [
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
        )
        one = host(url, f"{prefix}one", "one", 1)
        procs = [raw, worker, one]
        try:
            await asyncio.sleep(0.5)

            async def ask(name: str, timeout: float, session: str = "round-1") -> bool:
                answer = await bus.request(
                    bus.subjects.agent_inbox(name),
                    UserRequest(sender="runner", session_id=session, content="play"),
                    timeout=timeout,
                    attempts=1,
                )
                return isinstance(answer, FinalAnswer) and answer.finished_reason == "completed"

            # The tool worker must be up before the host reads the tools served.
            while True:
                try:
                    await bus.nc.request(f"{prefix}.tool.noop", b"{}", timeout=0.5)
                    break
                except Exception:
                    await asyncio.sleep(0.1)
            started = time.perf_counter()
            hosts = [host(url, prefix, "bench", n) for _ in range(args.hosts)]
            procs.extend(hosts)
            main = hosts[0]
            while True:  # every agent is served once one answers: the host subscribes once
                try:
                    if await ask(names[-1], 2.0, session="ready"):
                        break
                except Exception:
                    pass
                if main.poll() is not None:
                    raise RuntimeError(f"the host exited with {main.returncode}")
                await asyncio.sleep(0.05)
            ready_s = time.perf_counter() - started
            # The host of one agent, for the per-agent figure (also answered once).
            one_bus = await Bus.connect(url, prefix=f"{prefix}one")
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
            await one_bus.close()
            await asyncio.sleep(1.0)
            idle_cpu_before = await idle_cpu(main.pid, args.idle)
            rss_main, rss_one = rss_kb(main.pid), rss_kb(one.pid)

            async def raw_call(name: str, timeout: float) -> bool:
                await bus.nc.request(f"{prefix}.raw", b"x" * 200, timeout=timeout)
                return True

            floor_s, *_ = await fan_out(raw_call, names, args.in_flight, args.deadline)

            def cpu_now() -> dict[str, float]:
                return {
                    "hosts": sum(cpu_seconds(h.pid) for h in hosts),
                    "worker": cpu_seconds(worker.pid),
                    "server": cpu_seconds(server.pid or 0),
                    "runner": time.process_time(),
                }

            rounds = []
            for number in range(1, args.rounds + 1):
                before = cpu_now()

                async def play(name: str, timeout: float, number: int = number) -> bool:
                    return await ask(name, timeout, session="game")

                round_s, answered, errors, late = await fan_out(
                    play, names, args.in_flight, args.deadline
                )
                after = cpu_now()
                rounds.append(
                    {
                        "round": number,
                        "s": round(round_s, 2),
                        "answered": answered,
                        "errors": errors,
                        "late": late,
                        "agents_per_s": round(n / round_s),
                        "vs_floor": round(round_s / floor_s, 1),
                        "cpu_ms_per_agent": {
                            k: round((after[k] - before[k]) * 1000 / n, 3) for k in after
                        },
                    }
                )
            await asyncio.sleep(1.0)
            rss_after = rss_kb(main.pid)
            idle_cpu_after = await idle_cpu(main.pid, args.idle)

            # A broadcast, until every agent's session "news" holds it.
            heads = await key_value(bus, "sessions")
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
            limit = time.perf_counter() + args.deadline
            while time.perf_counter() < limit:
                reached = len(await heads.subjects("*.news"))
                if reached >= n:
                    broadcast_s = time.perf_counter() - started
                    break
                await asyncio.sleep(0.2)
            # The heads exist from the lease taken; wait for the last writes.
            record_ok = None
            if broadcast_s is not None:
                from fleetbus.agents.serving.sessions import SessionStore

                store = await SessionStore.open(bus, owner="bench")
                for _ in range(100):
                    record = await store.get(names[-1], "news")
                    if record is not None and record.owner is None and record.state.memory:
                        record_ok = True
                        break
                    await asyncio.sleep(0.1)
            protocol = await protocol_floor(bus, url, prefix, names, args)
            for entry, (floor_round_s, floor_cpu) in zip(rounds, protocol, strict=True):
                entry["vs_protocol_floor"] = round(entry["s"] / floor_round_s, 2)
                entry["protocol_floor_s"] = round(floor_round_s, 2)
                entry["protocol_floor_host_cpu_ms_per_agent"] = round(floor_cpu, 3)
        finally:
            await bus.close()
            for proc in procs:
                stop(proc)
    per_agent = (rss_main - rss_one) * 1024 / max(1, n - 1)
    per_agent_after = (rss_after - rss_one) * 1024 / max(1, n - 1)
    return {
        "bench": "simulation",
        "agents": n,
        "jetstream_sync": args.sync,
        "in_flight": args.in_flight,
        "ready_s": round(ready_s, 2),
        "idle_rss_per_agent_bytes": round(per_agent),
        "rss_per_agent_after_round_bytes": round(per_agent_after),
        "host_rss_mb": round(rss_main / 1024, 1),
        "host_rss_after_round_mb": round(rss_after / 1024, 1),
        "idle_cpu_core_share": round(idle_cpu_before, 4),
        "idle_cpu_after_round_core_share": round(idle_cpu_after, 4),
        "hosts": args.hosts,
        "checkpoints": CHECKPOINTS,
        "events": EVENTS,
        "floor_s": round(floor_s, 3),
        "rounds": rounds,
        "round_s_max": max(r["s"] for r in rounds),
        "lost": sum(r["errors"] + r["late"] for r in rounds),
        "broadcast_s": round(broadcast_s, 2) if broadcast_s is not None else None,
        "broadcast_reached": reached,
        "broadcast_recorded": record_ok,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agents", type=int, default=10_000)
    parser.add_argument("--in-flight", type=int, default=2_000)
    parser.add_argument("--deadline", type=float, default=120.0)
    parser.add_argument("--rounds", type=int, default=2, help="rounds played (same sessions)")
    parser.add_argument("--hosts", type=int, default=1, help="host processes in the group")
    parser.add_argument("--idle", type=float, default=10.0, help="seconds of idle CPU measured")
    parser.add_argument(
        "--sync",
        default="1",
        help="the server's JetStream fsync: 'always' or seconds (default 1, as `fleetbus sim run`)",
    )
    args = parser.parse_args()
    print(json.dumps(asyncio.run(measure(args))), flush=True)


if __name__ == "__main__":
    main()
