"""The fleet commands — ``fleetbus agent``, ``ask``, ``sessions``, ``confirm``,
``cancel``, ``watch`` — run as people run them: as processes, against agent
and tool-worker processes on a real server."""

from __future__ import annotations

import asyncio
import codecs
import json
import os
import re
import shlex
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from fleetbus.agents.serving.sessions import SessionStore
from fleetbus.bus import Bus, EmbeddedServer
from fleetbus.bus.subjects import ANY_OWNER
from fleetbus.protocol import AgentMessage, Event, FinalAnswer, TextBlock, UserRequest, decode
from tests.helpers import spawn, stop, wait_for_workers, workers
from tests.openai_server import FakeOpenAIServer, completion

TOOLS = "tests.integration.worker_tools"
CLI_ENV = {"FLEETBUS_CONNECT_TIMEOUT": "2", "COLUMNS": "1000"}
"""Rich wraps lines at the terminal's width: one error line must stay one line."""
LATENCY = re.compile(r"\[\d+\.\d ms\]")
CLOCK = re.compile(r"\d\d:\d\d:\d\d\.\d{3} ")


class Output:
    """What a running process prints, read as it comes without blocking."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        self.proc = proc
        self._fd = proc.stdout.fileno()
        os.set_blocking(self._fd, False)
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._text = ""

    @property
    def text(self) -> str:
        """Everything printed so far."""
        return self.read()

    def read(self) -> str:
        """Read what was printed since the last read; return everything printed so far."""
        while True:
            try:
                chunk = os.read(self._fd, 65536)
            except BlockingIOError:
                break
            if not chunk:
                break
            self._text += self._decoder.decode(chunk)
        return self._text

    async def wait_for(self, pattern: str, *, count: int = 1, timeout: float = 60.0) -> str:
        """Wait until ``pattern`` was printed ``count`` times; the output."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if len(re.findall(pattern, self.text)) >= count:
                return self._text
            if self.proc.poll() is not None:
                break
            await asyncio.sleep(0.02)
        text = self.text
        if len(re.findall(pattern, text)) >= count:
            return text
        raise AssertionError(
            f"{pattern!r} not printed {count} time(s) (exit {self.proc.poll()}):\n{text}"
        )

    async def finish(self, timeout: float = 60.0) -> tuple[int, str]:
        """Wait for the process to exit (reading as it prints); exit code and output."""
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None:
            self.read()  # keeps the pipe from filling up
            if time.monotonic() > deadline:
                self.proc.kill()
                self.proc.wait()
                raise AssertionError(f"still running after {timeout}s:\n{self.text}")
            await asyncio.sleep(0.02)
        text = self.text
        assert self.proc.stdout is not None
        self.proc.stdout.close()
        return self.proc.returncode, text


@contextmanager
def _interruptible() -> Iterator[None]:
    """Processes started in the block take Ctrl-C (SIGINT) as they would from
    a terminal, even when this one was started ignoring it (a background job
    of a shell, ``nohup``): an ignored signal stays ignored across ``exec``,
    a caught one is reset to its default."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _signal_masks(pid: int) -> str:
    """A process's blocked, ignored and caught signals, as Linux shows them."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as status:
            return " ".join(line.strip() for line in status if line.startswith("Sig"))
    except OSError:
        return "(no /proc)"


async def run_cli(*args: str, timeout: float = 60.0) -> tuple[int, str]:
    """Run ``fleetbus ARGS`` to its end: exit code and output."""
    return await Output(spawn(list(args), env=CLI_ENV)).finish(timeout)


@contextmanager
def running_cli(*args: str) -> Iterator[Output]:
    """``fleetbus ARGS`` running in the background; killed on exit if it still runs."""
    proc = spawn(list(args), env=CLI_ENV)
    try:
        yield Output(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        assert proc.stdout is not None
        proc.stdout.close()


async def until_watched(bus: Bus, watching: Output, session: str) -> None:
    """Publish probes of ``session`` until the watch prints one more: it is
    subscribed, and has printed what reached it before."""
    probe = AgentMessage(
        sender="probe", session_id=session, content=[TextBlock(text="probe")], reply=False
    )
    seen = watching.text.count("probe")
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        await bus.publish(bus.subjects.topic("probe"), probe)
        await bus.flush()
        if watching.text.count("probe") > seen:
            return
        assert watching.proc.poll() is None, watching.text
        await asyncio.sleep(0.1)
    raise AssertionError(f"the watch printed no probe:\n{watching.text}")


@contextmanager
def agent_process(url: str, prefix: str, spec: str, *extra: str) -> Iterator[Output]:
    """``fleetbus agent tests.integration.agent_specs:SPEC``, stopped (SIGTERM) on exit."""
    proc = spawn(
        [
            "agent",
            f"tests.integration.agent_specs:{spec}",
            "--nats",
            url,
            "--prefix",
            prefix,
            "--lease-ttl",
            "1",
            *extra,
        ]
    )
    try:
        yield Output(proc)
    finally:
        try:
            stop(proc)
        except subprocess.TimeoutExpired:
            pass


def pid_of(text: str) -> int:
    """The pid in an echo agent's answer (``… from <pid>``)."""
    found = re.search(r"from (\d+)", text)
    assert found, text
    return int(found.group(1))


def marks(directory: Path, tag: str) -> list[str]:
    return sorted(p.name for p in directory.glob(f"{tag}.*.done"))


def alive(pid: int) -> bool:
    """Whether a process runs (a zombie does not)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def parent_of(pid: int) -> int:
    """The parent pid of a process."""
    with open(f"/proc/{pid}/stat") as stat:
        return int(stat.read().rsplit(")", 1)[1].split()[1])


async def test_ask_streams_replies_that_watch_and_sessions_show(
    nats_server: EmbeddedServer, bus: Bus, tmp_path: Path
) -> None:
    url, prefix = nats_server.url, bus.prefix
    on_bus = ("--nats", url, "--prefix", prefix)
    env = {"FLEETBUS_TEST_DIR": str(tmp_path)}
    with (
        workers(url, prefix, 1, spec=TOOLS, env=env) as (worker,),
        running_cli("watch", "--session", "s3", *on_bus) as watching,
    ):
        await wait_for_workers(bus, "record", 1)
        with agent_process(url, prefix, "echo", "--replica-id", "r1") as agent:
            await agent.wait_for("serving echo")
            await until_watched(bus, watching, "s3")

            code, out = await run_cli("ask", "echo", "hello", *on_bus, "--session", "s1")
            assert code == 0, out
            assert out.splitlines()[0] == "session s1"
            assert f"echo hello from {agent.proc.pid}" in out
            assert "✓ completed (session s1)" in out

            code, out = await run_cli(
                "ask", "echo", 'tool record {"tag": "j"}', *on_bus, "--session", "s2", "--json"
            )
            assert code == 0, out
            messages = [decode(line.encode()) for line in out.splitlines()]
            assert all(m.session_id == "s2" for m in messages)
            events = [m.event for m in messages if isinstance(m, Event)]
            assert events[0] == "reply_start"
            assert events.index("tool_call") < events.index("tool_result")
            final = messages[-1]
            assert isinstance(final, FinalAnswer)
            assert final.finished_reason == "completed"
            assert str(final.content).startswith("done record=")
            assert len(marks(tmp_path, "j")) == 1

            code, out = await run_cli(
                "ask", "echo", 'tool echo {"text": "hi there"}', *on_bus, "--session", "s3"
            )
            assert code == 0, out
            assert '→ echo({"text": "hi there"})' in out
            assert "← echo: success — hi there" in out
            assert f"done echo=hi there from {agent.proc.pid}" in out

            await watching.wait_for(r"final_answer .*@ reply")
            watching.proc.send_signal(signal.SIGINT)
            code, watched = await watching.finish(timeout=45)
            assert code == 0, watched

            code, out = await run_cli("sessions", *on_bus)
            assert code == 0, out
            assert re.search(r"│ echo\s*│ s1\s*│ done\s*│", out), out

            code, out = await run_cli("sessions", "echo", *on_bus, "--json")
            assert code == 0, out
            listed = {s["session"]: s for s in json.loads(out)}
            assert set(listed) == {"s1", "s2", "s3"}
            assert listed["s1"]["status"] == "done"
            assert listed["s1"]["agent"] == "echo"
            assert listed["s1"]["pending"] == []
            assert listed["s1"]["last_answer"] == f"echo hello from {agent.proc.pid}"
    assert worker.returncode == 0

    # Message lines start with a clock (the watch may also print a count of skipped payloads).
    lines = [line for line in watched.splitlines() if CLOCK.match(line) and "probe" not in line]
    assert lines
    assert all("session=s3" in line for line in lines), watched

    def line_with(*parts: str) -> str:
        found = [line for line in lines if all(p in line for p in parts)]
        assert found, f"no line with {parts}:\n{watched}"
        return found[0]

    assert line_with("user_request", "cli", 'tool echo {"text": "hi there"}', ".agent.echo.inbox")
    call = line_with("tool_call", "agent.echo", 'echo({"text": "hi there"})', ".tool.echo")
    result = line_with("tool_result", "echo success — hi there", "@ reply")
    call_id = re.search(r"call=(\S+)", call)
    assert call_id
    assert f"call={call_id.group(1)}" in result  # the pair
    assert LATENCY.search(result), result
    assert LATENCY.search(line_with("event", "tool_result#", "echo success — hi there"))
    assert line_with("final_answer", f"completed — done echo=hi there from {agent.proc.pid}")


async def test_a_paused_reply_is_confirmed_with_the_command_it_prints(
    nats_server: EmbeddedServer, bus: Bus, tmp_path: Path
) -> None:
    url, prefix = nats_server.url, bus.prefix
    on_bus = ("--nats", url, "--prefix", prefix)
    env = {"FLEETBUS_TEST_DIR": str(tmp_path)}
    with workers(url, prefix, 1, spec=TOOLS, env=env):
        await wait_for_workers(bus, "record", 1)
        with agent_process(url, prefix, "careful", "--replica-id", "r1") as agent:
            await agent.wait_for("serving careful")

            code, out = await run_cli(
                "ask", "careful", 'tool record {"tag": "x"}', *on_bus, "--session", "h1"
            )
            assert code == 0, out
            assert "⏸ paused (session h1)" in out
            found = re.search(r"^\s*allow:\s+(fleetbus confirm h1 --allow (\S+))$", out, re.M)
            assert found, out
            command, call_id = found.group(1), found.group(2)
            assert f"fleetbus confirm h1 --deny {call_id}" in out
            assert marks(tmp_path, "x") == []  # not run before it is confirmed

            code, out = await run_cli("sessions", "careful", *on_bus, "--json")
            assert code == 0, out
            (session,) = json.loads(out)
            assert session["status"] == "paused"
            assert [(p["call_id"], p["tool_name"]) for p in session["pending"]] == [
                (call_id, "record")
            ]

            code, out = await run_cli(*shlex.split(command)[1:], *on_bus)
            assert code == 0, out
            assert "← record: success" in out
            assert f"from {agent.proc.pid}" in out
            assert "✓ completed (session h1)" in out
            assert len(marks(tmp_path, "x")) == 1

            # The same confirmation again finds nothing waiting: the tool does not run twice.
            code, out = await run_cli(*shlex.split(command)[1:], *on_bus)
            assert code == 1, out
            assert "Nothing is waiting for a confirmation." in out
            assert len(marks(tmp_path, "x")) == 1


async def test_cancel_interrupts_the_reply_an_ask_waits_for(
    nats_server: EmbeddedServer, bus: Bus
) -> None:
    url, prefix = nats_server.url, bus.prefix
    on_bus = ("--nats", url, "--prefix", prefix)
    with agent_process(url, prefix, "echo", "--replica-id", "r1", "--no-remote-tools") as agent:
        await agent.wait_for("serving echo")
        events = await bus.observe(bus.subjects.events("echo", "c1", ANY_OWNER))
        await bus.flush()
        with running_cli("ask", "echo", "sleep 20; slow", *on_bus, "--session", "c1") as asking:
            async with events, asyncio.timeout(20):
                async for message in events:  # the model sleeps from here on
                    if isinstance(message, Event) and message.event == "model_call_start":
                        break
            code, out = await run_cli("cancel", "c1", *on_bus)
            assert code == 0, out
            assert "cancel sent to echo for session c1" in out
            code, out = await asking.finish(timeout=45)
        assert code == 0, out
        assert "■ interrupted (session c1)" in out

        code, out = await run_cli("sessions", "echo", *on_bus, "--json")
        assert code == 0, out
        assert [(s["session"], s["status"]) for s in json.loads(out)] == [("c1", "idle")]


async def test_an_ask_that_times_out_or_is_stopped_interrupts_its_reply(
    nats_server: EmbeddedServer, bus: Bus
) -> None:
    url, prefix = nats_server.url, bus.prefix
    on_bus = ("--nats", url, "--prefix", prefix)
    store = await SessionStore.open(bus, owner="test")

    async def status(session: str) -> str:
        """The session's status once its reply has ended (or after 10 s)."""
        deadline = time.monotonic() + 10
        while True:
            record = await store.get("echo", session)
            if record is not None and record.status != "running":
                return record.status
            if time.monotonic() > deadline:
                return "running" if record is not None else "missing"
            await asyncio.sleep(0.05)

    with agent_process(url, prefix, "echo", "--replica-id", "r1", "--no-remote-tools") as agent:
        await agent.wait_for("serving echo")
        code, out = await run_cli(
            "ask", "echo", "sleep 20; slow", *on_bus, "--session", "t1", "--timeout", "1"
        )
        assert code == 1, out
        errors = [line for line in out.splitlines() if line.startswith("error:")]
        assert errors == ["error: agent 'echo' gave no final answer in session 't1' within 1s"]
        assert await status("t1") == "idle"  # interrupted, not left running for nobody

        events = await bus.observe(bus.subjects.events("echo", "t2", ANY_OWNER))
        await bus.flush()
        with (
            _interruptible(),
            running_cli("ask", "echo", "sleep 20; slow", *on_bus, "--session", "t2") as asking,
        ):
            # The reply ends by itself after the model's 20 s: what ended it
            # is in its end, and both processes' output is shown if not this.
            async with events, asyncio.timeout(60):
                async for message in events:  # the model sleeps from here on
                    if isinstance(message, Event) and message.event == "model_call_start":
                        masks = _signal_masks(asking.proc.pid)
                        asking.proc.send_signal(signal.SIGINT)  # Ctrl-C, once
                    if isinstance(message, Event) and message.event == "reply_end":
                        break
            code, out = await asking.finish(timeout=45)
        assert isinstance(message, Event)
        seen = f"ask ({masks}):\n{out}\nagent:\n{agent.text}"
        assert message.data["finished_reason"] == "interrupted", seen
        assert code == 130, seen
        assert "interrupted" in out
        assert await status("t2") == "idle"


async def test_replicas_share_the_asks_and_stop_with_their_supervisor(
    nats_server: EmbeddedServer, bus: Bus
) -> None:
    url, prefix = nats_server.url, bus.prefix
    on_bus = ("--nats", url, "--prefix", prefix)
    with agent_process(url, prefix, "echo", "--replicas", "2", "--no-remote-tools") as supervisor:
        await supervisor.wait_for("serving echo", count=2)
        assert "supervising 2 replicas" in supervisor.text
        code, out = await run_cli("ask", "echo", "ping", *on_bus, "--session", "p0")
        assert code == 0, out
        pids = {pid_of(out)}
        for n in range(1, 30):  # the queue group spreads the asks over the replicas
            if len(pids) == 2:
                break
            answer = await bus.request(
                bus.subjects.agent_inbox("echo"),
                UserRequest(content="ping", session_id=f"p{n}"),
                timeout=10,
            )
            assert isinstance(answer, FinalAnswer), answer
            pids.add(pid_of(str(answer.content)))
        assert len(pids) == 2, pids
        assert {parent_of(pid) for pid in pids} == {supervisor.proc.pid}
        supervisor.proc.send_signal(signal.SIGTERM)
        code, out = await supervisor.finish(timeout=30)
    assert code == 0, out
    assert out.count("agents stopped") == 2
    assert [pid for pid in pids if alive(pid)] == []


async def test_mistakes_are_one_clear_line(
    nats_server: EmbeddedServer, prefix: str, tmp_path: Path
) -> None:
    on_bus = ("--nats", nats_server.url, "--prefix", prefix)
    missing, broken, a_list = (
        tmp_path / "missing.json",
        tmp_path / "broken.json",
        tmp_path / "list.json",
    )
    broken.write_text('{"type": "object",')
    a_list.write_text('{"type": "array", "items": {"type": "string"}}')
    cases: list[tuple[list[str], str]] = [
        (["agent", "no.such:thing", *on_bus], "cannot import 'no.such'"),
        (["ask", "nobody", "hi", *on_bus], f"no agent 'nobody' is served with prefix '{prefix}'"),
        (["ask", "echo", "hi", "--session", "a b", *on_bus], "invalid session id 'a b'"),
        (["confirm", "unknown-session", "--allow", "x", *on_bus], "no session 'unknown-session'"),
        (["cancel", "unknown-session", *on_bus], "no session 'unknown-session'"),
        (["ask", "echo", "hi", "--schema", str(missing), *on_bus], "cannot read the schema"),
        (["ask", "echo", "hi", "--schema", str(broken), *on_bus], f"schema {broken} is not JSON"),
        (
            ["ask", "echo", "hi", "--schema", str(a_list), *on_bus],
            f"the schema {a_list} is not the JSON Schema of an object",
        ),
    ]
    results = await asyncio.gather(*(run_cli(*args) for args, _ in cases))
    for (args, message), (code, out) in zip(cases, results, strict=True):
        errors = [line for line in out.splitlines() if line.startswith("error:")]
        assert code == 1, (args, out)
        assert len(errors) == 1, (args, out)
        assert message in errors[0], (args, out)
        assert "Traceback" not in out, (args, out)
        assert len(out.strip().splitlines()) <= 2, (args, out)


async def test_watch_counts_no_undecodable_message_when_sessions_are_listed(
    nats_server: EmbeddedServer, bus: Bus
) -> None:
    on_bus = ("--nats", nats_server.url, "--prefix", bus.prefix)
    with running_cli("watch", "--session", "q1", *on_bus) as watching:
        await until_watched(bus, watching, "q1")
        store = await SessionStore.open(bus, owner="test")
        await store.acquire("echo", "q1")
        # What `fleetbus sessions` and every agent's recovery scan do: list the keys.
        assert [r.session_id for r in await store.records()] == ["q1"]
        await until_watched(bus, watching, "q1")
        await asyncio.sleep(0.1)
        watching.proc.send_signal(signal.SIGINT)
        code, out = await watching.finish(timeout=45)
    assert code == 0, out
    assert "undecodable" not in out


async def test_ask_with_a_schema_prints_the_structured_answer(
    nats_server: EmbeddedServer, bus: Bus, tmp_path: Path
) -> None:
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string"}, "temp_c": {"type": "integer"}},
        "required": ["city", "temp_c"],
    }
    schema_file = tmp_path / "forecast.json"
    schema_file.write_text(json.dumps(schema))
    spec = tmp_path / "agents.toml"
    spec.write_text('[agent.forecaster]\nsystem_prompt = "You forecast."\nmodel = "openai:m"\n')
    on_bus = ("--nats", nats_server.url, "--prefix", bus.prefix)
    with FakeOpenAIServer() as endpoint:
        # The model answers through the finish tool, once per ask.
        for n in (1, 2):
            endpoint.add(
                completion(
                    tool_calls=[(f"call_{n}", "generate_response", '{"city": "Oslo", "temp_c": 7}')]
                )
            )
        env = {**CLI_ENV, "OPENAI_BASE_URL": endpoint.url}
        proc = spawn(["agent", str(spec), "--no-remote-tools", *on_bus], env=env)
        try:
            await Output(proc).wait_for("serving forecaster")
            code, out = await run_cli(
                "ask", "forecaster", "Oslo tomorrow?", "--schema", str(schema_file), *on_bus
            )
            json_code, json_out = await run_cli(
                "ask", "forecaster", "Oslo?", "--schema", str(schema_file), "--json", *on_bus
            )
        finally:
            stop(proc)
    assert code == 0, out
    lines = out.strip().splitlines()
    assert lines[-2].startswith("✓ completed"), out
    assert json.loads(lines[-1]) == {"city": "Oslo", "temp_c": 7}  # printed after the end
    assert json_code == 0, json_out
    final = decode(json_out.splitlines()[-1].encode())
    assert isinstance(final, FinalAnswer)
    assert final.structured == {"city": "Oslo", "temp_c": 7}
    # The schema went with the request: the model was offered it as the finish tool.
    for body in endpoint.bodies:
        (finish,) = [t for t in body["tools"] if t["function"]["name"] == "generate_response"]
        assert finish["function"]["parameters"] == schema
