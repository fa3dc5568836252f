"""The gateway as it runs on a shared server: connected as the ``gateway``
user of ``fleetbus auth``'s block, it lists agents, answers, streams, lists
and reads sessions and journals, and continues a paused reply — all within
its role, which writes no journal."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest

from fleetbus.agents import Agent, AgentService, Permissions
from fleetbus.bus import Bus, ConnectOptions, EmbeddedServer, object_store
from fleetbus.cli.auth_cmd import User, authorization
from fleetbus.tools_workers import Toolkit, tool
from tests.integration.agent_specs import CommandModel
from tests.integration.gateway_fixtures import ALICE, gateway

PREFIX = f"gws{uuid.uuid4().hex[:8]}"
PASSWORD = "pw-" + uuid.uuid4().hex
USERS = [
    User(role="agent", user="agent-clerk", password=PASSWORD, name="clerk"),
    User(role="gateway", user="gw", password=PASSWORD),
]


@pytest.fixture(scope="module")
def secured() -> Iterator[EmbeddedServer]:
    with EmbeddedServer(config=authorization(PREFIX, USERS)) as server:
        yield server


def options(server: EmbeddedServer, user: str) -> ConnectOptions:
    return ConnectOptions(
        servers=[server.url], prefix=PREFIX, user=user, password=PASSWORD, name=user
    )


@pytest.fixture
async def clerk(secured: EmbeddedServer) -> AsyncIterator[list[str]]:
    stamped: list[str] = []

    @tool
    def stamp(tag: str) -> str:
        """Stamp a tag."""
        stamped.append(tag)
        return f"stamped {tag}"

    agent = Agent(
        "clerk",
        "",
        CommandModel(),
        toolkit=Toolkit([stamp]),
        permissions=Permissions.from_strings(ask=["stamp"]),
        description="Stamps tags.",
    )
    bus = await Bus.connect(options=options(secured, "agent-clerk"), timeout=5.0)
    try:
        await object_store(bus, "session_blobs")
        service = AgentService(bus, agent, drain_timeout=5.0)
        async with asyncio.TaskGroup() as tg:
            tg.create_task(service.run())
            try:
                await service.wait_ready()
                yield stamped
            finally:
                service.stop()
    finally:
        await bus.close()


async def test_the_gateway_serves_within_its_role(
    secured: EmbeddedServer, clerk: list[str]
) -> None:
    async with (
        gateway(secured.url, PREFIX, options=options(secured, "gw")) as gw,
        httpx.AsyncClient(
            base_url=gw.url, timeout=30, headers={"authorization": f"Bearer {ALICE}"}
        ) as http,
    ):
        models = (await http.get("/v1/models")).json()["data"]
        assert [m["id"] for m in models] == ["clerk"]
        chat = await http.post(
            "/v1/chat/completions",
            headers={"x-fleetbus-session": "work"},
            json={
                "model": "clerk",
                "messages": [{"role": "user", "content": "hello"}],
                "stream": True,
            },
        )
        chunks = [
            json.loads(line[6:]) for line in chat.text.splitlines() if line.startswith("data: {")
        ]
        text = "".join(
            c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]
        )
        assert text.startswith("echo hello from ")
        session = chat.headers["x-fleetbus-session"]
        paused = (
            await http.post(
                "/v1/fleet/agents/clerk/messages",
                json={"content": 'tool stamp {"tag": "S"}', "session": "work"},
            )
        ).json()
        assert paused["final"]["finished_reason"] == "paused"
        call_id = paused["pending"][0]["call_id"]
        done = await http.post(
            f"/v1/fleet/agents/clerk/sessions/{session}/confirm", json={"allow": [call_id]}
        )
        assert "stamped S" in done.json()["final"]["content"]
        assert clerk == ["S"]
        listed = (await http.get("/v1/fleet/sessions")).json()["sessions"]
        assert [s["session"] for s in listed] == [session]
        facts = (await http.get(f"/v1/fleet/agents/clerk/sessions/{session}/journal")).json()[
            "facts"
        ]
        assert facts
        assert facts[-1]["kind"] in ("end", "snapshot")
        read = (await http.get(f"/v1/fleet/agents/clerk/sessions/{session}")).json()
        assert read["status"] == "done"
