"""``RemoteAgent.reply_stream`` against agents served on a real server: the
events of a reply in order and then one final answer; a paused reply resumed
and streamed; leaving the stream early interrupts the remote reply; a deadline;
a replica killed mid-reply; an error answer.

The served agents think with ``CommandModel`` (see ``agent_specs``): ``tool
NAME {json}`` calls a tool, ``sleep S`` makes the model slow, anything else is
echoed as ``echo <text> from <pid>``.
"""

from __future__ import annotations

import asyncio
import re
import signal
import time
from collections.abc import AsyncIterator, Callable

import pytest

from fleetbus.agents import Agent, Permissions, RemoteAgent
from fleetbus.agents.serving.sessions import SessionRecord, SessionStore
from fleetbus.bus import Bus, EmbeddedServer, Observation
from fleetbus.bus.subjects import ANY_OWNER
from fleetbus.errors import BusError, CallTimeoutError, RemoteError
from fleetbus.protocol import (
    AnyMessage,
    Cancel,
    Confirmation,
    ConfirmResult,
    Event,
    FinalAnswer,
    UserRequest,
)
from fleetbus.tools_workers import Toolkit, tool
from tests.helpers import agents, serving
from tests.integration.agent_specs import CommandModel


def clerk(stamped: list[str], slow: dict[str, bool] | None = None) -> Agent:
    """Runs ``stamp`` (appends to ``stamped``) only once confirmed; ``note``
    and ``linger`` (30 s; ``slow`` records whether it started and finished)
    at once."""

    @tool
    def stamp(tag: str) -> str:
        """Stamp a tag."""
        stamped.append(tag)
        return f"stamped {tag}"

    @tool
    def note(text: str) -> str:
        """Note a text."""
        return f"noted {text}"

    @tool
    async def linger() -> str:
        """Take half a minute."""
        if slow is not None:
            slow["started"] = True
        await asyncio.sleep(30)
        if slow is not None:
            slow["finished"] = True
        return "lingered"

    return Agent(
        "clerk",
        "",
        CommandModel(),
        toolkit=Toolkit([stamp, note, linger]),
        permissions=Permissions.from_strings(ask=["stamp"]),
    )


async def collect(
    stream: AsyncIterator[Event | FinalAnswer],
    on_item: Callable[[Event | FinalAnswer], None] | None = None,
) -> list[Event | FinalAnswer]:
    items: list[Event | FinalAnswer] = []
    async with asyncio.timeout(30):
        async for item in stream:
            items.append(item)
            if on_item is not None:
                on_item(item)
    return items


async def until_end(observation: Observation, timeout: float) -> str:
    """The ``finished_reason`` of the next ``reply_end`` seen on an observed
    events subject (the answer itself is not published there)."""
    async with asyncio.timeout(timeout):
        async for message in observation:
            assert not isinstance(message, FinalAnswer), "an answer on the events subject"
            if isinstance(message, Event) and message.event == "reply_end":
                return str(message.data["finished_reason"])
    raise AssertionError("the observation ended")


async def record_of(bus: Bus, agent: str, session_id: str) -> SessionRecord:
    record = await (await SessionStore.open(bus, owner="test")).get(agent, session_id)
    assert record is not None
    return record


async def settled_record(bus: Bus, agent: str, session_id: str) -> SessionRecord:
    """The session's record once it is no longer ``running`` (or after 5 s)."""
    deadline = time.monotonic() + 5
    record = await record_of(bus, agent, session_id)
    while record.status == "running" and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
        record = await record_of(bus, agent, session_id)
    return record


async def cancels_before_probe(bus: Bus, control: Observation, session: str) -> list[Cancel]:
    """The cancels on the control subject before a probe published now: the
    probe follows on the same connection, so whatever this client published
    earlier arrives first."""
    probe = Cancel(sender="probe", session_id="probe", reason="probe")
    await bus.publish(bus.subjects.agent_control("clerk"), probe)
    seen: list[Cancel] = []
    async with asyncio.timeout(5):
        async for message in control:
            if message.id == probe.id:
                return seen
            if isinstance(message, Cancel) and message.session_id == session:
                seen.append(message)
    raise AssertionError("the probe never came")


def names(items: list[Event | FinalAnswer]) -> list[str]:
    return [item.event for item in items if isinstance(item, Event)]


async def test_events_arrive_in_order_then_one_final_answer(
    nats_server: EmbeddedServer, bus: Bus, prefix: str
) -> None:
    async with serving(nats_server.url, prefix, clerk([])):
        desk = RemoteAgent(bus, "clerk", session_id="s1", timeout=20)
        watched: list[AnyMessage] = []
        async with (
            await bus.observe(bus.subjects.events("clerk", "s1", ANY_OWNER)) as events,
            await bus.observe(bus.subjects.agent_control("clerk")) as control,
        ):
            await bus.flush()
            items = await collect(desk.reply_stream('tool note {"text": "x"}'))
            async with asyncio.timeout(5):
                async for message in events:  # what any watcher of the session saw
                    watched.append(message)
                    if isinstance(message, Event) and message.event == "reply_end":
                        break
            cancels = await cancels_before_probe(bus, control, "s1")
        record = await record_of(bus, "clerk", "s1")

    *streamed, final = items
    assert isinstance(final, FinalAnswer)
    assert all(isinstance(item, Event) for item in streamed)
    assert final.finished_reason == "completed"
    assert str(final.content).startswith("done note=noted x from ")
    # Every event the agent published, in its order, then its final answer:
    # the request's reply (it is not published on the events subject).
    assert [m.id for m in watched] == [item.id for item in streamed]
    assert [e.seq for e in streamed if isinstance(e, Event)] == list(range(len(streamed)))
    assert names(items)[0] == "reply_start"
    assert names(items)[-1] == "reply_end"
    assert names(items).index("tool_call") < names(items).index("tool_result")
    assert record.final is not None
    assert record.final["id"] == final.id
    assert cancels == []  # a stream read to its end interrupts nothing


async def test_a_paused_reply_resumed_by_a_confirmation_streams(
    nats_server: EmbeddedServer, bus: Bus, prefix: str
) -> None:
    stamped: list[str] = []
    async with serving(nats_server.url, prefix, clerk(stamped)):
        desk = RemoteAgent(bus, "clerk", session_id="desk", timeout=20)
        paused = await collect(desk.reply_stream('tool stamp {"tag": "a"}'))
        (asking,) = [
            e for e in paused if isinstance(e, Event) and e.event == "require_user_confirm"
        ]
        (call,) = asking.data["calls"]
        assert stamped == []
        confirm = ConfirmResult(
            confirmations=[Confirmation(call_id=call["call_id"], confirmed=True)]
        )
        resumed = await collect(desk.reply_stream(confirm))

    assert isinstance(paused[-1], FinalAnswer)
    assert paused[-1].finished_reason == "paused"
    *events, final = resumed
    assert isinstance(final, FinalAnswer)
    assert final.finished_reason == "completed"
    assert str(final.content).startswith("done stamp=stamped a from ")
    assert [i for i in resumed if isinstance(i, FinalAnswer)] == [final]
    results = [e for e in events if isinstance(e, Event) and e.event == "tool_result"]
    assert [(r.data["tool_name"], r.data["status"]) for r in results] == [("stamp", "success")]
    assert names(resumed)[-1] == "reply_end"
    assert stamped == ["a"]


@pytest.mark.parametrize("leave", ["break", "aclose"])
async def test_leaving_the_stream_interrupts_the_remote_reply(
    nats_server: EmbeddedServer, bus: Bus, prefix: str, leave: str
) -> None:
    slow: dict[str, bool] = {}
    async with serving(nats_server.url, prefix, clerk([], slow)):
        desk = RemoteAgent(bus, "clerk", session_id="s2", timeout=60)
        async with (
            await bus.observe(bus.subjects.events("clerk", "s2", ANY_OWNER)) as events,
            await bus.observe(bus.subjects.agent_control("clerk")) as control,
        ):
            await bus.flush()
            seen: list[str] = []
            if leave == "break":
                async for item in desk.reply_stream("tool linger {}"):
                    assert isinstance(item, Event)
                    seen.append(item.event)
                    if item.event == "tool_call":
                        break  # the stream is collected here, and closes
            else:
                stream = desk.reply_stream("tool linger {}")
                async for item in stream:
                    assert isinstance(item, Event)
                    seen.append(item.event)
                    if item.event == "tool_call":
                        break
                await stream.aclose()
            left = time.monotonic()
            end = await until_end(events, timeout=10)
            waited = time.monotonic() - left
            (cancel,) = await cancels_before_probe(bus, control, "s2")
        record = await settled_record(bus, "clerk", "s2")

    assert seen[-1] == "tool_call"
    assert end == "interrupted"
    assert waited < 10  # the 30 s tool was not waited for
    assert slow == {"started": True}  # it ran, and was cut short
    assert cancel.sender == bus.client_name
    assert record.status == "idle"
    assert record.final is not None
    assert record.final["finished_reason"] == "interrupted"


async def test_a_stream_past_its_deadline_raises_call_timeout_error(
    nats_server: EmbeddedServer, bus: Bus, prefix: str
) -> None:
    async with serving(nats_server.url, prefix, clerk([])):
        desk = RemoteAgent(bus, "clerk", session_id="late", timeout=60)
        seen: list[Event | FinalAnswer] = []
        async with await bus.observe(bus.subjects.events("clerk", "late", ANY_OWNER)) as events:
            await bus.flush()
            started = time.monotonic()
            with pytest.raises(
                CallTimeoutError,
                match=r"agent 'clerk' gave no final answer in session 'late' within 0\.5s",
            ) as caught:
                await collect(desk.reply_stream("sleep 20; slow", timeout=0.5), seen.append)
            took = time.monotonic() - started
            end = await until_end(events, timeout=10)  # the deadline interrupted it

    assert 0.5 <= took < 3
    assert names(seen)[:2] == ["reply_start", "model_call_start"]
    assert not any(isinstance(item, FinalAnswer) for item in seen)
    assert caught.value.subject == bus.subjects.agent_inbox("clerk")
    assert end == "interrupted"


async def test_an_error_answer_raises(nats_server: EmbeddedServer, bus: Bus, prefix: str) -> None:
    """Another replica holds the session past ``busy_wait``: ``overloaded``."""
    intruder = await SessionStore.open(bus, owner="intruder", lease_ttl=60)
    await intruder.acquire("clerk", "held")
    items: list[Event | FinalAnswer] = []
    async with serving(nats_server.url, prefix, clerk([]), busy_wait=0.1) as service:
        desk = RemoteAgent(bus, "clerk", session_id="held", timeout=20)
        async with await bus.observe(bus.subjects.agent_control("clerk")) as control:
            await bus.flush()
            with pytest.raises(RemoteError, match="UserRequest: overloaded") as caught:
                await collect(desk.reply_stream("hello"), items.append)
            cancels = await cancels_before_probe(bus, control, "held")

    assert items == []
    assert caught.value.code == "overloaded"
    assert caught.value.source_component == service.replica_id
    assert cancels == []  # nothing runs for a refused request: nothing to interrupt


def pid_of(text: str) -> int:
    found = re.search(r"from (\d+)$", text)
    assert found, text
    return int(found.group(1))


async def wait_for_replicas(bus: Bus, count: int) -> None:
    """Until ``count`` replicas of ``echo`` have answered."""
    seen: set[int] = set()
    deadline = time.monotonic() + 30
    n = 0
    while len(seen) < count:
        assert time.monotonic() < deadline, f"only {len(seen)} of {count} replicas answered"
        n += 1
        try:
            answer = await bus.request(
                bus.subjects.agent_inbox("echo"),
                UserRequest(content="ping", session_id=f"ready-{n}"),
                timeout=5,
            )
        except BusError:  # no responders yet
            await asyncio.sleep(0.1)
            continue
        if isinstance(answer, FinalAnswer):
            seen.add(pid_of(str(answer.content)))


async def test_a_reply_taken_over_after_a_crash_still_ends_once(
    nats_server: EmbeddedServer, bus: Bus
) -> None:
    """The replica running the reply is killed (SIGKILL) in its model call;
    the other takes the session over and finishes it: the stream yields the
    new owner's events and one final answer."""
    with agents(nats_server.url, bus.prefix, "echo", 2, "--no-remote-tools") as procs:
        await wait_for_replicas(bus, 2)
        store = await SessionStore.open(bus, owner="test")
        remote = RemoteAgent(bus, "echo", session_id="crash", timeout=60)
        killed: list[int] = []

        async def kill_the_owner() -> None:
            record = await store.get("echo", "crash")
            assert record is not None
            assert record.owner is not None
            (victim,) = [p for i, p in enumerate(procs) if record.owner == f"echo@r{i + 1}"]
            victim.send_signal(signal.SIGKILL)
            killed.append(victim.pid)

        items: list[Event | FinalAnswer] = []
        async with asyncio.timeout(45):
            async for item in remote.reply_stream("sleep 1.5; slow"):
                items.append(item)
                if isinstance(item, Event) and item.event == "model_call_start" and not killed:
                    await kill_the_owner()
        record = await store.get("echo", "crash")

    finals = [item for item in items if isinstance(item, FinalAnswer)]
    assert len(finals) == 1
    assert items[-1] is finals[0]
    assert finals[0].finished_reason == "completed"
    assert str(finals[0].content).startswith("echo sleep 1.5; slow from ")
    assert pid_of(str(finals[0].content)) != killed[0]  # the other replica answered
    assert names(items).count("model_call_start") == 2  # the model call ran again there
    assert len({item.id for item in items}) == len(items)
    assert record is not None
    assert record.status == "done"


async def test_a_fast_answer_comes_after_every_event_of_its_reply(
    nats_server: EmbeddedServer, bus: Bus, prefix: str
) -> None:
    """An answer that arrives right behind the reply's last events: the
    stream still hands out every event before it (the events published
    before it, let in by one round trip to the server)."""
    from fleetbus.testing import ScriptedModel

    text = "We ship to Canada within five to eight working days, and customs are included."
    model = ScriptedModel([ScriptedModel.text(text)], repeat_last=True)
    async with serving(nats_server.url, prefix, Agent("fast", "", model)):
        remote = RemoteAgent(bus, "fast")
        for n in range(8):
            items = await collect(
                remote.reply_stream("Do you ship to Canada?", session_id=f"f-{n}")
            )
            assert isinstance(items[-1], FinalAnswer)
            assert names(items)[-1] == "reply_end", names(items)
            deltas = "".join(
                str(i.data.get("text", ""))
                for i in items
                if isinstance(i, Event) and i.event == "text_delta"
            )
            assert deltas == text
