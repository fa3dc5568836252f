"""Running an evaluation: each case sent to an agent of the fleet, graded.

:class:`Evaluation` sends each case of a dataset to the agent (a
``user_request`` in a new session, with the case's ``output_schema`` when it
has one), ``concurrency`` cases at a time, streaming the reply's events:
the ``tool_call`` events give the tool calls made (names and arguments; the
``tool_result`` events their status; neither the finish tool of a structured
answer nor a step the model wrote unusably, ``format_error``, is a call: the
latter are counted apart), the ``model_call_end`` events the
tokens and the models (events are best effort: one lost on the way is not
counted). The answer is then graded by every grader of the case; a judge
grader asks the judge agent (the grader's ``agent``, else the run's
``judge``) with :func:`~fleetbus.evals.graders.judge_request`, for a
structured verdict (:data:`~fleetbus.evals.graders.VERDICT_SCHEMA`).

A case never stops the run: an agent that answers an error, times out, is
served by nobody, or ends its reply ``error``, ``interrupted`` or
``paused`` makes a failed case whose ``error`` says why, and a judge that
fails makes its grader fail. Each case is appended to ``results.jsonl`` as
it ends; ``summary.json`` is written at the start and at the end
(:mod:`fleetbus.evals.results`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Iterator
from typing import IO, Any

import orjson

from fleetbus.agents import RemoteAgent
from fleetbus.agents.events import MODEL_CALL_END, TOOL_CALL, TOOL_RESULT
from fleetbus.bus import Bus
from fleetbus.errors import ConfigError, FleetbusError
from fleetbus.evals.dataset import Case, Dataset, Grader, JudgeGrader
from fleetbus.evals.graders import (
    VERDICT_SCHEMA,
    Grade,
    Reply,
    ToolCallMade,
    grade,
    judge_request,
    verdict,
)
from fleetbus.evals.results import CaseResult, EvalFiles, EvalRun, RunFacts, read_run, summarize
from fleetbus.models import FINISH_TOOL
from fleetbus.models.model import FORMAT_ERROR_TOOL
from fleetbus.protocol import ContentBlock, Event, FinalAnswer, TextBlock

__all__ = ["DEFAULT_CONCURRENCY", "DEFAULT_TIMEOUT", "EvalListener", "Evaluation"]

logger = logging.getLogger(__name__)

DEFAULT_CONCURRENCY = 4
"""Cases run at once, by default."""
DEFAULT_TIMEOUT = 120.0
"""Seconds a case's reply (or a judge's) may take, by default."""
FAILED_ENDS = ("error", "interrupted", "paused")
"""The ways a reply ends that fail its case without grading it."""


class EvalListener:
    """What an evaluation tells as it goes (for a progress bar); does nothing
    by default."""

    def case_finished(self, result: CaseResult) -> None:
        """A case ended (graded, or failed with an error)."""


class Evaluation:
    """One run of a dataset against an agent.

    Args:
        bus: the connection to the fleet.
        dataset: the cases.
        agent: the agent to evaluate.
        judge: the judge agent of the ``judge`` graders that name none.
        concurrency: cases run at once.
        timeout: seconds a case's reply may take, unless the case gives its
            own; also a judge's.
        label: a name for the run (its directory's name on the page otherwise).
        listener: told of each case as it ends.

    Raises:
        ConfigError: a ``judge`` grader names no agent and ``judge`` is not
            given; ``concurrency`` or ``timeout`` is not positive; an agent's
            name cannot be a subject token.
    """

    def __init__(
        self,
        bus: Bus,
        dataset: Dataset,
        *,
        agent: str,
        judge: str | None = None,
        concurrency: int = DEFAULT_CONCURRENCY,
        timeout: float = DEFAULT_TIMEOUT,
        label: str | None = None,
        listener: EvalListener | None = None,
    ) -> None:
        if concurrency < 1:
            raise ConfigError(f"concurrency must be at least 1, not {concurrency}")
        if not timeout > 0:
            raise ConfigError(f"timeout must be a positive number of seconds, not {timeout}")
        if None in dataset.judges() and judge is None:
            line = next(
                n
                for c, n in zip(dataset.cases, dataset.lines, strict=True)
                if any(isinstance(g, JudgeGrader) and g.agent is None for g in c.expect)
            )
            raise ConfigError(
                f"{dataset.path}:{line}: a judge grader names no agent: give the judge "
                'agent (--judge AGENT), or "agent" in the grader'
            )
        for name in {agent, *(j for j in dataset.judges() if j is not None), judge}:
            if name is not None:
                bus.subjects.agent_inbox(name)  # a name that cannot be a subject: now
        self.bus = bus
        self.dataset = dataset
        self.agent = agent
        self.judge = judge
        self.concurrency = concurrency
        self.timeout = timeout
        self.label = label or ""
        self.listener = listener or EvalListener()

    async def run(self, out: str | os.PathLike[str]) -> EvalRun:
        """Run every case; write the run to the directory ``out`` (which must
        hold no run yet); the run, as :func:`~fleetbus.evals.read_run` reads it.

        Raises:
            ConfigError: ``out`` already holds a run, or cannot be written.
        """
        files = EvalFiles(out)
        files.prepare()
        facts = RunFacts(
            dataset=str(self.dataset.path),
            agent=self.agent,
            label=self.label,
            judge=self.judge,
            concurrency=self.concurrency,
            timeout=self.timeout,
            started_at=time.time(),
            cases=len(self.dataset.cases),
        )
        files.write_summary(facts)
        results: list[CaseResult] = []
        todo = iter(enumerate(self.dataset.cases))
        try:
            sink = files.results.open("ab")
        except OSError as exc:
            raise ConfigError(f"cannot write {files.results}: {exc.strerror or exc}") from exc
        with sink:
            try:
                async with asyncio.TaskGroup() as tg:
                    for _ in range(min(self.concurrency, len(self.dataset.cases))):
                        tg.create_task(self._work(todo, sink, results))
            except* OSError as group:
                first = group.exceptions[0]
                raise ConfigError(f"cannot write {files.results}: {first}") from None
        facts.finished_at = time.time()
        files.write_summary(summarize(facts, sorted(results, key=lambda r: r.index)))
        return read_run(files.out)

    async def _work(
        self, todo: Iterator[tuple[int, Case]], sink: IO[bytes], results: list[CaseResult]
    ) -> None:
        """Run cases until there are none left (one of ``concurrency`` such loops)."""
        for index, case in todo:
            result = await self.run_case(index, case)
            sink.write(orjson.dumps(result.to_dict(), default=str) + b"\n")
            sink.flush()
            results.append(result)
            self.listener.case_finished(result)

    async def run_case(self, index: int, case: Case) -> CaseResult:
        """Send ``case`` to the agent and grade its answer; a failure of the
        agent is the result's ``error``, never an exception."""
        limit = case.timeout or self.timeout
        remote = RemoteAgent(self.bus, self.agent, timeout=limit)
        result = CaseResult(index, case.id, case.input, session_id=remote.session_id)
        seen = _Seen()
        final: FinalAnswer | None = None
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            stream = remote.reply_stream(case.input, schema=case.output_schema)
            async with contextlib.aclosing(stream):
                async for item in stream:
                    if isinstance(item, FinalAnswer):
                        final = item
                    else:
                        seen.add(item)
        except FleetbusError as exc:
            result.error = _error_text(exc)
        result.latency = round(loop.time() - started, 6)
        seen.fill(result)
        if final is not None:
            result.answer = _text(final.content)
            result.structured = final.structured
            result.finished_reason = final.finished_reason
            if final.finished_reason in FAILED_ENDS:
                result.error = f"the reply ended {final.finished_reason}: {_clip(result.answer)}"
        if result.error is None:
            reply = Reply(result.answer, result.structured, tuple(result.tool_calls))
            result.grades = [await self._grade(case, grader, reply) for grader in case.expect]
            result.passed = all(g.passed for g in result.grades)
        else:
            logger.info(
                "case %s failed: %s",
                case.id,
                result.error,
                extra={"session_id": result.session_id},
            )
        return result

    async def _grade(self, case: Case, grader: Grader, reply: Reply) -> Grade:
        if not isinstance(grader, JudgeGrader):
            return grade(grader, reply)
        name = grader.agent or self.judge
        assert name is not None  # checked in __init__
        judge = RemoteAgent(self.bus, name, timeout=self.timeout)
        try:
            answer = await judge.reply(judge_request(case, grader, reply), schema=VERDICT_SCHEMA)
        except FleetbusError as exc:
            return Grade("judge", False, f"the judge {name} failed: {_error_text(exc)}")
        if answer.finished_reason != "completed":
            why = _clip(_text(answer.content))
            return Grade("judge", False, f"the judge {name} ended {answer.finished_reason}: {why}")
        return verdict(answer.structured, _text(answer.content))


class _Seen:
    """What a reply's events tell: its tool calls, tokens and models (each
    event once, by its reply and place in it)."""

    def __init__(self) -> None:
        self.events: set[tuple[str | None, int]] = set()
        self.calls: dict[str, ToolCallMade] = {}
        self.input_tokens = self.output_tokens = self.model_calls = self.format_errors = 0
        self.models: dict[str, None] = {}

    def add(self, event: Event) -> None:
        key = (event.call_id, event.seq)
        if key in self.events:
            return
        self.events.add(key)
        data = event.data
        if event.event == MODEL_CALL_END:
            self.model_calls += 1
            self.input_tokens += _count(data.get("input_tokens"))
            self.output_tokens += _count(data.get("output_tokens"))
            if isinstance(data.get("model"), str):
                self.models[data["model"]] = None
        elif event.event == TOOL_CALL and data.get("tool_name") == FORMAT_ERROR_TOOL:
            self.format_errors += 1
        elif event.event == TOOL_CALL and data.get("tool_name") != FINISH_TOOL:
            call_id = str(data.get("call_id"))
            arguments = data.get("parameters")
            self.calls.setdefault(
                call_id,
                ToolCallMade(
                    str(data.get("tool_name")), arguments if isinstance(arguments, dict) else {}
                ),
            )
        elif event.event == TOOL_RESULT:
            call = self.calls.get(str(data.get("call_id")))
            if call is not None:
                status = data.get("status")
                self.calls[str(data.get("call_id"))] = ToolCallMade(
                    call.name, call.arguments, str(status) if status is not None else None
                )

    def fill(self, result: CaseResult) -> None:
        result.tool_calls = list(self.calls.values())
        result.input_tokens = self.input_tokens
        result.output_tokens = self.output_tokens
        result.model_calls = self.model_calls
        result.format_errors = self.format_errors
        result.models = list(self.models)


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def _text(content: str | list[ContentBlock]) -> str:
    if isinstance(content, str):
        return content
    return "\n\n".join(b.text for b in content if isinstance(b, TextBlock))


def _error_text(exc: FleetbusError) -> str:
    """An exception as a case's error: its kind, then its message."""
    return f"{type(exc).__name__}: {_clip(str(exc), 500)}"


def _clip(text: str, limit: int = 300) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"
