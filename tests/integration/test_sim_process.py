"""``fleetbus sim run`` as people run it: child processes for the hosts and
the tool workers, a runner killed by SIGKILL and resumed, mistakes that get
one clear line."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import orjson
import pytest

from fleetbus.bus import Bus, EmbeddedServer, key_value
from fleetbus.cli.main import main
from fleetbus.models.model import ModelRequest, ModelResponse, ModelStreamItem
from fleetbus.protocol import TextBlock, ToolResultBlock, ToolUseBlock, new_id
from fleetbus.sim import AgentTemplate, Environment, Population, RunFiles, Simulation
from fleetbus.sim.processes import server_threads
from tests.helpers import output, spawn, stop
from tests.integration.test_examples import is_running
from tests.integration.test_sim_runner import simulation

NAMES = ("ada", "bob", "cy", "dee")


def killable() -> Simulation:
    """Four agents, three rounds; each answer waits ``SIM_TEST_DELAY`` seconds."""
    delay = float(os.environ.get("SIM_TEST_DELAY", "0"))
    return simulation(NAMES, delays=dict.fromkeys(NAMES, delay), rounds=3)


class WaitThenCall:
    """Waits ``SIM_TEST_DELAY`` seconds, then calls ``env_add`` on the tool
    worker, then answers: a reply that needs the worker after a while."""

    name = "wait-then-call"

    async def stream(self, request: ModelRequest) -> AsyncIterator[ModelStreamItem]:
        if not any(isinstance(b, ToolResultBlock) for b in request.messages[-1].content):
            await asyncio.sleep(float(os.environ.get("SIM_TEST_DELAY", "0")))
            use = ToolUseBlock(id=f"c-{new_id()[:8]}", name="env_add", input={"key": "visits"})
            yield ModelResponse([use], finish_reason="tool_calls")
            return
        yield ModelResponse([TextBlock(text="visits=1 ")], finish_reason="stop")


def interruptible() -> Simulation:
    """Four agents, one round; each reply calls the tool worker after ``SIM_TEST_DELAY`` s."""
    sim = simulation(NAMES, rounds=1)
    template = AgentTemplate(system_prompt="You are {name}.", model=WaitThenCall())
    sim.population = Population.from_rows([{"name": n} for n in NAMES], template=template)
    return sim


def crowded() -> Simulation:
    """Twelve agents, one round; each answer takes a second."""
    names = tuple(f"p{n}" for n in range(12))
    return simulation(names, delays=dict.fromkeys(names, 1.0), rounds=1)


async def leases_held(url: str, prefix: str, count: int, deadline: float) -> None:
    """Wait until ``count`` sessions are held (their leases live)."""
    async with await Bus.connect(url, prefix=prefix, name="lease-watch") as bus:
        leases = await key_value(bus, "session_leases", create=False)
        while len(await leases.keys()) < count:
            assert time.monotonic() < deadline, await leases.keys()
            await asyncio.sleep(0.02)


def all_exited(pids: list[int], within: float, said: str) -> None:
    """Wait until none of ``pids`` runs (up to ``within`` seconds)."""
    deadline = time.monotonic() + within
    while [pid for pid in pids if is_running(pid)]:
        assert time.monotonic() < deadline, said
        time.sleep(0.05)


def sim_run(spec: str, server: EmbeddedServer, prefix: str, out: Path, *extra: str) -> list[str]:
    """``fleetbus sim run`` of this module's ``spec`` on the test's server."""
    spec = f"tests.integration.test_sim_process:{spec}"
    return ["sim", "run", spec, "--nats", server.url, "--prefix", prefix, "--out", str(out), *extra]


def round_started(run: subprocess.Popen[bytes], out: Path, deadline: float) -> None:
    """Wait until ``sim run`` starts its first round (it writes its summary)."""
    while not (out / "summary.json").exists():
        assert run.poll() is None, output(run)
        assert time.monotonic() < deadline
        time.sleep(0.05)


def once_held(
    run: subprocess.Popen[bytes],
    out: Path,
    server: EmbeddedServer,
    prefix: str,
    count: int,
    act: Callable[[], None],
) -> int:
    """Once ``run``'s first round holds ``count`` sessions, ``act``; then
    wait for ``run`` to end (killed if it does not): its exit code."""
    try:
        deadline = time.monotonic() + 60
        round_started(run, out, deadline)
        asyncio.run(leases_held(server.url, prefix, count, deadline))
        act()
        return run.wait(100)
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()


def pid_of(*needles: str) -> int | None:
    """The process whose command line holds every one of ``needles``."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if all(needle in cmdline for needle in needles):
            return int(entry.name)
    return None


def completed(out: Path) -> int:
    try:
        return int(orjson.loads((out / "state.json").read_bytes())["completed"])
    except (OSError, ValueError, KeyError):
        return 0


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_runner_killed_in_round_two_resumes_from_round_one(
    nats_server: EmbeddedServer, prefix: str, tmp_path: Path
) -> None:
    out = tmp_path / "run"
    command = sim_run("killable", nats_server, prefix, out)
    first = spawn(command, env={"SIM_TEST_DELAY": "1.0"})
    try:
        deadline = time.monotonic() + 60
        while completed(out) < 1 and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.4)  # round 2 is in flight: every agent waits to answer
        assert completed(out) == 1
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    said = output(first)
    children = [int(pid) for pid in re.findall(r"(?:tools|host)-1 (\d+)", said)]
    assert len(children) == 2, said
    # A crash while round 2's records were being written: half a line.
    with (out / "results.jsonl").open("ab") as f:
        f.write(b'{"round": 2, "agent": "ada", "sta')

    second = spawn(command)
    code = second.wait(60)
    said = output(second)
    assert code == 0, said
    assert "resuming visits after round 1 of 3" in said
    # They stop by themselves once the killed runner's pipe closes: the host
    # when its replies are over, which may be after the new run ended.
    all_exited(children, 60, said)

    files = RunFiles(out)
    records = list(files.records())
    assert sorted((r["round"], r["agent"]) for r in records) == sorted(
        (n, a) for n in (1, 2, 3) for a in NAMES
    )
    for round_no in (1, 2, 3):
        mine = [r for r in records if r["round"] == round_no]
        assert all(r["status"] == "ok" for r in mine), mine
        # The environment went on from round 1's snapshot: whatever the
        # killed round 2 added was rolled back.
        assert sorted(r["value"] for r in mine) == list(range(4 * round_no - 3, 4 * round_no + 1))
        assert all(f" at {4 * (round_no - 1)} |" in r["answer"] for r in mine)
        # Each agent's memory holds each round once: the killed round's first
        # attempt was rolled back with the environment.
        assert all(r["answer"].endswith(f"| seen={round_no}") for r in mine), mine
    assert files.read_snapshot(3) == {"rounds_applied": 3, "visits": 12}
    state = files.load_state()
    assert state is not None
    assert (state.completed, state.records) == (3, 12)
    assert state.results_bytes == files.results.stat().st_size
    assert [s.metrics["applied"] for s in state.rounds] == [1, 2, 3]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_host_killed_with_requests_queued_loses_none_of_them(
    nats_server: EmbeddedServer, prefix: str, tmp_path: Path
) -> None:
    """Two hosts running one reply at a time share twelve requests: each
    holds one reply and queues the others, which it has not taken (no
    lease). Host 1 is SIGKILLed: the runner had no receipt for its queued
    requests and sends them again, host 2 answers them, and takes over the
    reply host 1 was running. No agent is late."""
    out = tmp_path / "run"
    extra = ("--hosts", "2", "--host-concurrency", "1", "--deadline", "60")
    command = sim_run("crowded", nats_server, prefix, out, *extra)
    run = spawn(command)

    def kill_a_host() -> None:
        host = pid_of(prefix, "visits-host-1")
        assert host is not None
        os.kill(host, signal.SIGKILL)

    # Each host runs its first reply (1 s, holding its lease) and queues the rest.
    code = once_held(run, out, nats_server, prefix, 2, kill_a_host)
    said = output(run)
    assert code == 0, said
    records = list(RunFiles(out).records())
    assert len(records) == 12, said
    assert [r for r in records if r["status"] != "ok"] == [], said


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["ctrl-c", "runner killed"])
def test_a_run_stopped_mid_round_lets_its_hosts_finish_with_their_tools(
    nats_server: EmbeddedServer, prefix: str, tmp_path: Path, how: str
) -> None:
    """The runner interrupted (Ctrl-C), or killed (its children stop when
    its pipe closes), while every agent's reply runs, each still to call
    the tool worker: the hosts stop first and finish their replies (their
    drain), the tool worker after them, so every tool call is served and
    every lease released. Stopped together, the worker left at once and
    the hosts waited out their drain (30 s) for tool calls nobody served;
    on Ctrl-C they were then killed holding their sessions."""
    out = tmp_path / "run"
    command = sim_run("interruptible", nats_server, prefix, out)
    run = spawn(command, env={"SIM_TEST_DELAY": "1.0"})
    stop = signal.SIGINT if how == "ctrl-c" else signal.SIGKILL
    code = once_held(run, out, nats_server, prefix, len(NAMES), lambda: run.send_signal(stop))
    said = output(run)
    children = [int(pid) for pid in re.findall(r"(?:tools|host)-1 (\d+)", said)]
    assert len(children) == 2, said
    if how == "ctrl-c":
        assert code == 130, said
        assert "interrupted after round 0" in said, said
    else:  # they stop by themselves
        all_exited(children, 60, said)
    assert not [pid for pid in children if is_running(pid)]

    async def left() -> tuple[list[str], Any]:
        async with await Bus.connect(nats_server.url, prefix=prefix, name="leases") as bus:
            leases = await key_value(bus, "session_leases", create=False)
            environment = await Environment.open(bus, "visits")
            return await leases.keys(), await environment.get("visits")

    # Every reply called its tool, served, and released its session.
    assert asyncio.run(left()) == ([], len(NAMES)), said


@pytest.mark.parametrize(
    ("spec", "extra", "message"),
    [
        ("absent.py:simulation", [], "no file absent.py"),
        ("{dir}/spec.py:simulation", [], "people.csv: no column 'background' (columns: name, k)"),
        ("{dir}/spec.py:nothing", [], "has no attribute 'nothing'"),
        ("{dir}/spec.py:fixed", ["--nats", "nats://127.0.0.1:1"], "cannot connect to NATS"),
    ],
)
def test_mistakes_get_one_clear_line(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    spec: str,
    extra: list[str],
    message: str,
) -> None:
    monkeypatch.setenv("FLEETBUS_CONNECT_TIMEOUT", "0.5")
    (tmp_path / "people.csv").write_text("name,k\nada,1\n")
    (tmp_path / "spec.py").write_text(
        "from pathlib import Path\n"
        "from fleetbus.sim import AgentTemplate, Population, Simulation\n"
        "template = AgentTemplate(system_prompt='{background}', model='offline')\n"
        "def simulation() -> Simulation:\n"
        "    table = Path(__file__).with_name('people.csv')\n"
        "    pop = Population.from_table(table, template=template)\n"
        "    return Simulation(name='s', population=pop, prompt=lambda c, a: 'hi')\n"
        "pop = Population.generate(2, template=AgentTemplate())\n"
        "fixed = Simulation(name='s', population=pop, prompt=lambda c, a: 'hi')\n"
    )
    args = ["sim", "run", spec.replace("{dir}", str(tmp_path)), "--out", str(tmp_path / "o")]
    assert main([*args, *extra]) == 1
    err = capsys.readouterr().err
    assert "".join(message.split()) in "".join(err.split())  # rich may wrap a long path
    assert "Traceback" not in err
    assert err.startswith("error:"), err


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads the server's environment")
@pytest.mark.parametrize("asked", [None, "2"], ids=["its-share", "GOMAXPROCS-set"])
def test_a_runs_server_gets_a_share_of_the_cores_unless_gomaxprocs_says(
    tmp_path: Path, asked: str | None
) -> None:
    """``fleetbus sim server`` (what ``sim run`` starts) runs nats-server on
    a quarter of the cores, or on what ``GOMAXPROCS`` says."""
    proc = spawn(
        ["sim", "server", "--state-dir", str(tmp_path / "jetstream")],
        env={"GOMAXPROCS": asked} if asked else None,
    )
    try:
        assert proc.stdout is not None
        lines = [proc.stdout.readline().decode() for _ in range(2)]  # (and what it says)
        assert any(line.startswith("ready nats://") for line in lines), lines
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        servers = [
            pid for pid in children if Path(f"/proc/{pid}/exe").resolve().name == "nats-server"
        ]
        assert len(servers) == 1, children
        environ = Path(f"/proc/{servers[0]}/environ").read_bytes().split(b"\0")
        threads = [v.split(b"=", 1)[1].decode() for v in environ if v.startswith(b"GOMAXPROCS=")]
        assert threads == [asked or os.environ.get("GOMAXPROCS") or str(server_threads())]
    finally:
        stop(proc)


@pytest.mark.parametrize(
    ("cores", "threads"), [(1, 1), (2, 1), (3, 1), (4, 1), (8, 2), (16, 4), (64, 16)]
)
def test_a_runs_server_is_held_to_a_quarter_of_the_cores(
    monkeypatch: pytest.MonkeyPatch, cores: int, threads: int
) -> None:
    monkeypatch.delenv("GOMAXPROCS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    assert server_threads() == threads
    monkeypatch.setenv("GOMAXPROCS", "3")
    assert server_threads() is None
