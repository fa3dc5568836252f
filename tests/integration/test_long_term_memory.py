"""Long-term memory on the bus: the memory worker (SQLite FTS5) reached with
BusMemory — ranked, bounded, hostile queries answered — an agent served in
this process reaching it over its host's bus, and agent replica processes sharing it
across sessions in both modes, through a restart of the worker process."""

from __future__ import annotations

import asyncio
import re
import signal
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from fleetbus import Agent
from fleetbus.bus import Bus, EmbeddedServer, ToolClient
from fleetbus.capabilities import BusMemory, Memory
from fleetbus.errors import RemoteError
from fleetbus.protocol import FinalAnswer, TextBlock, UserRequest
from fleetbus.testing import ScriptedModel
from fleetbus.tools_workers import ToolWorker
from fleetbus.tools_workers.memory import RETRIEVE_TOOL, memory_tools
from tests.helpers import serving, spawn, stop, wait_for_workers

SPEC = "tests.integration.memory_specs"


@pytest.fixture
async def memory(bus: Bus, tmp_path: Path) -> AsyncIterator[BusMemory]:
    """A memory worker in this process, and a BusMemory of it."""
    worker = ToolWorker(bus, memory_tools(tmp_path / "memory.db"), worker_id="w-memory")
    async with asyncio.TaskGroup() as tg:
        task = tg.create_task(worker.run())
        await worker.wait_ready()
        yield BusMemory(bus)
        worker.stop()
        await task


async def test_over_the_bus_retrieval_is_ranked_bounded_and_idempotent(
    memory: BusMemory, bus: Bus
) -> None:
    facts = [
        "Ann sings in a choir on Tuesdays.",
        "Ann's bike is a red Dutch bike with a basket.",
        "Ann lent her red umbrella to Bob.",
    ]
    assert await memory.record("helper", "user:ann", facts, record_id="r-1") == 3
    assert await memory.record("helper", "user:ann", facts, record_id="r-1") == 0  # a retry

    hits = await memory.retrieve("helper", "user:ann", "what colour is Ann's bike?")
    assert hits[0] == facts[1]
    assert await memory.retrieve("helper", "user:ann", "red umbrella", limit=1) == [facts[2]]
    bounded = await memory.retrieve("helper", "user:ann", "Ann", limit=3, max_chars=60)
    assert sum(len(h) for h in bounded) <= 60
    assert await memory.retrieve("helper", "user:bob", "bike") == []

    # Out of range: the worker's answer is a clear error, not a crash.
    with pytest.raises(RemoteError, match="invalid_parameters"):
        await memory.retrieve("helper", "user:ann", "bike", limit=0)


async def test_over_the_bus_a_hostile_query_is_answered(memory: BusMemory, bus: Bus) -> None:
    await memory.record("helper", "k", ['the "quoted" NEAR(word) is here'])
    hostile = '" NEAR( * ^ AND OR NOT text: scope : {x} ' * 20_000  # 840 KB of FTS5 syntax

    assert await memory.retrieve("helper", "k", hostile) == ['the "quoted" NEAR(word) is here']
    # Straight to the worker, past what BusMemory sends: answered all the same.
    raw = await ToolClient(bus).call(
        RETRIEVE_TOOL, {"agent_name": "helper", "key": "k", "query": hostile[:500_000]}
    )
    assert raw.status == "success"
    assert raw.content == ['the "quoted" NEAR(word) is here']


async def test_an_agent_served_here_gets_its_bus_memory_bound_by_the_host(
    memory: BusMemory, nats_server: EmbeddedServer, bus: Bus
) -> None:
    model = ScriptedModel(["Noted.", "It is 4711."])
    agent = Agent("keeper", "", model, capabilities=[Memory(BusMemory())])  # no bus: the host's
    async with serving(nats_server.url, bus.prefix, agent):
        for session, text in (("s1", "My locker code is 4711."), ("s2", "My locker code?")):
            reply = await bus.request(
                bus.subjects.agent_inbox("keeper"),
                UserRequest(content=text, session_id=session, metadata={"user_id": "ann"}),
                timeout=30,
                attempts=1,
            )
            assert isinstance(reply, FinalAnswer)
    hint = [
        b.text
        for m in model.requests[1].messages
        for b in m.content
        if isinstance(b, TextBlock) and "<long_term_memory>" in b.text
    ]
    assert len(hint) == 1
    assert "My locker code is 4711." in hint[0]


# -- agent processes and a memory worker process ---------------------------------------


async def ask(bus: Bus, agent: str, text: str, session: str, user: str | None = "ann") -> str:
    reply = await bus.request(
        bus.subjects.agent_inbox(agent),
        UserRequest(content=text, session_id=session, metadata={"user_id": user} if user else {}),
        timeout=30,
        attempts=1,
    )
    assert isinstance(reply, FinalAnswer), reply
    assert reply.finished_reason == "completed", reply
    return str(reply.content)


def pid_of(answer: str) -> int:
    found = re.search(r"from (\d+)$", answer)
    assert found, answer
    return int(found.group(1))


async def from_another_replica(bus: Bus, agent: str, text: str, than: int, tag: str) -> list[str]:
    """Ask in new sessions until a replica other than ``than`` answers; every answer."""
    answers: list[str] = []
    for n in range(40):
        answers.append(await ask(bus, agent, text, f"{tag}-{n}"))
        if pid_of(answers[-1]) != than:
            return answers
    raise AssertionError(f"only replica {than} answered: {answers}")


async def wait_for_agents(bus: Bus, names: list[str], pids: set[int]) -> None:
    """Until every replica (``pids``) has answered for every agent."""
    deadline = time.monotonic() + 30
    n = 0
    for name in names:
        seen: set[int] = set()
        while seen != pids:
            assert time.monotonic() < deadline, f"{name}: only {seen} of {pids} answered"
            n += 1
            try:
                seen.add(pid_of(await ask(bus, name, "ping", f"ready-{n}", user=None)))
            except Exception:
                await asyncio.sleep(0.1)


@contextmanager
def processes() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    try:
        yield started
    finally:
        for proc in started:
            try:
                stop(proc)
            except subprocess.TimeoutExpired:
                pass


@pytest.mark.slow
async def test_a_fact_crosses_sessions_and_replicas_in_both_modes_and_a_worker_restart(
    nats_server: EmbeddedServer, bus: Bus, tmp_path: Path
) -> None:
    url, prefix = nats_server.url, bus.prefix
    env = {"FLEETBUS_MEMORY_DB": str(tmp_path / "memory.db")}

    def worker(n: int) -> subprocess.Popen[bytes]:
        args = ["worker", "fleetbus.tools_workers.memory", "--nats", url, "--prefix", prefix]
        return spawn([*args, "--worker-id", f"m{n}"], env=env)

    def replica(n: int) -> subprocess.Popen[bytes]:
        args = ["agent", SPEC, "--nats", url, "--prefix", prefix, "--lease-ttl", "1"]
        return spawn([*args, "--replica-id", f"r{n}"])

    with processes() as procs:
        procs += [worker(1), replica(1), replica(2)]
        await wait_for_workers(bus, RETRIEVE_TOOL, 1)
        await wait_for_agents(bus, ["keeper", "chooser"], {procs[1].pid, procs[2].pid})

        # Static: told in one session; a hint in others, on another replica too.
        told = await ask(bus, "keeper", "My locker code is 4711.", "told")
        assert "hint: none" in told
        assert "long_term_memory_" not in told  # the store's tools are not offered
        later = await from_another_replica(
            bus, "keeper", "What is my locker code?", pid_of(told), "k"
        )
        assert all("user: My locker code is 4711." in a for a in later), later
        assert "hint: none" in await ask(bus, "keeper", "What is my locker code?", "b", "bob")

        # Agent mode: the model records; another session on another replica retrieves.
        kept = await ask(bus, "chooser", "remember: Ann's dog is named Pixel.", "told")
        assert kept.startswith("tool said: Remembered 1 fact(s).")
        assert "record_to_memory,retrieve_from_memory" in kept
        found = await from_another_replica(bus, "chooser", "recall: dog name", pid_of(kept), "c")
        assert all("Ann's dog is named Pixel." in a for a in found), found
        assert "hint: none" in await ask(bus, "chooser", "What is my dog's name?", "c-x")

        # A hostile input is a query like any other.
        hostile = '"NEAR(* ^ AND OR text: ' * 5_000
        assert "hint:" in await ask(bus, "keeper", hostile, "hostile")

        # The worker restarts on the same file: nothing is forgotten.
        assert stop(procs[0]) == 0
        procs.append(worker(2))
        await wait_for_workers(bus, RETRIEVE_TOOL, 1)
        again = await ask(bus, "keeper", "Do you know my locker code?", "after")
        assert "user: My locker code is 4711." in again
        recalled = await ask(bus, "chooser", "recall: Pixel", "after")
        assert "Ann's dog is named Pixel." in recalled

        # What a replica said it serves names no tool of the store's (never offered).
        procs[1].send_signal(signal.SIGTERM)
        said = procs[1].communicate(timeout=30)[0].decode()
        assert "serving" in said
        assert "long_term_memory_" not in said, said
