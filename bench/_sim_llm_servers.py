"""What ``bench/sim_llm.py`` starts and watches: its processes, the llama.cpp
servers and their counters, the slots in use over time, the fleet's micro
service counters, and the model prompts on the bus.

- :class:`Processes`: every process the benchmark starts, each in a session
  (process group) of its own, stopped at the end whatever happens;
- :class:`LlamaServer`: one ``bench/_llm_server.py`` and its Prometheus
  counters (``/metrics``: tokens generated, prompt tokens processed and
  taken from the cache, requests in the slots, requests waiting);
- :class:`Sampler`: the servers' slots in use, and the CPU time of the
  processes watched, read every ``interval`` seconds while a phase runs;
- :func:`service_stats`: the STATS documents of a NATS micro service
  (``fleetbus-models``: each model worker's requests and errors;
  ``fleetbus``: each tool worker's calls per tool);
- :class:`PromptTap`: a plain subscription on model subjects that reads
  every ``llm_prompt`` sent there (a copy: the queue group still gets it).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson
from nats.aio.client import Client
from nats.aio.msg import Msg

from fleetbus.errors import ProtocolError
from fleetbus.protocol import LlmPrompt, TextBlock, decode

TICKS = os.sysconf("SC_CLK_TCK")
STOP_TIMEOUT = 30.0
"""Seconds a process gets to stop after SIGTERM before SIGKILL."""


def cpu_seconds(pid: int) -> float | None:
    """The CPU seconds (user and system) process ``pid`` has used; ``None``
    once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / TICKS


class Processes:
    """The processes of a run, each in its own session, output in ``logs``."""

    def __init__(self, logs: Path, root: Path) -> None:
        self.logs = logs
        self.root = root
        self.started: list[tuple[str, subprocess.Popen[bytes]]] = []
        logs.mkdir(parents=True, exist_ok=True)

    def start(
        self, name: str, command: list[str], env: dict[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        """Start ``command`` (from the repository's root, ``PYTHONPATH`` its
        root); its output goes to ``logs/<name>.log``."""
        with (self.logs / f"{name}.log").open("wb") as out:
            proc = subprocess.Popen(
                command,
                cwd=self.root,
                env={**os.environ, "PYTHONPATH": str(self.root), **(env or {})},
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.started.append((name, proc))
        return proc

    def log(self, name: str) -> str:
        """What process ``name`` wrote so far."""
        try:
            return (self.logs / f"{name}.log").read_text(errors="replace")
        except OSError:
            return ""

    def stop(self, proc: subprocess.Popen[bytes]) -> None:
        """SIGTERM to its process group, SIGKILL after :data:`STOP_TIMEOUT`."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            if proc.poll() is not None:
                break
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, sig)
            try:
                proc.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                continue
        self.started = [(n, p) for n, p in self.started if p is not proc]

    def stop_all(self) -> None:
        """Stop every process still running, the last started first."""
        for _, proc in reversed(list(self.started)):
            self.stop(proc)


_METRIC = re.compile(r"^llamacpp:(\w+) ([-+0-9.eE]+)$", re.MULTILINE)
_LISTENING = re.compile(r"^LISTENING (\S+)$", re.MULTILINE)


@dataclass
class LlamaServer:
    """One llama.cpp server: its name in the report, its alias, its URL."""

    name: str
    alias: str
    proc: subprocess.Popen[bytes]
    log: str
    """Its log's name among the :class:`Processes`' logs."""
    url: str = ""
    client: httpx.AsyncClient = field(default_factory=lambda: httpx.AsyncClient(timeout=30.0))

    async def wait_listening(self, processes: Processes, timeout: float) -> None:
        """Until it prints its address (the model is loaded then).

        Raises:
            RuntimeError: it exited or did not listen within ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        while True:
            found = _LISTENING.search(processes.log(self.log))
            if found:
                self.url = found.group(1)
                return
            if self.proc.poll() is not None or time.monotonic() > deadline:
                tail = processes.log(self.log)[-600:]
                raise RuntimeError(f"llama server {self.name} did not start: {tail}")
            await asyncio.sleep(0.2)

    async def metrics(self) -> dict[str, float]:
        """Its Prometheus counters and gauges, by name (``tokens_predicted_total``…)."""
        response = await self.client.get(f"{self.url}/metrics")
        response.raise_for_status()
        return {m.group(1): float(m.group(2)) for m in _METRIC.finditer(response.text)}

    async def close(self) -> None:
        await self.client.aclose()


COUNTERS = {
    "generated_tokens": "tokens_predicted_total",
    "prompt_tokens": "prompt_tokens_total",
    "prompt_tokens_cached": "prompt_tokens_cached_total",
}
"""The counters a phase reports, by the name in the JSON line."""


def counted(before: dict[str, float], after: dict[str, float]) -> dict[str, int]:
    """What the server counted between two readings of :meth:`LlamaServer.metrics`."""
    return {k: round(after.get(m, 0.0) - before.get(m, 0.0)) for k, m in COUNTERS.items()}


@dataclass
class Sampler:
    """Reads the servers' slots in use and the watched processes' CPU time
    every ``interval`` seconds, until stopped."""

    servers: list[LlamaServer]
    slots: int
    interval: float = 1.0
    samples: list[tuple[float, list[float], list[float], float]] = field(default_factory=list)
    """(Unix time, requests in the slots per server, requests waiting per
    server, the servers' CPU seconds so far)."""
    cpu: dict[int, tuple[str, float, float]] = field(default_factory=dict)
    """pid: (its name, CPU seconds when first read, when last read)."""
    watched: dict[int, str] = field(default_factory=dict)

    def watch(self, pid: int, name: str) -> None:
        """Read ``pid``'s CPU time from now on (until it exits)."""
        self.watched[pid] = name
        self._read_cpu(pid, name)

    def cpu_of(self, pids: dict[int, str] | None = None) -> dict[str, float]:
        """CPU seconds used while watched, by name (summed over same-named
        processes), of ``pids`` or of every process watched; then forgets them."""
        chosen = pids if pids is not None else dict(self.watched)
        for pid, name in chosen.items():
            self._read_cpu(pid, name)
        out: dict[str, float] = defaultdict(float)
        for pid in chosen:
            if pid in self.cpu:
                name, first, last = self.cpu.pop(pid)
                out[name] += last - first
            self.watched.pop(pid, None)
        return {k: round(v, 2) for k, v in out.items()}

    def _read_cpu(self, pid: int, name: str) -> None:
        now = cpu_seconds(pid)
        if now is None:
            return
        first = self.cpu[pid][1] if pid in self.cpu else now
        self.cpu[pid] = (name, first, now)

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            servers = list(self.servers)  # (replaced between phases)
            try:
                readings = [await s.metrics() for s in servers]
            except (httpx.HTTPError, RuntimeError):  # (a server stopped meanwhile)
                readings = []
            if readings:
                self.samples.append(
                    (
                        time.time(),
                        [r.get("requests_processing", 0.0) for r in readings],
                        [r.get("requests_deferred", 0.0) for r in readings],
                        sum(cpu_seconds(s.proc.pid) or 0.0 for s in servers),
                    )
                )
            for pid, name in list(self.watched.items()):
                self._read_cpu(pid, name)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.interval)

    def slots_in_use(self, start: float, end: float) -> dict[str, Any]:
        """Between two Unix times: the mean share of each server's slots in
        use, the share of readings with every slot in use, requests waiting,
        and the cores the servers used."""
        window = [s for s in self.samples if start <= s[0] <= end]
        if len(window) < 2:
            return {"readings": len(window)}
        n = len(self.servers)
        busy = [_mean([s[1][i] for s in window]) / self.slots for i in range(n)]
        full = [sum(1 for s in window if s[1][i] >= self.slots) / len(window) for i in range(n)]
        waiting = [_mean([s[2][i] for s in window]) for i in range(n)]
        return {
            "readings": len(window),
            "busy_share": round(sum(busy) / n, 3),
            "busy_share_per_server": [round(b, 3) for b in busy],
            "all_slots_busy_share_per_server": [round(f, 3) for f in full],
            "waiting_mean_per_server": [round(w, 2) for w in waiting],
            "llama_servers_cores": round(
                (window[-1][3] - window[0][3]) / (window[-1][0] - window[0][0]), 2
            ),
        }


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


async def service_stats(nc: Client, service: str, timeout: float = 1.0) -> list[dict[str, Any]]:
    """The STATS documents of every instance of NATS micro service ``service``
    that answers within ``timeout`` seconds."""
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    docs: list[dict[str, Any]] = []
    try:
        await nc.publish(f"$SRV.STATS.{service}", b"", reply=inbox)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while (remaining := deadline - loop.time()) > 0:
            try:
                msg = await sub.next_msg(timeout=remaining if not docs else min(remaining, 0.3))
            except Exception:  # nats' TimeoutError: no more answers
                break
            if msg.data:  # (no responders: an empty status message)
                docs.append(orjson.loads(msg.data))
    finally:
        await sub.unsubscribe()
    return docs


def of_prefix(docs: list[dict[str, Any]], prefix: str) -> list[dict[str, Any]]:
    """The documents of the services of the fleet on ``prefix``."""
    return [d for d in docs if (d.get("metadata") or {}).get("fleetbus_prefix") == prefix]


_NAME = re.compile(r"Your name is (\S+?)\.\s*$")


@dataclass
class PromptTap:
    """Every ``llm_prompt`` sent on the subjects listened to: calls (distinct
    ``call_id``), sends (a prompt refused ``overloaded`` is sent again with
    its ``call_id``), the first calls of replies (a system prompt and one user
    message), and the agents whose system prompts name them."""

    sends: Counter[str] = field(default_factory=Counter)
    calls: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))
    first_calls: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))
    agents: dict[str, Counter[str]] = field(default_factory=lambda: defaultdict(Counter))
    """subject: agent name (from its system prompt): calls."""
    undecoded: int = 0

    async def listen(self, nc: Client, subjects: list[str]) -> list[Any]:
        """Subscribe to ``subjects``; the subscriptions (unsubscribe them at the end)."""
        return [await nc.subscribe(s, cb=self._heard) for s in subjects]

    async def _heard(self, msg: Msg) -> None:
        try:
            prompt = decode(msg.data)
        except ProtocolError:
            self.undecoded += 1
            return
        if not isinstance(prompt, LlmPrompt):
            return
        subject = msg.subject
        self.sends[subject] += 1
        call_id = prompt.call_id or ""
        if call_id in self.calls[subject]:
            return
        self.calls[subject].add(call_id)
        messages = prompt.messages
        if len(messages) == 2:
            self.first_calls[subject].add(call_id)
        system = ""
        if messages and messages[0].role == "system":
            system = "".join(b.text for b in messages[0].content if isinstance(b, TextBlock))
        named = _NAME.search(system)
        if named:
            self.agents[subject][named.group(1)] += 1

    def summary(self, subject: str) -> dict[str, int]:
        return {
            "prompts_sent": self.sends[subject],
            "calls": len(self.calls[subject]),
            "first_calls_of_replies": len(self.first_calls[subject]),
        }
