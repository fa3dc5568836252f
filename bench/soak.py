"""A fleet under load for minutes, its host replicas killed: nothing lost,
nothing piling up on the server.

Over one embedded nats-server: a tool worker process serving a no-op tool,
two host replicas serving a population (``fleetbus agent
bench._sim_population:population --checkpoints reply --lease-ttl 3``), and
clients in this process asking agents, in new and continuing sessions, with
receipts (as ``RemoteAgent`` does). Every ``--kill-every`` seconds one host
replica is SIGKILLed, then started again.

Measured: requests answered, errors, requests with no answer in time, how
many took longer than 2 s (sent again for want of a receipt, or taken over
after their replica died) and the longest; and at the end, once leases had
time to lapse, what is left on the server: its subscriptions against those
at the start, JetStream consumers, leases still held, and the session
journals (facts in all, and in the longest).

Prints one JSON line. Targets: every request answered, no consumer, no lease
held, as many subscriptions at the end as at the start.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

from _ports import free_port

from fleetbus.agents.serving.sessions import SessionStore, lease_owner
from fleetbus.bus import RESEND_AFTER, Bus, EmbeddedServer
from fleetbus.errors import FleetbusError
from fleetbus.protocol import FinalAnswer, UserRequest, new_id

ROOT = Path(__file__).resolve().parent.parent
AGENTS = 2_000
SESSIONS_PER_CLIENT = 50
SLOW_S = 2.0


def start(command: list[str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "fleetbus", *command],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "SIM_AGENTS": str(AGENTS)},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def monitor(port: int, path: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as answer:
        data: dict[str, Any] = json.load(answer)
        return data


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    port = free_port()
    with EmbeddedServer(sync_interval=1, extra_args=["-m", str(port)]) as server:
        url, prefix = server.url, f"soak{uuid.uuid4().hex[:8]}"
        bus = await Bus.connect(url, prefix=prefix, name="soak")
        common = ["--nats", url, "--prefix", prefix]
        worker = start(["worker", "bench._noop_tools", *common])
        hosts: list[subprocess.Popen[bytes]] = []

        def host(i: int) -> subprocess.Popen[bytes]:
            return start(
                [
                    "agent",
                    "bench._sim_population:population",
                    "--group",
                    "bench",
                    "--checkpoints",
                    "reply",
                    "--events",
                    "final",
                    "--lease-ttl",
                    "3",
                    "--concurrency",
                    "16",
                    "--replica-id",
                    f"h{i}",
                    *common,
                ]
            )

        try:
            await asyncio.sleep(3)  # the tool is served before the hosts read the tools
            hosts.extend(host(i) for i in range(2))
            await asyncio.sleep(5)
            # One request first: this process's reply inbox is subscribed at its first.
            await bus.request(
                bus.subjects.agent_inbox("sim-00000"),
                UserRequest(sender="soak", session_id="warm-up", content="play"),
                timeout=args.timeout,
            )
            subscriptions = monitor(port, "/varz")["subscriptions"]
            counts = {"asked": 0, "answered": 0, "errors": 0, "unanswered": 0, "slow": 0}
            longest = 0.0
            kills = 0
            end = time.monotonic() + args.duration

            async def client(c: int) -> None:
                nonlocal longest
                while time.monotonic() < end:
                    agent = f"sim-{random.randrange(AGENTS):05d}"
                    session = f"c{c}-{random.randrange(SESSIONS_PER_CLIENT)}"
                    request = UserRequest(
                        sender=f"client-{c}",
                        session_id=session,
                        content="play",
                        call_id=new_id(),
                        receipt=True,
                    )
                    counts["asked"] += 1
                    started = time.monotonic()
                    try:
                        answer = await bus.request(
                            bus.subjects.agent_inbox(agent),
                            request,
                            timeout=args.timeout,
                            resend=RESEND_AFTER,
                        )
                    except TimeoutError:
                        counts["unanswered"] += 1
                        continue
                    except FleetbusError:
                        counts["errors"] += 1
                        continue
                    took = time.monotonic() - started
                    longest = max(longest, took)
                    counts["slow"] += took > SLOW_S
                    ok = isinstance(answer, FinalAnswer) and answer.finished_reason == "completed"
                    counts["answered" if ok else "errors"] += 1

            async def killer() -> None:
                nonlocal kills
                while time.monotonic() + args.kill_every < end:
                    await asyncio.sleep(args.kill_every)
                    victim = kills % len(hosts)
                    hosts[victim].send_signal(signal.SIGKILL)
                    hosts[victim].wait()
                    kills += 1
                    await asyncio.sleep(2)
                    hosts[victim] = host(victim)

            await asyncio.gather(*(client(c) for c in range(args.clients)), killer())
            await asyncio.sleep(12)  # leases released, or lapsed and taken over
            store = await SessionStore.open(bus, owner="soak")
            held = 0
            for key in await store.leases.subjects():
                entry = await store.leases.get_or_none(key)
                held += entry is not None and lease_owner(entry.value) is not None
            jetstream = monitor(port, "/jsz")
            ends = monitor(port, "/varz")["subscriptions"]
            # What the journals hold: a subject a session, its facts bounded
            # by rollups however many replies it had.
            journals = await store.journal.keys()
            facts = sorted(journals.values())
            return {
                "bench": "soak",
                "cpus": os.cpu_count(),
                "seconds": args.duration,
                "clients": args.clients,
                "host_kills": kills,
                **counts,
                "longest_s": round(longest, 1),
                "subscriptions_start": subscriptions,
                "subscriptions_end": ends,
                "consumers": jetstream.get("consumers", 0),
                "leases_held": held,
                "sessions": len(journals),
                "journal_facts": sum(facts),
                "journal_facts_most_in_a_session": facts[-1] if facts else 0,
                "targets_met": {
                    "all_answered": counts["answered"] == counts["asked"],
                    "no_consumer": jetstream.get("consumers", 0) == 0,
                    "no_lease_held": held == 0,
                    "subscriptions_flat": ends == subscriptions,
                },
            }
        finally:
            await bus.close()
            for proc in [*hosts, worker]:
                proc.terminate()
            for proc in [*hosts, worker]:
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=120.0, help="seconds of load")
    parser.add_argument("--clients", type=int, default=40, help="requests at once")
    parser.add_argument("--kill-every", type=float, default=40.0, help="seconds between kills")
    parser.add_argument("--timeout", type=float, default=90.0, help="seconds a request waits")
    print(json.dumps(asyncio.run(measure(parser.parse_args()))), flush=True)


if __name__ == "__main__":
    main()
