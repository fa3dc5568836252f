"""``fleetbus watch`` against a real server: tool calls through a real worker,
reply events, filters by session and agent, JSON lines, undecodable payloads."""

from __future__ import annotations

import asyncio
import functools
import io
import json
import re
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import pytest
from rich.console import Console

from fleetbus.bus import Bus, EmbeddedServer, ToolClient
from fleetbus.cli.watch import watch
from fleetbus.protocol import Event
from fleetbus.tools_workers import Toolkit, ToolWorker, tool

LATENCY = re.compile(r"\[\d+\.\d ms\]")


@tool
async def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first addend.
        b: the second addend.
    """
    await asyncio.sleep(0.01)
    return a + b


@dataclass
class Watcher:
    """One running ``watch`` and what it printed."""

    session: str | None = None
    agent: str | None = None
    json_output: bool = False
    console: Console = field(
        default_factory=lambda: Console(record=True, width=100, file=io.StringIO())
    )
    ready: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def text(self) -> str:
        return self.console.export_text(clear=False)

    def lines(self, *parts: str) -> list[str]:
        """The printed lines that contain every one of ``parts``."""
        return [line for line in self.text.splitlines() if all(p in line for p in parts)]


@pytest.fixture
async def peer(nats_server: EmbeddedServer, prefix: str) -> AsyncIterator[Bus]:
    """A second connection of the same fleet: the worker and the callers."""
    connection = await Bus.connect(nats_server.url, prefix=prefix, name="peer")
    try:
        yield connection
    finally:
        await connection.close()


async def until(check: Callable[[], object], what: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{what} not printed after {timeout}s")


async def test_watch_shows_calls_results_events_and_filters(bus: Bus, peer: Bus) -> None:
    everything = Watcher()
    only_s1 = Watcher(session="s1")
    only_a1 = Watcher(agent="a1")
    as_json = Watcher(json_output=True)
    watchers = [everything, only_s1, only_a1, as_json]
    stop = asyncio.Event()
    worker = ToolWorker(peer, Toolkit([add]), worker_id="w-watch")

    async def scenario() -> None:
        async with asyncio.TaskGroup() as tg:
            serving = tg.create_task(worker.run())
            watching = [
                tg.create_task(
                    watch(
                        bus,
                        session=w.session,
                        agent=w.agent,
                        json_output=w.json_output,
                        console=w.console,
                        stop=stop,
                        ready=w.ready,
                    )
                )
                for w in watchers
            ]
            await worker.wait_ready()
            for w in watchers:
                await w.ready.wait()

            client = ToolClient(peer, sender="cli", timeout=5.0)
            assert (await client.call("add", {"a": 1, "b": 2}, call_id="c-1", session_id="s1")).ok
            assert (await client.call("add", {"a": 3, "b": 4}, call_id="c-2", session_id="s2")).ok
            agent_client = ToolClient(peer, sender="a1", timeout=5.0)
            assert (await agent_client.call("add", {"a": 5, "b": 6}, call_id="c-3")).ok
            await peer.publish(
                peer.subjects.events("a1", "s1", "alice"),
                Event(sender="a1", session_id="s1", call_id="r-1", event="reply_start"),
            )
            await client.discover(timeout=0.2)  # $SRV replies on _INBOX: not ours to show
            await peer.nc.publish(peer.subjects.topic("junk"), b"not a message")
            await peer.flush()

            for w in (everything, only_s1, only_a1):
                await until(functools.partial(w.lines, "reply_start"), "the event")
            await until(lambda: len(as_json.text.splitlines()) >= 7, "7 JSON lines")
            stop.set()
            for task in watching:
                await task
            worker.stop()
            await serving

    await asyncio.wait_for(scenario(), 20)

    # Everything: each call, its result with the latency since the call, the event.
    for call_id in ("c-1", "c-2", "c-3"):
        (call,) = everything.lines("tool_call", f"call={call_id}")
        assert "add(" in call
        assert call.rstrip().endswith(f"@ {bus.subjects.tool('add')}")
        (result,) = everything.lines("tool_result", f"call={call_id}")
        assert "w-watch" in result
        assert "add success" in result
        assert "@ reply" in result
        assert LATENCY.search(result), result
    assert '"a": 1, "b": 2' in everything.lines("tool_call", "call=c-1")[0]
    assert "add success — 3" in everything.lines("tool_result", "call=c-1")[0]
    (event,) = everything.lines("event", "reply_start")
    assert "a1" in event
    assert "session=s1" in event
    assert "skipped 1 undecodable message(s)" in everything.text  # the junk, not $SRV replies

    # --session s1: the s1 call and event, nothing of s2 or without a session.
    assert only_s1.lines("tool_call", "call=c-1")
    assert only_s1.lines("tool_result", "call=c-1")
    assert "c-2" not in only_s1.text
    assert "c-3" not in only_s1.text
    assert "session=s2" not in only_s1.text

    # --agent a1: what a1 sent, the replies to it, and its event stream.
    assert only_a1.lines("tool_call", "call=c-3")
    (reply,) = only_a1.lines("tool_result", "call=c-3")
    assert LATENCY.search(reply)
    assert "c-1" not in only_a1.text
    assert "c-2" not in only_a1.text

    # --json: one decoded message per line, the same ones.
    messages = [json.loads(line) for line in as_json.text.splitlines()]
    assert [m["type"] for m in messages].count("tool_call") == 3
    assert [m["type"] for m in messages].count("tool_result") == 3
    assert {m["call_id"] for m in messages if m["type"] == "tool_result"} == {"c-1", "c-2", "c-3"}
    assert any(m["type"] == "event" and m["event"] == "reply_start" for m in messages)
    assert "skipped" not in as_json.text


async def test_watch_returns_when_stopped_with_nothing_seen(bus: Bus) -> None:
    watcher = Watcher()
    stop = asyncio.Event()
    async with asyncio.TaskGroup() as tg:
        task = tg.create_task(
            watch(
                bus,
                session=None,
                agent=None,
                json_output=False,
                console=watcher.console,
                stop=stop,
                ready=watcher.ready,
            )
        )
        await asyncio.wait_for(watcher.ready.wait(), 5)
        stop.set()
        await asyncio.wait_for(task, 5)
    assert watcher.text == ""
    await bus.flush()  # the connection is still usable
