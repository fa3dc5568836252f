"""``fleetbus dashboard``: its JSON and Server-Sent Events endpoints, served by
a real uvicorn in the test's process, against agents, tool workers and a real
nats-server."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx2 as httpx
import pytest
import uvicorn

from fleetbus.agents import Agent, AgentState, Permissions
from fleetbus.agents.serving.remote import RemoteAgent
from fleetbus.agents.serving.sessions import SessionRecord, SessionStore
from fleetbus.bus import Bus, EmbeddedServer, ToolClient
from fleetbus.capabilities import Handoffs
from fleetbus.cli import dashboard_cmd
from fleetbus.cli._common import guarded
from fleetbus.dashboard import TOKEN_HEADER, FleetView, Limits, create_app
from fleetbus.errors import ConfigError
from fleetbus.protocol import Event, FinalAnswer, UserRequest, to_builtins
from fleetbus.testing import ScriptedModel
from fleetbus.tools_workers import Toolkit, ToolWorker
from tests.helpers import ROOT, free_port, serving, stop
from tests.integration import resume_specs, worker_tools
from tests.integration.agent_specs import PID, CommandModel


@dataclass
class Dashboard:
    """A dashboard served on a free port of 127.0.0.1."""

    url: str
    token: str
    view: FleetView
    client: httpx.AsyncClient

    async def fleet(self) -> dict[str, Any]:
        response = await self.client.get("/api/fleet")
        assert response.status_code == 200, response.text
        data: dict[str, Any] = response.json()
        return data

    async def until(
        self, check: Callable[[dict[str, Any]], Any], timeout: float = 20.0
    ) -> dict[str, Any]:
        """The first snapshot for which ``check`` is true."""
        deadline = time.monotonic() + timeout
        while True:
            snap = await self.fleet()
            if check(snap):
                return snap
            if time.monotonic() > deadline:
                raise AssertionError(f"not seen in {timeout}s: {json.dumps(snap, indent=1)}")
            await asyncio.sleep(0.1)


class _QuietServer(uvicorn.Server):
    """uvicorn without its signal handlers (the test runner keeps its own)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


@contextlib.asynccontextmanager
async def dashboard(bus: Bus, **view_options: Any) -> AsyncIterator[Dashboard]:
    """The dashboard of ``bus``'s fleet, polling fast, served until the block ends."""
    view_options.setdefault("session_poll", 0.3)
    view_options.setdefault("stats_poll", 0.3)
    view_options.setdefault("stats_wait", 0.2)
    view = FleetView(bus, **view_options)
    app = create_app(bus, view=view)
    sock = socket.create_server(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = _QuietServer(
        uvicorn.Config(app, log_config=None, access_log=False, timeout_graceful_shutdown=2)
    )
    url = f"http://127.0.0.1:{port}"
    async with asyncio.TaskGroup() as tg:
        task = tg.create_task(server.serve(sockets=[sock]))
        await asyncio.wait_for(view.ready.wait(), 10)
        try:
            async with httpx.AsyncClient(base_url=url, timeout=10) as client:
                yield Dashboard(url, app.state.token, view, client)
        finally:
            view.close()
            server.should_exit = True
            await task


async def sse(
    client: httpx.AsyncClient,
    path: str,
    until: Callable[[str, Any], bool],
    *,
    started: asyncio.Event | None = None,
    timeout: float = 20.0,
) -> list[tuple[str, Any]]:
    """The events of an SSE stream, read until ``until(event, data)``."""
    seen: list[tuple[str, Any]] = []
    async with asyncio.timeout(timeout), client.stream("GET", path) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        if started is not None:
            started.set()
        event = "message"
        async for line in response.aiter_lines():
            if line.startswith("event: "):
                event = line.removeprefix("event: ")
            elif line.startswith("data: "):
                data = json.loads(line.removeprefix("data: "))
                seen.append((event, data))
                if until(event, data):
                    return seen
                event = "message"
    raise AssertionError(f"the stream ended: {seen}")


def echo_agent(name: str = "echo", *, ask: list[str] | None = None) -> Agent:
    """An agent of the scripted model with the ``echo`` tool (asked before use with ``ask``)."""
    return Agent(
        name,
        "",
        CommandModel(),
        toolkit=Toolkit([worker_tools.echo]),
        permissions=Permissions.from_strings(ask=ask or []),
    )


async def until_true(check: Callable[[], Awaitable[bool]], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not true after {timeout}s")
        await asyncio.sleep(0.05)


# -- the page ----------------------------------------------------------------------------


async def test_the_page_embeds_its_token_and_forbids_inline_scripts(bus: Bus) -> None:
    async with dashboard(bus) as board:
        page = await board.client.get("/")
        assert page.status_code == 200
        assert f'<meta name="fleetbus-token" content="{board.token}">' in page.text
        csp = page.headers["content-security-policy"]
        assert "script-src 'self'" in csp
        assert "unsafe-inline" not in csp
        assert page.headers["x-frame-options"] == "DENY"
        script = await board.client.get("/static/dashboard.js")
        assert script.status_code == 200
        # Text from the bus is only ever set as text, never parsed as markup.
        assert not re.search(r"innerHTML|outerHTML|insertAdjacentHTML|document\.write", script.text)
        assert (await board.client.get("/static/dashboard.css")).status_code == 200
        # Another host name (DNS rebinding) is not answered.
        other = await board.client.get("/api/fleet", headers={"host": "attacker.example"})
        assert other.status_code == 400
        snap = await board.fleet()
        assert snap["prefix"] == bus.prefix
        assert snap["bus"]["connected"] is True


# -- sessions and their events -----------------------------------------------------------


async def test_a_session_started_from_the_test_is_listed_and_streams_live(
    nats_server: EmbeddedServer, bus: Bus
) -> None:
    async with (
        serving(nats_server.url, bus.prefix, echo_agent()),
        dashboard(bus) as board,
    ):
        opened = asyncio.Event()
        # The stream of a session that has no event yet: it follows the subject.
        stream = asyncio.create_task(
            sse(
                board.client,
                "/api/sessions/echo/s-live/stream",
                lambda _e, data: data.get("type") == "final_answer",
                started=opened,
            )
        )
        fleet_stream = asyncio.create_task(
            sse(
                board.client,
                "/api/fleet/stream",
                lambda event, data: (
                    event == "fleet"
                    and any(
                        s["session"] == "s-live" and s["status"] == "done" for s in data["sessions"]
                    )
                ),
            )
        )
        await asyncio.wait_for(opened.wait(), 10)
        await asyncio.sleep(0.2)  # the stream's subscription reaches the server
        answer = await RemoteAgent(bus, "echo", session_id="s-live").reply("hello", timeout=20)
        assert isinstance(answer, FinalAnswer)
        events = await stream
        names = [d.get("event") or d["type"] for _, d in events]
        assert names[0] == "reply_start", names
        assert "text_delta" in names or "model_call_end" in names
        final = events[-1][1]
        assert final["content"].startswith("echo hello from")
        await fleet_stream

        snap = await board.until(
            lambda s: any(x["session"] == "s-live" and x["in_store"] for x in s["sessions"])
        )
        (session,) = [s for s in snap["sessions"] if s["session"] == "s-live"]
        assert session["agent"] == "echo"
        assert session["status"] == "done"
        assert session["last_answer"].startswith("echo hello from")
        (agent,) = [a for a in snap["agents"] if a["name"] == "echo"]
        assert {"events", "store", "leases"} <= set(agent["sources"])
        assert [r["replica"] for r in agent["replicas"]] == ["echo@test"]
        assert agent["sessions"] == 1

        kept = (await board.client.get("/api/sessions/echo/s-live/events")).json()
        assert [e["id"] for e in kept] == [d["id"] for _, d in events], (
            [(e.get("event") or e["type"]) for e in kept],
            [(d.get("event") or d["type"]) for _, d in events],
        )
        bad = await board.client.get("/api/sessions/echo/no.such/stream")
        assert bad.status_code in (400, 404)


async def test_what_the_view_keeps_is_bounded(bus: Bus) -> None:
    limits = Limits(sessions=3, events_per_session=5, events=12, event_bytes=600)
    async with dashboard(bus, limits=limits) as board:
        for n in range(6):
            for seq in range(8):
                event = Event(
                    sender="loud",
                    session_id=f"b{n}",
                    event="tool_result",
                    data={"output": "<script>x</script>" * 200, "seq": seq},
                    seq=seq,
                )
                await bus.publish(bus.subjects.events("loud", f"b{n}", "alice"), event)
        await bus.flush()
        snap = await board.until(lambda s: any(x["session"] == "b5" for x in s["sessions"]))
        await board.until(
            lambda s: [x["events"] for x in s["sessions"] if x["session"] == "b5"] == [5]
        )
        snap = await board.fleet()
        assert [s["session"] for s in snap["sessions"]] == ["b5", "b4", "b3"]
        assert sum(s["events"] for s in snap["sessions"]) <= 12
        kept = (await board.client.get("/api/sessions/loud/b5/events")).json()
        assert [e["seq"] for e in kept] == [3, 4, 5, 6, 7]
        for item in kept:
            assert len(json.dumps(item)) < 1200
            assert item["clipped"] > 3600  # the original size, said
        assert (await board.client.get("/api/sessions/loud/b0/events")).json() == []


# -- tool workers ------------------------------------------------------------------------


async def test_a_tool_workers_stats_are_shown(nats_server: EmbeddedServer, bus: Bus) -> None:
    worker_bus = await Bus.connect(nats_server.url, prefix=bus.prefix, name="w-dash")
    try:
        worker = ToolWorker(worker_bus, Toolkit([worker_tools.echo]), worker_id="w-dash")
        async with asyncio.TaskGroup() as tg:
            task = tg.create_task(worker.run())
            await worker.wait_ready()
            async with dashboard(bus) as board:
                client = ToolClient(bus)
                for text in ("a", "b", "c"):
                    assert (await client.call("echo", {"text": text})).ok
                assert not (await client.call("echo", {"wrong": 1})).ok

                def counted(snap: dict[str, Any]) -> bool:
                    return any(
                        w["worker_id"] == "w-dash"
                        and [
                            (e["name"], e["num_requests"], e["num_errors"]) for e in w["endpoints"]
                        ]
                        == [("echo", 4, 1)]
                        for w in snap["workers"]
                    )

                snap = await board.until(counted)
                (shown,) = snap["workers"]
                (endpoint,) = shown["endpoints"]
                assert endpoint["average_ms"] is not None
                assert endpoint["average_ms"] >= 0
                assert "invalid_parameters" in endpoint["last_error"]
            worker.stop()
            await task
    finally:
        await worker_bus.close()


# -- confirmations -----------------------------------------------------------------------


async def test_allow_resumes_a_paused_session(nats_server: EmbeddedServer, bus: Bus) -> None:
    async with (
        serving(nats_server.url, bus.prefix, echo_agent("careful", ask=["echo"])),
        dashboard(bus) as board,
    ):
        remote = RemoteAgent(bus, "careful", session_id="h1")
        paused = await remote.reply('tool echo {"text": "allowed"}', timeout=20)
        assert isinstance(paused, FinalAnswer)
        assert paused.finished_reason == "paused"

        snap = await board.until(
            lambda s: any(x["session"] == "h1" and x["pending"] for x in s["sessions"])
        )
        (session,) = [s for s in snap["sessions"] if s["session"] == "h1"]
        assert session["status"] == "paused"
        ((call_id, tool, kind),) = [
            (p["call_id"], p["tool_name"], p["kind"]) for p in session["pending"]
        ]
        assert (tool, kind) == ("echo", "confirm")

        path = "/api/sessions/careful/h1/confirm"
        body = {"allow": [call_id]}
        token = {TOKEN_HEADER: board.token}
        assert (await board.client.post(path, json=body)).status_code == 403
        wrong = await board.client.post(path, json=body, headers={TOKEN_HEADER: "guess"})
        assert wrong.status_code == 403
        foreign = await board.client.post(
            path, json=body, headers={**token, "origin": "http://attacker.example"}
        )
        assert foreign.status_code == 403
        malformed = await board.client.post(path, json={"allow": "all"}, headers=token)
        assert malformed.status_code == 400
        await asyncio.sleep(0.5)
        assert [s["status"] for s in (await board.fleet())["sessions"]] == ["paused"]

        same_origin = {**token, "origin": board.url}
        sent = await board.client.post(path, json=body, headers=same_origin)
        assert sent.status_code == 200, sent.text
        assert sent.json()["accepted"] is True

        snap = await board.until(
            lambda s: any(x["session"] == "h1" and x["status"] == "done" for x in s["sessions"])
        )
        (session,) = [s for s in snap["sessions"] if s["session"] == "h1"]
        assert session["last_answer"].startswith("done echo=allowed from")
        assert session["pending"] == []

        # Nothing waits any more: the agent refuses, and the page is told.
        again = await board.client.post(path, json=body, headers=token)
        assert again.status_code == 409, again.text
        assert "Nothing is waiting for a confirmation" in again.json()["message"]


async def paused_call(board: Dashboard, session_id: str) -> dict[str, Any]:
    """The one call that ``session_id`` waits for, once the page shows it."""
    snap = await board.until(
        lambda s: any(x["session"] == session_id and x["pending"] for x in s["sessions"])
    )
    (session,) = [s for s in snap["sessions"] if s["session"] == session_id]
    assert session["status"] == "paused"
    (call,) = session["pending"]
    assert isinstance(call, dict)
    return call


async def test_an_edited_input_is_allowed_and_a_suggested_rule_accepted(
    nats_server: EmbeddedServer, bus: Bus
) -> None:
    async with (
        serving(nats_server.url, bus.prefix, echo_agent("careful", ask=["echo"])),
        dashboard(bus) as board,
    ):
        remote = RemoteAgent(bus, "careful", session_id="e1")
        paused = await remote.reply('tool echo {"text": "as the model wrote"}', timeout=20)
        assert isinstance(paused, FinalAnswer)
        assert paused.finished_reason == "paused"
        call = await paused_call(board, "e1")
        assert (call["tool_name"], call["kind"], call["clipped"]) == ("echo", "confirm", False)
        assert json.loads(call["parameters"]) == {"text": "as the model wrote"}
        assert call["suggested_rules"][-1] == "echo"  # the tool with any input, last

        path = "/api/sessions/careful/e1/confirm"
        token = {TOKEN_HEADER: board.token}
        for wrong in (
            {"edits": {call["call_id"]: "not an object"}},
            {"edits": [call["call_id"]]},
            {"allow": [call["call_id"]], "accept_rules": "echo"},
            {"allow": [call["call_id"]], "accept_rules": ["echo(("]},
        ):
            refused = await board.client.post(path, json=wrong, headers=token)
            assert refused.status_code == 400, (wrong, refused.text)
        sent = await board.client.post(
            path,
            json={"edits": {call["call_id"]: {"text": "edited"}}, "accept_rules": ["echo"]},
            headers=token,
        )
        assert sent.status_code == 200, sent.text
        assert sent.json()["accepted"] is True
        snap = await board.until(
            lambda s: any(x["session"] == "e1" and x["status"] == "done" for x in s["sessions"])
        )
        (session,) = [s for s in snap["sessions"] if s["session"] == "e1"]
        # The tool ran with the edited input (the model is told it was changed).
        assert session["last_answer"].startswith("done echo=(The user changed the input")
        assert session["last_answer"].endswith(f"edited from {PID}")

        # The accepted rule stays with the agent: a later session's call is not asked.
        later = RemoteAgent(bus, "careful", session_id="e2")
        answer = await later.reply('tool echo {"text": "no question"}', timeout=20)
        assert isinstance(answer, FinalAnswer)
        assert answer.finished_reason == "completed", answer
        assert str(answer.content).startswith("done echo=no question from")


async def test_an_external_result_resumes_a_paused_session(
    nats_server: EmbeddedServer, bus: Bus
) -> None:
    async with (
        serving(nats_server.url, bus.prefix, resume_specs.desk()),
        dashboard(bus) as board,
    ):
        remote = RemoteAgent(bus, "desk", session_id="x1")
        paused = await remote.reply('tool lookup {"query": "rows"}', timeout=20)
        assert isinstance(paused, FinalAnswer)
        assert paused.finished_reason == "paused"
        call = await paused_call(board, "x1")
        assert (call["tool_name"], call["kind"]) == ("lookup", "external")
        assert call["suggested_rules"] == []

        path = "/api/sessions/desk/x1/resume"
        token = {TOKEN_HEADER: board.token}
        assert (await board.client.post(path, json={"results": {}})).status_code == 403
        malformed: list[dict[str, Any]] = [
            {"results": []},
            {"results": {}},
            {"errors": {call["call_id"]: 3}},
        ]
        for wrong in malformed:
            refused = await board.client.post(path, json=wrong, headers=token)
            assert refused.status_code == 400, (wrong, refused.text)
        sent = await board.client.post(
            path, json={"results": {call["call_id"]: {"rows": 3}}}, headers=token
        )
        assert sent.status_code == 200, sent.text
        assert sent.json()["accepted"] is True
        snap = await board.until(
            lambda s: any(x["session"] == "x1" and x["status"] == "done" for x in s["sessions"])
        )
        (session,) = [s for s in snap["sessions"] if s["session"] == "x1"]
        assert session["last_answer"].startswith("done lookup={'rows': 3} from")
        assert session["pending"] == []

        again = await board.client.post(
            path, json={"errors": {call["call_id"]: "too late"}}, headers=token
        )
        assert again.status_code == 409, again.text
        assert "Nothing is waiting for an external result" in again.json()["message"]


# -- the bus going away ------------------------------------------------------------------


@pytest.mark.slow
async def test_the_view_says_disconnected_and_recovers(tmp_path: Path) -> None:
    port = free_port()
    server = EmbeddedServer(port=port, state_dir=tmp_path / "js").start()
    try:
        bus = await Bus.connect(server.url, prefix=f"t{uuid.uuid4().hex[:8]}", name="dash")
        try:
            async with dashboard(bus) as board:
                await board.until(lambda s: s["bus"]["connected"] and "sessions" not in s["errors"])
                server.stop()
                await board.until(lambda s: not s["bus"]["connected"])
                server = EmbeddedServer(port=port, state_dir=tmp_path / "js").start()
                await board.until(lambda s: s["bus"]["connected"], timeout=30)
                # The subscriptions came back with the connection.
                event = Event(sender="back", session_id="r1", event="reply_start", seq=0)
                await bus.publish(bus.subjects.events("back", "r1", "alice"), event)
                await board.until(
                    lambda s: any(x["session"] == "r1" for x in s["sessions"]), timeout=30
                )
        finally:
            await bus.close()
    finally:
        server.stop()


# -- the command -------------------------------------------------------------------------


def test_without_the_extra_the_command_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "uvicorn", None)
    parser = argparse.ArgumentParser()
    dashboard_cmd.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["dashboard"])
    with pytest.raises(ConfigError) as raised:
        dashboard_cmd.cmd(args)
    assert "\n" not in str(raised.value)
    assert guarded(lambda: dashboard_cmd.cmd(args)) == 1
    err = " ".join(capsys.readouterr().err.split())  # rich wraps at the terminal's width
    assert err.startswith("error: fleetbus dashboard needs uvicorn")
    assert err.endswith("pip install 'fleetbus[dashboard]'"), err


def _dashboard_process(url: str, prefix: str) -> subprocess.Popen[bytes]:
    """The command as a process (``fleetbus dashboard``), on any free port."""
    command = [sys.executable, "-m", "fleetbus", "dashboard", "--port", "0"]
    command += ["--nats", url, "--prefix", prefix]
    return subprocess.Popen(
        command,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "1000"},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )


@pytest.mark.slow
async def test_the_command_serves_until_sigterm(nats_server: EmbeddedServer, bus: Bus) -> None:
    proc = _dashboard_process(nats_server.url, bus.prefix)
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 30)
        found = re.search(rb"dashboard on (http://127\.0\.0\.1:\d+/) \(fleet (\S+) at", line)
        assert found, line
        assert found.group(2).decode() == bus.prefix
        async with httpx.AsyncClient(base_url=found.group(1).decode(), timeout=10) as client:
            snap = (await client.get("/api/fleet")).json()
            assert snap["prefix"] == bus.prefix
            async with client.stream("GET", "/api/fleet/stream") as live:
                assert live.status_code == 200
                code = await asyncio.to_thread(stop, proc)
        assert code == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


async def test_a_session_taken_cleanly_shows_running_before_its_first_fact(bus: Bus) -> None:
    """A session its last owner released is taken with a lease write only:
    the view says it runs from that write, and the store's polls (which
    still read it idle) do not say otherwise."""
    store = await SessionStore.open(bus, owner="quiet@r1")
    lease = await store.acquire("quiet", "s-clean", fresh=AgentState(agent_name="quiet"))
    await store.save(lease, status="idle", release=True)

    def status(snap: dict[str, Any]) -> str | None:
        return next((s["status"] for s in snap["sessions"] if s["session"] == "s-clean"), None)

    async with dashboard(bus) as board:
        merged: list[asyncio.Event] = []
        merge = board.view._merge

        def counted(records: list[SessionRecord]) -> None:
            merge(records)
            for event in merged:
                event.set()

        board.view._merge = counted  # type: ignore[method-assign]
        await board.until(lambda s: status(s) == "idle")
        request = UserRequest(content="hi", session_id="s-clean", call_id="q-clean")
        lease = await store.acquire(
            "quiet",
            "s-clean",
            fresh=AgentState(agent_name="quiet"),
            reply_to="_INBOX.quiet",
            pending_input=to_builtins(request),
        )
        assert lease.untaken is not None  # nothing appended
        await board.until(lambda s: status(s) == "running")
        for _ in range(2):  # two polls of the store, which still reads it idle
            merged.append(asyncio.Event())
            await asyncio.wait_for(merged[-1].wait(), 20)
        assert status(await board.fleet()) == "running"
        await store.save(lease, status="done", final={"content": "ok"}, release=True)
        await board.until(lambda s: status(s) == "done")


async def test_a_session_handed_over_shows_where_it_went(
    nats_server: EmbeddedServer, bus: Bus
) -> None:
    triage = Agent(
        "triage",
        "",
        ScriptedModel([ScriptedModel.call("transfer_to_billing", {"reason": "a refund"})]),
        capabilities=[Handoffs(["billing"])],
    )
    billing = Agent("billing", "", ScriptedModel([ScriptedModel.text("Refunded.")]))
    async with (
        serving(nats_server.url, bus.prefix, triage),
        serving(nats_server.url, bus.prefix, billing),
        dashboard(bus) as board,
    ):
        answer = await RemoteAgent(bus, "triage", session_id="h-over").reply("charged twice")
        assert (answer.sender, answer.content) == ("billing", "Refunded.")
        # As the events and journal facts say, and as the store's record
        # says once polled (stored "done", with the handed_off answer).
        snap = await board.until(
            lambda s: (
                {
                    (x["agent"], x["status"])
                    for x in s["sessions"]
                    if x["session"] == "h-over" and x["in_store"]
                }
                >= {("triage", "handed_off"), ("billing", "done")}
            )
        )
        assert any(s["agent"] == "billing" for s in snap["sessions"])
