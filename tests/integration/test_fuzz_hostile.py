"""Hostile payloads against live processes: a tool worker, an agent and a
model worker (issue 11).

Each request subject must answer every payload at once, with an ``error``
whose code is in the protocol's list or a correct result; a publish-only
subject (controls, a topic) answers exactly the payloads that do not decode.
The process stays up, serves a good request afterwards, and its memory stays
bounded. Examples are derandomized (the same every run) unless
``FLEETBUS_FUZZ_RANDOM`` is set. The focused tests below the fuzz ones guard
each defect the fuzz found.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import nats.errors
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fleetbus.agents import Agent
from fleetbus.bus import Bus, EmbeddedServer, discover
from fleetbus.errors import ProtocolError
from fleetbus.protocol import (
    ERROR_CODES,
    TOOL_STATUSES,
    Cancel,
    ChatMessage,
    ErrorMessage,
    Event,
    FinalAnswer,
    LlmPrompt,
    LlmResponse,
    Message,
    TextBlock,
    ToolCall,
    ToolResult,
    UserRequest,
    decode,
    encode,
)
from fleetbus.testing import ScriptedModel
from fleetbus.tools_workers import Toolkit, ToolWorker, tool
from fleetbus.tools_workers.builtin import builtin_toolkit
from tests.helpers import ROOT, serving, stop

MAX_PAYLOAD = 1024 * 1024
"""The embedded server's ``max_payload``."""

FUZZ = settings(
    max_examples=40,
    deadline=None,
    derandomize=not os.environ.get("FLEETBUS_FUZZ_RANDOM"),
    database=None,
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
    ],
)

REPLY_DEADLINE = 5.0
"""Seconds a request subject has to answer."""
SILENCE = 0.3
"""Seconds a publish-only subject is given to answer an undecodable payload."""
RSS_GROWTH = 200 * 1024 * 1024
"""Bytes a process may grow by over one fuzz test."""


# -- the processes ------------------------------------------------------------------


@dataclass
class Fleet:
    """Processes serving one prefix: a builtin tool worker, an agent ``fuzz``
    (offline model, observing topic ``news``) and a model worker ``offline``."""

    prefix: str
    procs: dict[str, subprocess.Popen[bytes]]
    logs: Path
    ready: bool = False
    service_ids: dict[str, str] = field(default_factory=dict)
    """The NATS micro service id of each worker, by service name."""

    async def assert_stats_answer(self, bus: Bus, service: str) -> None:
        """The worker registered as ``service`` answers STATS."""
        if service not in self.service_ids:
            found = [
                s
                for s in await discover(bus, service, timeout=1.0)
                if s.metadata.get("fleetbus_prefix") == self.prefix
            ]
            assert len(found) == 1, service
            self.service_ids[service] = found[0].id
        subject = f"$SRV.STATS.{service}.{self.service_ids[service]}"
        stats = msgspec.json.decode((await bus.nc.request(subject, b"", timeout=2)).data)
        assert stats["type"] == "io.nats.micro.v1.stats_response"

    def rss(self, role: str) -> int:
        """Resident memory of a process, in bytes."""
        status = Path(f"/proc/{self.procs[role].pid}/status").read_text()
        line = next(x for x in status.splitlines() if x.startswith("VmRSS:"))
        return int(line.split()[1]) * 1024

    def assert_alive(self) -> None:
        for role, proc in self.procs.items():
            if proc.poll() is not None:
                log = (self.logs / f"{role}.log").read_text(errors="replace")
                raise AssertionError(f"{role} exited with {proc.returncode}:\n{log[-4000:]}")


@pytest.fixture(scope="module")
def fleet(nats_server: EmbeddedServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    root = tmp_path_factory.mktemp("fuzz")
    (root / "agents.toml").write_text('[agent.fuzz]\nmodel = "offline"\nsystem_prompt = "Help."\n')
    prefix = f"fz{uuid.uuid4().hex[:10]}"
    bus = ["--nats", nats_server.url, "--prefix", prefix]
    commands = {
        "worker": ["worker", "fleetbus.tools_workers.builtin", *bus, "--worker-id", "fz-worker"],
        "agent": [
            "agent",
            str(root / "agents.toml"),
            *bus,
            "--lease-ttl",
            "1",
            "--replica-id",
            "fz-agent",
            "--topic",
            "news",
        ],
        "model": ["model-worker", "--model", "offline", "--serve-as", "offline", *bus],
    }
    procs = {}
    env = {**os.environ, "PYTHONPATH": str(ROOT), "FLEETBUS_FILES_ROOT": str(root / "files")}
    try:
        for role, command in commands.items():
            # Logs go to files: a pipe nobody reads would block a process that
            # logs every bad request.
            with (root / f"{role}.log").open("wb") as log:
                procs[role] = subprocess.Popen(
                    [sys.executable, "-m", "fleetbus", *command],
                    cwd=ROOT,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
        yield Fleet(prefix, procs, root)
    finally:
        for proc in procs.values():
            stop(proc)


@pytest.fixture
async def fuzzed(fleet: Fleet, nats_server: EmbeddedServer) -> AsyncIterator[tuple[Fleet, Bus]]:
    """The fleet, serving, and a bus on its prefix."""
    bus = await Bus.connect(nats_server.url, prefix=fleet.prefix, name="fuzzer")
    try:
        if not fleet.ready:
            async with asyncio.timeout(60):
                for good in (good_tool_call, good_user_request, good_prompt):
                    while True:
                        fleet.assert_alive()
                        try:
                            await good(bus)
                            break
                        except (nats.errors.Error, AssertionError):
                            await asyncio.sleep(0.2)
            fleet.ready = True
        yield fleet, bus
    finally:
        await bus.close()


async def good_tool_call(bus: Bus) -> None:
    call = ToolCall(call_id=uuid.uuid4().hex, tool_name="calculator", parameters={"expr": "6*7"})
    reply = await bus.nc.request(bus.subjects.tool("calculator"), encode(call), timeout=2)
    result = decode(reply.data)
    assert isinstance(result, ToolResult), result
    assert result.content == 42, result


async def good_user_request(bus: Bus) -> None:
    request = UserRequest(content="hello")
    reply = await bus.nc.request(bus.subjects.agent_inbox("fuzz"), encode(request), timeout=30)
    answer = decode(reply.data)
    assert isinstance(answer, FinalAnswer), answer
    assert answer.finished_reason == "completed", answer


async def good_prompt(bus: Bus) -> None:
    prompt = LlmPrompt(
        model="offline", messages=[ChatMessage(role="user", content=[TextBlock(text="hi")])]
    )
    reply = await bus.nc.request(bus.subjects.model("offline"), encode(prompt), timeout=2)
    assert isinstance(decode(reply.data), LlmResponse)


# -- hostile payloads ---------------------------------------------------------------

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20)
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=12,
)

BASES: dict[str, dict[str, Any]] = {
    "tool_call": {
        "type": "tool_call",
        "version": 1,
        "call_id": "c-1",
        "tool_name": "read_file",
        "parameters": {"path": "notes.txt"},
        "timeout": 5,
    },
    "user_request": {
        "type": "user_request",
        "version": 1,
        "content": "hello",
        "metadata": {"k": "v"},
    },
    "agent_message": {
        "type": "agent_message",
        "content": [{"type": "text", "text": "hi"}],
        "reply": False,
    },
    "llm_prompt": {
        "type": "llm_prompt",
        "model": "offline",
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        "options": {},
    },
    "cancel": {"type": "cancel", "call_id": "c-1", "session_id": "s-1", "reason": "stop"},
}
FIELDS = sorted({f for base in BASES.values() for f in base} | {"call_id", "session_id", "sender"})
DEEP = "\x00deep\x00"


def _deep(depth: int, kind: str, closed: bool) -> bytes:
    opening, closing = (b"[", b"]") if kind == "array" else (b'{"a":', b"}")
    inner = b"1" if kind == "object" else b""
    return opening * depth + (inner + closing * depth if closed else b"")


@st.composite
def envelope(draw: st.DrawFn, base_names: list[str]) -> bytes:
    """A message of ``base_names`` with hostile fields."""
    message = dict(BASES[draw(st.sampled_from(base_names))])
    deep = b""
    for _ in range(draw(st.integers(1, 3))):
        field = draw(st.sampled_from(FIELDS))
        how = draw(st.sampled_from(["drop", "null", "wrong", "huge", "deep", "version", "type"]))
        if how == "drop":
            message.pop(field, None)
        elif how == "null":
            message[field] = None
        elif how == "wrong":
            message[field] = draw(json_values)
        elif how == "huge":
            message[field] = "x" * draw(st.sampled_from([5_000, 200_000, MAX_PAYLOAD - 400]))
        elif how == "deep":
            depth = draw(st.sampled_from([50, 129, 300, 5_000, 100_000]))
            kind = draw(st.sampled_from(["array", "object"]))
            deep = _deep(depth, kind, draw(st.booleans()))
            message[field] = DEEP
        elif how == "version":
            message["version"] = draw(
                st.integers() | st.sampled_from([0, -1, 2, 2**70, "1", True, 1.0])
            )
        else:
            message["type"] = draw(st.text(max_size=30) | st.sampled_from(sorted(BASES)))
    data = msgspec.json.encode(message)
    if deep:
        data = data.replace(msgspec.json.encode(DEEP), deep, 1)
    return data[: MAX_PAYLOAD - 64]


@st.composite
def raw(draw: st.DrawFn, base_names: list[str]) -> bytes:
    """Bytes that are not a good message at all."""
    how = draw(st.sampled_from(["bytes", "truncated", "deep", "utf8", "bom", "scalar"]))
    valid = msgspec.json.encode(BASES[draw(st.sampled_from(base_names))])
    if how == "bytes":
        return draw(st.binary(max_size=300))
    if how == "truncated":
        return valid[: draw(st.integers(0, len(valid) - 1))]
    if how == "deep":
        depth = draw(st.sampled_from([2_000, 10_000, 300_000]))
        return _deep(depth, draw(st.sampled_from(["array", "object"])), draw(st.booleans()))
    if how == "utf8":
        at = valid.index(b'"', valid.index(b":")) + 1  # inside the first string value
        return (
            valid[:at] + draw(st.sampled_from([b"\xff", b"\xc3\x28", b"\xed\xa0\x80"])) + valid[at:]
        )
    if how == "bom":
        return b"\xef\xbb\xbf" + valid
    return msgspec.json.encode(draw(json_values))


@dataclass(frozen=True)
class Hostile:
    """A payload, shown briefly when a test fails (a megabyte repr helps nobody)."""

    data: bytes

    def __repr__(self) -> str:
        more = f" and {len(self.data) - 300} more bytes" if len(self.data) > 300 else ""
        return f"Hostile({self.data[:300]!r}{more})"


def payloads(*base_names: str) -> st.SearchStrategy[Hostile]:
    names = list(base_names)
    return (raw(names) | envelope(names)).map(Hostile)


# -- checking the answers -----------------------------------------------------------


def expected_error(payload: bytes) -> str | None:
    """The error code a payload that does not decode must get (``None``: it decodes)."""
    try:
        decode(payload)
    except ProtocolError as exc:
        return exc.code
    return None


RECEIPT = Event(event="receipt")
"""What :func:`send` returns for a receipt (an empty message)."""


async def send(bus: Bus, subject: str, payload: bytes, timeout: float) -> Message | None:
    try:
        reply = await bus.nc.request(subject, payload, timeout=timeout)
    except nats.errors.TimeoutError:
        return None
    if not reply.data and not reply.headers:
        return RECEIPT
    return decode(reply.data)


async def check_request(
    bus: Bus, subject: str, payload: bytes, results: tuple[type[Message], ...]
) -> Message:
    """``payload`` on a request subject: answered in time, with an error of
    the protocol's list (the codec's own code for what does not decode) or a
    result of ``results``."""
    reply = await send(bus, subject, payload, REPLY_DEADLINE)
    assert reply is not None, f"no answer within {REPLY_DEADLINE}s to {payload[:200]!r}"
    code = expected_error(payload)
    if code is not None:
        assert isinstance(reply, ErrorMessage), reply
        assert reply.code == code, reply
    if isinstance(reply, ErrorMessage):
        assert reply.code in ERROR_CODES, reply
        assert len(reply.message) < 4_000
    else:
        assert isinstance(reply, results), reply
    if isinstance(reply, ToolResult):
        assert reply.status in TOOL_STATUSES
        if reply.error_detail is not None:
            assert reply.error_detail.code in ERROR_CODES
            assert len(reply.error_detail.message) < 4_000
    return reply


async def check_publish_only(bus: Bus, subject: str, payload: bytes) -> None:
    """``payload`` on a control or topic subject: answered, ``malformed`` or
    the like, exactly when it does not decode."""
    code = expected_error(payload)
    reply = await send(bus, subject, payload, REPLY_DEADLINE if code else SILENCE)
    if code is None and reply is RECEIPT:
        # The one answer a control subject gives a message that decodes: a
        # tool_call there checks who holds the call, and a worker that
        # answered it (the request just before) says so.
        message = decode(payload)
        assert isinstance(message, ToolCall), message
        assert message.call_id, message
        assert ".tool." in subject, subject
        assert subject.endswith(".control"), subject
    elif code is None:
        assert reply is None, reply
    else:
        assert isinstance(reply, ErrorMessage), reply
        assert reply.code == code, reply


# -- the fuzz tests -----------------------------------------------------------------


@FUZZ
@given(hostile=payloads("tool_call", "cancel"), tool=st.sampled_from(["calculator", "read_file"]))
async def test_fuzz_a_tool_worker(fuzzed: tuple[Fleet, Bus], hostile: Hostile, tool: str) -> None:
    fleet, bus = fuzzed
    before = fleet.rss("worker")
    await check_request(bus, bus.subjects.tool(tool), hostile.data, (ToolResult,))
    await check_publish_only(bus, bus.subjects.tool_control(tool), hostile.data)
    fleet.assert_alive()
    await good_tool_call(bus)
    await fleet.assert_stats_answer(bus, "fleetbus")
    assert fleet.rss("worker") - before < RSS_GROWTH


@FUZZ
@given(hostile=payloads("user_request", "agent_message", "tool_call", "cancel"))
async def test_fuzz_an_agent(fuzzed: tuple[Fleet, Bus], hostile: Hostile) -> None:
    fleet, bus = fuzzed
    before = fleet.rss("agent")
    inbox, payload = bus.subjects.agent_inbox("fuzz"), hostile.data
    if expected_error(payload) is None and isinstance(decode(payload), Cancel):
        await check_publish_only(bus, inbox, payload)  # acted on, never answered
    else:
        await check_request(bus, inbox, payload, (FinalAnswer, Event, ToolResult))
    await check_publish_only(bus, bus.subjects.agent_control("fuzz"), payload)
    await check_publish_only(bus, bus.subjects.topic("news"), payload)
    fleet.assert_alive()
    await good_user_request(bus)
    assert fleet.rss("agent") - before < RSS_GROWTH


@FUZZ
@given(hostile=payloads("llm_prompt", "tool_call"))
async def test_fuzz_a_model_worker(fuzzed: tuple[Fleet, Bus], hostile: Hostile) -> None:
    fleet, bus = fuzzed
    before = fleet.rss("model")
    await check_request(bus, bus.subjects.model("offline"), hostile.data, (LlmResponse, Event))
    fleet.assert_alive()
    await good_prompt(bus)
    await fleet.assert_stats_answer(bus, "fleetbus-models")
    assert fleet.rss("model") - before < RSS_GROWTH


# -- the defects it found, one test each --------------------------------------------


@pytest.fixture
async def builtin_worker(bus: Bus, tmp_path: Path) -> AsyncIterator[ToolWorker]:
    worker = ToolWorker(bus, builtin_toolkit(tmp_path), worker_id="w-hostile")
    async with asyncio.TaskGroup() as tg:
        tg.create_task(worker.run())
        await worker.wait_ready()
        yield worker
        worker.stop()


async def stats_of(bus: Bus, worker: ToolWorker) -> dict[str, Any]:
    subject = f"$SRV.STATS.fleetbus.{worker.service.id}"
    stats: dict[str, Any] = msgspec.json.decode(
        (await bus.nc.request(subject, b"", timeout=2)).data
    )
    return stats


async def test_a_deeply_nested_call_is_answered_malformed_at_once(
    builtin_worker: ToolWorker, bus: Bus
) -> None:
    payload = (
        b'{"type":"tool_call","call_id":"c","tool_name":"calculator","parameters":{"expr":'
        + b"[" * 10_000
        + b"]" * 10_000
        + b"}}"
    )
    reply = decode((await bus.nc.request(bus.subjects.tool("calculator"), payload, timeout=2)).data)
    assert isinstance(reply, ErrorMessage)
    assert reply.code == "malformed"
    await good_tool_call(bus)


async def test_stats_still_answer_after_a_read_file_with_a_huge_path(
    builtin_worker: ToolWorker, bus: Bus
) -> None:
    call = ToolCall(call_id="c-big", tool_name="read_file", parameters={"path": "a" * 1_047_000})
    reply = decode(
        (await bus.nc.request(bus.subjects.tool("read_file"), encode(call), timeout=30)).data
    )
    assert isinstance(reply, ToolResult)
    assert reply.error_detail is not None
    assert reply.error_detail.code == "tool_error"
    stats = await stats_of(bus, builtin_worker)
    read_file = next(e for e in stats["endpoints"] if e["name"] == "read_file")
    assert read_file["num_errors"] == 1
    assert read_file["last_error"].startswith("tool_error: ValueError: path 'aaa")


async def test_a_reply_too_large_for_the_ids_it_echoes_is_still_answered(
    builtin_worker: ToolWorker, bus: Bus
) -> None:
    call = ToolCall(call_id="c" * (MAX_PAYLOAD - 300), tool_name="calculator", parameters={})
    payload = encode(call)
    assert len(payload) <= MAX_PAYLOAD
    reply = decode(
        (await bus.nc.request(bus.subjects.tool("calculator"), payload, timeout=30)).data
    )
    assert isinstance(reply, ErrorMessage), reply
    assert reply.code == "internal"
    assert reply.call_id is None
    assert "exceeds the server's max_payload" in reply.message


async def test_the_replay_record_is_bounded_in_bytes(bus: Bus) -> None:
    @tool
    def ok() -> str:
        """Succeed."""
        return "ok"

    worker = ToolWorker(bus, Toolkit([ok]), worker_id="w-budget", dedup_bytes=1024 * 1024)
    calls = [ToolCall(call_id=f"{i}-" + "c" * 200_000, tool_name="ok") for i in range(12)]

    async def call(message: ToolCall) -> None:
        reply = await bus.nc.request(bus.subjects.tool("ok"), encode(message), timeout=30)
        assert isinstance(decode(reply.data), ToolResult)

    async with asyncio.TaskGroup() as tg:
        tg.create_task(worker.run())
        await worker.wait_ready()
        try:
            for message in calls:
                await call(message)
            assert worker.executed == 12
            await call(calls[-1])  # recorded: replayed
            assert worker.executed == 12
            await call(calls[0])  # 2.4 MB of ids ago: no longer recorded, runs again
            assert worker.executed == 13
        finally:
            worker.stop()


async def test_info_fits_even_when_the_tools_describe_themselves_at_length(bus: Bus) -> None:
    @tool(description="d" * (MAX_PAYLOAD + 1))
    def verbose() -> str:
        """Succeed."""
        return "ok"

    worker = ToolWorker(bus, Toolkit([verbose]), worker_id="w-verbose")
    async with asyncio.TaskGroup() as tg:
        tg.create_task(worker.run())
        await worker.wait_ready()
        try:
            found = [
                s for s in await discover(bus, "fleetbus") if s.metadata["worker_id"] == "w-verbose"
            ]
            assert [e.name for e in found[0].endpoints] == ["verbose"]
            assert found[0].endpoints[0].metadata["description"].startswith("ddd")
        finally:
            worker.stop()


async def test_an_agent_answers_a_message_nested_deeper_than_it_stores_malformed(
    nats_server: EmbeddedServer, bus: Bus
) -> None:
    model = ScriptedModel(["never used"])
    async with serving(nats_server.url, bus.prefix, Agent("deep", "", model)):
        metadata: Any = "leaf"
        for _ in range(300):
            metadata = [metadata]
        request = UserRequest(content="hi", metadata={"a": metadata})
        reply = decode(
            (
                await bus.nc.request(bus.subjects.agent_inbox("deep"), encode(request), timeout=30)
            ).data
        )
        assert isinstance(reply, ErrorMessage), reply
        assert reply.code == "malformed", reply
        assert "128 levels" in reply.message
        good = UserRequest(content="hi")
        answer = decode(
            (await bus.nc.request(bus.subjects.agent_inbox("deep"), encode(good), timeout=30)).data
        )
        assert isinstance(answer, FinalAnswer)
        assert answer.content == "never used"
