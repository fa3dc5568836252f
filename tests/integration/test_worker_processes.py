"""Tool workers as separate OS processes: load sharing, a worker killed
mid-call, draining on SIGTERM, discovery."""

from __future__ import annotations

import asyncio
import signal
from collections import Counter
from pathlib import Path

from fleetbus.bus import Bus, EmbeddedServer, ToolClient
from fleetbus.protocol import ErrorMessage, decode
from tests.helpers import output, spawn, wait_for_file, wait_for_workers, workers

SPEC = "tests.integration.worker_tools"


async def test_calls_spread_over_two_worker_processes(
    nats_server: EmbeddedServer, bus: Bus, tmp_path: Path
) -> None:
    env = {"FLEETBUS_TEST_DIR": str(tmp_path)}
    with workers(nats_server.url, bus.prefix, 2, spec=SPEC, env=env):
        await wait_for_workers(bus, "echo", 2)
        client = ToolClient(bus, timeout=5)
        results = await asyncio.gather(*(client.call("echo", {"text": str(i)}) for i in range(200)))
    assert [r.content for r in results] == [str(i) for i in range(200)]
    shares = Counter(r.sender for r in results)
    assert set(shares) == {"w1", "w2"}
    assert min(shares.values()) >= 40  # a queue group splits randomly; 40/200 is far below even


async def test_discovery_counts_both_workers(nats_server: EmbeddedServer, bus: Bus) -> None:
    with workers(nats_server.url, bus.prefix, 2, spec=SPEC):
        await wait_for_workers(bus, "record", 2)
        tools = await ToolClient(bus).discover()
    assert set(tools) == {"echo", "record"}
    assert tools["record"].workers == 2
    assert sorted(tools["record"].worker_ids) == ["w1", "w2"]
    assert tools["record"].parameters["properties"]["tag"]["description"] == "names the marks."


async def test_a_call_survives_its_worker_being_killed(
    nats_server: EmbeddedServer, bus: Bus, tmp_path: Path
) -> None:
    env = {"FLEETBUS_TEST_DIR": str(tmp_path)}
    with workers(nats_server.url, bus.prefix, 2, spec=SPEC, env=env) as procs:
        await wait_for_workers(bus, "record", 2)
        client = ToolClient(bus, timeout=1.5, reply_grace=0.2, attempts=3)
        call = asyncio.create_task(
            client.call("record", {"tag": "kill", "delay": 1.0}, call_id="k-1")
        )
        first_start = await wait_for_file(tmp_path, "kill.*.start")
        victim_pid = int(first_start.read_text())
        victim = next(p for p in procs if p.pid == victim_pid)
        victim.send_signal(signal.SIGKILL)
        result = await asyncio.wait_for(call, 15)
        victim.wait(5)
    assert result.ok
    assert result.call_id == "k-1"
    assert isinstance(result.content, dict)
    survivor_pid = result.content["pid"]
    assert survivor_pid != victim_pid
    assert sorted(p.name for p in tmp_path.glob("kill.*.done")) == [f"kill.{survivor_pid}.done"]
    assert not (tmp_path / f"kill.{victim_pid}.done").exists()


async def test_sigterm_drains_the_call_in_flight_then_exits_0(
    nats_server: EmbeddedServer, bus: Bus, tmp_path: Path
) -> None:
    env = {"FLEETBUS_TEST_DIR": str(tmp_path)}
    with workers(nats_server.url, bus.prefix, 1, spec=SPEC, env=env) as procs:
        await wait_for_workers(bus, "record", 1)
        client = ToolClient(bus, timeout=10)
        call = asyncio.create_task(
            client.call("record", {"tag": "drain", "delay": 0.7}, attempts=1)
        )
        await wait_for_file(tmp_path, "drain.*.start")
        procs[0].send_signal(signal.SIGTERM)
        result = await asyncio.wait_for(call, 15)
        code = await asyncio.to_thread(procs[0].wait, 15)
        log = output(procs[0])
    assert result.ok
    assert code == 0
    assert "drained and stopped" in log
    assert (tmp_path / f"drain.{procs[0].pid}.done").exists()


async def test_a_worker_process_answers_garbage_and_keeps_serving(
    nats_server: EmbeddedServer, bus: Bus
) -> None:
    with workers(nats_server.url, bus.prefix, 1, spec=SPEC) as procs:
        await wait_for_workers(bus, "echo", 1)
        for payload in (b"\xff\xfe\x00", b"[]", b'{"type":"tool_call","version":7,"call_id":"v7"}'):
            reply = decode(
                (await bus.nc.request(bus.subjects.tool("echo"), payload, timeout=5)).data
            )
            assert isinstance(reply, ErrorMessage)
            assert reply.source_component == "w1"
        result = await ToolClient(bus).call("echo", {"text": "still here"})
        assert result.content == "still here"
        assert procs[0].poll() is None


def test_a_worker_with_a_bad_spec_exits_with_one_clear_line(nats_server: EmbeddedServer) -> None:
    proc = spawn(["worker", "no.such.module", "--nats", nats_server.url])
    code = proc.wait(60)
    log = output(proc)
    assert code == 1
    assert "cannot import 'no.such.module'" in log
    assert "Traceback" not in log
