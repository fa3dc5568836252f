"""The rounds of a simulation: ask every agent, gather, apply, go on.

:class:`SimulationRunner` drives a :class:`~fleetbus.sim.Simulation` whose
agents are served on the bus (by :class:`~fleetbus.sim.PopulationHost`
processes). Each round it sends every agent its prompt — a ``user_request``
to ``<prefix>.agent.<name>.inbox`` in the agent's session of the run, so an
agent remembers the earlier rounds — with up to ``concurrency`` requests in
flight, or one agent after another in an ordered round. It never waits past
the round's deadline: an agent not answered by then is ``late`` (its reply is
cancelled), one not asked by then is ``missing``. Then the simulation's
``apply`` sees every reply and changes the environment, and the round is
written (:class:`~fleetbus.sim.results.RunFiles`) before the next starts.

A runner that starts on a directory holding an unfinished run resumes it:
the records of the unfinished round are dropped, the environment is restored
from the snapshot of the last finished round, and the run goes on from the
next round in the same sessions. An agent's request of a round carries the
same ``call_id`` each time it is asked, so an agent asked the unfinished
round again drops its earlier attempt at it and answers anew against the
restored environment, keeping one copy of the round in its memory (those
requests ask for no receipt: see docs/protocol.md, ``user_request``).

Every other request asks for a receipt, and is sent again while none came
(after a quarter of the deadline, at least 3 s, then twice as long each
time; sooner once requests sent well after it have had their receipts, or
once receipts stop after later ones had theirs or after it was sent last):
a host replica that dies with requests it had queued, not taken yet, loses
none of them; another replica answers each once.

Requests go through :meth:`Bus.request <fleetbus.bus.Bus.request>` on the
connection's shared reply subscription: one future per request, no
subscription, no task of its own.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import Awaitable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from fleetbus.bus import RESEND_AFTER, Bus
from fleetbus.errors import (
    BusError,
    CallTimeoutError,
    ConfigError,
    ConnectionClosedError,
    NoRespondersError,
)
from fleetbus.protocol import (
    Cancel,
    ContentBlock,
    ErrorMessage,
    FinalAnswer,
    TextBlock,
    UserRequest,
    new_id,
)
from fleetbus.sim.environment import Environment
from fleetbus.sim.results import RoundSummary, RunFiles, RunState
from fleetbus.sim.simulation import AgentReply, AgentView, RoundContext, Simulation

__all__ = ["RunListener", "RunResult", "SimulationRunner"]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

DEFAULT_CONCURRENCY = 1000
"""Requests in flight by default."""


class RunListener:
    """Hears how a run goes (the CLI draws its progress bar from it).
    Override what you need; every method does nothing here."""

    def run_started(self, state: RunState, rounds: int) -> None:
        """The run starts (or resumes: ``state.completed`` rounds are done)."""

    def round_started(self, round_no: int, rounds: int, agents: int) -> None:
        """A round starts."""

    def replied(self, reply: AgentReply) -> None:
        """An agent's round ended (any status)."""

    def round_finished(self, summary: RoundSummary) -> None:
        """A round is written."""


@dataclass(slots=True)
class RunResult:
    """What a run did.

    Attributes:
        out: its directory.
        state: its state at the end.
        resumed_from: the rounds already finished when this run started.
    """

    out: Path
    state: RunState
    resumed_from: int

    @property
    def rounds(self) -> list[RoundSummary]:
        """Every finished round's summary."""
        return self.state.rounds


class SimulationRunner:
    """Runs a simulation's rounds against agents served on the bus.

    Args:
        bus: the connection.
        simulation: what to run.
        out: the run's directory (results, summary, snapshots, state).
        rounds: how many rounds in all; the simulation's by default.
        deadline: seconds each round may take; the simulation's by default.
        concurrency: requests in flight at most (parallel rounds).
        listener: hears the progress.

    Raises:
        ConfigError: ``concurrency`` or ``deadline`` is not positive.
    """

    def __init__(
        self,
        bus: Bus,
        simulation: Simulation,
        out: str | Path,
        *,
        rounds: int | None = None,
        deadline: float | None = None,
        concurrency: int = DEFAULT_CONCURRENCY,
        listener: RunListener | None = None,
    ) -> None:
        if concurrency < 1:
            raise ConfigError(f"concurrency must be at least 1, not {concurrency}")
        if deadline is not None and not deadline > 0:
            raise ConfigError(f"the deadline must be positive, not {deadline}")
        self.bus = bus
        self.simulation = simulation
        self.files = RunFiles(out)
        self.rounds = simulation.rounds if rounds is None else rounds
        self.deadline = simulation.deadline if deadline is None else deadline
        self.concurrency = concurrency
        self.listener = listener or RunListener()
        self.sender = f"sim.{simulation.name}"
        self.environment: Environment | None = None
        self._state: RunState | None = None
        self._asked_again: int | None = None
        """The round a resumed run asks again (its requests ask no receipt)."""

    # -- the run -------------------------------------------------------------------

    async def run(self) -> RunResult:
        """Run (or resume) until every round is finished.

        Raises:
            ConfigError: the directory holds another simulation's run, or its
                files cannot be read or written.
            StoreError: the environment cannot be read or written.
            ConnectionClosedError: the bus closed.
        """
        sim = self.simulation
        self.files.prepare()
        environment = await Environment.open(self.bus, sim.name)
        self.environment = environment
        state = self.files.load_state()
        if state is None:
            state = RunState(
                simulation=sim.name,
                run_id=new_id()[:16],
                agents=len(sim.population),
                started_at=time.time(),
            )
            self.files.truncate_results(0)
            await environment.restore(sim.environment)
            self.files.write_snapshot(0, await environment.snapshot())
            self.files.save_state(state)
        else:
            self._check_same_run(state)
            self.files.truncate_results(state.results_bytes)
            await environment.restore(self.files.read_snapshot(state.completed))
            logger.info("resuming %s after round %d of %d", sim.name, state.completed, self.rounds)
            self._asked_again = state.completed + 1
        self._state = state
        resumed_from = state.completed
        self.files.write_summary(self._summary(state))
        self.listener.run_started(state, self.rounds)
        for round_no in range(state.completed + 1, self.rounds + 1):
            await self._round(state, environment, round_no)
        return RunResult(self.files.out, state, resumed_from)

    def _check_same_run(self, state: RunState) -> None:
        sim = self.simulation
        if state.simulation != sim.name or state.agents != len(sim.population):
            raise ConfigError(
                f"{self.files.out} holds a run of {state.simulation!r} with {state.agents} "
                f"agents, not of {sim.name!r} with {len(sim.population)}: "
                "give another --out to start a new run"
            )

    async def _round(self, state: RunState, environment: Environment, round_no: int) -> None:
        sim = self.simulation
        agents = len(sim.population)
        started_at = time.time()
        loop = asyncio.get_running_loop()
        started = loop.time()
        deadline = started + self.deadline
        ctx = RoundContext(
            round=round_no,
            rounds=self.rounds,
            environment=environment,
            state=await environment.snapshot(),
            history=list(state.rounds),
        )
        self.listener.round_started(round_no, self.rounds, agents)
        replies: list[AgentReply | None] = [None] * agents
        if sim.order == "ordered":
            await self._ordered(ctx, replies, deadline)
        else:
            await self._parallel(ctx, replies, deadline)
        gathered = [r for r in replies if r is not None]
        assert len(gathered) == agents
        await self._cancel_late(state, [r for r in gathered if r.status == "late"])
        ctx.replies = gathered
        metrics: dict[str, Any] = {}
        if sim.apply is not None:
            outcome = sim.apply(ctx, gathered)
            applied = await outcome if inspect.isawaitable(outcome) else outcome
            metrics = dict(applied or {})
        counts = {status: 0 for status in ("ok", "error", "late", "missing")}
        for reply in gathered:
            counts[reply.status] += 1
        size, count = self.files.append_records(self._record(round_no, r) for r in gathered)
        self.files.write_snapshot(round_no, await environment.snapshot())
        duration = loop.time() - started
        answered = counts["ok"] + counts["error"]
        summary = RoundSummary(
            round=round_no,
            agents=agents,
            ok=counts["ok"],
            errors=counts["error"],
            late=counts["late"],
            missing=counts["missing"],
            duration=round(duration, 3),
            rate=round(answered / duration, 1) if duration > 0 else 0.0,
            metrics=metrics,
            started_at=started_at,
        )
        state.completed = round_no
        state.results_bytes = size
        state.records += count
        state.rounds.append(summary)
        self.files.save_state(state)  # the round is finished from here on
        self.files.write_summary(self._summary(state))
        self.listener.round_finished(summary)

    async def _parallel(
        self, ctx: RoundContext, replies: list[AgentReply | None], deadline: float
    ) -> None:
        """Every agent at once, ``concurrency`` requests in flight."""
        todo: Iterator[tuple[int, str]] = enumerate(self.simulation.population)

        async def asker() -> None:
            for index, name in todo:  # shared: each asker takes the next agent
                reply = await self._ask(ctx, index, name, deadline)
                replies[index] = reply
                await self._heard(ctx, reply)

        async with asyncio.TaskGroup() as tg:
            for _ in range(min(self.concurrency, len(replies))):
                tg.create_task(asker())

    async def _ordered(
        self, ctx: RoundContext, replies: list[AgentReply | None], deadline: float
    ) -> None:
        """One agent after another, each seeing the environment as those
        before it left it."""
        loop = asyncio.get_running_loop()
        assert self.environment is not None
        for index, name in enumerate(self.simulation.population):
            if index and loop.time() < deadline:
                ctx.state = await self.environment.snapshot()
            reply = await self._ask(ctx, index, name, deadline)
            replies[index] = reply
            ctx.replies.append(reply)
            await self._heard(ctx, reply)

    async def _heard(self, ctx: RoundContext, reply: AgentReply) -> None:
        self.listener.replied(reply)
        if self.simulation.on_reply is not None:
            await _resolve(self.simulation.on_reply(ctx, reply))

    async def _ask(self, ctx: RoundContext, index: int, name: str, deadline: float) -> AgentReply:
        """One agent's round: its prompt, the request, the answer read."""
        sim = self.simulation
        params = sim.population.params_at(index)
        loop = asyncio.get_running_loop()
        if loop.time() >= deadline:
            return AgentReply(
                name, index, params, "missing", error="not asked: the round's deadline passed"
            )
        prompt = await _resolve(sim.prompt(ctx, AgentView(name, index, params)))
        assert self._state is not None
        # A request asks for a receipt, and is sent again while none comes
        # (a host replica that died with it queued took it along), except in
        # the round a resumed run asks again: there the agent must replace
        # its earlier attempt, not answer it again.
        receipt = ctx.round != self._asked_again
        message = UserRequest(
            sender=self.sender,
            session_id=self._state.session_id,
            # The same each time this round is asked of this agent: a runner
            # that resumes an unfinished round has the agent replace its
            # earlier attempt, instead of a second reply in its memory.
            call_id=f"{self._state.session_id}-r{ctx.round}-{index}",
            content=prompt,
            metadata={"simulation": sim.name, "round": ctx.round},
            receipt=receipt,
        )
        sent = loop.time()
        try:
            answer = await self.bus.request(
                self.bus.subjects.agent_inbox(name),
                message,
                timeout=max(deadline - sent, 0.001),
                resend=max(RESEND_AFTER, self.deadline / 4) if receipt else None,
            )
        except CallTimeoutError:
            return AgentReply(
                name, index, params, "late", error=f"no answer within {self.deadline:g} s"
            )
        except NoRespondersError:
            return AgentReply(name, index, params, "missing", error="no host serves it")
        except ConnectionClosedError:
            raise
        except BusError as exc:
            return AgentReply(name, index, params, "error", error=str(exc))
        latency = round(loop.time() - sent, 4)
        if isinstance(answer, ErrorMessage):
            return AgentReply(
                name, index, params, "error", error=f"{answer.code}: {answer.message}",
                latency=latency,
            )  # fmt: skip
        if not isinstance(answer, FinalAnswer):
            return AgentReply(
                name, index, params, "error",
                error=f"answered a {type(answer).__name__}, not a final_answer", latency=latency,
            )  # fmt: skip
        text = _text(answer.content)
        reply = AgentReply(
            name, index, params, "ok", text=text, latency=latency,
            finished_reason=answer.finished_reason,
        )  # fmt: skip
        if answer.finished_reason != "completed":
            reply.status = "error"
            reply.error = f"the reply ended {answer.finished_reason}"
        elif sim.parse is not None:
            try:
                reply.value = sim.parse(text)
            except Exception as exc:
                reply.status = "error"
                reply.error = f"the answer could not be read: {type(exc).__name__}: {exc}"
        return reply

    async def _cancel_late(self, state: RunState, late: Sequence[AgentReply]) -> None:
        """Interrupt the replies nobody waits for any more (best effort), so
        an agent's next round does not wait for its session."""
        if not late:
            return
        try:
            for reply in late:
                cancel = Cancel(
                    sender=self.sender,
                    session_id=state.session_id,
                    reason="the round's deadline passed",
                )
                await self.bus.publish(self.bus.subjects.agent_control(reply.agent), cancel)
            await self.bus.flush(5.0)
        except BusError as exc:
            logger.warning("cancelling %d late replies failed: %s", len(late), exc)

    def _record(self, round_no: int, reply: AgentReply) -> dict[str, Any]:
        sim = self.simulation
        text = reply.text
        if text is not None and len(text) > sim.answer_limit:
            text = text[: sim.answer_limit] + "…"
        record: dict[str, Any] = {
            "round": round_no,
            "agent": reply.agent,
            "status": reply.status,
            "value": reply.value,
            "answer": text,
            "latency": reply.latency,
            "finished_reason": reply.finished_reason,
            "error": reply.error,
        }
        if sim.record_params:
            record["params"] = {k: reply.params.get(k) for k in sim.record_params}
        return record

    def _summary(self, state: RunState) -> dict[str, Any]:
        sim = self.simulation
        totals = {"ok": 0, "errors": 0, "late": 0, "missing": 0}
        for r in state.rounds:
            totals["ok"] += r.ok
            totals["errors"] += r.errors
            totals["late"] += r.late
            totals["missing"] += r.missing
        return {
            "simulation": sim.name,
            "description": sim.description,
            "run_id": state.run_id,
            "session_id": state.session_id,
            "agents": state.agents,
            "order": sim.order,
            "rounds": self.rounds,
            "completed": state.completed,
            "finished": state.completed >= self.rounds,
            "deadline": self.deadline,
            "concurrency": self.concurrency,
            "records": state.records,
            "totals": totals,
            "started_at": state.started_at,
            "updated_at": time.time(),
            "results": self.files.RESULTS,
            "environment": str(self.files.snapshot(state.completed).relative_to(self.files.out)),
            "per_round": [r.to_dict() for r in state.rounds],
        }


async def _resolve(value: _T | Awaitable[_T]) -> _T:
    if inspect.isawaitable(value):
        return await value
    return value


def _text(content: str | list[ContentBlock]) -> str:
    if isinstance(content, str):
        return content
    return "\n".join(block.text for block in content if isinstance(block, TextBlock))
