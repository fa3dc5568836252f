"""A replica cut off from the bus by a network partition loses its session
to another replica, and its tool call is left to that replica: when the
network is back, no ``cancel`` of the call reaches the worker, the tool runs
once, and the new owner's reply gets the tool's real result.

The partition is real: the losing replica is a ``fleetbus agent`` process in
a network namespace of its own, joined to the NATS server by a veth pair
(addresses in 10.213.0.0/16, made and removed by the test), and its link is
set down, then up. Needs root and ``ip`` (skipped otherwise). The server,
the tool worker and the replica taking over run in the test's process, in
the root namespace.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from fleetbus.agents import Agent
from fleetbus.agents.serving import RemoteAgent
from fleetbus.bus import Bus, EmbeddedServer
from fleetbus.protocol import encode
from fleetbus.testing import ScriptedModel
from fleetbus.tools_workers import Toolkit, ToolWorker
from tests.helpers import ROOT, worker_running
from tests.integration.test_session_loss_calls import (
    AGENT,
    SENDER,
    WAIT,
    Gate,
    assert_recorded_success,
    calls_of,
    cancels,
    gated_tools,
    replica,
    seen,
    think,
)

pytestmark = pytest.mark.slow


def asker() -> Agent:
    """The agent of the replica in the namespace (its ``gated`` tool comes
    from the bus, as ``fleetbus agent`` adds the tools it discovers)."""
    return Agent(AGENT, "", ScriptedModel([think], repeat_last=True), toolkit=Toolkit())


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


def _can_make_namespaces() -> str | None:
    """Why namespaces cannot be used here, or ``None``."""
    if shutil.which("ip") is None:
        return "no ip command"
    if os.geteuid() != 0:
        return "network namespaces need root"
    name = f"fbprobe{os.getpid()}"
    try:
        _ip("netns", "add", name)
        _ip("netns", "del", name)
    except (subprocess.CalledProcessError, OSError) as exc:
        return f"cannot make a network namespace: {exc}"
    return None


@contextmanager
def namespace() -> Iterator[tuple[str, str, str, str]]:
    """A network namespace joined to this one by a veth pair: its name, the
    link on this side, this side's address and the namespace's address."""
    tag = f"{os.getpid() % 10000}{random.randrange(100, 1000)}"
    name, outside, inside = f"fbns{tag}", f"fbo{tag}", f"fbi{tag}"
    subnet = f"10.213.{random.randrange(1, 255)}"
    near, far = f"{subnet}.1", f"{subnet}.2"
    _ip("netns", "add", name)
    try:
        _ip("link", "add", outside, "type", "veth", "peer", "name", inside)
        try:
            _ip("link", "set", inside, "netns", name)
            _ip("addr", "add", f"{near}/30", "dev", outside)
            _ip("link", "set", outside, "up")
            _ip("-n", name, "addr", "add", f"{far}/30", "dev", inside)
            _ip("-n", name, "link", "set", inside, "up")
            _ip("-n", name, "link", "set", "lo", "up")
            yield name, outside, near, far
        finally:
            subprocess.run(["ip", "link", "del", outside], capture_output=True, timeout=30)
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)


def _path() -> str:
    """The repository first on the path, then what the environment adds."""
    return os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)


def start_in(
    netns: str, spec: str, url: str, prefix: str, replica: str, log: Path, *options: str
) -> subprocess.Popen[bytes]:
    """``fleetbus agent SPEC`` in the namespace ``netns`` on ``url`` only, as
    replica ``replica`` with a 1 s lease; its output in ``log``."""
    with log.open("wb") as out:
        return subprocess.Popen(
            [
                *("ip", "netns", "exec", netns),
                *(sys.executable, "-m", "fleetbus", *options, "agent", spec),
                *("--nats", url, "--prefix", prefix),
                *("--lease-ttl", "1", "--replica-id", replica),
            ],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": _path(), "COLUMNS": "300"},
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def start_loser(netns: str, url: str, prefix: str, log: Path) -> subprocess.Popen[bytes]:
    """``fleetbus agent`` serving :func:`asker` in the namespace ``netns``
    (replica ``loser``, a 1 s lease, debug lines in ``log``)."""
    spec = "tests.integration.test_session_partition:asker"
    return start_in(netns, spec, url, prefix, "loser", log, "-vv")


async def wait_for_line(log: Path, text: str, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        if text in log.read_text(errors="replace"):
            return
        if proc.poll() is not None:
            raise AssertionError(f"the replica exited ({proc.returncode}):\n{log.read_text()}")
        await asyncio.sleep(0.05)
    raise AssertionError(f"no {text!r} in {log} after {WAIT}s:\n{log.read_text()}")


async def test_a_replica_cut_off_by_a_partition_leaves_its_tool_call_to_the_new_owner(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    why = _can_make_namespaces()
    if why is not None:
        pytest.skip(why)
    caplog.set_level(logging.INFO)
    gate = Gate()
    prefix = f"part{random.randrange(10**8)}"
    with namespace() as (netns, link, near, _), EmbeddedServer(host=near) as server:
        bus = await Bus.connect(server.url, prefix=prefix, name="test-client")
        log = tmp_path / "loser.log"
        worker = ToolWorker(bus, gated_tools(gate), worker_id="w1")
        tools, control = bus.subjects.tool("gated"), bus.subjects.tool_control("gated")
        try:
            async with (
                worker_running(worker),
                seen(bus, tools) as sent,
                seen(bus, control) as heard,
            ):
                loser = start_loser(netns, server.url, prefix, log)
                try:
                    await wait_for_line(log, "serving", loser)
                    asking = asyncio.create_task(
                        RemoteAgent(bus, AGENT, session_id="p1").reply("go", timeout=WAIT)
                    )
                    try:
                        async with asyncio.timeout(WAIT):
                            await gate.started.wait()  # the loser's call runs on the worker
                        async with replica(server.url, prefix, "successor", recover_interval=0.1):
                            _ip("link", "set", link, "down")  # the partition
                            try:
                                # The lease goes silent: the successor takes the
                                # session over and sends the call again.
                                await sent.until(lambda m: len(calls_of(m)) >= 2)
                                await wait_for_line(log, "session p1 was lost", loser)
                            finally:
                                _ip("link", "set", link, "up")
                            # Whatever the loser had to send reaches the server
                            # before it exits (it drains); then the worker has
                            # it before a round trip on its own connection.
                            loser.send_signal(signal.SIGTERM)
                            await asyncio.to_thread(loser.wait, WAIT)
                            await bus.flush()
                            first = calls_of(sent.messages)[0]
                            # The worker answers a check of the call only after
                            # whatever came before on its control subject.
                            await bus.nc.request(control, encode(first), timeout=WAIT)
                            gate.opened.set()
                            answer = await asyncio.wait_for(asking, WAIT)
                    finally:
                        asking.cancel()
                    await assert_recorded_success(bus, first.call_id or "", "x: run 1")
                finally:
                    if loser.poll() is None:
                        loser.kill()
                        loser.wait(30)
        finally:
            await bus.close()
    text = log.read_text(errors="replace")
    assert "left to run for the session's next owner" in text, text
    assert "taking over session p1 from asker@loser" in caplog.text
    assert cancels(heard.messages) == []
    assert worker.cancelled == 0
    assert gate.runs == 1
    assert {c.call_id for c in calls_of(sent.messages)} == {first.call_id}
    assert all(c.sender == SENDER for c in calls_of(sent.messages))
    assert answer.content == "got x: run 1"
