"""Agent replicas SIGKILLed while they serve sessions: every request is still
answered once and right, every session ends stored ``done`` with a consistent
memory, no tool call is asked of the model twice, and no tool runs twice.

The agent and its tool (``tests.integration.chaos_specs``) are deterministic,
so what a run without kills answers is known from the requests alone. One
tool worker serves the tool, so its record of answered calls is the only one.
Replicas are separate ``fleetbus agent --replicas 1`` processes, each with its
own replica id, started anew by the test after each kill.

Three ways to kill: at random (seeded) while twelve sessions run; at points
made likely by slow steps (in a model call, in a tool call); and at points too
brief to hit from outside, where a replica kills itself (armed by
``CHAOS_DIE_DIR``, see ``chaos_specs``) as a reply ends.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import pytest

from fleetbus.agents.serving import RemoteAgent
from fleetbus.agents.serving.sessions import SessionRecord, SessionStore, read_fact
from fleetbus.bus import RESEND_AFTER, Bus, EmbeddedServer
from fleetbus.protocol import (
    AnyMessage,
    FinalAnswer,
    ToolCall,
    UserRequest,
    decode,
    encode,
)
from tests.helpers import ROOT, wait_for_workers
from tests.integration.chaos_specs import (
    DIE_ANSWERED,
    DIE_ENV,
    DIE_STORED,
    FAST_ENV,
    RUNS_ENV,
    expected_answer,
    parse_job,
    step_value,
)

pytestmark = pytest.mark.slow

AGENT = "chaos"
SPECS = "tests.integration.chaos_specs"
LEASE_TTL = 1.0
SEED = int(os.environ.get("CHAOS_SEED", "20240611"))
"""The killer's seed (``CHAOS_SEED`` to replay another)."""


# -- processes ---------------------------------------------------------------------------


@dataclass
class Proc:
    """A fleetbus process logging to a file."""

    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None

    @property
    def ready(self) -> bool:
        return self.alive and "serving" in self.log.read_text(errors="replace")


@dataclass
class Fleet:
    """One tool worker and the agent replicas of a test, as OS processes."""

    url: str
    prefix: str
    directory: Path
    env: dict[str, str] = field(default_factory=dict)
    """More environment for the agent replicas."""
    args: list[str] = field(default_factory=list)
    """More arguments for the agent replicas."""
    replicas: list[Proc] = field(default_factory=list)
    others: list[Proc] = field(default_factory=list)
    killed: list[str] = field(default_factory=list)

    @property
    def runs(self) -> Path:
        return self.directory / "runs.txt"

    def _spawn(self, name: str, args: list[str], extra: dict[str, str] | None = None) -> Proc:
        log = self.directory / f"{name}.log"
        env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            RUNS_ENV: str(self.runs),
            "COLUMNS": "300",  # rich wraps log lines at the terminal's width
            **(extra or {}),
        }
        with log.open("wb") as out:
            popen = subprocess.Popen(
                [sys.executable, "-m", "fleetbus", "-v", *args],
                cwd=ROOT,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        return Proc(name, popen, log)

    def start_worker(self) -> None:
        args = ["worker", SPECS, "--nats", self.url, "--prefix", self.prefix]
        self.others.append(self._spawn("worker", [*args, "--worker-id", "w1"]))

    def start_replica(self, env: dict[str, str] | None = None) -> Proc:
        name = f"r{len(self.replicas) + 1}"
        proc = self._spawn(
            name,
            [
                "agent",
                f"{SPECS}:{AGENT}",
                "--nats",
                self.url,
                "--prefix",
                self.prefix,
                "--lease-ttl",
                str(LEASE_TTL),
                "--replica-id",
                name,
                *self.args,
            ],
            {**self.env, **(env or {})},
        )
        self.replicas.append(proc)
        return proc

    def replica(self, owner: str | None) -> Proc | None:
        """The live replica whose lease owner id is ``owner`` (``chaos@r3``)."""
        for proc in self.replicas:
            if owner == f"{AGENT}@{proc.name}" and proc.alive:
                return proc
        return None

    def kill(self, proc: Proc, env: dict[str, str] | None = None) -> Proc:
        """SIGKILL a replica and start another in its place (``env``: more
        environment for that one)."""
        proc.popen.send_signal(signal.SIGKILL)
        proc.popen.wait(10)
        self.killed.append(proc.name)
        return self.start_replica(env)

    def revive(self) -> None:
        """Start a replica in place of each that died on its own (as the
        supervisor of ``fleetbus agent --replicas N`` does)."""
        for proc in list(self.replicas):
            if not proc.alive and proc.name not in self.killed:
                self.killed.append(proc.name)
                self.start_replica()

    async def wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while not all(p.ready for p in self.replicas if p.alive):
            assert time.monotonic() < deadline, self.logs()
            await asyncio.sleep(0.05)

    def stop(self) -> None:
        for proc in [*self.replicas, *self.others]:
            if proc.alive:
                proc.popen.send_signal(signal.SIGTERM)
        for proc in [*self.replicas, *self.others]:
            try:
                proc.popen.wait(15)
            except subprocess.TimeoutExpired:
                proc.popen.kill()
                proc.popen.wait()

    def logs(self, *needles: str) -> str:
        """Every process's log lines that mention one of ``needles`` (all lines without)."""
        parts = []
        for proc in [*self.replicas, *self.others]:
            lines = proc.log.read_text(errors="replace").splitlines()
            if needles:
                lines = [line for line in lines if any(n in line for n in needles)]
            if lines:
                state = "killed" if proc.name in self.killed else "alive"
                parts.append(f"--- {proc.name} ({state})\n" + "\n".join(lines[-40:]))
        return "\n".join(parts)

    def tool_runs(self) -> Counter[tuple[str, int]]:
        """How many times ``chaos_step`` really ran, per (job, step)."""
        if not self.runs.exists():
            return Counter()
        found: Counter[tuple[str, int]] = Counter()
        for line in self.runs.read_text().splitlines():
            job, step = line.split()
            found[job, int(step)] += 1
        return found


@asynccontextmanager
async def fleet(
    nats_server: EmbeddedServer,
    bus: Bus,
    directory: Path,
    replicas: int,
    env: dict[str, str] | None = None,
    args: list[str] | None = None,
) -> AsyncIterator[Fleet]:
    """The worker, then ``replicas`` agent replicas, all ready; stopped on exit."""
    running = Fleet(nats_server.url, bus.prefix, directory, env or {}, args or [])
    try:
        running.start_worker()
        # Replicas add the bus's tools to the agent once, as they start.
        await wait_for_workers(bus, "chaos_step", 1)
        for _ in range(replicas):
            running.start_replica()
        await running.wait_ready()
        yield running
    finally:
        running.stop()


# -- what the bus carried ----------------------------------------------------------------


async def listen(bus: Bus, subject: str) -> tuple[list[AnyMessage], Callable[[], Awaitable[None]]]:
    """Every message published on ``subject`` from now on, decoded; on the
    agent's events subjects, also every final answer written in its session
    journals (an ``end`` fact)."""
    got: list[AnyMessage] = []

    async def cb(msg: Any) -> None:
        got.append(decode(msg.data))

    async def fact(msg: Any) -> None:
        final = read_fact(msg.data).final
        if final is not None:
            got.append(decode(orjson.dumps(final)))

    subs = [await bus.nc.subscribe(subject, cb=cb)]
    if subject == bus.subjects.all_events(AGENT):
        subs.append(await bus.nc.subscribe(f"{bus.prefix}.session.{AGENT}.*", cb=fact))
    await bus.flush()

    async def stop() -> None:
        for one in subs:
            await one.unsubscribe()

    return got, stop


async def tap_calls(bus: Bus) -> tuple[list[tuple[float, ToolCall]], Callable[[], Awaitable[None]]]:
    """Every ``tool_call`` sent to ``chaos_step`` from now on, with when it was seen."""
    sent: list[tuple[float, ToolCall]] = []

    async def cb(msg: Any) -> None:
        message = decode(msg.data)
        if isinstance(message, ToolCall):
            sent.append((time.monotonic(), message))

    sub = await bus.nc.subscribe(bus.subjects.tool("chaos_step"), cb=cb)
    await bus.flush()
    return sent, sub.unsubscribe


@dataclass
class Asked:
    """A request sent with a reply subject of its own, and what came back on it."""

    job: str
    steps: int
    text: str
    replies: list[AnyMessage]
    call_id: str | None = None
    """The request's own ``call_id`` (``None``: its answer carries the reply's id)."""

    @property
    def session(self) -> str:
        return f"chaos-{self.job}"

    @property
    def answered(self) -> bool:
        return any(isinstance(m, FinalAnswer) for m in self.replies)


async def ask(bus: Bus, text: str) -> tuple[Asked, Callable[[], Awaitable[None]]]:
    """Send ``job …`` to the agent (session ``chaos-<job>``) with a reply
    subject of its own, and keep what comes back on it."""
    job, steps, _ = parse_job(text)
    inbox = bus.nc.new_inbox()
    replies, unsubscribe = await listen(bus, inbox)
    asked = Asked(job, steps, text, replies)
    request = UserRequest(sender="chaos-test", session_id=asked.session, content=text)
    await bus.nc.publish(bus.subjects.agent_inbox(AGENT), encode(request), reply=inbox)
    return asked, unsubscribe


async def wait_for(check: Callable[[], bool], *, timeout: float) -> bool:
    """Whether ``check()`` came true within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.05)
    return True


async def taken(store: SessionStore, sessions: list[str], timeout: float) -> None:
    """Wait until a replica has stored each session (taken its request)."""
    deadline = time.monotonic() + timeout
    for session in sessions:
        while await store.get(AGENT, session) is None:
            assert time.monotonic() < deadline, f"no replica took the request of {session}"
            await asyncio.sleep(0.02)


async def chaos(running: Fleet, rng: random.Random, asked: list[Asked], *, max_kills: int) -> int:
    """SIGKILL a random ready replica every 0.3-1.5 s (starting another in its
    place) until every request is answered; how many were killed."""
    kills = 0
    while kills < max_kills:
        await asyncio.sleep(rng.uniform(0.3, 1.5))
        if all(a.answered for a in asked):
            break
        victims = [p for p in running.replicas if p.ready]
        if victims:
            running.kill(rng.choice(victims))
            kills += 1
    return kills


async def settled(store: SessionStore, sessions: list[str], timeout: float) -> dict[str, Any]:
    """Each session as stored once no replica runs it any more (or at the timeout)."""
    deadline = time.monotonic() + timeout
    while True:
        records = {s: await store.get(AGENT, s) for s in sessions}
        if time.monotonic() > deadline or all(
            r is not None and r.status != "running" for r in records.values()
        ):
            return records
        await asyncio.sleep(0.1)


# -- the checks ----------------------------------------------------------------------------


def describe(record: SessionRecord | None) -> str:
    if record is None:
        return "not stored"
    lines = [f"status={record.status} owner={record.owner} final={record.final}"]
    reply = record.state.reply
    if reply is not None:
        lines.append(f"reply {reply.reply_id} at step {reply.iteration}, arrived={reply.arrived}")
    for m in record.state.memory:
        blocks = [
            f"{type(b).__name__}({getattr(b, 'id', '')} "
            f"{getattr(b, 'input', '') or getattr(b, 'output', '') or getattr(b, 'text', '')})"
            for b in m.content
        ]
        lines.append(f"  {m.role}: {' '.join(blocks)}")
    return "\n".join(lines)


def problems_of(
    asked: Asked,
    record: SessionRecord | None,
    events: list[AnyMessage],
    wire: list[ToolCall],
    runs: Counter[tuple[str, int]],
    *,
    events_once: bool = True,
) -> list[str]:
    """What is wrong with one request's outcome (empty: nothing). With
    ``events_once=False`` the final answer may be written in the journal more
    than once."""
    problems: list[str] = []
    expected = expected_answer(asked.job, asked.steps)
    finals = [m for m in asked.replies if isinstance(m, FinalAnswer)]
    if len(asked.replies) != 1 or len(finals) != 1:
        problems.append(f"{len(asked.replies)} replies to the request: {asked.replies}")
    for final in finals:
        if final.content != expected or final.finished_reason != "completed":
            problems.append(f"answered {final.content!r} ({final.finished_reason})")
    published = [m for m in events if isinstance(m, FinalAnswer)]
    if len(published) != 1 if events_once else not published:
        problems.append(f"{len(published)} final answers written in the journal")
    if any(m.content != expected for m in published):
        problems.append(f"final answers written in the journal: {[m.content for m in published]}")
    if record is None:
        return [*problems, "the session is not stored"]
    if record.status != "done":
        problems.append(f"stored {record.status}, not done")
    if record.final is None or record.final.get("content") != expected:
        problems.append(f"stored final {record.final}")
    memory = record.state.memory
    users = [m.text for m in memory if m.role == "user"]
    if users != [asked.text]:
        problems.append(f"user messages in memory: {users}")
    uses = [(i, u) for i, m in enumerate(memory) for u in m.tool_uses]
    if [u.input.get("step") for _, u in uses] != list(range(1, asked.steps + 1)):
        problems.append(f"tool calls in memory: {[u.input for _, u in uses]}")
    for index, use in uses:
        results = [r for m in memory[index + 1 :] for r in m.tool_results if r.id == use.id]
        earlier = [r for m in memory[: index + 1] for r in m.tool_results if r.id == use.id]
        value = step_value(asked.job, int(use.input.get("step", 0)))
        if len(results) != 1 or earlier:
            problems.append(
                f"call {use.id} has {len(results)} results after it, {len(earlier)} before"
            )
        elif results[0].state != "success" or results[0].output != value:
            problems.append(f"call {use.id}: {results[0].state} {results[0].output!r}")
    used = {u.id for _, u in uses}
    strays = [r.id for m in memory for r in m.tool_results if r.id not in used]
    if strays:
        problems.append(f"results of calls never asked: {strays}")
    # A call travels as <reply id>.<tool_use id>: one reply per session here.
    sent_ids = {str(c.call_id) for c in wire if c.session_id == asked.session}
    replies = {i.partition(".")[0] for i in sent_ids}
    stored_reply = record.final.get("call_id") if record.final and not asked.call_id else None
    if len(replies) > 1 or (stored_reply is not None and replies - {stored_reply}):
        problems.append(f"calls sent for replies {sorted(replies)}, the stored one {stored_reply}")
    sent_uses = {i.partition(".")[2] for i in sent_ids}
    if sent_uses != used:
        problems.append(f"call_ids sent {sorted(sent_ids)}, tool_use ids stored {sorted(used)}")
    for step in range(1, asked.steps + 1):
        if runs[asked.job, step] != 1:
            problems.append(f"step {step} ran {runs[asked.job, step]} times")
    return problems


def report(
    fleet: Fleet,
    asked: list[Asked],
    records: dict[str, Any],
    events: list[AnyMessage],
    wire: list[ToolCall],
    *,
    events_once: bool = True,
) -> Iterator[str]:
    runs = fleet.tool_runs()
    for a in asked:
        mine = [m for m in events if m.session_id == a.session]
        problems = problems_of(a, records.get(a.session), mine, wire, runs, events_once=events_once)
        if problems:
            yield (
                f"=== session {a.session} ({a.text}):\n  "
                + "\n  ".join(problems)
                + f"\nstored: {describe(records.get(a.session))}\n"
                + fleet.logs(a.session)
            )


# -- the tests -------------------------------------------------------------------------------


async def test_requests_survive_replicas_killed_at_random(
    nats_server: EmbeddedServer, bus: Bus, tmp_path: Path
) -> None:
    """12 sessions of 3 tool steps each on 2 replicas; once every request is
    taken, a random replica is SIGKILLed every 0.3-1.5 s (and replaced), at
    most 8 times, until every request is answered."""
    rng = random.Random(SEED)
    store = await SessionStore.open(bus, owner="chaos-test")
    async with fleet(nats_server, bus, tmp_path, 2) as running:
        wire, stop_wire = await tap_calls(bus)
        events, stop_events = await listen(bus, bus.subjects.all_events(AGENT))
        asked: list[Asked] = []
        closers = [stop_wire, stop_events]
        for n in range(12):
            one, unsubscribe = await ask(bus, f"job j{n} 3")
            asked.append(one)
            closers.append(unsubscribe)
        sessions = [a.session for a in asked]
        # The promise starts once a replica holds the request (with its lease).
        await taken(store, sessions, 10)
        async with asyncio.TaskGroup() as tg:
            killer = tg.create_task(chaos(running, rng, asked, max_kills=8))
            waiting = tg.create_task(wait_for(lambda: all(a.answered for a in asked), timeout=60))
        kills = killer.result()
        # Unanswered requests (if any) are reported below, with their sessions.
        records = await settled(store, sessions, 15 if waiting.result() else 1)
        await asyncio.sleep(0.5)  # a second answer would come now
        await bus.flush()
        for close in closers:
            await close()
        take_overs = running.logs("taking over session").count("taking over session")
        calls = [call for _, call in wire]
        failures = list(report(running, asked, records, events, calls))
    resent = len(calls) - len({c.call_id for c in calls})
    print(
        f"seed {SEED}: {kills} kills ({running.killed}), {take_overs} take-overs, "
        f"{resent} calls sent again"
    )
    assert not failures, "\n\n".join(failures)
    assert kills >= 1
    assert take_overs >= 1  # the kills hit sessions in flight


async def kill_owner_when(
    running: Fleet, store: SessionStore, session: str, ready: Callable[[SessionRecord], bool]
) -> SessionRecord:
    """Once the stored session satisfies ``ready``, SIGKILL the replica that
    holds it (unless it is dead already); the record seen then."""
    deadline = time.monotonic() + 20
    while True:
        record = await store.get(AGENT, session)
        if record is not None and ready(record):
            break
        assert time.monotonic() < deadline, f"{session} never got there: {describe(record)}"
        await asyncio.sleep(0.02)
    victim = running.replica(record.owner)
    if victim is not None:
        running.kill(victim)
    return record


async def test_kills_in_the_first_model_call_and_in_tool_calls(
    nats_server: EmbeddedServer, bus: Bus, tmp_path: Path
) -> None:
    """The replica of session m is killed while its first model call runs
    (1 s): the input is not lost. The replicas of sessions t and w are killed
    while their tool runs (2 s, 10 s): the call is sent again with the same
    call_id and the tool runs once; w's tool still runs when the call comes
    again, so the worker joins the run."""
    store = await SessionStore.open(bus, owner="chaos-test")
    async with fleet(nats_server, bus, tmp_path, 2) as running:
        wire, stop_wire = await tap_calls(bus)
        events, stop_events = await listen(bus, bus.subjects.all_events(AGENT))
        thinking, stop_thinking = await ask(bus, "job m 2 slow-model=1")
        acting, stop_acting = await ask(bus, "job t 2 slow-tool=2")
        waiting, stop_waiting = await ask(bus, "job w 1 slow-tool=10")
        asked = [thinking, acting, waiting]
        # Killed only once every request is taken: a replica killed with a
        # request it has not taken yet: test_requests_held_by_a_killed_replica.
        await taken(store, [a.session for a in asked], 10)

        def in_first_model_call(record: SessionRecord) -> bool:
            # The request is in the journal's taken fact; the input is not
            # written apart (a take-over serves the request from its start).
            return (
                record.status == "running"
                and record.pending_input is not None
                and not record.state.memory
            )

        def in_first_tool_call(job: str) -> Callable[[SessionRecord], bool]:
            def check(record: SessionRecord) -> bool:
                uses = [u for m in record.state.memory for u in m.tool_uses]
                return len(uses) == 1 and running.tool_runs()[job, 1] >= 1

            return check

        async with asyncio.TaskGroup() as tg:
            kills = [
                tg.create_task(
                    kill_owner_when(running, store, thinking.session, in_first_model_call)
                ),
                tg.create_task(
                    kill_owner_when(running, store, acting.session, in_first_tool_call("t"))
                ),
                tg.create_task(
                    kill_owner_when(running, store, waiting.session, in_first_tool_call("w"))
                ),
            ]
        answered = await wait_for(lambda: all(a.answered for a in asked), timeout=30)
        records = await settled(store, [a.session for a in asked], 15)
        await asyncio.sleep(0.5)  # a second answer would come now
        await bus.flush()
        for close in (stop_wire, stop_events, stop_thinking, stop_acting, stop_waiting):
            await close()
        calls = [call for _, call in wire]
        failures = list(report(running, asked, records, events, calls))
        logs = running.logs(*(a.session for a in asked))
    assert answered, logs
    assert not failures, "\n\n".join(failures)
    killed_thinking, killed_acting, killed_waiting = (k.result() for k in kills)
    # Killed in the model call: the request was stored, the model's answer was not.
    assert killed_thinking.pending_input is not None
    assert killed_thinking.pending_input["content"] == thinking.text
    assert not killed_thinking.state.memory
    for session, killed in ((acting, killed_acting), (waiting, killed_waiting)):
        # Killed in the tool call: the call was stored and sent, its result was not.
        memory = killed.state.memory
        assert [len(m.tool_uses) for m in memory] == [0, 1], describe(killed)
        assert not any(m.tool_results for m in memory)
        stored = next(u for m in records[session.session].state.memory for u in m.tool_uses)
        assert stored.id == memory[1].tool_uses[0].id
        sent = [c for c in calls if c.session_id == session.session and c.parameters["step"] == 1]
        assert len(sent) >= 2, sent  # sent again after the take-over...
        assert len({c.call_id for c in sent}) == 1  # ...with its call_id
        assert running.tool_runs()[session.job, 1] == 1
    # w's call came again while its tool ran (10 s from after the first sending,
    # so any time under 10 s is while it ran): the worker joined the run.
    times = [t for t, c in wire if c.session_id == waiting.session]
    print(f"w's call sent again {times[1] - times[0]:.1f} s after its first sending")
    assert times[1] - times[0] < 10.0, times


async def test_requests_held_by_a_killed_replica(
    nats_server: EmbeddedServer, bus: Bus, tmp_path: Path
) -> None:
    """A replica that runs one reply at a time holds four more requests it
    has not taken (no lease, no receipt) when it is SIGKILLed. Each was sent
    again by its client, to the same replica (which holds it, and takes it
    once), then to the replica started in its place: every request is
    answered once, and each session holds it once."""
    store = await SessionStore.open(bus, owner="chaos-test")
    async with fleet(nats_server, bus, tmp_path, 1, args=["--concurrency", "1"]) as running:
        wire, stop_wire = await tap_calls(bus)
        events, stop_events = await listen(bus, bus.subjects.all_events(AGENT))
        texts = ["job busy 1 slow-model=8", *(f"job held{n} 1" for n in range(4))]
        asked = [Asked(parse_job(text)[0], parse_job(text)[1], text, []) for text in texts]

        async def ask_remote(one: Asked) -> None:
            remote = RemoteAgent(bus, AGENT, session_id=one.session, timeout=60)
            answer = await remote.reply(one.text)
            one.call_id = answer.call_id
            one.replies.append(answer)

        async with asyncio.TaskGroup() as tg:
            for one in asked:
                tg.create_task(ask_remote(one))
                await asyncio.sleep(0.05)  # the busy one first
            await taken(store, [asked[0].session], 10)
            # Past the first sending again (RESEND_AFTER), still held untaken.
            await asyncio.sleep(RESEND_AFTER + 1.5)
            held = [await store.get(AGENT, one.session) for one in asked[1:]]
            assert held == [None] * 4, [describe(r) for r in held]
            # Only this replica need be busy while the others are held: the
            # one in its place serves the busy request again without its 8 s.
            running.kill(running.replicas[0], {FAST_ENV: "1"})
        records = await settled(store, [a.session for a in asked], 15)
        await asyncio.sleep(0.5)  # a second answer would come now
        await bus.flush()
        for close in (stop_wire, stop_events):
            await close()
        calls = [call for _, call in wire]
        failures = list(report(running, asked, records, events, calls))
    assert not failures, "\n\n".join(failures)


async def test_replicas_killed_as_their_replies_end(
    nats_server: EmbeddedServer, bus: Bus, tmp_path: Path
) -> None:
    """A replica kills itself right after publishing the final answer event of
    one session (the answer is in the stored memory, the session not yet
    stored done, the requester not answered); another right before releasing
    the lease of a session it has just stored done (the requester not
    answered). Each requester still gets its answer once, and each session
    ends stored done with it."""
    dying = tmp_path / "died"
    dying.mkdir()
    store = await SessionStore.open(bus, owner="chaos-test")
    async with fleet(nats_server, bus, tmp_path, 2, {DIE_ENV: str(dying)}) as running:
        wire, stop_wire = await tap_calls(bus)
        events, stop_events = await listen(bus, bus.subjects.all_events(AGENT))
        answered, stop_answered = await ask(bus, "job die-answered 2")
        stored, stop_stored = await ask(bus, "job die-stored 2")
        asked = [answered, stored]
        assert [a.session for a in asked] == [DIE_ANSWERED, DIE_STORED]

        def over() -> bool:
            running.revive()
            return all(a.answered for a in asked)

        await wait_for(over, timeout=45)
        records = await settled(store, [a.session for a in asked], 5)
        await asyncio.sleep(0.5)  # a second answer would come now
        await bus.flush()
        for close in (stop_wire, stop_events, stop_answered, stop_stored):
            await close()
        calls = [call for _, call in wire]
        failures = list(report(running, asked, records, events, calls))
    assert sorted(p.name for p in dying.iterdir()) == [DIE_ANSWERED, DIE_STORED]
    assert not failures, "\n\n".join(failures)
