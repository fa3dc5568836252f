"""Simulations against a real nats-server, hosts and tool workers in this
process: rounds written record by record, ordered rounds, deadlines, the
environment's compare-and-set."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from fleetbus.bus import Bus, EmbeddedServer, ToolClient
from fleetbus.errors import RevisionMismatchError
from fleetbus.models.model import ModelRequest, ModelResponse, ModelStreamItem
from fleetbus.protocol import TextBlock, ToolResultBlock, ToolUseBlock, new_id
from fleetbus.sim import (
    AgentReply,
    AgentTemplate,
    AgentView,
    Environment,
    Population,
    PopulationHost,
    RoundContext,
    RunFiles,
    Simulation,
    SimulationRunner,
    SimulationToolWorker,
)


class StepModel:
    """One ReAct step a reply: ``env_add(visits)`` on the tool worker, then
    ``"<prompt> | visits=<value> | seen=<user messages in memory>"``; it waits
    the ``delay=S`` of its system prompt before answering."""

    name = "step"

    async def stream(self, request: ModelRequest) -> AsyncIterator[ModelStreamItem]:
        last = request.messages[-1]
        results = [b for b in last.content if isinstance(b, ToolResultBlock)]
        if not results:
            use = ToolUseBlock(
                id=f"c-{new_id()[:8]}", name="env_add", input={"key": "visits", "amount": 1}
            )
            yield ModelResponse([use], finish_reason="tool_calls")
            return
        system = " ".join(
            b.text for m in request.messages if m.role == "system" for b in m.content
            if isinstance(b, TextBlock)
        )  # fmt: skip
        delay = re.search(r"delay=([\d.]+)", system)
        await asyncio.sleep(float(delay.group(1)) if delay else 0.0)
        users = [m for m in request.messages if m.role == "user"]
        prompt = " ".join(b.text for b in users[-1].content if isinstance(b, TextBlock))
        value = results[0].output["value"] if isinstance(results[0].output, dict) else None
        text = f"{prompt} | visits={value} | seen={len(users)}"
        yield ModelResponse([TextBlock(text=text)], finish_reason="stop")


def simulation(
    names: Sequence[str], *, delays: dict[str, float] | None = None, **options: Any
) -> Simulation:
    rows = [{"name": n, "delay": (delays or {}).get(n, 0.0)} for n in names]
    template = AgentTemplate(system_prompt="You are {name}. delay={delay}", model=StepModel())

    def prompt(ctx: RoundContext, agent: AgentView) -> str:
        return f"round {ctx.round} for {agent.name} at {ctx.state.get('visits')}"

    async def apply(ctx: RoundContext, replies: Sequence[AgentReply]) -> dict[str, Any]:
        applied = await ctx.environment.update("rounds_applied", lambda n: n + 1)
        return {"ok": sum(r.ok for r in replies), "applied": applied.value}

    return Simulation(
        name="visits",
        population=Population.from_rows(rows, template=template),
        prompt=prompt,
        apply=apply,
        parse=lambda text: int(text.split("visits=")[1].split(" ")[0]),
        environment={"visits": 0, "rounds_applied": 0},
        record_params=("delay",),
        **options,
    )


@asynccontextmanager
async def served(url: str, prefix: str, sim: Simulation) -> AsyncIterator[None]:
    """The simulation's tool worker and one host, each on its own connection."""
    tools_bus = await Bus.connect(url, prefix=prefix, name="sim-tools")
    host_bus = await Bus.connect(url, prefix=prefix, name="sim-host")
    worker = SimulationToolWorker(tools_bus, sim, drain_timeout=2.0)
    host = PopulationHost(host_bus, sim, lease_ttl=2.0, drain_timeout=2.0, tool_wait=5.0)
    try:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(worker.run())
            tg.create_task(host.run())
            try:
                await worker.wait_ready(10)
                await host.wait_ready(10)
                yield
            finally:
                host.stop()
                worker.stop()
    finally:
        await host_bus.close()
        await tools_bus.close()


async def test_three_rounds_are_written_record_by_record(
    nats_server: EmbeddedServer, bus: Bus, prefix: str, tmp_path: Path
) -> None:
    names = ["ada", "bob", "cy", "dee"]
    sim = simulation(names, rounds=3)
    async with served(nats_server.url, prefix, sim):
        result = await SimulationRunner(bus, sim, tmp_path, concurrency=3).run()
    files = RunFiles(tmp_path)
    records = list(files.records())
    assert len(records) == 12
    for round_no in (1, 2, 3):
        mine = [r for r in records if r["round"] == round_no]
        assert [r["agent"] for r in mine] == names  # population order within a round
        for record in mine:
            assert record["status"] == "ok", record
            assert record["error"] is None
            assert record["finished_reason"] == "completed"
            assert record["params"] == {"delay": 0.0}
            assert record["latency"] > 0
            # The prompt saw the environment as the round started; the agent
            # remembers every round of the run (one session).
            expected = f"round {round_no} for {record['agent']} at {4 * (round_no - 1)}"
            assert record["answer"].startswith(expected + " | visits="), record
            assert record["answer"].endswith(f" | seen={round_no}"), record
        # Each agent's env_add ran once on the tool worker: the values it saw.
        assert sorted(r["value"] for r in mine) == list(range(4 * round_no - 3, 4 * round_no + 1))
    assert [(s.round, s.ok, s.errors, s.late, s.missing) for s in result.rounds] == [
        (1, 4, 0, 0, 0),
        (2, 4, 0, 0, 0),
        (3, 4, 0, 0, 0),
    ]
    assert [s.metrics for s in result.rounds] == [{"ok": 4, "applied": n} for n in (1, 2, 3)]
    assert files.read_snapshot(0) == {"rounds_applied": 0, "visits": 0}
    assert files.read_snapshot(3) == {"rounds_applied": 3, "visits": 12}
    state = files.load_state()
    assert state is not None
    assert (state.completed, state.records) == (3, 12)
    assert state.results_bytes == files.results.stat().st_size
    summary = files.summary.read_text()
    assert '"finished": true' in summary
    assert '"records": 12' in summary


async def test_an_ordered_round_lets_each_agent_see_the_ones_before(
    nats_server: EmbeddedServer, bus: Bus, prefix: str, tmp_path: Path
) -> None:
    seen_before: list[int] = []

    def on_reply(ctx: RoundContext, reply: AgentReply) -> None:
        seen_before.append(len(ctx.replies) - 1)

    sim = simulation(["a", "b", "c"], order="ordered", on_reply=on_reply)
    async with served(nats_server.url, prefix, sim):
        await SimulationRunner(bus, sim, tmp_path).run()
    records = list(RunFiles(tmp_path).records())
    assert [r["answer"].split(" | ")[0] for r in records] == [
        "round 1 for a at 0",
        "round 1 for b at 1",
        "round 1 for c at 2",
    ]
    assert [r["value"] for r in records] == [1, 2, 3]
    assert seen_before == [0, 1, 2]


@pytest.mark.parametrize("order", ["parallel", "ordered"])
async def test_the_deadline_cuts_late_agents_and_counts_them(
    nats_server: EmbeddedServer, bus: Bus, prefix: str, tmp_path: Path, order: str
) -> None:
    sim = simulation(["fast", "slow", "last"], delays={"slow": 30.0}, order=order)
    async with served(nats_server.url, prefix, sim):
        started = time.monotonic()
        result = await SimulationRunner(bus, sim, tmp_path, deadline=1.0).run()
        took = time.monotonic() - started
    assert took < 5.0  # not the slow agent's 30 s
    statuses = {r["agent"]: r["status"] for r in RunFiles(tmp_path).records()}
    (summary,) = result.rounds
    if order == "parallel":
        assert statuses == {"fast": "ok", "slow": "late", "last": "ok"}
        assert (summary.ok, summary.late, summary.missing) == (2, 1, 0)
    else:  # one after another: nobody is asked once the deadline passed
        assert statuses == {"fast": "ok", "slow": "late", "last": "missing"}
        assert (summary.ok, summary.late, summary.missing) == (1, 1, 1)
    late = next(r for r in RunFiles(tmp_path).records() if r["agent"] == "slow")
    assert late["error"] == "no answer within 1 s"
    assert late["answer"] is None


async def test_compare_and_set_conflicts_in_the_environment_and_its_tools(
    nats_server: EmbeddedServer, bus: Bus, prefix: str
) -> None:
    env = await Environment.open(bus, "cas")
    await env.restore({"price": 10, "stale": True})
    entry = await env.entry("price")
    assert entry.value == 10
    await env.compare_and_set("price", 11, revision=entry.revision)
    with pytest.raises(RevisionMismatchError):
        await env.compare_and_set("price", 12, revision=entry.revision)  # lost the race
    with pytest.raises(RevisionMismatchError):
        await env.compare_and_set("price", 13, revision=0)  # exists already
    await env.delete("stale")
    await env.compare_and_set("stale", "again", revision=0)  # absent again: created
    # Concurrent read-change-write loses no update.
    await asyncio.gather(*(env.update("count", lambda n: n + 1, default=0) for _ in range(20)))
    assert await env.snapshot() == {"count": 20, "price": 11, "stale": "again"}

    sim = simulation(["a"])
    sim.name = "cas"
    async with served(nats_server.url, prefix, sim):
        client = ToolClient(bus)
        got = await client.call("env_get", {"key": "price"})
        assert got.ok
        assert got.content["value"] == 11
        revision = got.content["revision"]
        ok = await client.call("env_set", {"key": "price", "value": 12, "revision": revision})
        assert ok.ok, ok
        stale = await client.call("env_set", {"key": "price", "value": 99, "revision": revision})
        assert stale.status == "error"
        assert stale.error_detail is not None
        assert "conflict: 'price' is at revision" in stale.error_detail.message
        added = await client.call("env_add", {"key": "count", "amount": 2.5})
        assert added.ok
        assert added.content["value"] == 22.5
    assert await env.get("price") == 12
