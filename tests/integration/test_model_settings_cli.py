"""Model strings and settings on the command line, as people run them:
``fleetbus agent`` and ``fleetbus model-worker`` processes against the local
OpenAI-compatible test server, pointed at with ``OPENAI_BASE_URL``."""

from __future__ import annotations

import asyncio
import dataclasses
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from fleetbus.bus import Bus, EmbeddedServer
from fleetbus.models import ModelSettings
from tests.helpers import spawn, stop, wait_for_workers, workers
from tests.integration.test_fleet_cli import Output
from tests.openai_server import FakeOpenAIServer, sse, text_chunks, tool_call_chunks

TOOLS = "tests.integration.worker_tools"
BASE_ENV = {"FLEETBUS_CONNECT_TIMEOUT": "2", "COLUMNS": "1000"}
"""Rich wraps lines at the terminal's width: one error line must stay one line."""


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Processes inherit this environment: only what a test sets configures a model."""
    for name in ("OPENAI_API_KEY", "OPENAI_BASE_URL", "FLEETBUS_MODEL"):
        monkeypatch.delenv(name, raising=False)
    for field in ModelSettings.model_fields:
        monkeypatch.delenv(f"FLEETBUS_MODEL_{field.upper()}", raising=False)


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


async def run_cli(*args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    """``fleetbus ARGS`` to its end: exit code and output."""
    return await Output(spawn(list(args), env={**BASE_ENV, **(env or {})})).finish(40)


def closed_port() -> int:
    """A port on 127.0.0.1 that nothing listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


async def test_the_readme_variables_alone_give_the_demo_agent_its_model(
    nats_server: EmbeddedServer, bus: Bus, tmp_path: Path
) -> None:
    on_bus = ("--nats", nats_server.url, "--prefix", bus.prefix)
    with FakeOpenAIServer() as endpoint:
        endpoint.add(
            sse(
                tool_call_chunks(0, "call_1", "echo", '{"text": ', '"hi there"}'),
                finish="tool_calls",
            ),
            sse(text_chunks("The echo said ", "hi there.")),
        )
        # A bare name, as the README and the local-llm recipe write it.
        env = {"OPENAI_BASE_URL": endpoint.url, "FLEETBUS_MODEL": "fake-model"}
        tool_env = {"FLEETBUS_TEST_DIR": str(tmp_path)}
        with workers(nats_server.url, bus.prefix, 1, spec=TOOLS, env=tool_env):
            await wait_for_workers(bus, "echo", 1)
            with process("agent", "fleetbus.cli.demo_fleet:agents", *on_bus, env=env) as agent:
                await agent.wait_for("serving assistant")
                code, out = await run_cli("ask", "assistant", "Echo 'hi there'.", *on_bus)
                printed = agent.text
        url = endpoint.url
    assert code == 0, out
    assert "The echo said hi there." in out
    assert f"assistant: model openai:fake-model at {url}" in printed
    first, second = endpoint.bodies
    assert first["model"] == "fake-model"
    assert "echo" in [t["function"]["name"] for t in first["tools"]]
    tool_message = second["messages"][-1]
    assert (tool_message["role"], tool_message["tool_call_id"]) == ("tool", "call_1")
    assert "hi there" in tool_message["content"]  # the worker ran the tool


async def test_toml_settings_under_the_command_line_over_the_environment(
    nats_server: EmbeddedServer, bus: Bus, tmp_path: Path
) -> None:
    spec = tmp_path / "agents.toml"
    spec.write_text(
        f"""
[agent.helper]
system_prompt = "You help."
model = "openai:fake-model"
tools = ["{TOOLS}"]

[agent.helper.model_settings]
temperature = 0.3
max_tokens = 50
tools = "off"
"""
    )
    on_bus = ("--nats", nats_server.url, "--prefix", bus.prefix)
    with FakeOpenAIServer() as endpoint:
        endpoint.add(sse(text_chunks("Four.")))
        env = {
            "OPENAI_BASE_URL": endpoint.url,
            "FLEETBUS_MODEL_TEMPERATURE": "0.1",  # under TOML and the command line
            "FLEETBUS_MODEL_MAX_TOKENS": "10",  # under TOML
        }
        command = ("agent", str(spec), "--no-remote-tools", "--model-temperature", "0.7")
        with process(*command, *on_bus, env=env) as agent:
            await agent.wait_for("serving helper")
            code, out = await run_cli("ask", "helper", "What is 2 + 2?", *on_bus)
    assert code == 0, out
    assert "Four." in out
    (body,) = endpoint.bodies
    assert (body["model"], body["temperature"], body["max_tokens"]) == ("fake-model", 0.7, 50)
    # Tool mode off: the tools are described in the system prompt, not sent as tools.
    assert "tools" not in body
    assert "echo" in body["messages"][0]["content"]


async def test_model_overrides_the_spec_and_model_timeout_and_retries_apply_to_replicas(
    nats_server: EmbeddedServer, bus: Bus, tmp_path: Path
) -> None:
    spec = tmp_path / "agents.toml"
    spec.write_text('[agent.helper]\nmodel = "offline"\n')
    on_bus = ("--nats", nats_server.url, "--prefix", bus.prefix)
    with FakeOpenAIServer() as endpoint:
        endpoint.add(dataclasses.replace(sse(text_chunks("too late")), delay=4.0))
        url = endpoint.url
        command = (
            *("agent", str(spec), "--no-remote-tools", "--model", "openai:fake-model"),
            *("--model-timeout", "1", "--model-retries", "0"),
            *("--replicas", "2"),  # the options reach every replica process
        )
        with process(*command, *on_bus, env={"OPENAI_BASE_URL": endpoint.url}) as agent:
            await agent.wait_for("serving helper", count=2)
            code, out = await run_cli("ask", "helper", "Hello?", *on_bus)
            await asyncio.sleep(0.5)  # a retry, if one were made, would reach the server now
            requests = len(endpoint.requests)
            printed = agent.text
    assert code == 1, out
    # The 1 s timeout, not the server's 4 s (said, not timed: the machine is shared).
    assert "did not answer within 1 s" in out, out
    assert "too late" not in out
    assert requests == 1  # no retry: neither the SDK's nor the agent's
    assert printed.count(f"helper: model openai:fake-model at {url}") == 2


async def test_a_model_worker_serves_a_model_string_and_an_agent_uses_it_by_bus_name(
    nats_server: EmbeddedServer, bus: Bus, tmp_path: Path
) -> None:
    spec = tmp_path / "agents.toml"
    spec.write_text(
        '[agent.helper]\nmodel = "bus:fake-model"\n'
        "[agent.helper.model_settings]\ntemperature = 0.2\n"
    )
    on_bus = ("--nats", nats_server.url, "--prefix", bus.prefix)
    with FakeOpenAIServer() as endpoint:
        endpoint.add(sse(text_chunks("Hello from ", "the worker.")))
        worker_command = (
            "model-worker",
            "--model",
            "openai:fake-model",
            "--model-max-tokens",
            "20",
        )
        worker_env = {"OPENAI_BASE_URL": endpoint.url, "OPENAI_API_KEY": "sk-worker-only"}
        with process(*worker_command, *on_bus, env=worker_env) as worker:
            await worker.wait_for("serving fake-model as")
            with process("agent", str(spec), "--no-remote-tools", *on_bus) as agent:
                await agent.wait_for("serving helper")
                code, out = await run_cli("ask", "helper", "Hello?", *on_bus)
                printed = agent.text
    assert code == 0, out
    assert "Hello from the worker." in out
    assert "helper: model bus:fake-model" in printed
    (request,) = endpoint.requests
    assert request.headers["authorization"] == "Bearer sk-worker-only"
    # The agent's settings travel with the prompt; the worker's are its own.
    assert (request.body["temperature"], request.body["max_tokens"]) == (0.2, 20)


@pytest.mark.parametrize(
    ("command", "env", "message"),
    [
        (
            ("agent", "fleetbus.cli.demo_fleet:agents"),
            {"FLEETBUS_MODEL": "openai:gpt-x"},
            "error: FLEETBUS_MODEL: model 'openai:gpt-x': no API key: set OPENAI_API_KEY",
        ),
        (
            ("agent", "fleetbus.cli.demo_fleet:agents"),
            {"FLEETBUS_MODEL": "gpt-x", "OPENAI_BASE_URL": "http://127.0.0.1:{port}/v1"},
            "error: model openai:gpt-x: cannot reach http://127.0.0.1:{port}/v1 (OPENAI_BASE_URL)",
        ),
        (
            ("agent", "fleetbus.cli.demo_fleet:agents"),
            {"FLEETBUS_MODEL": "gpt-x"},
            "error: FLEETBUS_MODEL: model 'gpt-x': a bare name is an OpenAI-compatible model",
        ),
        (
            ("agent", "fleetbus.cli.demo_fleet:agents"),
            {"FLEETBUS_MODEL": "offline", "FLEETBUS_MODEL_TIMEOUT": "soon"},
            "error: FLEETBUS_MODEL_TIMEOUT: Input should be a valid number",
        ),
        (
            ("model-worker", "--model", "openai:gpt-x"),
            {"OPENAI_BASE_URL": "http://127.0.0.1:{port}/v1"},
            "error: model openai:gpt-x: cannot reach http://127.0.0.1:{port}/v1 (OPENAI_BASE_URL)",
        ),
        (
            ("model-worker",),
            {},
            "error: name the model to serve: --model openai:NAME (or offline), or set FLEETBUS_M",
        ),
        (
            ("agent", "fleetbus.cli.demo_fleet:agents"),
            {"FLEETBUS_MODEL": "bus:nobody", "FLEETBUS_MODEL_WAIT": "1"},
            "error: model bus:nobody: no model worker serves it on prefix",
        ),
    ],
)
async def test_a_model_that_cannot_be_configured_or_reached_stops_with_one_line(
    nats_server: EmbeddedServer,
    bus: Bus,
    command: tuple[str, ...],
    env: dict[str, str],
    message: str,
) -> None:
    port = str(closed_port())
    env = {k: v.replace("{port}", port) for k, v in env.items()}
    code, out = await run_cli(*command, "--nats", nats_server.url, "--prefix", bus.prefix, env=env)
    lines = [line for line in out.splitlines() if line.strip()]
    assert code == 1, out
    assert len(lines) == 1, out
    assert lines[0].startswith(message.replace("{port}", port)), out


@pytest.mark.slow
async def test_the_demo_says_why_its_agent_could_not_start() -> None:
    """The demo's agent stops at once on a model it cannot reach: the demo
    says why, in its last line, instead of waiting for it (60 s) and saying
    only that it did not come up."""
    port = str(closed_port())
    env = {"FLEETBUS_MODEL": "gpt-x", "OPENAI_BASE_URL": f"http://127.0.0.1:{port}/v1"}
    env["OPENAI_API_KEY"] = "sk-unused"
    code, out = await run_cli("demo", "--calls", "20", "--workers", "1", env=env)
    assert code == 1, out
    said = " ".join(out.split())  # the console wraps long lines
    assert (
        f"error: the agent exited (error: model openai:gpt-x: cannot reach http://127.0.0.1:{port}/v1"
        in said
    ), out
