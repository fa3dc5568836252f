"""Models served over the bus: a ModelWorker holds the model, a BusChatModel
calls it; deltas stream as they are produced, a call beyond the concurrency
waits in a shallow queue, limits answer ``overloaded`` (which the client
resends until its time is up), failures come back as ModelError, and the worker keeps serving."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path

import pytest

from fleetbus.agents import Agent, AgentSettings
from fleetbus.bus import Bus, EmbeddedServer, Request, discover
from fleetbus.errors import ConfigError
from fleetbus.models.bus_model import BusChatModel
from fleetbus.models.model import (
    ModelConfig,
    ModelError,
    ModelRequest,
    ModelResponse,
    ModelStreamItem,
    TextDelta,
    ThinkingDelta,
)
from fleetbus.models.model_worker import MODEL_SERVICE_NAME, ModelWorker
from fleetbus.protocol import (
    ChatMessage,
    ErrorMessage,
    Event,
    FinalAnswer,
    LlmPrompt,
    LlmResponse,
    TextBlock,
    ToolCall,
    ToolSpec,
    ToolUseBlock,
    Usage,
    decode,
)
from fleetbus.testing import ScriptedModel
from fleetbus.tools_workers import Toolkit, tool
from fleetbus.tools_workers.builtin import builtin_toolkit
from tests.helpers import ROOT, output

HELLO = [ChatMessage(role="user", content=[TextBlock(text="Hello?")])]


class GatedModel:
    """Streams one delta, then waits for ``gate`` before finishing."""

    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.started = asyncio.Event()

    @property
    def name(self) -> str:
        return "gated"

    async def stream(self, request: ModelRequest) -> AsyncIterator[ModelStreamItem]:
        self.started.set()
        yield TextDelta("first ")
        await self.gate.wait()
        yield TextDelta("second")
        yield ModelResponse(content=[TextBlock(text="first second")], finish_reason="stop")


@asynccontextmanager
async def serving(worker: ModelWorker) -> AsyncIterator[ModelWorker]:
    async with asyncio.TaskGroup() as tg:
        tg.create_task(worker.run())
        try:
            await worker.wait_ready()
            yield worker
        finally:
            worker.stop()


@pytest.fixture
async def caller(nats_server: EmbeddedServer, prefix: str) -> AsyncIterator[Bus]:
    bus = await Bus.connect(nats_server.url, prefix=prefix, name="caller")
    try:
        yield bus
    finally:
        await bus.close()


async def collect(model: BusChatModel, request: ModelRequest) -> list[ModelStreamItem]:
    return [item async for item in model.stream(request)]


async def test_deltas_arrive_in_order_and_the_response_matches(bus: Bus, caller: Bus) -> None:
    text = "Hello over the bus, in pieces!"
    model = ScriptedModel([ScriptedModel.text(text, thinking="Think first.")], chunk_size=4)
    async with serving(ModelWorker(bus, model, worker_id="mw-1")):
        items = await collect(BusChatModel(caller, "scripted"), ModelRequest(HELLO))
    *deltas, final = items
    assert [d.text for d in deltas if isinstance(d, TextDelta)] == [
        text[i : i + 4] for i in range(0, len(text), 4)
    ]
    assert "".join(d.thinking for d in deltas if isinstance(d, ThinkingDelta)) == "Think first."
    assert isinstance(deltas[0], ThinkingDelta)  # in the model's order
    assert isinstance(final, ModelResponse)
    assert final.text == text
    assert final.thinking == "Think first."
    assert (final.finish_reason, final.model) == ("stop", "scripted")
    assert final.usage is not None
    assert final.usage.output_tokens > 0
    assert model.requests[0].messages == HELLO


async def test_without_stream_only_the_response_comes(bus: Bus, caller: Bus) -> None:
    model = ScriptedModel(["quiet answer"], chunk_size=2)
    async with serving(ModelWorker(bus, model)):
        items = await collect(BusChatModel(caller, "scripted", stream=False), ModelRequest(HELLO))
    assert len(items) == 1
    assert isinstance(items[0], ModelResponse)
    assert items[0].text == "quiet answer"


async def test_tool_calls_come_through_as_tool_use_blocks(bus: Bus, caller: Bus) -> None:
    model = ScriptedModel([ScriptedModel.call("calculator", {"expr": "1 + 2"}, call_id="c1")])
    spec = ToolSpec(
        name="calculator",
        description="Adds.",
        parameters={"type": "object", "properties": {"expr": {"type": "string"}}},
    )
    request = ModelRequest(HELLO, tools=[spec], tool_choice="auto", options={"temperature": 0})
    async with serving(ModelWorker(bus, model)):
        items = await collect(BusChatModel(caller, "scripted"), request)
    final = items[-1]
    assert isinstance(final, ModelResponse)
    assert final.tool_uses == [ToolUseBlock(id="c1", name="calculator", input={"expr": "1 + 2"})]
    assert final.finish_reason == "tool_calls"
    sent = model.requests[0]
    assert (sent.tools, sent.tool_choice, sent.options) == ([spec], "auto", {"temperature": 0})


async def test_deltas_reach_the_caller_while_the_model_is_still_running(
    bus: Bus, caller: Bus
) -> None:
    model = GatedModel()
    async with serving(ModelWorker(bus, model, drain_timeout=2)):
        stream = BusChatModel(caller, "gated", timeout=5).stream(ModelRequest(HELLO))
        try:
            first = await asyncio.wait_for(anext(stream), 5)
            assert first == TextDelta("first ")
            assert not model.gate.is_set()  # the model has not finished
            model.gate.set()
            rest = [item async for item in stream]
        finally:
            model.gate.set()
            await stream.aclose()
    assert rest[0] == TextDelta("second")
    assert isinstance(rest[-1], ModelResponse)
    assert rest[-1].text == "first second"


async def until(condition: Callable[[], bool]) -> None:
    """Wait (bounded) for a worker's counters to show what a test waits for."""
    async with asyncio.timeout(10):
        while not condition():  # noqa: ASYNC110 - a worker's counters
            await asyncio.sleep(0.01)


async def test_a_call_beyond_the_concurrency_waits_for_a_place(bus: Bus, caller: Bus) -> None:
    model = GatedModel()
    async with serving(ModelWorker(bus, model, concurrency=1, drain_timeout=2)) as worker:
        client = BusChatModel(caller, "gated", timeout=10, attempts=1)
        async with asyncio.TaskGroup() as tg:
            first = tg.create_task(collect(client, ModelRequest(HELLO)))
            try:
                await asyncio.wait_for(model.started.wait(), 5)
                second = tg.create_task(collect(client, ModelRequest(HELLO)))
                await until(lambda: worker.waiting == 1)
                assert (worker.running, worker.calls, worker.refused) == (1, 1, 0)
            finally:
                model.gate.set()
        assert (worker.calls, worker.refused, worker.waiting) == (2, 0, 0)
    for items in (first.result(), second.result()):
        assert isinstance(items[-1], ModelResponse)
        assert items[-1].text == "first second"


async def test_a_call_beyond_the_queue_is_refused_and_sent_again_until_its_time_is_up(
    bus: Bus, caller: Bus
) -> None:
    model = GatedModel()
    worker = ModelWorker(bus, model, concurrency=1, queue=0, drain_timeout=2)
    async with serving(worker):
        async with asyncio.TaskGroup() as tg:
            first = tg.create_task(
                collect(BusChatModel(caller, "gated", timeout=10), ModelRequest(HELLO))
            )
            try:
                await asyncio.wait_for(model.started.wait(), 5)
                raw = await caller.request(bus.subjects.model("gated"), prompt("raw-1"), timeout=5)
                busy = BusChatModel(caller, "gated", timeout=3.0, attempts=1, retry_backoff=0.05)
                with pytest.raises(ModelError, match="busy: 1 call") as refused:
                    await collect(busy, ModelRequest(HELLO))
            finally:
                model.gate.set()
        assert worker.refused >= 3  # the raw one, and the client's beyond its one attempt
    assert isinstance(raw, ErrorMessage)
    assert (raw.code, raw.call_id) == ("overloaded", "raw-1")
    assert raw.retry_after is not None
    assert raw.retry_after > 0
    assert "overloaded" in str(refused.value)
    assert not refused.value.retryable  # the call's time is spent: no point in more
    final = first.result()[-1]
    assert isinstance(final, ModelResponse)


async def test_a_call_that_waits_too_long_for_a_place_is_refused(bus: Bus, caller: Bus) -> None:
    model = GatedModel()
    worker = ModelWorker(bus, model, concurrency=1, queue=1, queue_timeout=0.2, drain_timeout=2)
    async with serving(worker):
        async with asyncio.TaskGroup() as tg:
            tg.create_task(collect(BusChatModel(caller, "gated", timeout=10), ModelRequest(HELLO)))
            try:
                await asyncio.wait_for(model.started.wait(), 5)
                raw = await caller.request(bus.subjects.model("gated"), prompt("raw-2"), timeout=5)
            finally:
                model.gate.set()
        assert (worker.calls, worker.refused) == (1, 1)
    assert isinstance(raw, ErrorMessage)
    assert raw.code == "overloaded"
    assert "no place came free within 0.2 s" in raw.message
    assert raw.retry_after is not None


async def test_a_busy_worker_does_not_use_up_the_agents_retries(bus: Bus, caller: Bus) -> None:
    model = GatedModel()
    agent = Agent(
        "patient",
        "You wait.",
        BusChatModel(caller, "gated", timeout=10, retry_backoff=0.05),
        settings=AgentSettings(model_calls=ModelConfig(max_retries=0)),
    )
    worker = ModelWorker(bus, model, concurrency=1, queue=0, drain_timeout=2)
    async with serving(worker), asyncio.TaskGroup() as tg:
        tg.create_task(collect(BusChatModel(caller, "gated", timeout=10), ModelRequest(HELLO)))
        try:
            await asyncio.wait_for(model.started.wait(), 5)
            reply = tg.create_task(agent.reply("Hello?"))
            await until(lambda: worker.refused >= 3)  # more than attempts + max_retries
        finally:
            model.gate.set()
    assert reply.result().content == "first second"


async def test_a_sessions_calls_go_to_the_worker_that_served_it_while_it_serves(
    bus: Bus, caller: Bus
) -> None:
    models = {w: ScriptedModel([f"from {w}"], repeat_last=True) for w in ("mw.a", "mw.b")}
    client = BusChatModel(caller, "scripted")
    session = ModelRequest(HELLO, session_id="s-1")
    workers = {w: ModelWorker(bus, m, worker_id=w) for w, m in models.items()}
    runs = {w: asyncio.create_task(worker.run()) for w, worker in workers.items()}
    try:
        for worker in workers.values():
            await worker.wait_ready()
        texts = [await answer(client, session) for _ in range(12)]
        assert len(set(texts)) == 1  # a queue group alone picks at random
        served = texts[0].removeprefix("from ")
        other = next(w for w in workers if w != served)
        # Another session is not bound to it.
        others = {await answer(client, ModelRequest(HELLO, session_id=f"t-{i}")) for i in range(12)}
        assert others == {"from mw.a", "from mw.b"}
        workers[served].stop()
        await runs[served]
        assert await answer(client, session) == f"from {other}"  # gone: any worker
        assert await answer(client, session) == f"from {other}"  # and now that one
    finally:
        for w, worker in workers.items():
            worker.stop()
            await runs[w]


async def test_a_sessions_call_goes_elsewhere_when_its_worker_is_busy(
    bus: Bus, caller: Bus
) -> None:
    models = {w: GatedModel() for w in ("mw-a", "mw-b")}
    for model in models.values():
        model.gate.set()
    client = BusChatModel(caller, "gated", timeout=10)
    session = ModelRequest(HELLO, session_id="s-1")
    async with AsyncExitStack() as stack:
        workers = {
            w: await stack.enter_async_context(
                serving(ModelWorker(bus, m, worker_id=w, concurrency=1, queue=0))
            )
            for w, m in models.items()
        }
        await collect(client, session)
        served = next(w for w, worker in workers.items() if worker.calls == 1)
        other = next(w for w in workers if w != served)
        models[served].gate.clear()
        models[served].started.clear()
        own = workers[served].own_subject
        async with asyncio.TaskGroup() as tg:
            occupying = tg.create_task(caller.request(own, prompt("occupy"), timeout=10))
            try:
                await asyncio.wait_for(models[served].started.wait(), 5)
                await collect(client, session)
            finally:
                models[served].gate.set()
        assert isinstance(occupying.result(), LlmResponse)
        assert workers[served].calls == 2  # the first call, and the one occupying it
        assert workers[served].refused >= 1  # refused there (and again if the group chose it)
        assert (workers[other].calls, workers[other].refused) == (1, 0)


async def test_a_next_subject_outside_the_fleets_inboxes_is_not_followed(
    bus: Bus, caller: Bus
) -> None:
    elsewhere = bus.subjects.tool("calculator")
    prompts: list[str] = []

    async def fake_worker(request: Request) -> LlmResponse:
        prompts.append(request.subject)
        return LlmResponse(
            sender="fake",
            call_id=request.message.call_id,
            content=[TextBlock(text="ok")],
            next_subject=elsewhere,
        )

    stop, ready = asyncio.Event(), asyncio.Event()
    client = BusChatModel(caller, "fake", timeout=5)
    session = ModelRequest(HELLO, session_id="s-1")
    async with await caller.observe(elsewhere) as diverted, asyncio.TaskGroup() as tg:
        tg.create_task(bus.serve(bus.subjects.model("fake"), fake_worker, stop=stop, ready=ready))
        try:
            await ready.wait()
            assert await answer(client, session) == "ok"
            assert await answer(client, session) == "ok"
        finally:
            stop.set()
        await caller.flush()
        assert await diverted.received() == []
    assert prompts == [bus.subjects.model("fake")] * 2


async def answer(client: BusChatModel, request: ModelRequest) -> str:
    final = (await collect(client, request))[-1]
    assert isinstance(final, ModelResponse)
    return final.text


def prompt(call_id: str) -> LlmPrompt:
    return LlmPrompt(sender="raw", call_id=call_id, model="gated", messages=HELLO)


async def test_the_request_rate_limit_answers_overloaded_with_its_wait(
    bus: Bus, caller: Bus
) -> None:
    model = ScriptedModel(["ok"], repeat_last=True)
    client = BusChatModel(caller, "scripted", attempts=1)
    async with serving(ModelWorker(bus, model, requests_per_minute=2)) as worker:
        for _ in range(2):
            assert isinstance((await collect(client, ModelRequest(HELLO)))[-1], ModelResponse)
        raw = await caller.request(bus.subjects.model("scripted"), prompt("raw-3"), timeout=5)
        started = time.monotonic()
        with pytest.raises(ModelError, match=r"2 requests per minute.*retry in ~\d+ s") as exc:
            await collect(BusChatModel(caller, "scripted", timeout=0.5), ModelRequest(HELLO))
        assert time.monotonic() - started < 5  # it waited what it could, not the minute
        assert worker.calls == 2
    assert isinstance(raw, ErrorMessage)
    assert raw.code == "overloaded"
    assert raw.retry_after is not None
    assert 50 < raw.retry_after <= 60
    assert not exc.value.retryable  # the call's time ran out waiting
    assert len(model.requests) == 2


async def test_the_token_rate_limit_counts_the_usage_reported(bus: Bus, caller: Bus) -> None:
    answer = ModelResponse(
        content=[TextBlock(text="long")], usage=Usage(input_tokens=900, output_tokens=200)
    )
    model = ScriptedModel([answer], repeat_last=True)
    client = BusChatModel(caller, "scripted", timeout=0.5)
    async with serving(ModelWorker(bus, model, tokens_per_minute=1000)):
        await collect(client, ModelRequest(HELLO))  # the window was empty: admitted
        with pytest.raises(ModelError, match=r"1000 tokens per minute is reached \(~1100 used"):
            await collect(client, ModelRequest(HELLO))
    assert len(model.requests) == 1


async def test_model_failures_become_model_errors_and_the_worker_keeps_serving(
    bus: Bus, caller: Bus
) -> None:
    model = ScriptedModel(
        [
            ModelError("invalid api key", retryable=False),
            ModelError("rate limited upstream", retryable=True),
            RuntimeError("adapter bug"),
            "still here",
        ]
    )
    client = BusChatModel(caller, "scripted", attempts=1)
    async with serving(ModelWorker(bus, model, worker_id="mw-f")):
        with pytest.raises(ModelError, match=r"internal: .*invalid api key") as permanent:
            await collect(client, ModelRequest(HELLO))
        with pytest.raises(ModelError, match=r"overloaded: .*rate limited upstream") as transient:
            await collect(client, ModelRequest(HELLO))
        with pytest.raises(ModelError, match="RuntimeError: adapter bug") as bug:
            await collect(client, ModelRequest(HELLO))
        items = await collect(client, ModelRequest(HELLO))
    assert not permanent.value.retryable
    assert str(permanent.value).startswith("mw-f: internal: model scripted failed:")
    assert transient.value.retryable
    assert not bug.value.retryable
    assert isinstance(items[-1], ModelResponse)
    assert items[-1].text == "still here"


@tool
def lookup(key: str) -> str:
    """Look a key up, here in the agent's process.

    Args:
        key: what to look up.
    """
    return {"answer": "42"}.get(key, "unknown")


async def test_an_agent_replies_with_a_model_on_the_bus_and_a_local_tool(
    bus: Bus, caller: Bus
) -> None:
    model = ScriptedModel(
        [
            ScriptedModel.call("lookup", {"key": "answer"}, call_id="t1", thinking="Look it up."),
            ScriptedModel.text("The answer is 42, as the lookup said."),
        ],
        chunk_size=5,
    )
    agent = Agent(
        "asker", "You look things up.", BusChatModel(caller, "scripted"), toolkit=Toolkit([lookup])
    )
    async with serving(ModelWorker(bus, model)):
        items = [item async for item in agent.reply_stream("What is the answer?")]
    final = items[-1]
    assert isinstance(final, FinalAnswer)
    assert final.content == "The answer is 42, as the lookup said."
    events = [e.event for e in items if isinstance(e, Event)]
    last_call = len(events) - 1 - events[::-1].index("model_call_start")
    deltas = [i for i, name in enumerate(events) if name == "text_delta"]
    assert deltas
    assert all(last_call < i < events.index("reply_end") for i in deltas)
    assert "thinking_delta" in events
    assert "tool_result" in events
    # The tool ran here; its result travelled to the worker in the next prompt.
    tool_message = model.requests[1].messages[-1]
    assert tool_message.role == "tool"
    assert "42" in repr(tool_message.content)


async def test_no_worker_is_a_retryable_model_error_within_the_timeout(caller: Bus) -> None:
    started = time.monotonic()
    with pytest.raises(ModelError, match="no model worker serves") as exc:
        await collect(BusChatModel(caller, "nobody", timeout=2), ModelRequest(HELLO))
    assert time.monotonic() - started < 2
    assert exc.value.retryable


async def test_a_silent_subscriber_is_a_model_error_at_the_timeout(bus: Bus, caller: Bus) -> None:
    async with await bus.observe(bus.subjects.model("mute")):
        await bus.flush()
        started = time.monotonic()
        with pytest.raises(ModelError, match="no model worker answered") as exc:
            await collect(BusChatModel(caller, "mute", timeout=0.3), ModelRequest(HELLO))
    assert 0.3 <= time.monotonic() - started < 2
    assert exc.value.retryable


async def test_malformed_prompts_get_error_replies_and_the_worker_keeps_serving(
    bus: Bus, caller: Bus
) -> None:
    model = ScriptedModel(["fine"])
    subject = caller.subjects.model("scripted")
    async with serving(ModelWorker(bus, model)):
        garbage = await caller.nc.request(subject, b"{not json", timeout=5)
        missing = await caller.nc.request(subject, b'{"type": "llm_prompt"}', timeout=5)
        wrong = await caller.request(subject, ToolCall(call_id="x1", tool_name="t"), timeout=5)
        items = await collect(BusChatModel(caller, "scripted"), ModelRequest(HELLO))
    first, second = decode(garbage.data), decode(missing.data)
    assert isinstance(first, ErrorMessage)
    assert first.code == "malformed"
    assert isinstance(second, ErrorMessage)
    assert second.code == "malformed"
    assert isinstance(wrong, ErrorMessage)
    assert wrong.code == "malformed"
    assert (wrong.call_id, "'tool_call'" in wrong.message) == ("x1", True)
    assert isinstance(items[-1], ModelResponse)
    assert items[-1].text == "fine"


async def test_the_served_name_must_be_a_subject_token_and_is_registered(
    bus: Bus, caller: Bus
) -> None:
    with pytest.raises(ConfigError, match="model name"):
        ModelWorker(bus, ScriptedModel(name="gpt-4.1"))
    model = ScriptedModel(["hi"], name="gpt-4.1")
    async with serving(ModelWorker(bus, model, name="gpt-4-1", requests_per_minute=30)):
        services = await discover(caller, MODEL_SERVICE_NAME)
        items = await collect(BusChatModel(caller, "gpt-4-1"), ModelRequest(HELLO))
    [endpoint] = [e for s in services for e in s.endpoints]
    assert (endpoint.name, endpoint.subject) == ("gpt-4-1", caller.subjects.model("gpt-4-1"))
    assert endpoint.metadata["model"] == "gpt-4.1"
    assert endpoint.metadata["requests_per_minute"] == "30"
    assert isinstance(items[-1], ModelResponse)
    assert items[-1].model == "gpt-4.1"


def spawn_model_worker(url: str, prefix: str) -> subprocess.Popen[bytes]:
    """``python -m fleetbus.cli.model_worker_cmd --model offline`` on ``prefix``."""
    command = ["--model", "offline", "--nats", url, "--prefix", prefix, "--worker-id", "mw-p"]
    return subprocess.Popen(
        [sys.executable, "-m", "fleetbus.cli.model_worker_cmd", *command],
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )


def terminate(proc: subprocess.Popen[bytes]) -> str:
    """SIGTERM a process, wait for it, and return what it printed."""
    proc.send_signal(signal.SIGTERM)
    try:
        printed, _ = proc.communicate(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        printed, _ = proc.communicate()
    return printed.decode(errors="replace")


async def test_an_agent_uses_the_offline_model_of_a_worker_process(
    nats_server: EmbeddedServer, caller: Bus, tmp_path: Path
) -> None:
    proc = spawn_model_worker(nats_server.url, caller.prefix)
    try:
        deadline = time.monotonic() + 15
        while not await discover(caller, MODEL_SERVICE_NAME, timeout=0.2):
            assert proc.poll() is None, output(proc)
            assert time.monotonic() < deadline, "the model worker did not register"
        model = BusChatModel(caller, "offline", timeout=10)
        agent = Agent("helper", "You help.", model, toolkit=builtin_toolkit(files_root=tmp_path))
        final = await agent.reply("What is 2026 - 1991?")
    finally:
        printed = terminate(proc)
    assert "35" in str(final.content)
    assert proc.returncode == 0
    assert f"mw-p serving fleetbus-offline as {caller.subjects.model('offline')}" in printed
