"""A simulation with a real model: ``examples/guess_two_thirds.py`` played by
agents whose model calls go through model workers to two llama.cpp servers,
against a plain client on the same servers, in one run.

In one run, over one embedded nats-server, three phases one after the
other, each on two llama.cpp servers started for it (``bench/_llm_server.py``:
Qwen2.5-Coder-1.5B-Instruct Q4_K_M, CPU only, ``--slots`` parallel slots and
``--threads`` threads each). Fresh servers per phase: the phases send the
same prompts, and servers that kept the earlier phase's prompt cache
served the next phase with 39 % of its prompt work (measured). On 2
cores one thread per server is best: 12 conversations of the plain phase
took 94 s with 1 thread each, 211 s with 2 each (4 threads on 2 cores).

1. **plain**: the requests the game's agents send (each agent's system
   prompt and round-1 prompt, the calculator tool on offer, the same
   ``max_tokens`` and temperature, streamed; the tool call answered and the
   conversation carried on as the agent does), sent with ``openai.AsyncOpenAI``
   straight to the servers, ``--slots`` conversations at a time per server,
   as many conversations as there are agents, each kept on one server
   (``bench/_sim_llm_plain.py``);
2. **sim**: ``fleetbus sim run examples/guess_two_thirds.py:simulation
   --model bus:NAME``, its host started by it, with one ``fleetbus
   model-worker --serve-as NAME --concurrency WC`` per server (the same
   name: their queue group shares the calls) and a ``fleetbus sim tools``
   worker for the calculator (started here, so that its calls can be
   counted after the round);
3. **groups**: ``bench/_sim_llm_groups.py`` (``--group-agents``, half of
   ``--agents`` by default): the same game, the population in two groups
   with a model each: group ``a`` (two thirds of the agents) ``bus:NAME-a``,
   served by a worker on server 1 only, group ``b`` ``bus:NAME-b`` by a
   worker on server 2 only. One GGUF is available offline: the two models
   are the same weights under two aliases, sampled at two temperatures
   (``--temperature-a`` 0, ``--temperature-b`` 1). A listener on the bus
   reads whose prompt every model call carries (the groups' system prompts
   end with the agent's name).

Measured by the servers themselves (their Prometheus ``/metrics``: tokens
generated, prompt tokens processed, prompt tokens found in the cache),
read before and after each phase: tokens a second over the phase's wall
time (the plain client's, the simulation's rounds'), and sim/plain
(``sim_vs_plain``; target >= 0.9 for generated tokens a second). The plain
and sim phases decode greedily (``--temperature`` 0) so that both do about
the same work; the answers still differ a little (batches change the
arithmetic), so the line also gives the same job's speed (plain seconds /
sim seconds), all tokens (prompt and generated) a second, and the servers'
CPU. Also: each server's share of the tokens and of the calls (the model
workers' micro service counters: prompts, answered, refused or failed); the
share of the slots in use, read every second (``requests_processing`` /
slots), and the requests waiting in a server's queue; the CPU used by the
servers, by fleetbus's processes, and by the rest of the machine (other
benchmarks: read ``others_cores`` before trusting a ratio). For the
simulation: answered and lost per round (late, missing), errors (failed
replies by kind, answers without a number), guesses read, calculator calls
run (the tool worker's counters), seconds per round; for each group: its
replies, guesses read, and the model server its calls reached.

A model worker runs at most ``--concurrency`` calls (the server's slots by
default); a call that finds them all taken waits for a place in a queue as
deep (``ModelWorker``'s ``queue``), and one that finds the queue full too is
refused with ``overloaded`` and ``retry_after``, which the agent's
``BusChatModel`` sends again after about that long until the call's
timeout, without using up ``--model-retries`` (fleetbus's default, 2).
``--worker-concurrency`` above the slots lets the servers queue the calls
instead.

Prints one JSON line (``--results FILE`` appends it there too), progress on
stderr. About 15 minutes with the defaults on a quiet 2-core machine (50
agents, 1 round, 4 slots per server: 5 minutes a phase, 4 for the groups);
needs ``/work/shared/local-llm/setup.sh`` run once (the xllamacpp venv and
the GGUF under ``~/.cache/fleetbus-llm``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any, cast

import nats
from _results import commit, emit, head
from _sim_llm_groups import example
from _sim_llm_plain import Conversation, converse_all
from _sim_llm_servers import (
    LlamaServer,
    Processes,
    PromptTap,
    Sampler,
    counted,
    cpu_seconds,
    of_prefix,
    service_stats,
)
from nats.aio.client import Client

from fleetbus.bus import EmbeddedServer
from fleetbus.sim import AgentView, Environment, RoundContext
from fleetbus.sim.processes import server_threads

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
CACHE = Path(os.environ.get("FLEETBUS_LLM_CACHE", Path.home() / ".cache" / "fleetbus-llm"))
LLM_PYTHON = CACHE / "venv" / "bin" / "python"
GGUF = CACHE / "models" / "qwen2.5-coder-1.5b-instruct.gguf"
EXAMPLE_SPEC = f"{ROOT / 'examples' / 'guess_two_thirds.py'}:simulation"
GROUPS_SPEC = f"{HERE / '_sim_llm_groups.py'}:simulation"
TICKS = os.sysconf("SC_CLK_TCK")
READY_TIMEOUT = 300.0


def progress(line: str) -> None:
    """A line on stderr (the JSON line is stdout's)."""
    print(f"{time.strftime('%H:%M:%S')} {line}", file=sys.stderr, flush=True)


def machine_busy_ticks() -> int:
    """Clock ticks every CPU of the machine spent not idle (``/proc/stat``)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    return sum(fields) - fields[3] - fields[4]


@dataclass
class Worker:
    """A model worker of a phase: its id, its server, the name it serves."""

    worker_id: str
    server: LlamaServer
    serve_as: str
    temperature: float | None = None


@dataclass
class Phase:
    """What a phase runs and what it has started."""

    label: str
    prefix: str
    spec: str
    workers: list[Worker]
    model: str | None
    env: dict[str, str]
    agents: int


class Bench:
    """One run: the servers, the processes, the counters."""

    def __init__(self, args: argparse.Namespace, run_dir: Path) -> None:
        self.args = args
        self.run_dir = run_dir
        self.procs = Processes(run_dir / "logs", ROOT)
        self.servers: list[LlamaServer] = []
        self.nats_url = ""
        self.nats_pid = 0
        self.nc: Client | None = None
        self.sampler: Sampler | None = None

    # -- the servers ---------------------------------------------------------------

    async def start_servers(self, phase: str) -> None:
        """Two llama servers, started for ``phase``: the servers of the phase
        before are stopped first, so that each phase starts with empty
        caches (the prompts of one phase are the next one's: a server that
        kept them would answer the second phase from its prompt cache)."""
        args = self.args
        for server in self.servers:
            self.procs.stop(server.proc)
            await server.close()
        self.servers = []
        for i in (1, 2):
            name, alias = f"server-{i}", f"{args.name}-s{i}"
            command = [
                str(LLM_PYTHON), str(HERE / "_llm_server.py"), str(GGUF),
                "--alias", alias,
                "--parallel", str(args.slots),
                "--threads", str(args.threads),
                "--ctx-per-slot", str(args.ctx_per_slot),
            ]  # fmt: skip
            log = f"{phase}-{name}"
            self.servers.append(LlamaServer(name, alias, self.procs.start(log, command), log))
        await asyncio.gather(*(s.wait_listening(self.procs, READY_TIMEOUT) for s in self.servers))
        if self.sampler is not None:
            self.sampler.servers = self.servers
        progress(f"llama servers of {phase}: {', '.join(s.url for s in self.servers)}")

    async def readings(self) -> list[dict[str, float]]:
        return [await s.metrics() for s in self.servers]

    def llama_cpu(self) -> float:
        return sum(cpu_seconds(s.proc.pid) or 0.0 for s in self.servers)

    def tokens(
        self, before: list[dict[str, float]], after: list[dict[str, float]], seconds: float
    ) -> dict[str, Any]:
        """Each server's counts, their sums, and tokens a second over ``seconds``."""
        per = {s.name: counted(b, a) for s, b, a in zip(self.servers, before, after, strict=True)}
        total = {k: sum(p[k] for p in per.values()) for k in next(iter(per.values()))}
        return {
            "per_server": per,
            **total,
            "generated_tokens_per_s": round(total["generated_tokens"] / seconds, 2),
            "prompt_tokens_per_s": round(total["prompt_tokens"] / seconds, 2),
            "tokens_per_s": round(
                (total["prompt_tokens"] + total["generated_tokens"]) / seconds, 2
            ),
            "generated_share_per_server": {
                name: round(p["generated_tokens"] / max(1, total["generated_tokens"]), 3)
                for name, p in per.items()
            },
        }

    def cpu(
        self, llama_before: float, busy_before: int, seconds: float, own: float
    ) -> dict[str, Any]:
        """Cores used over the phase: the llama servers, fleetbus's processes
        (``own``: CPU seconds), everything else on the machine."""
        llama = self.llama_cpu() - llama_before
        busy = (machine_busy_ticks() - busy_before) / TICKS
        return {
            "llama_servers_cores": round(llama / seconds, 2),
            "fleetbus_and_client_cores": round(own / seconds, 2),
            "others_cores": round(max(0.0, busy - llama - own) / seconds, 2),
            "machine_busy_cores": round(busy / seconds, 2),
        }

    # -- phase 1: the plain client -------------------------------------------------------

    def conversations(self) -> list[Conversation]:
        """Round 1 of the game as each agent gets it with a real model."""
        args = self.args
        ex = example()
        population = ex.simulation(args.agents, args.rounds).population
        ctx = RoundContext(
            round=1, rounds=args.rounds, environment=cast(Environment, None), state={}
        )
        saved = os.environ.get("FLEETBUS_MODEL")
        os.environ["FLEETBUS_MODEL"] = f"bus:{args.name}"  # the example's real-model prompt
        try:
            out = []
            for i, name in enumerate(population):
                params = population.params_at(i)
                system = population.system_prompt(name, params, index=i)
                user = ex.prompt(ctx, AgentView(name, i, params))
                out.append(Conversation(name, system, user))
        finally:
            if saved is None:
                del os.environ["FLEETBUS_MODEL"]
            else:
                os.environ["FLEETBUS_MODEL"] = saved
        return out

    async def plain(self) -> dict[str, Any]:
        args = self.args
        conversations = self.conversations()
        progress(
            f"plain client: {len(conversations)} conversations, {args.slots} per server at once"
        )
        before, llama_before, busy_before = (
            await self.readings(),
            self.llama_cpu(),
            machine_busy_ticks(),
        )
        own_before = time.process_time()
        start = time.time()
        seconds, outcomes = await converse_all(
            self.servers,
            conversations,
            slots=args.slots,
            parse=example().parse,
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            timeout=args.timeout,
        )
        end = time.time()
        after = await self.readings()
        own = time.process_time() - own_before
        assert self.sampler is not None
        calls = Counter[str]()
        for o in outcomes:
            calls[o.server] += o.calls
        figures = {
            "seconds": round(seconds, 1),
            "conversations": len(outcomes),
            "model_calls": sum(o.calls for o in outcomes),
            "calls_share_per_server": {
                s.name: round(calls[s.name] / max(1, sum(calls.values())), 3) for s in self.servers
            },
            "tool_calls": sum(o.tool_calls for o in outcomes),
            "guesses_read": sum(1 for o in outcomes if o.value is not None),
            "errors": sum(1 for o in outcomes if o.error is not None),
            "calls_sent_again_after_a_closed_connection": sum(o.reconnects for o in outcomes),
            "error_examples": [o.error for o in outcomes if o.error][:3],
            "usage_completion_tokens": sum(o.completion_tokens for o in outcomes),
            **self.tokens(before, after, seconds),
            "slots": self.sampler.slots_in_use(start, end),
            "cpu": self.cpu(llama_before, busy_before, seconds, own),
        }
        progress(
            f"plain: {seconds:.1f} s, {figures['generated_tokens_per_s']} generated tokens/s, "
            f"slots in use {figures['slots'].get('busy_share')}"
        )
        return figures

    # -- phases 2 and 3: the simulation ----------------------------------------------------

    async def start_phase(self, phase: Phase) -> list[subprocess.Popen[bytes]]:
        """Its model workers and its tool worker, once they serve."""
        args = self.args
        started = []
        for w in phase.workers:
            command = [
                sys.executable, "-m", "fleetbus", "model-worker",
                "--model", f"openai:{w.server.alias}",
                "--serve-as", w.serve_as,
                "--model-base-url", f"{w.server.url}/v1",
                "--concurrency", str(args.worker_concurrency or args.slots),
                "--nats", self.nats_url, "--prefix", phase.prefix,
                "--worker-id", w.worker_id,
                "--model-timeout", str(args.timeout),
                "--model-max-tokens", str(args.max_tokens),
            ]  # fmt: skip
            if w.temperature is not None:
                command += ["--model-temperature", str(w.temperature)]
            started.append(self.procs.start(w.worker_id, command))
        tools_id = f"tools-{phase.label}"
        command = [
            sys.executable, "-m", "fleetbus", "sim", "tools", phase.spec,
            "--agents", str(phase.agents), "--nats", self.nats_url, "--prefix", phase.prefix,
            "--worker-id", tools_id,
        ]  # fmt: skip
        started.append(self.procs.start(tools_id, command, env=phase.env))
        assert self.nc is not None
        deadline = time.monotonic() + READY_TIMEOUT
        wanted_order = [w.worker_id for w in phase.workers]
        wanted = set(wanted_order)
        while True:
            models = of_prefix(await service_stats(self.nc, "fleetbus-models"), phase.prefix)
            tools = of_prefix(await service_stats(self.nc, "fleetbus"), phase.prefix)
            found = {d["metadata"].get("worker_id") for d in models}
            if wanted <= found and tools:
                return started
            for name, proc in zip([*wanted_order, tools_id], started, strict=True):
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited: {self.procs.log(name)[-600:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the workers of {phase.label} did not start")
            await asyncio.sleep(0.5)

    def sim_command(self, phase: Phase, out: Path) -> list[str]:
        args = self.args
        command = [
            sys.executable, "-m", "fleetbus", "sim", "run", phase.spec,
            "--agents", str(phase.agents), "--rounds", str(args.rounds),
            "--nats", self.nats_url, "--prefix", phase.prefix, "--out", str(out),
            "--concurrency", str(max(phase.agents, 1)),
            "--hosts", str(args.hosts), "--host-concurrency", str(args.host_concurrency),
            "--tool-workers", "0",
            "--deadline", str(args.deadline),
            "--model-max-tokens", str(args.max_tokens),
            "--model-timeout", str(args.timeout),
            "--model-retries", str(args.model_retries),
        ]  # fmt: skip
        if phase.model is not None:
            command += ["--model", phase.model]
            if args.temperature is not None:
                command += ["--model-temperature", str(args.temperature)]
        return command

    async def simulate(self, phase: Phase) -> dict[str, Any]:
        """Run the phase's simulation; its figures."""
        args = self.args
        assert self.nc is not None
        assert self.sampler is not None
        sampler = self.sampler
        workers = await self.start_phase(phase)
        tap = PromptTap()
        names = sorted({w.serve_as for w in phase.workers})
        subs = await tap.listen(self.nc, [f"{phase.prefix}.model.{n}" for n in names])
        out = self.run_dir / phase.label
        watched = {
            p.pid: n
            for p, n in zip(workers, [*(w.worker_id for w in phase.workers), "tools"], strict=True)
        }
        watched[self.nats_pid] = "nats-server"
        for pid, name in watched.items():
            sampler.watch(pid, name)
        before, llama_before, busy_before = (
            await self.readings(),
            self.llama_cpu(),
            machine_busy_ticks(),
        )
        started = time.time()
        command = self.sim_command(phase, out)
        progress(f"{phase.label}: {' '.join(command[2:])}")
        runner = self.procs.start(f"sim-{phase.label}", command, env=phase.env)
        watched[runner.pid] = "sim-runner"
        sampler.watch(runner.pid, "sim-runner")
        limit = time.monotonic() + args.deadline * args.rounds + READY_TIMEOUT
        while runner.poll() is None:
            with contextlib.suppress(OSError, ValueError):
                children = json.loads((out / "logs" / "children.json").read_text())
                for name, pid in children.items():
                    if pid not in watched:
                        watched[pid] = name.rsplit("-", 1)[0]
                        sampler.watch(pid, watched[pid])
            if time.monotonic() > limit:
                raise RuntimeError(f"{phase.label}: the simulation did not finish")
            await asyncio.sleep(0.5)
        ended = time.time()
        after = await self.readings()
        if runner.returncode != 0:
            raise RuntimeError(
                f"{phase.label}: sim run exited {runner.returncode}: "
                f"{self.procs.log(f'sim-{phase.label}')[-1500:]}"
            )
        model_docs = of_prefix(await service_stats(self.nc, "fleetbus-models"), phase.prefix)
        tool_docs = of_prefix(await service_stats(self.nc, "fleetbus"), phase.prefix)
        own = sampler.cpu_of(watched)
        for sub in subs:
            await sub.unsubscribe()
        for proc in workers:
            self.procs.stop(proc)
        summary = json.loads((out / "summary.json").read_text())
        records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
        rounds = summary["per_round"]
        first = rounds[0]["started_at"]
        last_end = rounds[-1]["started_at"] + rounds[-1]["duration"]
        seconds = sum(r["duration"] for r in rounds)
        answered = {d["metadata"]["worker_id"]: _answered(d["endpoints"][0]) for d in model_docs}
        server_of = {w.worker_id: w.server.name for w in phase.workers}
        calls_per_server = Counter[str]()
        for worker_id, figures in answered.items():
            calls_per_server[server_of[worker_id]] += figures["answered"]
        figures = {
            "seconds": round(seconds, 1),
            "wall_s_with_start_and_stop": round(ended - started, 1),
            "rounds": [_round(r) for r in rounds],
            **_replies(records),
            "tool_calls": _tool_calls(tool_docs),
            "model_workers": {
                worker_id: {"server": server_of[worker_id], **f}
                for worker_id, f in answered.items()
            },
            "model_calls": sum(calls_per_server.values()),
            "prompts_refused_or_failed": sum(f["errors"] for f in answered.values()),
            "calls_share_per_server": {
                s.name: round(calls_per_server[s.name] / max(1, sum(calls_per_server.values())), 3)
                for s in self.servers
            },
            "bus": {f"bus:{n}": tap.summary(f"{phase.prefix}.model.{n}") for n in names},
            **self.tokens(before, after, seconds),
            "slots": sampler.slots_in_use(first, last_end),
            "cpu": self.cpu(llama_before, busy_before, ended - started, sum(own.values())),
            "fleetbus_cpu_s": own,
        }
        if args.keep is not None:
            figures["dir"] = str(out)
        if phase.label == "groups":
            figures["groups"] = _groups(records, tap, phase, figures)
        progress(
            f"{phase.label}: {seconds:.1f} s, {figures['generated_tokens_per_s']} generated "
            f"tokens/s, slots in use {figures['slots'].get('busy_share')}, "
            f"{figures['guesses_read']} guesses read of {phase.agents * args.rounds}"
        )
        return figures

    async def measure(self) -> dict[str, Any]:
        args = self.args
        phases = set(args.phases.split(","))
        base = f"llm{uuid.uuid4().hex[:6]}"
        out: dict[str, Any] = {}
        with EmbeddedServer(sync_interval=1.0, threads=server_threads()) as server:
            self.nats_url, self.nats_pid = server.url, server.pid or 0
            self.nc = await nats.connect(server.url)
            stop = asyncio.Event()
            try:
                self.sampler = Sampler([], args.slots, interval=args.sample_interval)
                async with asyncio.TaskGroup() as tg:
                    tg.create_task(self.sampler.run(stop))
                    try:
                        if "plain" in phases:
                            await self.start_servers("plain")
                            out["plain"] = await self.plain()
                        if "sim" in phases:
                            await self.start_servers("sim")
                            workers = [
                                Worker(f"mw-{i + 1}", s, args.name)
                                for i, s in enumerate(self.servers)
                            ]
                            model = f"bus:{args.name}"
                            phase = Phase(
                                "sim", f"{base}s", EXAMPLE_SPEC, workers, model, {}, args.agents
                            )
                            out["sim"] = await self.simulate(phase)
                        if "groups" in phases:
                            await self.start_servers("groups")
                            a, b = f"{args.name}-a", f"{args.name}-b"
                            workers = [
                                Worker("mw-a", self.servers[0], a, args.temperature_a),
                                Worker("mw-b", self.servers[1], b, args.temperature_b),
                            ]
                            env = {"SIM_LLM_MODEL_A": f"bus:{a}", "SIM_LLM_MODEL_B": f"bus:{b}"}
                            size = args.group_agents or max(1, args.agents // 2)
                            phase = Phase(
                                "groups", f"{base}g", GROUPS_SPEC, workers, None, env, size
                            )
                            out["groups"] = await self.simulate(phase)
                    finally:
                        stop.set()
            finally:
                await self.nc.close()
                self.procs.stop_all()
                for s in self.servers:
                    await s.close()
        return out


def _answered(endpoint: dict[str, Any]) -> dict[str, Any]:
    """A model worker's counters: prompts it got, answered, refused or failed."""
    requests, errors = endpoint["num_requests"], endpoint["num_errors"]
    return {
        "prompts": requests,
        "answered": requests - errors,
        "errors": errors,
        "last_error": (endpoint.get("last_error") or "")[:200],
    }


def _round(r: dict[str, Any]) -> dict[str, Any]:
    return {
        "round": r["round"],
        "s": r["duration"],
        "answered": r["ok"] + r["errors"],
        "ok": r["ok"],
        "errors": r["errors"],
        "lost": r["late"] + r["missing"],
        "late": r["late"],
        "missing": r["missing"],
        "metrics": r["metrics"],
    }


def _kind(error: str | None, answer: str | None) -> str:
    """What went wrong with a reply, in a word."""
    text = f"{error or ''} {answer or ''}"
    if "could not be read" in text:
        return "no_number_in_answer"
    if "tool-call text format" in text:
        return "tool_call_format"
    if "overloaded" in text or "busy" in text:
        return "model_busy"
    if "did not answer within" in text or "timeout" in text:
        return "model_timeout"
    return "other"


def _replies(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Replies, losses, errors and guesses in a run's records."""
    status = Counter(r["status"] for r in records)
    errors = [r for r in records if r["status"] == "error"]
    values = [r["value"] for r in records if r["value"] is not None]
    return {
        "replies": len(records),
        "answered": status["ok"] + status["error"],
        "lost": status["late"] + status["missing"],
        "errors": status["error"],
        "errors_by_kind": dict(Counter(_kind(r["error"], r["answer"]) for r in errors)),
        "error_examples": [
            f"{r['agent']}: {r['error']}: {(r['answer'] or '')[:160]}" for r in errors[:3]
        ],
        "guesses_read": len(values),
        "guesses_not_read": status["ok"] + status["error"] - len(values),
        "latency_s_median": _median([r["latency"] for r in records if r["latency"] is not None]),
    }


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 1) if values else None


def _tool_calls(docs: list[dict[str, Any]]) -> dict[str, int]:
    out: Counter[str] = Counter()
    for doc in docs:
        for endpoint in doc.get("endpoints", []):
            if endpoint["name"] == "calculator":
                out["calculator"] += endpoint["num_requests"]
                out["calculator_errors"] += endpoint["num_errors"]
    return dict(out)


def _groups(
    records: list[dict[str, Any]], tap: PromptTap, phase: Phase, figures: dict[str, Any]
) -> dict[str, Any]:
    """Per group: its replies and guesses, and where its model calls went."""
    out: dict[str, Any] = {}
    seen_on = {
        w.serve_as: set(tap.agents[f"{phase.prefix}.model.{w.serve_as}"]) for w in phase.workers
    }
    for label, w in zip(("a", "b"), phase.workers, strict=True):
        mine = [r for r in records if r["params"]["group"] == label]
        agents = {r["agent"] for r in mine}
        values = [r["value"] for r in mine if r["value"] is not None]
        subject = f"{phase.prefix}.model.{w.serve_as}"
        elsewhere = sum(len(agents & s) for n, s in seen_on.items() if n != w.serve_as)
        out[label] = {
            "model": f"bus:{w.serve_as}",
            "served_by": f"{w.worker_id} -> {w.server.name} (alias {w.server.alias})",
            "temperature": w.temperature,
            **_replies(mine),
            "guess_mean": round(statistics.fmean(values), 2) if values else None,
            "guess_stdev": round(statistics.stdev(values), 2) if len(values) > 1 else None,
            "agents_whose_calls_reached_it": len(agents & seen_on[w.serve_as]),
            "agents_of_other_groups_on_it": len(seen_on[w.serve_as] - agents),
            "agents_whose_calls_went_elsewhere": elsewhere,
            "model_calls_sent": sum(tap.agents[subject].values()),
            "calls_answered_by_its_worker": figures["model_workers"][w.worker_id]["answered"],
            "its_server_counted": figures["per_server"][w.server.name],
        }
    out["verified"] = all(
        out[g]["agents_of_other_groups_on_it"] == 0
        and out[g]["agents_whose_calls_went_elsewhere"] == 0
        and out[g]["agents_whose_calls_reached_it"] == out[g]["replies"]
        for g in ("a", "b")
    )
    return out


def _stop_on_sigterm() -> None:
    """SIGTERM ends the run as Ctrl-C does: every process started is stopped."""

    def handler(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agents", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument(
        "--group-agents", type=int, help="agents of the groups phase (default: half of --agents)"
    )
    parser.add_argument("--slots", type=int, default=4, help="parallel slots per llama server")
    parser.add_argument("--threads", type=int, default=1, help="threads per llama server")
    parser.add_argument("--ctx-per-slot", type=int, default=4096)
    parser.add_argument("--max-tokens", type=int, default=160, help="tokens per model answer")
    parser.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="of plain and sim (default 0: greedy, both phases get the same answers)",
    )
    parser.add_argument("--temperature-a", type=float, default=0.0, help="group a's model")
    parser.add_argument("--temperature-b", type=float, default=1.0, help="group b's model")
    parser.add_argument(
        "--worker-concurrency", type=int, help="calls per model worker (default: --slots)"
    )
    parser.add_argument("--model-retries", type=int, default=2)
    parser.add_argument("--hosts", type=int, default=1, help="host processes of the simulation")
    parser.add_argument("--host-concurrency", type=int, default=64)
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per model call")
    parser.add_argument("--deadline", type=float, default=3600.0, help="seconds per round")
    parser.add_argument("--name", default="qwen", help="the model's name on the bus")
    parser.add_argument("--phases", default="plain,sim,groups")
    parser.add_argument("--sample-interval", type=float, default=1.0)
    parser.add_argument("--keep", type=Path, help="keep the runs' files and logs in this directory")
    parser.add_argument("--results", type=Path, help="append the JSON line to this file too")
    args = parser.parse_args()
    if not LLM_PYTHON.exists() or not GGUF.exists():
        sys.exit(f"no {LLM_PYTHON} or {GGUF}: run /work/shared/local-llm/setup.sh first")
    first = head(commit=commit(watched=("fleetbus", "examples")), bench="sim_llm")
    _stop_on_sigterm()
    run_dir = args.keep or Path(tempfile.mkdtemp(prefix="sim-llm-"))
    run_dir.mkdir(parents=True, exist_ok=True)
    progress(f"files and logs in {run_dir}")
    started = time.perf_counter()
    try:
        figures = asyncio.run(Bench(args, run_dir).measure())
    finally:
        if args.keep is None:
            shutil.rmtree(run_dir, ignore_errors=True)
    line: dict[str, Any] = {
        **first,
        "model": f"{GGUF.stem} Q4_K_M, llama.cpp (xllamacpp), CPU",
        "servers": 2,
        "slots": args.slots,
        "threads": args.threads,
        "agents": args.agents,
        "group_agents": args.group_agents or max(1, args.agents // 2),
        "rounds": args.rounds,
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "worker_concurrency": args.worker_concurrency or args.slots,
        "host_concurrency": args.host_concurrency,
        "model_retries": args.model_retries,
        "command": " ".join(["python", "bench/sim_llm.py", *sys.argv[1:]]),
    }
    if "plain" in figures and "sim" in figures:
        plain, sim = figures["plain"], figures["sim"]
        ratio = sim["generated_tokens_per_s"] / max(1e-9, plain["generated_tokens_per_s"])
        line["sim_vs_plain"] = {
            "generated_tokens_per_s": round(ratio, 3),
            "same_job_speed": round(plain["seconds"] / max(1e-9, sim["seconds"]), 3),
            "prompt_tokens_per_s": round(
                sim["prompt_tokens_per_s"] / max(1e-9, plain["prompt_tokens_per_s"]), 3
            ),
            "tokens_per_s": round(sim["tokens_per_s"] / max(1e-9, plain["tokens_per_s"]), 3),
            "llama_servers_cores": round(
                sim["cpu"]["llama_servers_cores"] / max(1e-9, plain["cpu"]["llama_servers_cores"]),
                3,
            ),
            "slots_busy_share": round(
                sim["slots"].get("busy_share", 0.0)
                / max(1e-9, plain["slots"].get("busy_share", 1.0)),
                3,
            ),
            "target_0_9_met": ratio >= 0.9,
        }
    line.update(figures)
    line["seconds"] = round(time.perf_counter() - started, 1)
    line["note"] = (
        "One GGUF offline: the groups' two models are the same weights under two aliases "
        "on two servers, sampled at two temperatures. Tokens are the servers' own counters "
        "(/metrics); a phase's tokens/s is over its wall time (the rounds' for the simulation)."
    )
    emit(line, args.results)


if __name__ == "__main__":
    main()
