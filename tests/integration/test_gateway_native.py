"""The gateway's fleet-native face over plain HTTP: agents, a reply streamed
as typed events, sessions listed and read with their journal, a paused reply
confirmed (allowed, denied, edited), an external result, a cancel; and the
limits: no token, another user's session, too many streams, a client that
goes away."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from fleetbus.agents import Agent, Permissions
from fleetbus.agents.serving import SessionJournals
from fleetbus.bus import Bus, EmbeddedServer
from fleetbus.tools_workers import Toolkit, tool
from tests.helpers import serving
from tests.integration.agent_specs import CommandModel
from tests.integration.gateway_fixtures import ADMIN, ALICE, BOB, gateway


def clerk(stamped: list[str], lingering: asyncio.Event | None = None) -> Agent:
    @tool
    def stamp(tag: str) -> str:
        """Stamp a tag."""
        stamped.append(tag)
        return f"stamped {tag}"

    @tool
    async def linger() -> str:
        """Take a minute."""
        if lingering is not None:
            lingering.set()
        await asyncio.sleep(60)
        return "lingered"

    return Agent(
        "clerk",
        "",
        CommandModel(),
        toolkit=Toolkit([stamp, linger]),
        permissions=Permissions.from_strings(ask=["stamp"]),
        description="Stamps tags.",
    )


@pytest.fixture
async def http(
    nats_server: EmbeddedServer, prefix: str
) -> AsyncIterator[tuple[httpx.AsyncClient, list[str]]]:
    stamped: list[str] = []
    async with (
        serving(nats_server.url, prefix, clerk(stamped)),
        gateway(nats_server.url, prefix) as gw,
        httpx.AsyncClient(base_url=f"{gw.url}/v1/fleet", timeout=30) as client,
    ):
        yield client, stamped


def auth(token: str = ALICE) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"}


def events_of(text: str) -> list[tuple[str, dict[str, Any]]]:
    """The (event, data) pairs of an SSE body."""
    found = []
    for block in text.split("\n\n"):
        lines = dict(
            line.split(": ", 1)
            for line in block.splitlines()
            if ": " in line and not line.startswith(":")
        )
        if "data" in lines:
            found.append((lines.get("event", "message"), json.loads(lines["data"])))
    return found


async def test_agents_are_listed_with_their_tools(
    http: tuple[httpx.AsyncClient, list[str]],
) -> None:
    client, _ = http
    listed = (await client.get("/agents", headers=auth())).json()["agents"]
    assert [(a["name"], a["description"]) for a in listed] == [("clerk", "Stamps tags.")]
    assert {t["name"] for t in listed[0]["tools"]} == {"stamp", "linger"}


async def test_a_streamed_reply_is_typed_events_then_the_final_answer(
    http: tuple[httpx.AsyncClient, list[str]],
) -> None:
    client, _ = http
    response = await client.post(
        "/agents/clerk/messages", headers=auth(), json={"content": "hi", "stream": True}
    )
    assert response.headers["content-type"].startswith("text/event-stream")
    events = events_of(response.text)
    names = [name for name, _ in events]
    assert names[0] == "reply_start"
    assert names[-1] == "final_answer"
    assert "text_delta" in names or "model_call_end" in names
    assert events[-1][1]["content"].startswith("echo hi from ")
    session = response.headers["x-fleetbus-session"]
    # The session is listed, readable, and its journal too.
    sessions = (await client.get("/sessions", headers=auth())).json()["sessions"]
    assert [s["session"] for s in sessions] == [session]
    one = (await client.get(f"/agents/clerk/sessions/{session}", headers=auth())).json()
    assert one["status"] == "done"
    assert one["final"]["content"].startswith("echo hi")
    assert [m["role"] for m in one["memory"]][-2:] == ["user", "assistant"]
    journal = (await client.get(f"/agents/clerk/sessions/{session}/journal", headers=auth())).json()
    assert journal["facts"]
    assert journal["facts"][-1]["kind"] in ("end", "snapshot")


async def test_a_paused_reply_is_confirmed_with_an_edited_input(
    http: tuple[httpx.AsyncClient, list[str]],
) -> None:
    client, stamped = http
    paused = (
        await client.post(
            "/agents/clerk/messages",
            headers=auth(),
            json={"content": 'tool stamp {"tag": "A"}', "session": "s1"},
        )
    ).json()
    assert paused["final"]["finished_reason"] == "paused"
    (call,) = paused["pending"]
    assert call["tool_name"] == "stamp"
    assert call["kind"] == "confirm"
    session = paused["session"]
    done = await client.post(
        f"/agents/clerk/sessions/{session}/confirm",
        headers=auth(),
        json={"edits": {call["call_id"]: {"tag": "B"}}, "stream": True},
    )
    final = events_of(done.text)[-1]
    assert final[0] == "final_answer"
    assert "stamped B" in final[1]["content"]
    assert stamped == ["B"]


async def test_users_see_only_their_own_sessions(http: tuple[httpx.AsyncClient, list[str]]) -> None:
    client, _ = http
    mine = (
        await client.post("/agents/clerk/messages", headers=auth(), json={"content": "secret"})
    ).json()["session"]
    # Bob can neither list, read, journal, continue nor cancel it: it does not exist for him.
    assert (await client.get("/sessions", headers=auth(BOB))).json()["sessions"] == []
    for path in (f"/agents/clerk/sessions/{mine}", f"/agents/clerk/sessions/{mine}/journal"):
        assert (await client.get(path, headers=auth(BOB))).status_code == 404
    confirm = await client.post(
        f"/agents/clerk/sessions/{mine}/confirm", headers=auth(BOB), json={"allow": ["x"]}
    )
    assert confirm.status_code == 404
    cancel = await client.post(f"/agents/clerk/sessions/{mine}/cancel", headers=auth(BOB))
    assert cancel.status_code == 404
    # Naming Alice's session as his conversation gives Bob a session of his own.
    his = (
        await client.post(
            "/agents/clerk/messages", headers=auth(BOB), json={"content": "heard?", "session": mine}
        )
    ).json()
    assert his["session"] != mine
    assert his["final"]["content"] == "heard: "
    # An admin sees both.
    every = (await client.get("/sessions", headers=auth(ADMIN))).json()["sessions"]
    assert {s["session"] for s in every} == {mine, his["session"]}


async def test_no_token_no_access(http: tuple[httpx.AsyncClient, list[str]]) -> None:
    client, _ = http
    for headers in (
        {},
        {"authorization": "Bearer nope-nope-nope-nope"},
        {"authorization": "Basic abc"},
    ):
        response = await client.get("/agents", headers=headers)
        assert response.status_code == 401
        assert response.headers["www-authenticate"] == "Bearer"
        assert response.json()["error"]["type"] == "authentication_error"
    assert (await client.get("/agents", headers={"x-api-key": ALICE})).status_code == 200
    # No such route, or not with that method: the same shape of error.
    missing = await client.get("/nowhere", headers=auth())
    assert missing.status_code == 404
    assert missing.json()["error"]["type"] == "not_found_error"
    wrong = await client.delete("/agents", headers=auth())
    assert wrong.status_code == 405
    assert wrong.json()["error"]["type"] == "invalid_request_error"


async def test_openapi_describes_the_routes(http: tuple[httpx.AsyncClient, list[str]]) -> None:
    client, _ = http
    spec = (await client.get("/../../openapi.json")).json()
    assert "/v1/chat/completions" in spec["paths"]
    assert "/v1/fleet/agents/{agent}/sessions/{session}/confirm" in spec["paths"]


async def test_a_client_that_goes_away_cancels_its_reply_and_frees_its_stream(
    nats_server: EmbeddedServer, prefix: str, bus: Bus
) -> None:
    lingering = asyncio.Event()
    async with (
        serving(nats_server.url, prefix, clerk([], lingering)),
        gateway(nats_server.url, prefix, max_streams_per_token=1) as gw,
        httpx.AsyncClient(base_url=f"{gw.url}/v1/fleet", timeout=30) as client,
    ):
        body = {"content": "tool linger", "stream": True, "session": "long"}
        async with client.stream("POST", "/agents/clerk/messages", headers=auth(), json=body) as s:
            await lingering.wait()
            # The token's one stream is taken.
            busy = await client.post(
                "/agents/clerk/messages", headers=auth(), json={"content": "x"}
            )
            assert busy.status_code == 429
            session = s.headers["x-fleetbus-session"]
        # Gone: the reply is interrupted, and the stream is free again.
        assert (await ended(bus, session))["finished_reason"] == "interrupted"
        again = await client.post("/agents/clerk/messages", headers=auth(), json={"content": "x"})
        assert again.status_code == 200


async def ended(bus: Bus, session: str) -> dict[str, Any]:
    """The final answer of the clerk's session once its journal says the reply ended."""
    journals = await SessionJournals.open_journals(bus)
    async with asyncio.timeout(20):
        async for fact in journals.follow("clerk", session):
            if fact.kind in ("end", "snapshot"):
                record = await journals.get("clerk", session)
                if record is not None and record.final is not None:
                    return record.final
    raise AssertionError("the journal's follow ended")


async def test_with_detach_a_client_that_goes_away_leaves_the_reply_to_finish(
    nats_server: EmbeddedServer, prefix: str, bus: Bus
) -> None:
    async with (
        serving(nats_server.url, prefix, clerk([])),
        gateway(nats_server.url, prefix, on_disconnect="detach") as gw,
        httpx.AsyncClient(base_url=f"{gw.url}/v1/fleet", timeout=30) as client,
    ):
        body = {"content": "sleep 1; later", "stream": True}
        async with client.stream("POST", "/agents/clerk/messages", headers=auth(), json=body) as s:
            session = s.headers["x-fleetbus-session"]
            async for line in s.aiter_lines():
                if line == "event: reply_start":
                    break
        final = await ended(bus, session)
        assert final["finished_reason"] == "completed"
        assert final["content"].startswith("echo sleep 1; later from ")


async def test_a_browser_page_of_an_allowed_origin_may_call_and_others_may_not(
    nats_server: EmbeddedServer, prefix: str
) -> None:
    async with (
        gateway(nats_server.url, prefix, cors_origins=("https://chat.example.com",)) as gw,
        httpx.AsyncClient(base_url=gw.url) as client,
    ):
        asked = {
            "access-control-request-method": "POST",
            "access-control-request-headers": "authorization,content-type",
        }
        allowed = await client.options(
            "/v1/chat/completions", headers={"origin": "https://chat.example.com", **asked}
        )
        assert allowed.status_code == 200
        assert allowed.headers["access-control-allow-origin"] == "https://chat.example.com"
        refused = await client.options(
            "/v1/chat/completions", headers={"origin": "https://evil.example", **asked}
        )
        assert "access-control-allow-origin" not in refused.headers


async def test_a_chunked_body_over_the_limit_is_refused_as_one_with_a_length(
    http: tuple[httpx.AsyncClient, list[str]],
) -> None:
    client, _ = http

    async def chunks(size: int) -> AsyncIterator[bytes]:
        body = json.dumps({"content": "x" * size}).encode()
        for start in range(0, len(body), 64 * 1024):
            yield body[start : start + 64 * 1024]

    headers = {**auth(), "content-type": "application/json"}
    big = await client.post(
        "/agents/clerk/messages", headers=headers, content=chunks(2 * 1024 * 1024)
    )
    assert big.status_code == 413
    assert big.json()["error"]["code"] == "request_too_large"
    small = await client.post("/agents/clerk/messages", headers=headers, content=chunks(10))
    assert small.status_code == 200, small.text
    assert small.json()["final"]["content"].startswith("echo xxxxxxxxxx from ")
