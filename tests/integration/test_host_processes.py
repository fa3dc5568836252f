"""A host serving a population of 1,000 agents as separate OS processes
(``fleetbus agent tests.integration.agent_specs:crowd --group crowd``):
direct messages to every agent on a constant number of subscriptions,
replicas sharing the agents and finishing the reply of a replica killed
mid-reply, broadcasts recorded once in every agent's memory, durable topics
caught up after a restart."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import signal
import time
import urllib.request
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, TypeVar

import nats.js.errors
import pytest

from fleetbus.agents.serving.sessions import SessionRecord, SessionStore, lease_owner, session_key
from fleetbus.bus import Bus, EmbeddedServer
from fleetbus.errors import CallTimeoutError, NoRespondersError
from fleetbus.protocol import AgentMessage, FinalAnswer, TextBlock, UserRequest
from tests.helpers import free_port, running
from tests.integration.agent_specs import crowd_member

pytestmark = pytest.mark.slow

CROWD = 1000
T = TypeVar("T")
R = TypeVar("R")


def host(url: str, prefix: str, replica: str, *extra: str) -> list[str]:
    """``fleetbus agent`` serving the crowd in group ``crowd`` (lease 1 s)."""
    return [
        "agent",
        "tests.integration.agent_specs:crowd",
        "--group",
        "crowd",
        "--nats",
        url,
        "--prefix",
        prefix,
        "--no-remote-tools",
        "--checkpoints",
        "reply",
        "--events",
        "final",
        "--lease-ttl",
        "1",
        "--replica-id",
        replica,
        *extra,
    ]


async def ask(
    bus: Bus, agent: str, text: str, session: str, *, timeout: float = 30.0
) -> FinalAnswer:
    answer = await bus.request(
        bus.subjects.agent_inbox(agent),
        UserRequest(content=text, session_id=session),
        timeout=timeout,
    )
    assert isinstance(answer, FinalAnswer), answer
    return answer


def pid_of(answer: FinalAnswer) -> int:
    found = re.search(r" from (\d+)$", str(answer.content))
    assert found, answer.content
    return int(found.group(1))


async def bounded(
    items: Iterable[T], work: Callable[[T], Awaitable[R]], limit: int = 64
) -> list[R]:
    """``work`` on each item, ``limit`` at a time; the results in order."""
    gate = asyncio.Semaphore(limit)

    async def one(item: T) -> R:
        async with gate:
            return await work(item)

    return await asyncio.gather(*(one(item) for item in items))


async def wait_for_hosts(
    bus: Bus, count: int, *, crowd: int = CROWD, timeout: float = 30.0
) -> set[int]:
    """The pids of ``count`` host processes serving a crowd of ``crowd``
    agents, once each has answered."""
    seen: set[int] = set()
    deadline = time.monotonic() + timeout
    n = 0
    while time.monotonic() < deadline and len(seen) < count:
        n += 1
        try:
            answer = await ask(bus, crowd_member(n % crowd), "ping", f"ready-{n}", timeout=2)
        except CallTimeoutError:
            continue
        except NoRespondersError:  # not subscribed yet
            await asyncio.sleep(0.1)
            continue
        seen.add(pid_of(answer))
    assert len(seen) >= count, f"only {len(seen)} of {count} hosts answered"
    return seen


async def records(
    store: SessionStore, names: Iterable[str], session: str
) -> list[SessionRecord | None]:
    return await bounded(names, lambda name: store.get(name, session))


async def broadcast(bus: Bus, topic: str, text: str, session: str) -> None:
    await bus.publish(
        bus.subjects.topic(topic),
        AgentMessage(
            sender="herald",
            name="herald",
            session_id=session,
            content=[TextBlock(text=text)],
            reply=False,
        ),
    )
    await bus.flush()


async def heard_by_all(
    store: SessionStore, names: list[str], session: str, texts: list[str], timeout: float = 30.0
) -> dict[str, list[str]]:
    """Each agent's memory in ``session`` (texts), once every agent holds
    ``len(texts)`` messages and no lease; what it holds at the deadline else."""
    heard: dict[str, list[str]] = {}
    waiting = list(names)
    deadline = time.monotonic() + timeout
    while True:
        # Count the sessions first (one request): no reads until all exist.
        if len(await store.journal.keys(f"*.{session}")) >= len(names):
            for name, record in zip(waiting, await records(store, waiting, session), strict=True):
                if record is not None and record.owner is None:
                    heard[name] = [m.text for m in record.state.memory]
            waiting = [n for n in waiting if len(heard.get(n, [])) < len(texts)]
        if not waiting or time.monotonic() >= deadline:
            return heard
        await asyncio.sleep(0.2)


async def subscriptions(monitor: int, connection: str) -> list[tuple[str, str]]:
    """The subscriptions (subject, queue group) the server holds for the
    client connection named ``connection``, from its monitoring endpoint."""
    url = f"http://127.0.0.1:{monitor}/connz?subs=detail&limit=1000"

    def read() -> dict[str, Any]:
        with urllib.request.urlopen(url, timeout=5) as response:
            data: dict[str, Any] = json.load(response)
            return data

    for conn in (await asyncio.to_thread(read))["connections"]:
        if conn.get("name") == connection:
            subs = conn.get("subscriptions_list_detail", [])
            return sorted((s["subject"], s.get("qgroup", "")) for s in subs)
    raise AssertionError(f"no connection named {connection}")


async def test_one_host_process_serves_1000_agents_on_constant_subscriptions(prefix: str) -> None:
    monitor = free_port()
    with EmbeddedServer(extra_args=["--http_port", str(monitor)]) as server:
        bus = await Bus.connect(server.url, prefix=prefix, name="test-client")
        try:
            with running([host(server.url, prefix, "solo")]) as [proc]:
                await wait_for_hosts(bus, 1)
                before = await subscriptions(monitor, "solo")
                names = [crowd_member(i) for i in range(CROWD)]
                answers = await bounded(
                    names, lambda name: ask(bus, name, f"hello {name}", "direct")
                )
                after = await subscriptions(monitor, "solo")
                with pytest.raises(CallTimeoutError):  # past the end of the crowd
                    await ask(bus, crowd_member(CROWD), "hello?", "direct", timeout=1)
                with pytest.raises(CallTimeoutError):
                    await ask(bus, "stranger", "hello?", "direct", timeout=1)
                last = await ask(bus, crowd_member(CROWD - 1), "still there?", "direct")
                store = await SessionStore.open(bus, owner="test")
                record = await store.get(crowd_member(500), "direct")
        finally:
            await bus.close()
    assert [(a.sender, a.content) for a in answers] == [
        (name, f"echo hello {name} from {proc.pid}") for name in names
    ]
    assert last.content == f"echo still there? from {proc.pid}"
    assert record is not None
    assert [m.text for m in record.state.memory] == [
        f"hello {crowd_member(500)}",
        f"echo hello {crowd_member(500)} from {proc.pid}",
    ]
    # One wildcard inbox in the host's queue group, however many agents it served.
    assert after == before
    assert (f"{prefix}.agent.*.inbox", "host.crowd") in after
    # And the directory's nine: three verbs on three subjects each, whatever the agents.
    served = [(s, q) for s, q in after if not s.startswith("$SRV.")]
    assert len(served) <= 6, after
    assert len(after) - len(served) == 9, after
    assert not [s for s, _ in after if re.search(r"\bc\d{4}\b", s)]


async def test_replicas_share_the_crowd_and_a_killed_replicas_reply_is_finished(
    nats_server: EmbeddedServer, bus: Bus
) -> None:
    with running([host(nats_server.url, bus.prefix, f"r{i}") for i in (1, 2)]) as procs:
        pids = await wait_for_hosts(bus, 2)
        names = [crowd_member(i) for i in range(0, CROWD, 5)]
        answers = await bounded(names, lambda name: ask(bus, name, "hi", "spread"))
        by_pid = {pid: [a for a in answers if pid_of(a) == pid] for pid in pids}
        assert all(by_pid.values()), "one replica served no agent"
        # A reply in progress when the replica running it is killed.
        asking = asyncio.create_task(ask(bus, "c0042", "sleep 1.5; after the crash", "crash"))
        store = await SessionStore.open(bus, owner="test")
        owner = None
        deadline = time.monotonic() + 10
        while owner is None and time.monotonic() < deadline:
            # Who runs it: the lease says (a new session's head is written
            # by its first save, at the end of the reply here).
            held = await store.leases.get_or_none(session_key("c0042", "crash"))
            owner = lease_owner(held.value) if held is not None else None
            await asyncio.sleep(0.02)
        assert owner in ("crowd@r1", "crowd@r2")
        victim, survivor = procs if owner == "crowd@r1" else procs[::-1]
        victim.send_signal(signal.SIGKILL)
        answer = await asyncio.wait_for(asking, 30)
        finished = await store.get("c0042", "crash")
        # The killed replica's idle sessions go on too, with their memory.
        orphan = by_pid[victim.pid][0]
        recalled = await ask(bus, str(orphan.sender), "heard?", "spread")
    assert pids == {p.pid for p in procs}
    assert all(a.content == f"echo hi from {pid_of(a)}" for a in answers)
    assert victim.wait(5) == -signal.SIGKILL
    assert answer.finished_reason == "completed"
    assert answer.content == f"echo sleep 1.5; after the crash from {survivor.pid}"
    assert finished is not None
    assert (finished.status, finished.owner) == ("done", None)
    assert [m.text for m in finished.state.memory] == [
        "sleep 1.5; after the crash",
        f"echo sleep 1.5; after the crash from {survivor.pid}",
    ]
    assert recalled.content == "heard: hi"


async def test_a_broadcast_reaches_every_agent_once_with_two_replicas(
    nats_server: EmbeddedServer, bus: Bus
) -> None:
    texts = ["the market opens at nine", "bring lanterns"]
    names = [crowd_member(i) for i in range(CROWD)]
    with running([host(nats_server.url, bus.prefix, f"r{i}", "--topic", "news") for i in (1, 2)]):
        await wait_for_hosts(bus, 2)
        for text in texts:
            await broadcast(bus, "news", text, "town")
        store = await SessionStore.open(bus, owner="test")
        heard = await heard_by_all(store, names, "town", texts)
        sessions = list(await store.journal.keys("*.town"))
        answer = await ask(bus, "c0777", "heard?", "town")
    assert sessions == [f"{name}.town" for name in names]
    # Two replicas record the two broadcasts, in either order: each once.
    missing = [name for name in names if sorted(heard.get(name, [])) != sorted(texts)]
    assert not missing, f"{len(missing)} agents: {[(n, heard.get(n)) for n in missing[:3]]}"
    assert str(answer.content).removeprefix("heard: ").split(" | ") in (texts, texts[::-1])


async def test_a_durable_topic_is_caught_up_after_the_host_restarts(
    nats_server: EmbeddedServer, bus: Bus
) -> None:
    env = {"FLEETBUS_TEST_CROWD": "20"}
    names = [crowd_member(i) for i in range(20)]
    command = host(nats_server.url, bus.prefix, "durable", "--topic", "news", "--durable-topics")
    store = await SessionStore.open(bus, owner="test")
    try:
        with running([command], env=env):
            await wait_for_hosts(bus, 1, crowd=len(names))
            await broadcast(bus, "news", "while up", "town")
            before = await heard_by_all(store, names, "town", ["while up"])
        # Stopped (SIGTERM): the broadcast waits in the topic's stream.
        await broadcast(bus, "news", "while down", "town")
        with running([command], env=env):
            await wait_for_hosts(bus, 1, crowd=len(names))
            after = await heard_by_all(store, names, "town", ["while up", "while down"])
            await asyncio.sleep(0.5)  # nothing more comes (no redelivery of the first)
            again = await heard_by_all(store, names, "town", ["while up", "while down"], timeout=0)
    finally:
        # The stream and its durable consumer outlive the host by design; other
        # tests count the consumers of the whole server.
        with contextlib.suppress(nats.js.errors.NotFoundError):  # failed before making it
            await bus.nc.jetstream().delete_stream(bus.subjects.topic_stream("news"))
    assert before == {name: ["while up"] for name in names}
    assert after == {name: ["while up", "while down"] for name in names}
    assert again == after
