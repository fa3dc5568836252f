"""The README's path with a small local model's habits: only ``OPENAI_BASE_URL``
and ``FLEETBUS_MODEL`` set, and the local Chat Completions server replaying
what small models send — the tool call written as text in a fenced JSON
block, then an answer that uses the result; or plain text, never a tool.

``fleetbus worker`` + ``fleetbus agent`` + ``fleetbus ask``, the same with the
model behind ``fleetbus model-worker``, and ``fleetbus demo``, all as
processes."""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from fleetbus.bus import Bus, EmbeddedServer
from fleetbus.models import ModelSettings
from tests.helpers import spawn, stop, wait_for_workers
from tests.integration.test_fleet_cli import Output
from tests.openai_server import FakeOpenAIServer, completion

MODEL = "qwen-coder-1b5"
"""The model's name on the endpoint (no dot: it is also a ``bus:NAME``)."""
QUESTION = "What is 17 * 23 + 4?"
CALL = '{"name": "calculator", "arguments": {"expr": "17 * 23 + 4"}}'
FENCED = f"```json\n{CALL}\n```"
"""How Qwen2.5-Coder-1.5B through llama.cpp writes its call: as text, no ``tool_calls``."""
ANSWER = "17 * 23 + 4 = 395."
BASE_ENV = {"FLEETBUS_CONNECT_TIMEOUT": "2", "COLUMNS": "1000"}
"""Rich wraps lines at the terminal's width: a line looked for must stay one line."""


@pytest.fixture(autouse=True)
def _only_the_readme_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    """Processes inherit this environment: only what a test sets configures a model."""
    names = ["OPENAI_API_KEY", "OPENAI_BASE_URL", "FLEETBUS_MODEL"]
    names += ["FLEETBUS_NATS_URL", "FLEETBUS_PREFIX", "FLEETBUS_DEMO_TIMEOUT"]
    names += [f"FLEETBUS_MODEL_{field.upper()}" for field in ModelSettings.model_fields]
    for name in names:
        monkeypatch.delenv(name, raising=False)


@contextmanager
def process(*args: str, env: dict[str, str] | None = None) -> Iterator[Output]:
    """``fleetbus ARGS`` in the background, stopped (SIGTERM) on exit."""
    proc = spawn(list(args), env={**BASE_ENV, **(env or {})})
    try:
        yield Output(proc)
    finally:
        try:
            stop(proc)
        except Exception:  # already gone, or killed after the timeout
            pass


async def run_cli(
    *args: str, env: dict[str, str] | None = None, timeout: float = 40
) -> tuple[int, str]:
    """``fleetbus ARGS`` to its end: exit code and output."""
    return await Output(spawn(list(args), env={**BASE_ENV, **(env or {})})).finish(timeout)


async def stopped(worker: Output) -> str:
    """SIGTERM a process (``fleetbus -v worker``) and what it printed by its end."""
    worker.proc.send_signal(signal.SIGTERM)
    code, text = await worker.finish(timeout=60)
    assert code == 0, text
    return text


def check_the_calculator_ran_on_the_worker(
    endpoint: FakeOpenAIServer, out: str, worker_log: str
) -> None:
    """The text call ran on the tool worker, its result went back to the model as
    a tool message, and the answer printed is the one that used it."""
    assert "✓ completed" in out, out
    assert ANSWER in out, out  # not the fenced JSON taken as the answer
    assert "```" not in out, out
    assert "← calculator: success — 395" in out, out
    assert "worker w1 stopped after 1 call(s)" in worker_log, worker_log
    first, second = endpoint.bodies
    assert first["model"] == MODEL
    offered = [t["function"]["name"] for t in first["tools"]]
    assert "calculator" in offered  # discovered on the bus: the agent has no tool of its own
    call, result = second["messages"][-2:]
    (tool_call,) = call["tool_calls"]
    assert tool_call["function"]["name"] == "calculator"
    assert json.loads(tool_call["function"]["arguments"]) == {"expr": "17 * 23 + 4"}
    assert result == {"role": "tool", "tool_call_id": tool_call["id"], "content": "395"}


def script(endpoint: FakeOpenAIServer) -> None:
    endpoint.add(completion(FENCED), completion(ANSWER))


async def test_worker_agent_and_ask_with_a_model_that_writes_its_call_as_text(
    nats_server: EmbeddedServer, bus: Bus
) -> None:
    on_bus = ("--nats", nats_server.url, "--prefix", bus.prefix)
    with FakeOpenAIServer() as endpoint:
        script(endpoint)
        env = {"OPENAI_BASE_URL": endpoint.url, "FLEETBUS_MODEL": f"openai:{MODEL}"}
        with process(
            "-v", "worker", "fleetbus.tools_workers.builtin", *on_bus, "--worker-id", "w1"
        ) as worker:
            await wait_for_workers(bus, "calculator", 1)
            with process("agent", "fleetbus.cli.demo_fleet:agents", *on_bus, env=env) as agent:
                await agent.wait_for("serving assistant")
                assert "assistant: remote tools calculator" in agent.text
                code, out = await run_cli("ask", "assistant", QUESTION, *on_bus, "--timeout", "30")
            worker_log = await stopped(worker)
    assert code == 0, out
    check_the_calculator_ran_on_the_worker(endpoint, out, worker_log)


async def test_the_same_through_a_model_worker(nats_server: EmbeddedServer, bus: Bus) -> None:
    on_bus = ("--nats", nats_server.url, "--prefix", bus.prefix)
    with FakeOpenAIServer() as endpoint:
        script(endpoint)
        model_worker_env = {"OPENAI_BASE_URL": endpoint.url}
        agent_env = {"FLEETBUS_MODEL": f"bus:{MODEL}"}
        with (
            process(
                "-v", "worker", "fleetbus.tools_workers.builtin", *on_bus, "--worker-id", "w1"
            ) as worker,
            process(
                "model-worker", "--model", f"openai:{MODEL}", *on_bus, env=model_worker_env
            ) as model_worker,
        ):
            await wait_for_workers(bus, "calculator", 1)
            await model_worker.wait_for(f"serving {MODEL} as")
            with process(
                "agent", "fleetbus.cli.demo_fleet:agents", *on_bus, env=agent_env
            ) as agent:
                await agent.wait_for("serving assistant")
                assert f"assistant: model bus:{MODEL}" in agent.text
                code, out = await run_cli("ask", "assistant", QUESTION, *on_bus, "--timeout", "30")
            worker_log = await stopped(worker)
    assert code == 0, out
    check_the_calculator_ran_on_the_worker(endpoint, out, worker_log)


def offered_tools(body: dict[str, Any]) -> set[str]:
    return {t["function"]["name"] for t in body.get("tools", [])}


@pytest.mark.slow
async def test_the_demo_with_a_model_that_never_calls_a_tool_explains_and_exits_0() -> None:
    reply = "Happy to help! I believe it is 35, it is noon in Tokyo, and noted."
    with FakeOpenAIServer(fallback=completion(reply)) as endpoint:
        env = {"OPENAI_BASE_URL": endpoint.url, "FLEETBUS_MODEL": f"openai:{MODEL}"}
        code, out = await run_cli("demo", "--calls", "20", env=env, timeout=55)
    assert code == 0, out
    assert f"model: openai:{MODEL}" in out, out
    assert reply in out
    assert "the first question: the model answered without calculator (it used no tool)" in out
    assert "the second question: the model answered without current_time and calculator" in out
    assert (
        "no confirmation was asked, because the model did not call write_file "
        "(it used no tool)" in out
    ), out
    assert "the fleet worked:" in out, out
    assert "the fleet failed" not in out, out
    assert "agent stopped (exit code 0)" in out
    # The model had the tools to choose from, on every question of the conversation.
    questions = [b for b in endpoint.bodies if "ping" not in json.dumps(b["messages"][-1])]
    assert len(questions) >= 3, endpoint.bodies
    assert all({"calculator", "write_file"} <= offered_tools(b) for b in questions)
