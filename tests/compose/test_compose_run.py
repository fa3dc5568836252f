"""docker-compose.yml run for real (``make test-compose``): the fleet starts
as the file's header says and serves as soon as ``docker compose up --wait``
returns, through the CLI and the gateway; the agent replicas are containers
of their own; the tool workers scale and the new ones take calls; the API key
reaches the model worker only; a model server on the Docker host is reached
as ``host.docker.internal``; and on the 3-node NATS cluster of
deploy/nats-cluster/compose.yml, the fleet goes on, sessions included, when
the node leading the session store is killed.

Each test runs a compose project of its own (containers, network and volumes
named after it, the dashboard and the gateway on free ports of 127.0.0.1)
and removes it at the end (``down -v``). The image, ``fleetbus:local``, is
built once for the module. What the runs measured is printed (``-rA``).
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import time
import urllib.parse
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.openai_server import CompletionReply, FakeOpenAIServer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

ROOT = Path(__file__).resolve().parents[2]
SINGLE = ("docker-compose.yml",)
CLUSTER = ("docker-compose.yml", "deploy/nats-cluster/compose.yml")
TOKEN = "sk-compose-test-0123456789"
API_KEY = "sk-compose-test-not-a-real-key"
QUESTION = "What is 2026 - 1991?"
ANSWER = "2026 - 1991 = 35"
RUNTIME_UID = "10001"
CALLS = 64
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")

CALLS_SCRIPT = f"""
import asyncio
from fleetbus.bus import Bus, ToolClient

async def main():
    bus = await Bus.connect()
    try:
        client = ToolClient(bus)
        results = await asyncio.gather(
            *(client.call("calculator", {{"expr": f"{{i}} + 1"}}) for i in range({CALLS}))
        )
    finally:
        await bus.close()
    print(sum(not r.ok for r in results), "failed")

asyncio.run(main())
"""
"""{CALLS} calculator calls at once, from one process: how many failed."""

REPLICAS_SCRIPT = """
import asyncio
import json
from fleetbus.bus import Bus, discover

async def main():
    bus = await Bus.connect()
    try:
        found = await discover(bus, "fleetbus-agents", timeout=2)
    finally:
        await bus.close()
    print(json.dumps(sorted(s.metadata.get("replica_id", "") for s in found)))

asyncio.run(main())
"""
"""The replica ids of the agent hosts that answer the fleet's service discovery."""

JSZ_SCRIPT = """
import urllib.request
with urllib.request.urlopen("http://127.0.0.1:8222/jsz?streams=true&config=true") as r:
    print(r.read().decode())
"""
"""The JetStream report of the nats-server of the container it runs in."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@dataclass
class Stack:
    """One compose project of the fleet, and what was measured of it."""

    files: tuple[str, ...]
    project: str = field(default_factory=lambda: f"fleetbus-test-{uuid.uuid4().hex[:8]}")
    dashboard_port: int = field(default_factory=free_port)
    gateway_port: int = field(default_factory=free_port)
    timings: dict[str, float] = field(default_factory=dict)
    model_env: dict[str, str] = field(default_factory=dict)
    """``FLEETBUS_MODEL``, ``OPENAI_BASE_URL``: the model worker's model (else offline)."""

    def env(self) -> dict[str, str]:
        """This process's environment without the variables that would change
        the compose file (the caller's model, key, log format, project), and
        with the test's."""
        kept = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("FLEETBUS_", "OPENAI_", "COMPOSE_", "DOCKER_DEFAULT"))
        }
        tokens = [{"user": "compose-test", "token": TOKEN}]
        return kept | {
            "COMPOSE_PROFILES": "gateway",
            "FLEETBUS_GATEWAY_TOKENS": json.dumps(tokens),
            "FLEETBUS_DASHBOARD_PORT": str(self.dashboard_port),
            "FLEETBUS_GATEWAY_PORT": str(self.gateway_port),
            "OPENAI_API_KEY": API_KEY,
            **self.model_env,
        }

    def compose(
        self, *args: str, stdin: str | None = None, timeout: float = 600, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        files = [word for name in self.files for word in ("-f", name)]
        argv = ["docker", "compose", "--project-name", self.project, *files, *args]
        done = subprocess.run(
            argv,
            cwd=ROOT,
            env=self.env(),
            input=stdin,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if check and done.returncode != 0:
            raise AssertionError(
                f"{' '.join(args)} exited {done.returncode}\n{done.stdout}\n{done.stderr}"
            )
        return done

    def timed(self, what: str, *args: str) -> subprocess.CompletedProcess[str]:
        started = time.monotonic()
        done = self.compose(*args)
        self.timings[what] = round(time.monotonic() - started, 1)
        return done

    def fleetbus(self, *args: str) -> str:
        """The output of a fleetbus command run as the header shows
        (``docker compose run --rm agent …``), without starting services."""
        return self.compose("run", "--rm", "-T", "--no-deps", "agent", *args).stdout

    def python(self, script: str, service: str = "agent") -> str:
        """What ``script`` prints, run by the image's Python in a new container."""
        argv = ["run", "--rm", "-T", "--no-deps", "--entrypoint", "python", service, "-"]
        return self.compose(*argv, stdin=script).stdout

    def exec(self, service: str, *argv: str) -> str:
        return self.compose("exec", "-T", service, *argv).stdout

    def containers(self, service: str) -> list[dict[str, Any]]:
        """``docker compose ps`` of ``service``, stopped containers included."""
        out = self.compose("ps", "--all", "--format", "json", service).stdout.strip()
        if out.startswith("["):
            found: list[dict[str, Any]] = json.loads(out)
            return found
        return [json.loads(line) for line in out.splitlines() if line.strip()]

    def worker_ids(self) -> set[str]:
        tools = json.loads(self.fleetbus("tools", "--json", "--wait", "2"))
        return {worker for tool in tools.values() for worker in tool["worker_ids"]}

    def get(self, port: int, path: str) -> Any:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as response:
            return json.loads(response.read())

    def chat(self, text: str) -> str:
        """The gateway's answer to ``text`` (OpenAI chat completions)."""
        body = {"model": "assistant", "messages": [{"role": "user", "content": text}]}
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.gateway_port}/v1/chat/completions",
            data=json.dumps(body).encode(),
            headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=120) as response:
            answer: str = json.loads(response.read())["choices"][0]["message"]["content"]
            return answer

    def fleet_until(self, done: Any, what: str, deadline: float = 60) -> dict[str, Any]:
        """The dashboard's ``/api/fleet`` once ``done(fleet)`` holds (it reads
        the bus every second or so)."""
        end = time.monotonic() + deadline
        while True:
            fleet: dict[str, Any] = self.get(self.dashboard_port, "/api/fleet")
            if done(fleet):
                return fleet
            if time.monotonic() > end:
                raise AssertionError(f"the dashboard never showed {what}: {fleet}")
            time.sleep(0.5)

    def streams(self, service: str) -> dict[str, dict[str, Any]]:
        """The JetStream streams ``service``'s nats-server holds, by name."""
        jsz = json.loads(self.exec(service, "python", "-c", JSZ_SCRIPT))
        return {
            stream["name"]: stream
            for account in jsz.get("account_details") or []
            for stream in account.get("stream_detail") or []
        }


@pytest.fixture(scope="module")
def image() -> None:
    """``fleetbus:local``, built from this tree (every service runs it)."""
    build = Stack(SINGLE)
    build.timed("build", "build", "nats")
    print(f"image fleetbus:local built in {build.timings['build']} s")


@contextmanager
def running(files: tuple[str, ...], model_env: dict[str, str] | None = None) -> Iterator[Stack]:
    """A new project of ``files``, removed with its volumes at the end."""
    stack = Stack(files, model_env=model_env or {})
    try:
        yield stack
    finally:
        print(stack.compose("ps", "--all", check=False).stdout)
        print(stack.compose("logs", "--no-color", "--tail", "20", check=False).stdout)
        stack.timed("down", "down", "--volumes", "--remove-orphans", "--timeout", "30")
        print(f"timings (s): {stack.timings}")


def test_the_fleet_answers_at_once_and_its_tool_workers_scale(image: None) -> None:
    with running(SINGLE) as stack:
        stack.timed("up --wait", "up", "--detach", "--wait", "--wait-timeout", "300", "--no-build")

        # Asked as soon as `up --wait` returned, as the header shows.
        started = time.monotonic()
        assert ANSWER in stack.fleetbus("ask", "assistant", QUESTION)
        stack.timings["first ask"] = round(time.monotonic() - started, 1)
        assert "35" in stack.chat(QUESTION)

        # The agent's replicas: two containers, each serving as a replica of its own.
        containers = {c["ID"][:12] for c in stack.containers("agent")}
        assert len(containers) == 2
        replicas = json.loads(stack.python(REPLICAS_SCRIPT))
        assert {r.partition("@")[0] for r in replicas} == {"assistant"}, replicas
        assert {r.partition("@")[2].rpartition("-")[0] for r in replicas} == containers

        # Two tool workers, then four: the new ones take calls too.
        before = stack.worker_ids()
        assert len(before) == 2, before
        stack.timed(
            "scale tools=4",
            *("up", "--detach", "--wait", "--wait-timeout", "300", "--no-build"),
            *("--scale", "tools=4"),
        )
        after = stack.worker_ids()
        assert len(after) == 4, after
        assert before < after
        assert stack.python(CALLS_SCRIPT).split() == ["0", "failed"]

        def counts(fleet: dict[str, Any]) -> dict[str, int]:
            return {
                w["worker_id"]: sum(e["num_requests"] for e in w["endpoints"])
                for w in fleet["workers"]
            }

        fleet = stack.fleet_until(
            lambda f: sum(counts(f).values()) >= CALLS, f"{CALLS} calls counted"
        )
        taken = counts(fleet)
        print(f"calls taken by each worker: {taken}")
        assert set(taken) == after
        assert all(taken[worker] > 0 for worker in after - before), taken

        # The API key is in the model worker's environment only, and in no image.
        assert f"OPENAI_API_KEY={API_KEY}" in stack.exec("model-worker", "env").splitlines()
        for service in ("agent", "tools", "dashboard", "gateway", "nats"):
            assert "OPENAI_API_KEY" not in stack.exec(service, "env"), service
        config = subprocess.run(
            ["docker", "image", "inspect", "--format", "{{json .Config.Env}}", "fleetbus:local"],
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        ).stdout
        assert "OPENAI" not in config
        assert "TOKEN" not in config

        # Every process runs as the image's user, not root.
        for service in ("nats", "tools", "model-worker", "agent", "dashboard", "gateway"):
            assert stack.exec(service, "id", "-u").strip() == RUNTIME_UID, service

        # Log lines are whole lines, JSON or the command's own, however long.
        logs = stack.compose("logs", "--no-color", "--no-log-prefix", "tools", "agent").stdout
        # (docker compose starts each line with an erase-line escape)
        lines = [ANSI.sub("", line) for line in logs.splitlines() if line.strip()]
        for line in lines:
            if line.startswith("{"):
                json.loads(line)
        serving = re.compile(r"worker worker\.\S+-1 serving calculator, .+ \(prefix fleet\)")
        assert sum(bool(serving.fullmatch(line)) for line in lines) == 4, lines
        remote = [line for line in lines if line.startswith("assistant: remote tools ")]
        assert len(remote) == 2, lines
        assert all(line.endswith("write_file") for line in remote), remote


def test_on_a_nats_cluster_the_fleet_outlives_a_node(image: None) -> None:
    session = "compose-cluster"
    with running(CLUSTER) as stack:
        stack.timed("up --wait", "up", "--detach", "--wait", "--wait-timeout", "300", "--no-build")
        asked = ("ask", "assistant", "--session", session)
        assert ANSWER in stack.fleetbus(*asked, QUESTION)

        # Three copies of everything fleetbus stores (R3), found by itself.
        streams = stack.streams("nats")
        assert streams
        replicas = {name: s["config"]["num_replicas"] for name, s in streams.items()}
        assert set(replicas.values()) == {3}, replicas
        leases = streams.get("KV_fleet_session_leases") or next(iter(streams.values()))
        leader = leases["cluster"]["leader"]
        victim = "nats" if leader == "nats-1" else leader
        print(f"streams: {replicas}; killing {victim}, the leader of {leases['config']['name']}")

        stack.compose("kill", victim)
        started = time.monotonic()
        assert "6*7 = 42" in stack.fleetbus(*asked, "What is 6*7?")
        stack.timings["ask after the kill"] = round(time.monotonic() - started, 1)
        assert "4" in stack.fleetbus("call", "calculator", '{"expr": "2 + 2"}')
        assert ANSWER in stack.fleetbus("ask", "assistant", QUESTION)

        # The session went on: both exchanges are in its journal.
        history = stack.fleetbus("sessions", "history", "assistant", session, "--json")
        assert QUESTION in history
        assert "What is 6*7?" in history
        assert "6*7 = 42" in history

        # The killed node stayed down all along (a kill is not restarted).
        states = {c["State"] for c in stack.containers(victim)}
        assert states == {"exited"}, states
        survivor = "nats-2" if victim == "nats" else "nats"
        after = stack.streams(survivor)[leases["config"]["name"]]["cluster"]["leader"]
        assert after
        assert after != leader


def test_a_model_server_on_the_docker_host_is_reached_as_its_header_says(image: None) -> None:
    """An OpenAI-compatible server on the machine that runs Docker, listening
    on all its addresses, is ``host.docker.internal`` to the model worker."""
    said = "From the model server on the Docker host: 35."
    server = FakeOpenAIServer(fallback=CompletionReply(text=said))
    server.start(host="0.0.0.0")
    try:
        port = urllib.parse.urlsplit(server.url).port
        model = {
            "FLEETBUS_MODEL": "openai:host-model",
            "OPENAI_BASE_URL": f"http://host.docker.internal:{port}/v1",
        }
        with running(SINGLE, model) as stack:
            stack.timed(
                "up --wait", "up", "--detach", "--wait", "--wait-timeout", "300", "--no-build"
            )
            assert said in stack.fleetbus("ask", "assistant", QUESTION)
    finally:
        server.stop()
    assert server.bodies, "the model server was never asked"
    assert {body["model"] for body in server.bodies} == {"host-model"}
