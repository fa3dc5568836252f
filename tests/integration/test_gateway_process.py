"""``fleetbus gateway`` as a user runs it, in front of the demo fleet: a
tool worker, the demo's agent (offline model) and the gateway, each its own
process; the OpenAI SDK, pointed at the gateway with ``OPENAI_BASE_URL``,
lists the agent and gets an answer that used a tool of the fleet; the A2A
card of the agent is served; the command's errors are one line. A gateway
killed mid-reply loses nothing: the reply ends in its session, and another
replica reads it and continues the responses the dead one gave."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal

import httpx
import openai
import pytest

from fleetbus.agents import Agent
from fleetbus.agents.serving import SessionJournals
from fleetbus.bus import Bus, EmbeddedServer
from tests.helpers import free_port, output, running, serving, spawn, wait_for_workers
from tests.integration.agent_specs import CommandModel
from tests.integration.gateway_fixtures import ALICE, gateway

pytestmark = pytest.mark.slow

TOKEN = "sk-process-0123456789"


async def _ready(url: str, *, token: str = TOKEN, agent: str = "assistant") -> None:
    """Wait until the gateway lists ``agent`` (the agent and the gateway both
    started, the agent discovered)."""
    async with httpx.AsyncClient() as http:
        async with asyncio.timeout(60):
            while True:
                try:
                    models = await http.get(
                        f"{url}/v1/models", headers={"authorization": f"Bearer {token}"}
                    )
                    if any(m["id"] == agent for m in models.json().get("data", [])):
                        return
                except (httpx.HTTPError, ValueError):
                    pass  # not up yet (an answer that is no JSON: not the gateway's yet)
                await asyncio.sleep(0.2)


async def test_the_openai_sdk_talks_to_the_demo_fleet_through_the_gateway(
    nats_server: EmbeddedServer, bus: Bus, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {
        "FLEETBUS_MODEL": "offline",
        "FLEETBUS_GATEWAY_TOKENS": json.dumps([{"user": "me", "token": TOKEN}]),
    }
    fleet = ["--nats", nats_server.url, "--prefix", prefix]
    with running([["worker", "fleetbus.tools_workers.builtin", *fleet]], env=env):
        # The agent finds its tools on the bus as it starts: start it once they are served.
        await wait_for_workers(bus, "calculator", 1)
        with running(
            [
                ["agent", "fleetbus.cli.demo_fleet:agents", *fleet],
                ["gateway", "--port", str(port), *fleet],
            ],
            env=env,
        ) as (_, gateway):
            await _ready(url)
            monkeypatch.setenv("OPENAI_BASE_URL", f"{url}/v1")
            monkeypatch.setenv("OPENAI_API_KEY", TOKEN)
            async with openai.AsyncOpenAI(max_retries=0) as client:
                models = [m.id async for m in client.models.list()]
                assert models == ["assistant"]
                chat = await client.chat.completions.create(
                    model="assistant",
                    messages=[{"role": "user", "content": "What is 2026 - 1991?"}],
                )
                assert "35" in (chat.choices[0].message.content or "")
                stream = await client.chat.completions.create(
                    model="assistant",
                    messages=[{"role": "user", "content": "What is 6 * 7?"}],
                    stream=True,
                )
                pieces = [c async for c in stream]
            reasoning = "".join(
                getattr(c.choices[0].delta, "reasoning_content", None) or ""
                for c in pieces
                if c.choices
            )
            text = "".join(c.choices[0].delta.content or "" for c in pieces if c.choices)
            assert "[calling calculator(" in reasoning
            assert "42" in text
            async with httpx.AsyncClient() as http:
                card = await http.get(
                    f"{url}/a2a/assistant/.well-known/agent-card.json",
                    headers={"authorization": f"Bearer {TOKEN}"},
                )
                assert card.status_code == 200
                assert card.json()["name"] == "assistant"
            gateway.send_signal(signal.SIGTERM)
            assert gateway.wait(30) == 0
            said = output(gateway)
            assert "gateway on http://127.0.0.1:" in said
            assert "gateway stopped" in said


def test_the_gateway_without_tokens_says_how_to_give_them(nats_server: EmbeddedServer) -> None:
    proc = spawn(
        ["gateway", "--nats", nats_server.url, "--port", "0"], env={"FLEETBUS_GATEWAY_TOKENS": ""}
    )
    assert proc.wait(60) == 1
    said = output(proc)
    assert "the gateway has no tokens" in said
    assert "FLEETBUS_GATEWAY_TOKENS" in said
    assert "Traceback" not in said


def test_new_token_prints_a_token_and_its_entry() -> None:
    proc = spawn(["gateway", "--new-token", "alice"])
    assert proc.wait(60) == 0
    said = output(proc)
    token = said.split("token: ", 1)[1].split()[0]
    entry = json.loads(said.split("entry: ", 1)[1].strip())
    assert entry["user"] == "alice"
    assert "sha256" in entry
    assert token not in said.split("entry: ")[1]


async def test_a_gateway_killed_mid_reply_loses_nothing_another_replica_serves_on(
    nats_server: EmbeddedServer, prefix: str
) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    tokens = json.dumps([{"user": "alice", "token": ALICE}])
    headers = {"authorization": f"Bearer {ALICE}"}
    command = ["gateway", "--port", str(port), "--no-a2a", "--nats", nats_server.url]
    async with serving(nats_server.url, prefix, Agent("clerk", "", CommandModel())):
        with running([[*command, "--prefix", prefix]], env={"FLEETBUS_GATEWAY_TOKENS": tokens}) as (
            first,
        ):
            await _ready(url, token=ALICE, agent="clerk")
            async with httpx.AsyncClient(base_url=url, headers=headers, timeout=30) as http:
                started = await http.post(
                    "/v1/responses", json={"model": "clerk", "input": "remember this"}
                )
                response_id = started.json()["id"]
                body = {"content": "sleep 2; slow work", "session": "k", "stream": True}
                with contextlib.suppress(httpx.HTTPError):
                    async with http.stream(
                        "POST", "/v1/fleet/agents/clerk/messages", json=body
                    ) as s:
                        session = s.headers["x-fleetbus-session"]
                        async for line in s.aiter_lines():
                            if line == "event: reply_start":
                                first.kill()  # mid-reply, no goodbye
                                break
        # Another replica: the reply the dead one followed ran to its end, and
        # the response it gave continues here.
        async with (
            gateway(nats_server.url, prefix) as other,
            httpx.AsyncClient(base_url=other.url, headers=headers, timeout=30) as http,
        ):
            journals = await SessionJournals.open_journals(other.bus)
            async with asyncio.timeout(30):
                async for fact in journals.follow("clerk", session):
                    if fact.kind in ("end", "snapshot"):
                        break
            read = (await http.get(f"/v1/fleet/agents/clerk/sessions/{session}")).json()
            assert read["final"]["finished_reason"] == "completed"
            assert read["final"]["content"].startswith("echo sleep 2; slow work from ")
            again = await http.post(
                "/v1/responses",
                json={"model": "clerk", "input": "heard?", "previous_response_id": response_id},
            )
            assert again.json()["output"][0]["content"][0]["text"] == "heard: remember this"
