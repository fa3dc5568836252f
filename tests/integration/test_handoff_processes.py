"""Handoffs across processes: ``triage`` and ``billing`` (``handoff_specs``)
run as separate ``fleetbus agent`` processes. The requester asks triage and
reads one stream; billing answers it, and a later request of the session
goes to billing. A billing replica SIGKILLed while it runs the reply, or a
triage replica killed as it hands the conversation over, loses nothing."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import pytest

from fleetbus.agents.serving import RemoteAgent
from fleetbus.agents.serving.leases import lease_owner
from fleetbus.agents.serving.sessions import SessionStore, session_key
from fleetbus.bus import Bus, EmbeddedServer
from fleetbus.protocol import Event, FinalAnswer
from tests.helpers import ROOT
from tests.integration.handoff_specs import DIE_ENV, LEDGER_ENV, RUNS_ENV

pytestmark = pytest.mark.slow

SPECS = "tests.integration.handoff_specs"


@dataclass
class Fleet:
    url: str
    prefix: str
    directory: Path
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    @property
    def runs(self) -> list[str]:
        path = self.directory / "runs.txt"
        return path.read_text().splitlines() if path.exists() else []

    def start(self, agent: str, replica: str, env: dict[str, str] | None = None) -> None:
        with (self.directory / f"{replica}.log").open("wb") as log:
            self.procs[replica] = self._spawn(agent, replica, env, log)

    def _spawn(
        self, agent: str, replica: str, env: dict[str, str] | None, log: BinaryIO
    ) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "fleetbus",
                "-v",
                "agent",
                f"{SPECS}:{agent}",
                "--nats",
                self.url,
                "--prefix",
                self.prefix,
                "--no-remote-tools",
                "--lease-ttl",
                "1",
                "--events",
                "all",
                "--replica-id",
                replica,
            ],
            cwd=ROOT,
            env={
                **os.environ,
                "PYTHONPATH": str(ROOT),
                "COLUMNS": "300",
                RUNS_ENV: str(self.directory / "runs.txt"),
                LEDGER_ENV: "1.5",
                **(env or {}),
            },
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
        )

    def log(self, replica: str) -> str:
        return (self.directory / f"{replica}.log").read_text(errors="replace")

    def logs(self) -> str:
        return "\n".join(f"--- {r}\n{self.log(r)[-3000:]}" for r in self.procs)

    async def ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while not all("serving" in self.log(r) for r, p in self.procs.items() if p.poll() is None):
            assert time.monotonic() < deadline, self.logs()
            await asyncio.sleep(0.05)

    def kill(self, replica: str) -> None:
        self.procs[replica].send_signal(signal.SIGKILL)
        self.procs[replica].wait(10)

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture
def fleet(nats_server: EmbeddedServer, bus: Bus, tmp_path: Path) -> Iterator[Fleet]:
    running = Fleet(nats_server.url, bus.prefix, tmp_path)
    try:
        yield running
    finally:
        running.stop()


async def test_a_handoff_survives_a_kill_of_the_receiving_replica(fleet: Fleet, bus: Bus) -> None:
    fleet.start("triage", "t1")
    fleet.start("billing", "b1")
    fleet.start("billing", "b2")
    await fleet.ready()
    store = await SessionStore.open(bus, owner="test")
    remote = RemoteAgent(bus, "triage", session_id="h1", timeout=60)
    events: list[Event] = []
    final: FinalAnswer | None = None
    killed: str | None = None
    async for item in remote.reply_stream("I was charged twice"):
        if isinstance(item, FinalAnswer):
            final = item
            continue
        events.append(item)
        if killed is None and item.event == "tool_call" and item.data.get("tool_name") == "ledger":
            # Billing runs its tool: kill the replica holding its lease.
            while not fleet.runs:  # noqa: ASYNC110 - another process writes it
                await asyncio.sleep(0.01)
            lease = await store.leases.get(session_key("billing", "h1"))
            owner = lease_owner(lease.value)
            assert owner is not None
            killed = owner.rpartition("@")[2]
            fleet.kill(killed)
    assert killed in ("b1", "b2"), [(e.sender, e.event) for e in events]
    assert final is not None
    assert (final.sender, final.content, final.finished_reason) == (
        "billing",
        "billing: I was charged twice",
        "completed",
    ), fleet.logs()
    assert final.call_id is not None
    # One stream: triage's end, naming the handoff, then billing's reply.
    ends = [e for e in events if e.event == "reply_end"]
    assert ends[0].data.get("handoff", {}).get("agent") == "billing"
    assert fleet.runs == ["I was charged twice", "I was charged twice"]  # again after the kill
    # Each session records the hand-over.
    triage = await store.get("triage", "h1")
    assert triage is not None
    assert triage.final is not None
    assert triage.final["finished_reason"] == "handed_off"
    assert triage.final["handoff"]["agent"] == "billing"
    billing = await store.get("billing", "h1")
    assert billing is not None
    assert billing.status == "done"
    assert billing.state.memory[0].metadata == {"handed_over_by": "triage"}
    # The session is billing's now: the next request to triage goes there.
    again = await remote.reply("And my invoice?")
    assert (again.sender, again.content) == ("billing", "billing: And my invoice?")
    billing = await store.get("billing", "h1")
    assert billing is not None
    assert [m.text for m in billing.state.memory if m.role == "user" and m.text] == [
        "I was charged twice",
        "And my invoice?",
    ]


async def test_a_triage_replica_killed_as_it_hands_over_loses_nothing(
    fleet: Fleet, bus: Bus, tmp_path: Path
) -> None:
    (tmp_path / "die").mkdir()
    fleet.start("triage", "t1", {DIE_ENV: str(tmp_path / "die")})
    fleet.start("triage", "t2", {DIE_ENV: str(tmp_path / "die")})
    fleet.start("billing", "b1")
    await fleet.ready()
    remote = RemoteAgent(bus, "triage", session_id="h2", timeout=60)
    final = await remote.reply("Where is my refund?")
    assert (tmp_path / "die" / "died").exists()  # a triage replica died handing over
    assert sum(p.poll() is not None for r, p in fleet.procs.items() if r.startswith("t")) == 1
    assert (final.sender, final.content) == ("billing", "billing: Where is my refund?"), (
        fleet.logs()
    )
    assert fleet.runs == ["Where is my refund?"]
    store = await SessionStore.open(bus, owner="test")
    triage = await store.get("triage", "h2")
    assert triage is not None
    assert triage.final is not None
    assert triage.final["finished_reason"] == "handed_off"
