"""One reply is one trace across processes: the agent's spans here (an SDK
provider with an in-memory exporter), the tool worker's in its own process
(exported to its output by ``OTEL_TRACES_EXPORTER=console``), joined by the
``traceparent`` the tool call carries in its NATS headers."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from fleetbus.agents import Agent
from fleetbus.bus import Bus, EmbeddedServer, ToolClient
from fleetbus.errors import FleetbusError
from fleetbus.models.bus_model import BusChatModel
from fleetbus.protocol import FinalAnswer, UserRequest
from fleetbus.testing import ScriptedModel
from fleetbus.tools_workers import Toolkit
from tests.helpers import ROOT, stop, wait_for_workers
from tests.integration.test_openai_through_worker import wait_for_model


def exported(text: str) -> list[dict[str, Any]]:
    """The JSON spans the console exporter printed, among other output."""
    decoder = json.JSONDecoder()
    found: list[dict[str, Any]] = []
    at = text.find("{")
    while at >= 0:
        try:
            value, end = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            at = text.find("{", at + 1)
            continue
        if isinstance(value, dict) and "context" in value and "name" in value:
            found.append(value)
        at = text.find("{", end)
    return found


@pytest.mark.slow
async def test_a_reply_and_its_tool_call_on_a_worker_process_are_one_trace(
    nats_server: EmbeddedServer, bus: Bus, spans: InMemorySpanExporter, tmp_path: Path
) -> None:
    log = tmp_path / "worker.out"
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "OTEL_TRACES_EXPORTER": "console",
        "OTEL_SERVICE_NAME": "calculator-worker",
    }
    command = [sys.executable, "-m", "fleetbus", "worker", "fleetbus.tools_workers.builtin"]
    command += ["--nats", nats_server.url, "--prefix", bus.prefix, "--worker-id", "traced"]
    with log.open("wb") as out:
        worker = subprocess.Popen(  # noqa: ASYNC220 - started, not waited on
            command,
            cwd=ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
        try:
            await wait_for_workers(bus, "calculator", 1)
            toolkit = Toolkit()
            await toolkit.add_remote(ToolClient(bus), ["calculator"])
            model = ScriptedModel(
                [
                    ScriptedModel.call("calculator", {"expr": "6 * 7"}, call_id="k1"),
                    ScriptedModel.text("42"),
                ]
            )
            agent = Agent("tracer", "", model, toolkit=toolkit)
            final = await agent.reply("6 times 7?")
        finally:
            assert stop(worker) == 0  # a clean exit flushes the worker's spans
    assert final.content == "42"
    here = {s.name: s for s in spans.get_finished_spans()}
    reply, call = here["fleetbus reply"], here["fleetbus tool call"]
    trace_id = f"0x{reply.context.trace_id:032x}"
    worker_spans = [s for s in exported(log.read_text()) if s["name"] == "fleetbus tool run"]
    assert len(worker_spans) == 1, log.read_text()[-2000:]
    (run,) = worker_spans
    assert run["context"]["trace_id"] == trace_id  # one trace across the two processes
    assert run["parent_id"] == f"0x{call.context.span_id:016x}"  # under the agent's tool call
    assert run["kind"] == "SpanKind.SERVER"
    assert run["attributes"]["fleetbus.served_by"] == "traced"
    assert run["resource"]["attributes"]["service.name"] == "calculator-worker"


async def answered(bus: Bus, agent: str, timeout: float = 30.0) -> None:
    """Wait until ``agent`` answers a request (its process is serving)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        try:
            reply = await bus.request(
                bus.subjects.agent_inbox(agent),
                UserRequest(content="ready?", session_id="warm-up"),
                timeout=2.0,
            )
        except FleetbusError:
            reply = None
        if isinstance(reply, FinalAnswer):
            return
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"{agent} did not answer within {timeout}s")
        await asyncio.sleep(0.1)


def _traced_process(command: list[str], out: Any, service: str) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "OTEL_TRACES_EXPORTER": "console",
        "OTEL_SERVICE_NAME": service,
    }
    return subprocess.Popen(
        [sys.executable, "-m", "fleetbus", *command],
        cwd=ROOT,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=out,
        stderr=subprocess.STDOUT,
    )


@pytest.mark.slow
async def test_a_reply_on_a_model_worker_with_a_tool_worker_is_one_trace(
    nats_server: EmbeddedServer, bus: Bus, spans: InMemorySpanExporter, tmp_path: Path
) -> None:
    on_bus = ["--nats", nats_server.url, "--prefix", bus.prefix]
    tools_log, model_log = tmp_path / "tools.out", tmp_path / "model.out"
    with tools_log.open("wb") as tools_out, model_log.open("wb") as model_out:
        tools = _traced_process(
            ["worker", "fleetbus.tools_workers.builtin", *on_bus, "--worker-id", "t1"],
            tools_out,
            "tools",
        )
        model_worker = _traced_process(
            ["model-worker", "--model", "offline", "--serve-as", "offline", *on_bus],
            model_out,
            "models",
        )
        try:
            await wait_for_workers(bus, "calculator", 1)
            await wait_for_model(bus, "offline")  # it may start after the tool worker
            toolkit = Toolkit()
            await toolkit.add_remote(ToolClient(bus), ["calculator"])
            model = BusChatModel(bus, "offline", timeout=20)
            agent = Agent("planner", "", model, toolkit=toolkit)
            final = await agent.reply("What is 6 * 7? Use the calculator.", session_id="s-traced")
        finally:
            assert stop(tools) == 0
            assert stop(model_worker) == 0
    assert "42" in str(final.content)
    here = spans.get_finished_spans()
    (reply,) = [s for s in here if s.name == "fleetbus reply"]
    model_calls = {s.context.span_id for s in here if s.name == "fleetbus model call"}
    tool_calls = {s.context.span_id for s in here if s.name == "fleetbus tool call"}
    trace_id = f"0x{reply.context.trace_id:032x}"
    served = [s for s in exported(model_log.read_text()) if s["name"] == "fleetbus model worker"]
    runs = [s for s in exported(tools_log.read_text()) if s["name"] == "fleetbus tool run"]
    assert len(served) == len(model_calls) >= 2, model_log.read_text()[-2000:]
    assert len(runs) == len(tool_calls) == 1, tools_log.read_text()[-2000:]
    for span in [*served, *runs]:
        assert span["context"]["trace_id"] == trace_id  # the agent, the model, the tool: one trace
    assert {int(s["parent_id"], 16) for s in served} == model_calls
    assert {int(s["parent_id"], 16) for s in runs} == tool_calls
    # The ids on both sides are the ones sent on the wire: the model worker
    # names the session, the agent's tool call the call_id the worker saw.
    assert {s["attributes"]["fleetbus.session_id"] for s in served} == {"s-traced"}
    (tool_call,) = [s for s in here if s.name == "fleetbus tool call"]
    assert tool_call.attributes is not None
    assert tool_call.attributes["fleetbus.call_id"] == runs[0]["attributes"]["fleetbus.call_id"]
    assert runs[0]["attributes"]["fleetbus.session_id"] == "s-traced"


@pytest.mark.slow
async def test_fleetbus_ask_is_one_trace_through_the_agent_and_the_tool_worker(
    nats_server: EmbeddedServer, bus: Bus, tmp_path: Path
) -> None:
    on_bus = ["--nats", nats_server.url, "--prefix", bus.prefix]
    spec = tmp_path / "agents.toml"
    spec.write_text('[agent.calc]\nsystem_prompt = "You compute."\nmodel = "offline"\n')
    logs = {name: tmp_path / f"{name}.out" for name in ("tools", "agent", "ask")}
    with (
        logs["tools"].open("wb") as tools_out,
        logs["agent"].open("wb") as agent_out,
        logs["ask"].open("wb") as ask_out,
    ):
        tools = _traced_process(
            ["worker", "fleetbus.tools_workers.builtin", *on_bus], tools_out, "tools"
        )
        agent = None
        try:
            await wait_for_workers(bus, "calculator", 1)
            agent = _traced_process(["agent", str(spec), *on_bus], agent_out, "agents")
            await answered(bus, "calc")
            ask = _traced_process(
                ["ask", "calc", "What is 6 * 7? Use the calculator.", *on_bus], ask_out, "cli"
            )
            assert await asyncio.to_thread(ask.wait, 60) == 0
        finally:
            for proc in (agent, tools):
                if proc is not None:
                    assert stop(proc) == 0
    found = {name: exported(path.read_text()) for name, path in logs.items()}
    (asked,) = [s for s in found["ask"] if s["name"] == "fleetbus ask"]
    trace_id = asked["context"]["trace_id"]

    def traced(name: str, where: str) -> list[dict[str, Any]]:
        # The readiness request above is a trace of its own: only the ask's counts.
        return [
            s for s in found[where] if s["name"] == name and s["context"]["trace_id"] == trace_id
        ]

    served = traced("fleetbus agent request", "agent")
    calls = traced("fleetbus tool call", "agent")
    runs = traced("fleetbus tool run", "tools")
    assert len(served) == 1, logs["agent"].read_text()[-2000:]
    assert len(traced("fleetbus reply", "agent")) == 1
    assert len(calls) == len(runs) == 1  # the CLI, the agent, the worker: one trace
    assert served[0]["parent_id"] == asked["context"]["span_id"]
    assert runs[0]["parent_id"] == calls[0]["context"]["span_id"]
    assert "42" in logs["ask"].read_text()
