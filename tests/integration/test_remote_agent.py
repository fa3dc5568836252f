"""RemoteAgent against an AgentService on a real server: one session across
calls, observations, agent messages, pause with confirm and external results,
cancel, error answers, answers breaking the contract, a hub mixing a local
and a remote agent; and whether a service said ready answers at once.

The served agents think with ``CommandModel`` (see ``agent_specs``): ``heard?``
answers every earlier user text of the session, ``tool NAME {json}`` calls a
tool, ``sleep S`` makes the model slow, anything else is echoed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator

import pytest

from fleetbus.agents import Agent, MsgHub, Permissions, RemoteAgent
from fleetbus.agents.serving.sessions import SessionRecord, SessionStore
from fleetbus.agents.state import PendingCall
from fleetbus.bus import Bus, EmbeddedServer, Observation, Request
from fleetbus.bus.subjects import ANY_OWNER
from fleetbus.errors import (
    CallTimeoutError,
    ConfigError,
    InvalidSubjectError,
    NoRespondersError,
    RemoteError,
    UnexpectedMessageError,
)
from fleetbus.protocol import (
    AgentMessage,
    AnyMessage,
    Cancel,
    ConfirmResult,
    Event,
    ExternalResult,
    FinalAnswer,
    Message,
    TextBlock,
    UserRequest,
)
from fleetbus.testing import ScriptedModel
from fleetbus.tools_workers import Toolkit, tool
from tests.helpers import serving
from tests.integration.agent_specs import CommandModel

PID = os.getpid()


def echo() -> Agent:
    return Agent("echo", "", CommandModel(), toolkit=Toolkit())


def clerk_agent(stamped: list[str]) -> Agent:
    """Asks before ``stamp`` (run here; appends to ``stamped``) and before
    ``lookup`` (external: its result comes from outside)."""

    @tool
    def stamp(tag: str) -> str:
        """Stamp a tag."""
        stamped.append(tag)
        return f"stamped {tag}"

    @tool(external=True)
    def lookup(query: str) -> str:
        """Look something up (done outside the agent)."""
        raise AssertionError("an external tool is never run by the agent")

    return Agent(
        "clerk",
        "",
        CommandModel(),
        toolkit=Toolkit([stamp, lookup]),
        permissions=Permissions.from_strings(ask=["stamp", "lookup"]),
    )


async def sent(observation: Observation, count: int) -> list[AnyMessage]:
    """The next ``count`` messages seen on an observed subject."""
    messages: list[AnyMessage] = []
    async with asyncio.timeout(5):
        async for message in observation:
            messages.append(message)
            if len(messages) == count:
                break
    return messages


async def record_of(bus: Bus, agent: str, session_id: str) -> SessionRecord:
    record = await (await SessionStore.open(bus, owner="test")).get(agent, session_id)
    assert record is not None
    return record


async def pending(bus: Bus, agent: str, session_id: str) -> list[PendingCall]:
    record = await record_of(bus, agent, session_id)
    assert record.status == "paused"
    assert record.state.reply is not None
    return record.state.reply.pending


async def test_replies_continue_one_session(
    nats_server: EmbeddedServer, bus: Bus, prefix: str
) -> None:
    async with serving(nats_server.url, prefix, echo()):
        writer = RemoteAgent(bus, "echo", timeout=10)
        given = RemoteAgent(bus, "echo", session_id="given", sender="cli", timeout=10)
        assert (given.name, given.session_id) == ("echo", "given")
        async with await bus.observe(bus.subjects.agent_inbox("echo")) as inbox:
            first = await writer.reply("hello")
            second = await writer.reply([TextBlock(text="heard?")])
            elsewhere = await writer.reply("heard?", session_id="elsewhere")
            third = await writer.reply("heard?")
            empty = await writer.reply()
            answer = await given.reply("hi")
            *requests, to_given = await sent(inbox, 6)
        record = await record_of(bus, "echo", "given")

    assert first.content == f"echo hello from {PID}"
    assert first.finished_reason == "completed"
    assert first.session_id == writer.session_id
    assert second.content == "heard: hello"  # the second reply sees the first
    assert elsewhere.content == "heard: "  # another session, for that call only
    assert elsewhere.session_id == "elsewhere"
    assert third.content == "heard: hello | heard?"
    assert empty.finished_reason == "completed"
    assert all(isinstance(m, UserRequest) for m in requests)
    assert [m.session_id for m in requests] == [writer.session_id] * 2 + ["elsewhere"] + [
        writer.session_id
    ] * 2
    assert [m.content for m in requests if isinstance(m, UserRequest)] == [
        "hello",
        [TextBlock(text="heard?")],
        "heard?",
        "heard?",
        [],
    ]
    assert {m.sender for m in requests} == {"test-client"}  # the bus's name
    assert len({m.call_id for m in requests}) == 5
    assert None not in {m.call_id for m in requests}
    assert (to_given.session_id, to_given.sender) == ("given", "cli")
    assert answer.session_id == "given"
    assert answer.content == f"echo hi from {PID}"
    assert record.status == "done"
    assert [(m.role, m.text) for m in record.state.memory] == [
        ("user", "hi"),
        ("assistant", f"echo hi from {PID}"),
    ]


async def test_observed_messages_are_remembered_without_a_reply(
    nats_server: EmbeddedServer, bus: Bus, prefix: str
) -> None:
    async with serving(nats_server.url, prefix, echo()):
        writer = RemoteAgent(bus, "echo", timeout=10)
        editor = AgentMessage(sender="editor", name="editor", content=[TextBlock(text="snacks")])
        async with await bus.observe(bus.subjects.agent_inbox("echo")) as inbox:
            await writer.observe("the office closes at 5")
            await writer.observe([editor, "see you"])
            observations = await sent(inbox, 3)
        record = await record_of(bus, "echo", writer.session_id)
        answer = await writer.reply("heard?")

    messages = [m for m in observations if isinstance(m, AgentMessage)]
    assert len(messages) == 3
    assert [m.reply for m in messages] == [False] * 3
    assert [m.sender for m in messages] == ["test-client", "editor", "test-client"]
    assert {m.session_id for m in messages} == {writer.session_id}
    assert len({m.call_id for m in messages}) == 3
    # Acknowledged one by one, recorded in order, without a reply.
    assert record.status == "idle"
    assert record.final is None
    assert [(m.role, m.name, m.text) for m in record.state.memory] == [
        ("user", "test-client", "the office closes at 5"),
        ("user", "editor", "snacks"),
        ("user", "test-client", "see you"),
    ]
    assert all("observed" in m.marks for m in record.state.memory)
    assert answer.content == "heard: the office closes at 5 | snacks | see you"


async def test_an_agent_message_is_answered_and_remembered_under_its_speakers_name(
    nats_server: EmbeddedServer, bus: Bus, prefix: str
) -> None:
    async with serving(nats_server.url, prefix, echo()):
        writer = RemoteAgent(bus, "echo", session_id="dm", timeout=10)
        original = AgentMessage(
            sender="editor", name="editor", content=[TextBlock(text="Fix it.")], reply=False
        )
        async with await bus.observe(bus.subjects.agent_inbox("echo")) as inbox:
            answer = await writer.reply(original)
            (message,) = await sent(inbox, 1)
        record = await record_of(bus, "echo", "dm")

    assert answer.content == f"echo Fix it. from {PID}"
    assert isinstance(message, AgentMessage)
    assert message.reply is True
    assert (message.sender, message.name, message.content) == ("editor", "editor", original.content)
    assert message.session_id == "dm"
    assert message.call_id is not None
    assert (record.state.memory[0].name, record.state.memory[0].text) == ("editor", "Fix it.")


async def test_a_paused_reply_is_confirmed_denied_and_given_external_results(
    nats_server: EmbeddedServer, bus: Bus, prefix: str
) -> None:
    stamped: list[str] = []
    clerk = clerk_agent(stamped)
    async with (
        serving(nats_server.url, prefix, clerk),
        await bus.observe(bus.subjects.agent_inbox("clerk")) as inbox,
    ):
        desk = RemoteAgent(bus, "clerk", session_id="desk", timeout=10)

        paused = await desk.reply('tool stamp {"tag": "a"}')
        assert paused.finished_reason == "paused"
        (call,) = await pending(bus, "clerk", "desk")
        assert (call.tool_name, call.kind, call.parameters) == ("stamp", "confirm", {"tag": "a"})
        assert stamped == []
        done = await desk.confirm(call.call_id, allow=True)
        assert done.finished_reason == "completed"
        assert done.content == f"done stamp=stamped a from {PID}"
        assert stamped == ["a"]

        await desk.reply('tool stamp {"tag": "b"}')
        (call,) = await pending(bus, "clerk", "desk")
        denied = await desk.confirm(call.call_id, allow=False)
        assert denied.finished_reason == "completed"
        assert "stamp=denied" in str(denied.content)
        assert stamped == ["a"]

        await desk.reply('tool stamp {"tag": "c"}')
        (call,) = await pending(bus, "clerk", "desk")
        await desk.confirm(call.call_id, allow=True, always=True)
        unasked = await desk.reply('tool stamp {"tag": "d"}')  # allowed from now on
        assert unasked.finished_reason == "completed"
        assert stamped == ["a", "c", "d"]

        # Confirmed, an external tool still waits: for its result from outside.
        await desk.reply('tool lookup {"query": "q"}')
        (call,) = await pending(bus, "clerk", "desk")
        assert call.kind == "confirm"
        still = await desk.confirm(call.call_id, allow=True, always=True)
        assert still.finished_reason == "paused"
        (external,) = await pending(bus, "clerk", "desk")
        assert (external.call_id, external.kind) == (call.call_id, "external")
        found = await desk.external_result(external.call_id, {"rows": 3})
        assert found.finished_reason == "completed"
        assert found.content == f"done lookup={{'rows': 3}} from {PID}"

        await desk.reply('tool lookup {"query": "r"}')
        (external,) = await pending(bus, "clerk", "desk")
        assert external.kind == "external"  # not asked again: 'always'
        failed = await desk.external_result(external.call_id, "disk full", status="error")
        assert failed.finished_reason == "completed"
        assert str(failed.content).startswith("done lookup=tool_error: disk full")

        idle = await desk.confirm("t99", allow=True)
        assert idle.finished_reason == "error"
        assert idle.content == "Nothing is waiting for a confirmation."
        messages = await sent(inbox, 13)

    resumes = [m for m in messages if isinstance(m, ConfirmResult | ExternalResult)]
    assert {m.session_id for m in resumes} == {"desk"}
    confirmations = [c for m in resumes if isinstance(m, ConfirmResult) for c in m.confirmations]
    assert [(c.confirmed, c.always) for c in confirmations] == [
        (True, False),
        (False, False),
        (True, True),
        (True, True),
        (True, False),
    ]
    results = [r for m in resumes if isinstance(m, ExternalResult) for r in m.results]
    assert [(r.status, r.content) for r in results] == [("success", {"rows": 3}), ("error", None)]
    detail = results[1].error_detail
    assert detail is not None
    assert (detail.code, detail.message) == ("tool_error", "disk full")


async def test_confirming_an_external_call_warns_of_nothing(
    nats_server: EmbeddedServer, bus: Bus, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    async with serving(nats_server.url, prefix, clerk_agent([])):
        desk = RemoteAgent(bus, "clerk", timeout=10)
        await desk.reply('tool lookup {"query": "q"}')
        (call,) = await pending(bus, "clerk", desk.session_id)
        with caplog.at_level(logging.WARNING):
            still = await desk.confirm(call.call_id, allow=True)
    assert still.finished_reason == "paused"
    assert "matched no pending call" not in caplog.text


async def test_an_external_result_nothing_waits_for_is_said_in_english(
    nats_server: EmbeddedServer, bus: Bus, prefix: str
) -> None:
    async with serving(nats_server.url, prefix, echo()):
        idle = await RemoteAgent(bus, "echo", timeout=10).external_result("t9", 1)
    assert idle.finished_reason == "error"
    assert str(idle.content).startswith("Nothing is waiting for an external result: agent echo")


async def test_cancel_interrupts_the_running_reply(
    nats_server: EmbeddedServer, bus: Bus, prefix: str
) -> None:
    async with serving(nats_server.url, prefix, echo()):
        writer = RemoteAgent(bus, "echo", timeout=20)
        events = await bus.observe(bus.subjects.events("echo", writer.session_id, ANY_OWNER))
        control = await bus.observe(bus.subjects.agent_control("echo"))
        async with control, asyncio.TaskGroup() as tg:
            replying = tg.create_task(writer.reply("sleep 20; slow"))
            async with events, asyncio.timeout(10):
                async for event in events:  # the model sleeps from here on
                    if isinstance(event, Event) and event.event == "model_call_start":
                        break
            await writer.cancel("changed my mind")
            async with asyncio.timeout(10):
                answer = await replying
            (cancel,) = await sent(control, 1)
        record = await record_of(bus, "echo", writer.session_id)
        after = await writer.reply("heard?")

    assert answer.finished_reason == "interrupted"
    assert isinstance(cancel, Cancel)
    assert (cancel.session_id, cancel.reason, cancel.sender) == (
        writer.session_id,
        "changed my mind",
        "test-client",
    )
    assert record.status == "idle"
    assert after.content == "heard: sleep 20; slow"  # the session goes on


async def test_an_error_answer_raises_remote_error(
    nats_server: EmbeddedServer, bus: Bus, prefix: str
) -> None:
    """A session another replica holds past ``busy_wait`` is answered
    ``overloaded``: every call that wants a final answer raises it."""
    intruder = await SessionStore.open(bus, owner="intruder", lease_ttl=60)
    await intruder.acquire("echo", "held")
    async with serving(nats_server.url, prefix, echo(), busy_wait=0.1) as service:
        held = RemoteAgent(bus, "echo", session_id="held", timeout=10)
        async with await bus.observe(bus.subjects.agent_inbox("echo")) as inbox:
            with pytest.raises(
                RemoteError, match="could not handle the UserRequest: overloaded"
            ) as caught:
                await held.reply("hi")
            (request,) = await sent(inbox, 1)
            with pytest.raises(RemoteError, match="could not handle the ConfirmResult: overloaded"):
                await held.confirm("t0", allow=True)
            with pytest.raises(
                RemoteError, match="could not handle the ExternalResult: overloaded"
            ):
                await held.external_result("t0", "x")
    assert caught.value.code == "overloaded"
    assert caught.value.source_component == service.replica_id
    assert caught.value.call_id == request.call_id
    assert request.session_id == "held"


async def test_a_session_id_that_is_no_subject_token_is_refused_before_sending(
    nats_server: EmbeddedServer, bus: Bus, prefix: str
) -> None:
    async with serving(nats_server.url, prefix, echo()):
        bad = RemoteAgent(bus, "echo", session_id="not a token", timeout=10)
        async with await bus.observe(bus.subjects.agent_inbox("echo")) as inbox:
            with pytest.raises(InvalidSubjectError, match="invalid session id 'not a token'"):
                await bad.reply("hi")
            with pytest.raises(InvalidSubjectError, match="invalid session id"):
                await bad.confirm("t0", allow=True)
            with pytest.raises(InvalidSubjectError, match="invalid session id"):
                await bad.external_result("t0", "x")
            with pytest.raises(RemoteError, match="could not handle the AgentMessage"):
                await bad.observe("noted?")  # refused by the agent: it streams nothing
            (observed,) = await sent(inbox, 1)
    assert isinstance(observed, AgentMessage)  # the only message that left


async def test_observing_in_a_malformed_session_is_refused_as_malformed(
    nats_server: EmbeddedServer, bus: Bus, prefix: str
) -> None:
    async with serving(nats_server.url, prefix, echo()):
        bad = RemoteAgent(bus, "echo", session_id="not a token", timeout=10)
        with pytest.raises(RemoteError) as caught:
            await bad.observe("noted?")
    assert caught.value.code == "malformed"


async def test_answers_that_break_the_contract(bus: Bus) -> None:
    """A responder on the inbox that answers the wrong type, or nothing."""

    async def odd(request: Request) -> Message | None:
        message = request.message
        if isinstance(message, AgentMessage):
            return FinalAnswer(content="not an acknowledgement")
        if isinstance(message, UserRequest) and message.content == "silence":
            return None
        return Event(event="reply_start", session_id=message.session_id)

    stop = asyncio.Event()
    ready = asyncio.Event()
    async with asyncio.TaskGroup() as tg:
        tg.create_task(bus.serve(bus.subjects.agent_inbox("odd"), odd, stop=stop, ready=ready))
        try:
            await ready.wait()
            remote = RemoteAgent(bus, "odd", timeout=10)
            with pytest.raises(UnexpectedMessageError, match="final_answer"):
                await remote.reply("hi")
            with pytest.raises(UnexpectedMessageError, match="observed"):
                await remote.observe("noted?")
            impatient = RemoteAgent(bus, "odd", session_id="quiet", timeout=0.3)
            with pytest.raises(
                CallTimeoutError,
                match=r"agent 'odd' gave no final answer in session 'quiet' "
                r"within 0\.3s",
            ):
                await impatient.reply("silence")
        finally:
            stop.set()
    with pytest.raises(NoRespondersError, match="after 1 attempt"):
        await RemoteAgent(bus, "nobody").reply("hi")


async def test_an_agent_that_starts_serving_within_seconds_is_asked_again(
    nats_server: EmbeddedServer, bus: Bus
) -> None:
    """Nobody serving the agent is asked again for a few seconds: its
    replicas may be reconnecting after their server died, or starting."""
    asking = asyncio.create_task(RemoteAgent(bus, "late", timeout=30).reply("hi"))
    await asyncio.sleep(0)  # the request is sent first: nobody serves it yet
    agent = Agent("late", "", ScriptedModel(["here now"]))
    async with serving(nats_server.url, bus.prefix, agent):
        final = await asyncio.wait_for(asking, 30)
    assert final.content == "here now"


def test_an_agent_name_that_is_no_subject_token_is_refused(bus: Bus) -> None:
    with pytest.raises(ConfigError, match="invalid agent name"):
        RemoteAgent(bus, "two words")


async def test_a_local_and_a_remote_agent_talk_in_a_hub(
    nats_server: EmbeddedServer, bus: Bus, prefix: str
) -> None:
    host = Agent("host", "", ScriptedModel([ScriptedModel.text("Welcome, writer.")]))
    async with serving(nats_server.url, prefix, echo()):
        remote = RemoteAgent(bus, "echo", session_id="hub", timeout=10)
        async with MsgHub([host, remote], announcement="Start.") as hub:
            await hub.speak(host)
            answer = await hub.speak(remote, "heard?")
        record = await record_of(bus, "echo", "hub")

    assert answer.content == "heard: Start. | Welcome, writer."
    assert [(m.name, m.text) for m in record.state.memory[:2]] == [
        ("test-client", "Start."),
        ("host", "Welcome, writer."),
    ]
    assert [m.text for m in host.memory] == ["Start.", "Welcome, writer.", answer.content]
    assert host.memory[-1].name == "echo"
    assert hub.transcript == [
        ("", "Start."),
        ("host", "Welcome, writer."),
        ("echo", "heard: Start. | Welcome, writer."),
    ]


@contextlib.asynccontextmanager
async def late_after_ping(url: str, hold: float) -> AsyncIterator[str]:
    """A TCP proxy to the server at ``url`` (its own URL yielded) that passes on
    what a client sends up to each ``PING`` at once, and what follows it
    ``hold`` seconds later: as a server may read them apart (TCP allows it)."""
    host, _, port = url.removeprefix("nats://").rpartition(":")
    handlers: set[asyncio.Task[None]] = set()

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, late: bool) -> None:
        try:
            while data := await reader.read(65536):
                head, ping, rest = data.rpartition(b"PING\r\n")
                writer.write(head + ping if late and ping else data)
                await writer.drain()
                if late and ping:
                    await asyncio.sleep(hold)
                    writer.write(rest)
                    await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()

    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        handlers.add(task)
        upstream_reader, upstream_writer = await asyncio.open_connection(host, int(port))
        async with asyncio.TaskGroup() as tg:
            tg.create_task(pipe(reader, upstream_writer, True))
            tg.create_task(pipe(upstream_reader, writer, False))

    server = await asyncio.start_server(accept, "127.0.0.1", 0)
    try:
        yield f"nats://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()
        await server.wait_closed()
        if handlers:
            await asyncio.wait(handlers, timeout=5)


async def test_a_service_ready_to_serve_answers_at_once(
    nats_server: EmbeddedServer, bus: Bus, prefix: str
) -> None:
    async with (
        late_after_ping(nats_server.url, hold=0.2) as url,
        serving(url, prefix, echo(), settle=False),
    ):
        try:
            answer: FinalAnswer | None = await RemoteAgent(bus, "echo", timeout=5).reply("hi")
        except NoRespondersError:  # caught here: the service then stops as usual
            answer = None
    assert answer is not None, "no responders right after wait_ready()"
    assert answer.content == f"echo hi from {PID}"
