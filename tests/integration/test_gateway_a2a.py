"""The gateway's A2A face, spoken to by a2a-sdk's own client over HTTP: the
card (with a skill per tool), a task answered, a task streamed, a task read
from another gateway (nothing is kept in a gateway), a slow task cancelled, a
task that asks to confirm a call continued with an approval or a denial, a
structured answer as data; and the limits: no token, another user's task.
A2A 0.3's method names answer too (what ``curl`` in docs/a2a.md sends)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest
from a2a.client import (
    A2ACardResolver,
    AgentCardResolutionError,
    Client,
    ClientConfig,
    ClientFactory,
)
from a2a.helpers import get_artifact_text, get_data_parts, get_message_text, new_data_part
from a2a.types import (
    CancelTaskRequest,
    GetTaskRequest,
    InvalidParamsError,
    Message,
    Part,
    Role,
    SendMessageRequest,
    StreamResponse,
    Task,
    TaskNotCancelableError,
    TaskNotFoundError,
    TaskState,
)
from a2a.utils.proto_utils import warn_on_missing_required_fields

from fleetbus.agents import Agent, Permissions
from fleetbus.bus import EmbeddedServer
from fleetbus.capabilities import Guardrails, PatternGuardrail
from fleetbus.models import FINISH_TOOL
from fleetbus.protocol import new_id
from fleetbus.testing import ScriptedModel
from fleetbus.tools_workers import Toolkit, tool
from tests.helpers import serving
from tests.integration.agent_specs import CommandModel
from tests.integration.gateway_fixtures import ALICE, BOB, Gateway, gateway

COMPLETED = TaskState.TASK_STATE_COMPLETED
WORKING = TaskState.TASK_STATE_WORKING
CANCELED = TaskState.TASK_STATE_CANCELED
INPUT_REQUIRED = TaskState.TASK_STATE_INPUT_REQUIRED


def clerk(stamped: list[str], lingering: asyncio.Event) -> Agent:
    """Runs ``stamp`` once confirmed, ``note`` at once, ``linger`` for a minute."""

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
        """Take a minute."""
        lingering.set()
        await asyncio.sleep(60)
        return "lingered"

    return Agent(
        "clerk",
        "",
        CommandModel(),
        toolkit=Toolkit([stamp, note, linger]),
        permissions=Permissions.from_strings(ask=["stamp"]),
        description="Stamps tags.",
    )


class Fleet:
    def __init__(self, gw: Gateway, stamped: list[str], lingering: asyncio.Event) -> None:
        self.gw = gw
        self.stamped = stamped
        self.lingering = lingering

    def url(self, agent: str = "clerk") -> str:
        return f"{self.gw.url}/a2a/{agent}"


@pytest.fixture
async def fleet(nats_server: EmbeddedServer, prefix: str) -> AsyncIterator[Fleet]:
    stamped: list[str] = []
    lingering = asyncio.Event()
    async with (
        serving(nats_server.url, prefix, clerk(stamped, lingering)),
        gateway(nats_server.url, prefix, a2a=True) as gw,
    ):
        yield Fleet(gw, stamped, lingering)


@contextlib.asynccontextmanager
async def a2a(url: str, token: str = ALICE, *, streaming: bool = False) -> AsyncIterator[Client]:
    """a2a-sdk's client of the agent at ``url``, from its card, with ``token``."""
    async with httpx.AsyncClient(headers={"authorization": f"Bearer {token}"}, timeout=30) as http:
        factory = ClientFactory(ClientConfig(httpx_client=http, streaming=streaming))
        client = await factory.create_from_url(url)
        try:
            yield client
        finally:
            await client.close()


def ask(
    text: str = "", *, context_id: str = "", task_id: str = "", **data: Any
) -> SendMessageRequest:
    parts = [Part(text=text)] if text else []
    if data:
        parts.append(new_data_part(data))
    message = Message(
        role=Role.ROLE_USER,
        message_id=new_id(),
        parts=parts,
        context_id=context_id,
        task_id=task_id,
    )
    return SendMessageRequest(message=message)


async def send(client: Client, request: SendMessageRequest) -> Task:
    """The task a non-streaming send answers."""
    async with asyncio.timeout(30):
        responses = [r async for r in client.send_message(request)]
    (response,) = responses
    assert response.HasField("task")
    return response.task


def answer(task: Task) -> str:
    (artifact,) = task.artifacts
    return get_artifact_text(artifact)


def pending_calls(task: Task) -> list[dict[str, Any]]:
    (data,) = get_data_parts(task.status.message.parts)
    calls: list[dict[str, Any]] = data["pending"]
    return calls


async def test_the_card_shows_the_agent_and_a_skill_per_tool(fleet: Fleet) -> None:
    async with httpx.AsyncClient(headers={"authorization": f"Bearer {ALICE}"}) as http:
        card = await A2ACardResolver(http, fleet.url()).get_agent_card()
    assert warn_on_missing_required_fields(card, "test")
    assert (card.name, card.description) == ("clerk", "Stamps tags.")
    skills = {s.id: (s.name, s.description, list(s.tags)) for s in card.skills}
    assert skills == {
        "clerk": ("clerk", "Stamps tags.", ["agent"]),
        "tool:stamp": ("stamp", "Stamp a tag.", ["tool"]),
        "tool:note": ("note", "Note a text.", ["tool"]),
        "tool:linger": ("linger", "Take a minute.", ["tool"]),
    }
    assert card.capabilities.streaming
    interfaces = [
        (i.url, i.protocol_binding, i.protocol_version) for i in card.supported_interfaces
    ]
    assert interfaces == [(fleet.url(), "JSONRPC", "1.0"), (fleet.url(), "JSONRPC", "0.3")]
    assert card.security_schemes["bearer"].http_auth_security_scheme.scheme == "bearer"
    assert "bearer" in card.security_requirements[0].schemes


async def test_no_token_no_card_and_no_answer(fleet: Fleet) -> None:
    async with httpx.AsyncClient() as http:
        card = await http.get(f"{fleet.url()}/.well-known/agent-card.json")
        assert card.status_code == 401
        assert card.headers["www-authenticate"] == "Bearer"
        rpc = await http.post(
            fleet.url(), json={"jsonrpc": "2.0", "id": 1, "method": "message/send", "params": {}}
        )
        assert rpc.status_code == 401
        assert rpc.json()["error"]["code"] == -32600
        with pytest.raises(AgentCardResolutionError) as refused:
            await A2ACardResolver(http, fleet.url()).get_agent_card(
                http_kwargs={"headers": {"authorization": "Bearer sk-unknown-0123456789"}}
            )
        assert refused.value.status_code == 401
        # An agent that is not served: no card.
        missing = await http.get(
            f"{fleet.url('nobody')}/.well-known/agent-card.json",
            headers={"authorization": f"Bearer {ALICE}"},
        )
        assert missing.status_code == 404


async def test_a_message_is_answered_with_a_completed_task(fleet: Fleet) -> None:
    async with a2a(fleet.url()) as client:
        task = await send(client, ask("hi", context_id="talk-1"))
        assert task.status.state == COMPLETED
        assert answer(task).startswith("echo hi from ")
        assert task.context_id == "talk-1"
        assert task.id.startswith("clerk.")
        assert [get_message_text(m) for m in task.history] == ["hi"]
        # The same context is the same conversation.
        again = await send(client, ask("heard?", context_id="talk-1"))
        assert answer(again) == "heard: hi"
        assert again.id != task.id
        assert again.context_id == "talk-1"
        # Without one, a new conversation, whose context the task names.
        fresh = await send(client, ask("heard?"))
        assert answer(fresh) == "heard: "
        assert fresh.context_id not in ("", "talk-1")


async def test_a_streamed_task_tells_its_tool_calls_then_its_answer(fleet: Fleet) -> None:
    async with a2a(fleet.url(), streaming=True) as client:
        request = ask('tool note {"text": "x"}')
        async with asyncio.timeout(30):
            stream: list[StreamResponse] = [r async for r in client.send_message(request)]
    first = stream[0]
    assert first.HasField("task")
    assert first.task.status.state == WORKING
    task_id = first.task.id
    told = [
        r.status_update.metadata["event"]
        for r in stream
        if r.HasField("status_update") and r.status_update.status.state == WORKING
    ]
    assert told == ["tool_call", "tool_result"]
    calls = [
        get_data_parts(r.status_update.status.message.parts)[0]
        for r in stream
        if r.HasField("status_update") and r.status_update.status.state == WORKING
    ]
    assert calls[0]["tool_name"] == "note"
    assert calls[0]["parameters"] == {"text": "x"}
    artifact, end = stream[-2], stream[-1]
    assert artifact.artifact_update.task_id == task_id
    assert get_artifact_text(artifact.artifact_update.artifact).startswith("done note=noted x")
    assert end.status_update.task_id == task_id
    assert end.status_update.status.state == COMPLETED


async def test_a_task_is_read_from_another_gateway(
    fleet: Fleet, nats_server: EmbeddedServer, prefix: str
) -> None:
    async with a2a(fleet.url()) as client:
        done = await send(client, ask("hi", context_id="c"))
        paused = await send(client, ask('tool stamp {"tag": "A"}', context_id="d"))
    assert paused.status.state == INPUT_REQUIRED
    async with (
        gateway(nats_server.url, prefix, a2a=True) as other,
        a2a(f"{other.url}/a2a/clerk") as elsewhere,
    ):
        read = await elsewhere.get_task(GetTaskRequest(id=done.id))
        assert (read.id, read.context_id, read.status.state) == (done.id, "c", COMPLETED)
        assert answer(read) == answer(done)
        assert [get_message_text(m) for m in read.history] == ["hi"]
        waiting = await elsewhere.get_task(GetTaskRequest(id=paused.id))
        assert waiting.status.state == INPUT_REQUIRED
        assert pending_calls(waiting) == pending_calls(paused)
        # An earlier task of a conversation stays readable, over.
        await send(elsewhere, ask("more", context_id="c"))
        earlier = await elsewhere.get_task(GetTaskRequest(id=done.id))
        assert earlier.status.state == COMPLETED
        assert answer(earlier) == answer(done)
        session = done.id.rsplit(".", 1)[0]
        with pytest.raises(TaskNotFoundError):
            await elsewhere.get_task(GetTaskRequest(id=f"{session}.nothing"))


async def test_a_slow_task_is_cancelled(fleet: Fleet) -> None:
    async with a2a(fleet.url(), streaming=True) as watching, a2a(fleet.url()) as other:
        stream = watching.send_message(ask("tool linger"))
        async with asyncio.timeout(30):
            first = await anext(stream)
            await fleet.lingering.wait()
            cancelled = await other.cancel_task(CancelTaskRequest(id=first.task.id))
            assert cancelled.status.state == CANCELED
            rest = [r async for r in stream]
        assert rest[-1].status_update.status.state == CANCELED
        read = await other.get_task(GetTaskRequest(id=first.task.id))
        assert read.status.state == CANCELED
        with pytest.raises(TaskNotCancelableError):
            await other.cancel_task(CancelTaskRequest(id=first.task.id))


async def test_a_task_answered_at_once_goes_on(fleet: Fleet) -> None:
    """``returnImmediately``: the task is answered ``working``, and its reply
    runs on after the answer, until cancelled."""
    async with a2a(fleet.url()) as client:
        request = ask("tool linger")
        request.configuration.return_immediately = True
        task = await send(client, request)
        assert task.status.state == WORKING
        async with asyncio.timeout(30):
            await fleet.lingering.wait()
        read = await client.get_task(GetTaskRequest(id=task.id))
        assert read.status.state == WORKING
        cancelled = await client.cancel_task(CancelTaskRequest(id=task.id))
        assert cancelled.status.state == CANCELED


async def test_a_paused_task_is_continued_with_an_approval(fleet: Fleet) -> None:
    async with a2a(fleet.url()) as client:
        paused = await send(client, ask('tool stamp {"tag": "A"}'))
        assert paused.status.state == INPUT_REQUIRED
        assert fleet.stamped == []
        (call,) = pending_calls(paused)
        assert (call["tool_name"], call["parameters"], call["kind"]) == (
            "stamp",
            {"tag": "A"},
            "confirm",
        )
        assert "yes" in get_message_text(paused.status.message)
        with pytest.raises(InvalidParamsError):  # not an answer
            await send(client, ask("maybe", task_id=paused.id))
        done = await send(client, ask("Yes", task_id=paused.id, context_id=paused.context_id))
        assert done.id == paused.id
        assert done.status.state == COMPLETED
        assert [get_message_text(m) for m in done.history] == ['tool stamp {"tag": "A"}', "Yes"]
        assert answer(done).startswith("done stamp=stamped A")
        assert fleet.stamped == ["A"]
        with pytest.raises(InvalidParamsError):  # over: nothing to answer
            await send(client, ask("yes", task_id=paused.id))


async def test_a_paused_task_is_continued_with_a_denial_as_data(fleet: Fleet) -> None:
    async with a2a(fleet.url(), streaming=True) as client:
        async with asyncio.timeout(30):
            first = [r async for r in client.send_message(ask('tool stamp {"tag": "B"}'))]
            end = first[-1].status_update
            assert end.status.state == INPUT_REQUIRED
            (call,) = pending_calls_of(end.status.message)
            decision = ask(task_id=end.task_id, confirm={call["call_id"]: False})
            then = [r async for r in client.send_message(decision)]
    assert then[0].task.id == end.task_id
    assert then[-1].status_update.status.state == COMPLETED
    assert "denied" in get_artifact_text(then[-2].artifact_update.artifact)
    assert fleet.stamped == []


def pending_calls_of(message: Message) -> list[dict[str, Any]]:
    (data,) = get_data_parts(message.parts)
    calls: list[dict[str, Any]] = data["pending"]
    return calls


async def test_another_user_cannot_reach_the_task(fleet: Fleet) -> None:
    async with a2a(fleet.url()) as alice, a2a(fleet.url(), BOB) as bob:
        paused = await send(alice, ask('tool stamp {"tag": "C"}', context_id="mine"))
        with pytest.raises(TaskNotFoundError):
            await bob.get_task(GetTaskRequest(id=paused.id))
        with pytest.raises(TaskNotFoundError):
            await bob.cancel_task(CancelTaskRequest(id=paused.id))
        with pytest.raises(TaskNotFoundError):
            await send(bob, ask("yes", task_id=paused.id))
        # Bob's context of the same name is another conversation.
        theirs = await send(bob, ask("heard?", context_id="mine"))
        assert answer(theirs) == "heard: "
    assert fleet.stamped == []


async def test_a_structured_answer_is_data(nats_server: EmbeddedServer, prefix: str) -> None:
    model = ScriptedModel([ScriptedModel.call(FINISH_TOOL, {"city": "Oslo", "celsius": 4})])
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string"}, "celsius": {"type": "number"}},
        "required": ["city", "celsius"],
    }
    async with (
        serving(nats_server.url, prefix, Agent("forecaster", "", model)),
        gateway(nats_server.url, prefix, a2a=True) as gw,
        a2a(f"{gw.url}/a2a/forecaster") as client,
    ):
        request = ask("Oslo?")
        request.message.metadata.update({"output_schema": schema})
        task = await send(client, request)
    (artifact,) = task.artifacts
    assert get_data_parts(artifact.parts) == [{"city": "Oslo", "celsius": 4.0}]


async def test_a_guardrail_trip_is_a_rejected_task(
    nats_server: EmbeddedServer, prefix: str
) -> None:
    guarded = Agent(
        "guarded",
        "",
        ScriptedModel([ScriptedModel.text("never seen")], repeat_last=True),
        capabilities=[Guardrails(input=[PatternGuardrail([r"(?i)password"], name="secrets")])],
    )
    async with (
        serving(nats_server.url, prefix, guarded),
        gateway(nats_server.url, prefix, a2a=True) as gw,
        a2a(f"{gw.url}/a2a/guarded") as client,
    ):
        task = await send(client, ask("my password is x"))
    assert task.status.state == TaskState.TASK_STATE_REJECTED
    assert "secrets" in task.status.message.parts[0].text


async def test_a2a_0_3_method_names_answer(fleet: Fleet) -> None:
    """What docs/a2a.md's curl sends."""
    rpc: Callable[..., Any]
    async with httpx.AsyncClient(headers={"authorization": f"Bearer {ALICE}"}, timeout=30) as http:

        async def rpc(method: str, params: dict[str, Any]) -> dict[str, Any]:
            body = {"jsonrpc": "2.0", "id": 1, "method": method, "params": params}
            response = await http.post(fleet.url(), json=body)
            assert response.status_code == 200, response.text
            found: dict[str, Any] = response.json()
            return found

        sent = await rpc(
            "message/send",
            {
                "message": {
                    "role": "user",
                    "messageId": "m-1",
                    "contextId": "curl",
                    "parts": [{"kind": "text", "text": "hi"}],
                }
            },
        )
        task = sent["result"]
        assert (task["kind"], task["status"]["state"], task["contextId"]) == (
            "task",
            "completed",
            "curl",
        )
        assert task["artifacts"][0]["parts"][0]["text"].startswith("echo hi from ")
        card = (await http.get(f"{fleet.url()}/.well-known/agent-card.json")).json()
        assert (card["url"], card["protocolVersion"]) == (fleet.url(), "0.3")
        read = await rpc("tasks/get", {"id": task["id"]})
        assert read["result"]["status"]["state"] == "completed"
        missing = await rpc("tasks/get", {"id": "clerk.nobody.nothing"})
        assert missing["error"]["code"] == -32001
