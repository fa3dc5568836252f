"""The gateway's cost: what HTTP adds to a reply over asking the agent on the
bus, and many streamed replies open at once, in one run.

Processes: an embedded nats-server (its defaults: JetStream, fsync on every
write); one agent host (``fleetbus agent bench._gateway_agents:agents``:
``quick`` answers a short text at once, ``slow`` waits ``--slow`` seconds,
then writes its answer in ``--chunks`` pieces); the gateway (``fleetbus
gateway --no-a2a``, on uvloop as the command runs it, with a tokens file of
its own); and this process, the client (on uvloop when installed), so the
load generator shares no event loop with the gateway.

1. **Overhead per request.** The same request (``"Hello."`` to ``quick``,
   each in a new session) sent one at a time, ``--requests`` times by each
   route after ``--warmup``; the routes take turns over ``--rounds`` rounds,
   so that a changing machine falls on all of them (``--routes`` picks
   them; ``bus``, ``native`` and ``native_raw`` always run):

   - ``bus``: ``RemoteAgent.reply`` on the bus, from this process;
   - ``native``: ``POST /v1/fleet/agents/quick/messages`` (not streamed) with
     ``httpx.AsyncClient``, keep-alive, over a real socket;
   - ``chat``: ``POST /v1/chat/completions`` with the same client;
   - ``openai_sdk``: the same through the official SDK (``AsyncOpenAI``,
     ``chat.completions.create``, no retries);
   - ``native_raw``: ``native`` with a minimal HTTP/1.1 client written here
     (one keep-alive connection, bytes written and read by hand): the
     gateway's share, without httpx's;
   - ``healthz`` / ``healthz_raw``: ``GET /healthz`` with each client: the
     floor of an HTTP round trip to the gateway (uvicorn, FastAPI), no bus.

   Reported: p50/p90/p99 of each (ms); the overhead of each HTTP route over
   ``bus`` at p50 and p90, in ms and as a ratio, and at p50 less the
   ``healthz`` floor of the same client (``overhead_beyond_http_floor``);
   the CPU each process spent per request of each route (this client, the
   gateway, the agent host, nats-server; ``/proc`` clock ticks, so coarse
   to a few hundredths of a ms at the defaults). ``overhead_p50_ms`` is
   ``native_raw`` over ``bus`` — what the gateway adds, its client's own
   cost left out — against ``target_ms`` (1 ms): ``target_met`` says whether
   it held in this run; nothing is asserted. ``overhead_p50_ms_httpx`` is
   ``native`` over ``bus``: the same with httpx's own cost (about half a
   millisecond a request, its ``healthz`` over ``healthz_raw``) in.
2. **Concurrent streams.** ``--streams`` clients (default 500) each POST a
   streamed message (``"stream": true``) to ``slow`` at the same moment,
   each with a token of its own (the gateway's ``max_streams_per_token``
   stays at its default). The clients share ``httpx.AsyncClient``s of
   :data:`POOL` connections each: one pool of 500 spends more CPU than the
   gateway does, in httpcore's pool, which scans every connection for each
   request it places. The agent host runs ``--agent-concurrency`` replies at
   once (``fleetbus agent --concurrency``; by default the streams + 16: the
   command's own default, 16, would queue them). The same number of
   ``RemoteAgent.reply_stream`` calls on the bus, from this process, run
   first: the same replies without the gateway. Reported for each: finals
   delivered, seconds from the start to all streams open (response headers;
   on the bus, the first event), to all finals and to all streams closed, the
   most streams open at once, ``text_delta`` events per stream, errors by
   kind, this process's CPU; for the gateway, its resident memory before and
   its peak (``VmRSS``, ``VmHWM``; the peak since it started) and its CPU;
   and the ratio of the times to all finals. The soft limit of open files
   is raised to what the streams need (both ends of each connection are on
   this machine) when it is lower.

``BENCH_PROFILE=DIR`` runs the gateway under cProfile during the measured
rounds of (1) (``bench/_gateway_profiled.py``; ``DIR/gateway.prof``) and
adds its top functions per gateway request to the output, by own time and
(fleetbus's) by cumulative time; the profiler slows the gateway, so the
latencies of such a run are not comparable with others'. ``--routes native``
profiles that route alone.

Prints one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import pstats
import re
import resource
import signal
import ssl
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
from _gateway_agents import QUICK_ANSWER

from fleetbus.agents.serving import RemoteAgent
from fleetbus.bus import Bus, EmbeddedServer
from fleetbus.gateway.settings import GatewaySettings
from fleetbus.protocol import Event, FinalAnswer

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
TARGET_MS = 1.0
ASK = "Hello."
QUICK = "quick"
SLOW = "slow"
BENCH_TOKEN = "sk-bench-0123456789abcdef"
POOL = 25
"""Connections of each HTTP client of the streams."""
ROUTES = ("bus", "native", "chat", "openai_sdk", "native_raw", "healthz", "healthz_raw")
HTTP_ROUTES = ("native", "chat", "openai_sdk", "native_raw")
TICK = 1.0 / os.sysconf("SC_CLK_TCK")


# -- processes -----------------------------------------------------------------------------


class Child:
    """A child process whose output is read as it comes (its last lines kept)."""

    def __init__(self, command: list[str], env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen(
            command,
            cwd=ROOT,
            env={**os.environ, **(env or {}), "PYTHONPATH": str(ROOT), "COLUMNS": "200"},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        self.lines: list[str] = []
        self._changed = threading.Condition()
        self._ended = False
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _read(self) -> None:
        assert self.proc.stdout is not None
        try:
            for raw in self.proc.stdout:
                with self._changed:
                    self.lines.append(raw.decode(errors="replace"))
                    if len(self.lines) > 2000:
                        del self.lines[:1000]
                    self._changed.notify_all()
        finally:
            with self._changed:
                self._ended = True
                self._changed.notify_all()

    def wait_for(self, pattern: str, timeout: float) -> re.Match[str]:
        """The first line matching ``pattern``, waited for.

        Raises:
            RuntimeError: the process ended first, or ``timeout`` passed.
        """
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                for line in self.lines:
                    found = re.search(pattern, line)
                    if found:
                        return found
                left = deadline - time.monotonic()
                if self._ended or left <= 0:
                    raise RuntimeError(
                        f"no line {pattern!r} from {self.proc.args!r}:\n{self.tail()}"
                    )
                self._changed.wait(left)

    def tail(self, lines: int = 30) -> str:
        return "".join(self.lines[-lines:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._reader.join(5)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def cpu_seconds(pid: int | None) -> float:
    """User + system CPU seconds of a process (``/proc``), 0 when unknown."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) * TICK


def memory_mb(pid: int, key: str) -> float | None:
    """``VmRSS`` / ``VmHWM`` of a process in MB (``/proc/PID/status``)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    return None


def raise_open_files(needed: int) -> dict[str, int]:
    """The soft limit of open files raised to ``needed`` (up to the hard
    limit) when lower; children inherit it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < needed:
        wanted = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    now = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return {"soft_before": soft, "soft": now, "hard": hard, "needed": needed}


# -- clients -------------------------------------------------------------------------------


class RawHttp:
    """One keep-alive HTTP/1.1 connection whose requests are written and read
    by hand: what a client costs at the least."""

    def __init__(self, host: str, port: int, token: str) -> None:
        self.host, self.port = host, port
        self.head = f"host: {host}:{port}\r\nauthorization: Bearer {token}\r\n"
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def open(self) -> None:
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port)

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            await self.writer.wait_closed()

    async def call(self, method: str, path: str, body: bytes = b"") -> tuple[int, bytes]:
        assert self.reader is not None
        assert self.writer is not None
        extra = f"content-type: application/json\r\ncontent-length: {len(body)}\r\n" if body else ""
        self.writer.write(f"{method} {path} HTTP/1.1\r\n{self.head}{extra}\r\n".encode() + body)
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head[9:12])
        length = re.search(rb"(?im)^content-length:\s*(\d+)", head)
        if length is None:
            raise RuntimeError(f"an answer without content-length: {head!r}")
        return status, await self.reader.readexactly(int(length.group(1)))


@dataclass
class Route:
    """One way of asking, and what it cost."""

    name: str
    call: Callable[[], Awaitable[None]]
    times: list[float] = field(default_factory=list)
    cpu: defaultdict[str, float] = field(default_factory=lambda: defaultdict(float))


def checked(status: int, text: str, route: str) -> None:
    if status != 200 or QUICK_ANSWER not in text:
        raise RuntimeError(f"{route}: {status} {text[:500]}")


def percentiles(times: list[float]) -> dict[str, float]:
    ordered = sorted(times)
    q = statistics.quantiles(ordered, n=100, method="inclusive")
    return {
        "p50": round(statistics.median(ordered) * 1e3, 3),
        "p90": round(q[89] * 1e3, 3),
        "p99": round(q[98] * 1e3, 3),
    }


# -- the fleet -----------------------------------------------------------------------------


@dataclass
class Fleet:
    server: EmbeddedServer
    prefix: str
    agent: Child
    gateway: Child
    url: str
    port: int
    stream_tokens: list[str]
    profile: Path | None


def write_tokens(path: Path, streams: int) -> list[str]:
    tokens = [f"sk-stream-{n:05d}-0123456789" for n in range(streams)]
    entries = [{"user": "bench", "token": BENCH_TOKEN}]
    entries += [{"user": f"s{n:05d}", "token": t} for n, t in enumerate(tokens)]
    path.write_text(json.dumps(entries))
    return tokens


def start_fleet(
    server: EmbeddedServer, tmp: Path, args: argparse.Namespace, profile_dir: str | None
) -> Fleet:
    prefix = f"gw{uuid.uuid4().hex[:8]}"
    where = ["--nats", server.url, "--prefix", prefix]
    agent = Child(
        [
            sys.executable,
            "-m",
            "fleetbus",
            "agent",
            "bench._gateway_agents:agents",
            *where,
            "--concurrency",
            str(args.agent_concurrency),
            "--no-remote-tools",
        ],
        env={"GATEWAY_BENCH_SLOW": str(args.slow), "GATEWAY_BENCH_CHUNKS": str(args.chunks)},
    )
    tokens_file = tmp / "tokens.json"
    stream_tokens = write_tokens(tokens_file, args.streams)
    gateway_args = ["gateway", "--tokens", str(tokens_file), "--port", "0", "--no-a2a", *where]
    profile: Path | None = None
    env: dict[str, str] = {}
    if profile_dir:
        Path(profile_dir).mkdir(parents=True, exist_ok=True)
        profile = Path(profile_dir).resolve() / "gateway.prof"
        profile.unlink(missing_ok=True)
        env["PROFILE_FILE"] = str(profile)
        command = [sys.executable, str(HERE / "_gateway_profiled.py"), *gateway_args]
    else:
        command = [sys.executable, "-m", "fleetbus", *gateway_args]
    gateway = Child(command, env=env)
    try:
        agent.wait_for(r"^serving ", 60)
        port = int(gateway.wait_for(r"gateway on http://127\.0\.0\.1:(\d+)/v1", 60).group(1))
    except BaseException:
        gateway.stop()
        agent.stop()
        raise
    return Fleet(
        server=server,
        prefix=prefix,
        agent=agent,
        gateway=gateway,
        url=f"http://127.0.0.1:{port}",
        port=port,
        stream_tokens=stream_tokens,
        profile=profile,
    )


async def wait_healthy(http: httpx.AsyncClient, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if (await http.get("/healthz")).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError("the gateway did not answer /healthz")
        await asyncio.sleep(0.05)


# -- 1. overhead per request ---------------------------------------------------------------


async def sequential(fleet: Fleet, bus: Bus, args: argparse.Namespace) -> dict[str, Any]:
    auth = {"authorization": f"Bearer {BENCH_TOKEN}"}
    native_body = json.dumps({"content": ASK}).encode()
    chat_body = {"model": QUICK, "messages": [{"role": "user", "content": ASK}]}
    async with httpx.AsyncClient(base_url=fleet.url, headers=auth, timeout=30) as http:
        await wait_healthy(http, 30)
        raw = RawHttp("127.0.0.1", fleet.port, BENCH_TOKEN)
        await raw.open()
        sdk = openai.AsyncOpenAI(
            base_url=f"{fleet.url}/v1", api_key=BENCH_TOKEN, max_retries=0, timeout=30
        )

        async def on_bus() -> None:
            answer = await RemoteAgent(bus, QUICK, timeout=30).reply(ASK)
            checked(200, str(answer.content), "bus")

        async def native() -> None:
            answer = await http.post(
                f"/v1/fleet/agents/{QUICK}/messages",
                content=native_body,
                headers={"content-type": "application/json"},
            )
            checked(answer.status_code, answer.text, "native")

        async def chat() -> None:
            answer = await http.post("/v1/chat/completions", json=chat_body)
            checked(answer.status_code, answer.text, "chat")

        async def openai_sdk() -> None:
            completion = await sdk.chat.completions.create(
                model=QUICK, messages=[{"role": "user", "content": ASK}]
            )
            checked(200, completion.choices[0].message.content or "", "openai_sdk")

        async def native_raw() -> None:
            status, body = await raw.call("POST", f"/v1/fleet/agents/{QUICK}/messages", native_body)
            checked(status, body.decode(), "native_raw")

        async def healthz() -> None:
            answer = await http.get("/healthz")
            if answer.status_code != 200:
                raise RuntimeError(f"healthz: {answer.status_code}")

        async def healthz_raw() -> None:
            status, _ = await raw.call("GET", "/healthz")
            if status != 200:
                raise RuntimeError(f"healthz_raw: {status}")

        routes = [
            route
            for route in (
                Route("bus", on_bus),
                Route("native", native),
                Route("chat", chat),
                Route("openai_sdk", openai_sdk),
                Route("native_raw", native_raw),
                Route("healthz", healthz),
                Route("healthz_raw", healthz_raw),
            )
            if route.name in args.routes
        ]
        try:
            for route in routes:
                for _ in range(args.warmup):
                    await route.call()
            if fleet.profile is not None:
                os.kill(fleet.gateway.pid, signal.SIGUSR1)
                await http.get("/healthz")  # served after the handler ran
            per_round = [args.requests // args.rounds] * args.rounds
            per_round[-1] += args.requests - sum(per_round)
            pids = {
                "gateway": fleet.gateway.pid,
                "agent": fleet.agent.pid,
                "nats": fleet.server.pid,
            }
            for number, count in enumerate(per_round):
                shift = number % len(routes)
                order = routes[shift:] + routes[:shift]
                for route in order if number % 2 == 0 else order[::-1]:
                    before = {k: cpu_seconds(p) for k, p in pids.items()}
                    client_before = time.process_time()
                    for _ in range(count):
                        started = time.perf_counter()
                        await route.call()
                        route.times.append(time.perf_counter() - started)
                    route.cpu["client"] += time.process_time() - client_before
                    for k, p in pids.items():
                        route.cpu[k] += cpu_seconds(p) - before[k]
            if fleet.profile is not None:
                os.kill(fleet.gateway.pid, signal.SIGUSR2)
        finally:
            await raw.close()
            await sdk.close()

    latency = {r.name: percentiles(r.times) for r in routes}
    bus_p50, bus_p90 = latency["bus"]["p50"], latency["bus"]["p90"]
    http_routes = [r.name for r in routes if r.name in HTTP_ROUTES]
    overhead_p50 = {n: round(latency[n]["p50"] - bus_p50, 3) for n in http_routes}
    report: dict[str, Any] = {
        "latency_ms": latency,
        "overhead_p50_ms": overhead_p50["native_raw"],
        "target_ms": TARGET_MS,
        "target_met": overhead_p50["native_raw"] <= TARGET_MS,
        "overhead_p50_ms_httpx": overhead_p50["native"],
        "overhead_p50_ms_by_route": overhead_p50,
        "overhead_p90_ms_by_route": {n: round(latency[n]["p90"] - bus_p90, 3) for n in http_routes},
        "ratio_p50_over_bus": {n: round(latency[n]["p50"] / bus_p50, 3) for n in http_routes},
        # The overhead less an HTTP round trip to the gateway with the same client.
        "overhead_beyond_http_floor_p50_ms": {
            name: round(overhead_p50[name] - latency[floor]["p50"], 3)
            for name, floor in (("native", "healthz"), ("native_raw", "healthz_raw"))
            if name in latency and floor in latency
        },
        "cpu_ms_per_request": {
            r.name: {k: round(v / len(r.times) * 1e3, 3) for k, v in sorted(r.cpu.items())}
            for r in routes
        },
    }
    if fleet.profile is not None:
        gateway_requests = sum(len(r.times) for r in routes if r.name != "bus")
        report["profile_routes"] = sorted(r.name for r in routes if r.name != "bus")
        report["profile"] = await asyncio.to_thread(read_profile, fleet.profile, gateway_requests)
    return report


def read_profile(path: Path, requests: int, top: int = 25) -> dict[str, Any]:
    """The top of the gateway's profile, once written, per gateway request."""
    deadline = time.monotonic() + 30
    while not path.exists():
        if time.monotonic() > deadline:
            return {"file": str(path), "error": "not written"}
        time.sleep(0.1)
    stats = pstats.Stats(str(path))
    rows = list(stats.stats.items())  # type: ignore[attr-defined]
    total = sum(v[2] for _, v in rows)

    def where(file: str, line: int, name: str) -> str:
        return f"{file.rpartition('site-packages/')[2].removeprefix(str(ROOT) + '/')}:{line}:{name}"

    def per_request(seconds: float) -> float:
        return round(seconds / requests * 1e6, 1)

    own = sorted(rows, key=lambda kv: kv[1][2], reverse=True)[:top]
    ours = [kv for kv in rows if kv[0][0].startswith(str(ROOT / "fleetbus"))]
    cumulative = sorted(ours, key=lambda kv: kv[1][3], reverse=True)[:top]
    return {
        "file": str(path),
        "gateway_requests": requests,
        "profiled_cpu_ms_per_request": round(total / requests * 1e3, 3),
        "own_time_us_per_request": [
            [where(*key), per_request(tt), calls] for key, (_cc, calls, tt, _ct, _c) in own
        ],
        "fleetbus_cumulative_us_per_request": [
            [where(*key), per_request(ct), calls] for key, (_cc, calls, _tt, ct, _c) in cumulative
        ],
    }


# -- 2. concurrent streams -----------------------------------------------------------------


@dataclass
class StreamRun:
    opened: list[float] = field(default_factory=list)
    finals: list[float] = field(default_factory=list)
    deltas: list[int] = field(default_factory=list)
    errors: Counter[str] = field(default_factory=Counter)
    ends: list[float] = field(default_factory=list)
    open_now: int = 0
    open_peak: int = 0

    def open(self, at: float) -> None:
        self.opened.append(at)
        self.open_now += 1
        self.open_peak = max(self.open_peak, self.open_now)

    def closed(self) -> None:
        self.open_now -= 1

    def report(self, streams: int) -> dict[str, Any]:
        return {
            "finals": len(self.finals),
            "of": streams,
            "all_open_s": round(max(self.opened), 3) if len(self.opened) == streams else None,
            "all_finals_s": round(max(self.finals), 3) if self.finals else None,
            "median_final_s": round(statistics.median(self.finals), 3) if self.finals else None,
            "all_closed_s": round(max(self.ends), 3) if self.ends else None,
            "peak_open": self.open_peak,
            "text_deltas_per_stream": (
                [min(self.deltas), max(self.deltas)] if self.deltas else None
            ),
            "errors": dict(self.errors),
        }


def error_kind(exc: BaseException) -> str:
    return type(exc).__name__


async def streams_on_bus(bus: Bus, args: argparse.Namespace) -> dict[str, Any]:
    run = StreamRun()
    go = asyncio.Event()
    t0 = 0.0  # set when the streams start

    async def one(n: int) -> None:
        await go.wait()
        deltas = 0
        opened = False
        try:
            stream = RemoteAgent(bus, SLOW, timeout=args.deadline).reply_stream(f"Tell me {n}.")
            async for item in stream:
                if not opened:
                    opened = True
                    run.open(time.perf_counter() - t0)
                if isinstance(item, Event) and item.event == "text_delta":
                    deltas += 1
                elif isinstance(item, FinalAnswer):
                    run.finals.append(time.perf_counter() - t0)
                    run.deltas.append(deltas)
            run.ends.append(time.perf_counter() - t0)
        except Exception as exc:
            run.errors[error_kind(exc)] += 1
        finally:
            if opened:
                run.closed()

    client_cpu = time.process_time()
    async with asyncio.TaskGroup() as tg:
        for n in range(args.streams):
            tg.create_task(one(n))
        await asyncio.sleep(0)  # each waits for the start
        t0 = time.perf_counter()
        go.set()
    report = run.report(args.streams)
    report["client_cpu_s"] = round(time.process_time() - client_cpu, 2)
    return report


async def streams_on_gateway(fleet: Fleet, args: argparse.Namespace) -> dict[str, Any]:
    run = StreamRun()
    go = asyncio.Event()
    t0 = 0.0  # set when the streams start
    limits = httpx.Limits(max_connections=POOL, max_keepalive_connections=POOL)
    timeout = httpx.Timeout(args.deadline, connect=60)
    path = f"/v1/fleet/agents/{SLOW}/messages"
    pid = fleet.gateway.pid
    rss_before = memory_mb(pid, "VmRSS")
    hwm_before = memory_mb(pid, "VmHWM")
    cpu_before = cpu_seconds(pid)

    async def one(http: httpx.AsyncClient, n: int, token: str) -> None:
        await go.wait()
        opened = False
        deltas = 0
        final = False
        event = "message"
        try:
            async with http.stream(
                "POST",
                path,
                json={"content": f"Tell me {n}.", "stream": True},
                headers={"authorization": f"Bearer {token}"},
            ) as answer:
                if answer.status_code != 200:
                    await answer.aread()
                    run.errors[f"http_{answer.status_code}"] += 1
                    return
                opened = True
                run.open(time.perf_counter() - t0)
                async for line in answer.aiter_lines():
                    if line.startswith("event: "):
                        event = line[7:]
                    elif line.startswith("data: "):
                        if event == "text_delta":
                            deltas += 1
                        elif event == "final_answer":
                            final = True
                            run.finals.append(time.perf_counter() - t0)
                            run.deltas.append(deltas)
                        elif event == "error":
                            run.errors["sse_error:" + json.loads(line[6:])["error"]["code"]] += 1
                    elif not line:
                        event = "message"
                if not final:
                    run.errors["ended_without_final"] += 1
            run.ends.append(time.perf_counter() - t0)
        except Exception as exc:
            run.errors[error_kind(exc)] += 1
        finally:
            if opened:
                run.closed()

    client_cpu = time.process_time()
    async with contextlib.AsyncExitStack() as stack:
        # Clients of POOL connections each: one pool of them all spends its
        # time in httpcore's pool, which scans every connection for each
        # request it places (quadratic in the connections).
        tls = ssl.create_default_context()  # made once: each client would load it
        clients = [
            await stack.enter_async_context(
                httpx.AsyncClient(base_url=fleet.url, limits=limits, timeout=timeout, verify=tls)
            )
            for _ in range(-(-args.streams // POOL))
        ]
        async with asyncio.TaskGroup() as tg:
            for n, token in enumerate(fleet.stream_tokens):
                tg.create_task(one(clients[n // POOL], n, token))
            await asyncio.sleep(0)  # each waits for the start
            t0 = time.perf_counter()
            go.set()
    report = run.report(args.streams)
    report["gateway_rss_before_mb"] = rss_before
    report["gateway_peak_rss_before_mb"] = hwm_before
    report["gateway_peak_rss_mb"] = memory_mb(pid, "VmHWM")
    report["gateway_cpu_s"] = round(cpu_seconds(pid) - cpu_before, 2)
    report["client_cpu_s"] = round(time.process_time() - client_cpu, 2)
    return report


# -- the run -------------------------------------------------------------------------------


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    started = time.perf_counter()
    report: dict[str, Any] = {
        "bench": "gateway",
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "client_loop": type(asyncio.get_running_loop()).__module__.split(".")[0],
        "requests": args.requests,
        "warmup": args.warmup,
        "rounds": args.rounds,
        "streams": args.streams,
        "slow_s": args.slow,
        "chunks": args.chunks,
        "agent_concurrency": args.agent_concurrency,
        "gateway_max_streams_per_token": GatewaySettings().max_streams_per_token,
        "stream_tokens": args.streams,
        "load": round(os.getloadavg()[0], 2),
    }
    report["open_files"] = raise_open_files(2 * args.streams + 512)
    with EmbeddedServer() as server, tempfile.TemporaryDirectory(prefix="bench-gw-") as tmp:
        fleet = start_fleet(server, Path(tmp), args, os.environ.get("BENCH_PROFILE"))
        bus = await Bus.connect(server.url, prefix=fleet.prefix, name="bench-client")
        try:
            report["gateway_rss_idle_mb"] = memory_mb(fleet.gateway.pid, "VmRSS")
            report.update(await sequential(fleet, bus, args))
            report["gateway_rss_after_requests_mb"] = memory_mb(fleet.gateway.pid, "VmRSS")
            if args.streams:
                report["streams_bus"] = await streams_on_bus(bus, args)
                report["streams_gateway"] = await streams_on_gateway(fleet, args)
                bus_s = report["streams_bus"]["all_finals_s"]
                gw_s = report["streams_gateway"]["all_finals_s"]
                if bus_s and gw_s:
                    report["streams_all_finals_ratio_over_bus"] = round(gw_s / bus_s, 3)
                report["agent_peak_rss_mb"] = memory_mb(fleet.agent.pid, "VmHWM")
        finally:
            await bus.close()
            fleet.gateway.stop()
            fleet.agent.stop()
    report["seconds"] = round(time.perf_counter() - started, 1)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=300, help="timed requests per route")
    parser.add_argument("--warmup", type=int, default=20, help="untimed requests per route first")
    parser.add_argument("--rounds", type=int, default=5, help="rounds the routes take turns in")
    parser.add_argument(
        "--routes",
        default=",".join(ROUTES),
        help="routes of (1), comma-separated (bus, native and native_raw always): "
        + ",".join(ROUTES),
    )
    parser.add_argument("--streams", type=int, default=500, help="concurrent streams (0: none)")
    parser.add_argument("--slow", type=float, default=2.0, help="seconds the slow model waits")
    parser.add_argument("--chunks", type=int, default=4, help="pieces the slow answer streams in")
    parser.add_argument(
        "--agent-concurrency",
        type=int,
        help="replies the agent host runs at once (default: streams + 16, at least 64)",
    )
    parser.add_argument(
        "--deadline", type=float, default=300.0, help="seconds a streamed reply may take"
    )
    args = parser.parse_args()
    if args.requests < args.rounds or args.rounds < 1:
        parser.error("--requests must be at least --rounds, and --rounds at least 1")
    args.routes = {"bus", "native", "native_raw", *args.routes.split(",")}
    if not args.routes <= set(ROUTES):
        parser.error(f"--routes: unknown {', '.join(sorted(args.routes - set(ROUTES)))}")
    if args.agent_concurrency is None:
        args.agent_concurrency = max(64, args.streams + 16)
    try:
        import uvloop
    except ImportError:
        report = asyncio.run(measure(args))
    else:
        report = uvloop.run(measure(args))
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
