"""What an evaluation run writes, and reads back: its directory.

A run's directory (``--out``) holds:

- ``results.jsonl``: one :class:`CaseResult` a line, written as each case
  ends (so in the order they end; ``index`` is the case's place in the
  dataset);
- ``summary.json``: the run's facts (:class:`RunFacts`): the dataset, the
  agent, the label, the settings, the figures of all its cases, the models
  that answered;
- ``report.html``: its page (:mod:`fleetbus.evals.report`).

:func:`read_run` reads a directory back (:class:`EvalRun`), for the page
and for comparing two runs.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import orjson

from fleetbus._report_page import quantile
from fleetbus.errors import ConfigError
from fleetbus.evals.graders import Grade, ToolCallMade

__all__ = ["CaseResult", "EvalFiles", "EvalRun", "RunFacts", "read_run", "summarize"]


@dataclass(slots=True)
class CaseResult:
    """One case, as it went.

    Attributes:
        index: the case's place in the dataset (from 0).
        case_id: the case's ``id``.
        input: what the agent was asked.
        answer: the answer's text ('' when there was none).
        structured: the structured answer, when one was asked for and given.
        passed: whether every grader passed (``False`` with an ``error``).
        grades: each grader's verdict, in the case's order.
        latency: seconds from the request to the answer (or to the error).
        input_tokens: tokens the model calls of the reply read.
        output_tokens: tokens they wrote.
        model_calls: the model calls of the reply.
        format_errors: the steps the model wrote that could be used neither as
            a tool call nor as an answer (the agent told the model so).
        models: the models that answered them.
        tool_calls: the tool calls it made, in order.
        finished_reason: how the reply ended ('' when it did not).
        error: why the case failed without being graded: the agent's error,
            a timeout, a reply that ended ``error``/``interrupted``/``paused``.
        session_id: the session the case ran in.
    """

    index: int
    case_id: str
    input: str
    answer: str = ""
    structured: dict[str, Any] | None = None
    passed: bool = False
    grades: list[Grade] = field(default_factory=list)
    latency: float = 0.0
    input_tokens: int = 0
    output_tokens: int = 0
    model_calls: int = 0
    format_errors: int = 0
    models: list[str] = field(default_factory=list)
    tool_calls: list[ToolCallMade] = field(default_factory=list)
    finished_reason: str = ""
    error: str | None = None
    session_id: str = ""

    @property
    def tokens(self) -> int:
        """Input and output tokens together."""
        return self.input_tokens + self.output_tokens

    def to_dict(self) -> dict[str, Any]:
        """The record as ``results.jsonl`` holds it (``id`` for ``case_id``)."""
        data = asdict(self)
        data["id"] = data.pop("case_id")
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CaseResult:
        """A record of ``results.jsonl``.

        Raises:
            TypeError: it is not one.
            KeyError: a field is missing.
            ValueError: a field is not of its type.
        """
        grades = [
            Grade(str(g["kind"]), bool(g["passed"]), str(g["reason"])) for g in data["grades"]
        ]
        calls = [
            ToolCallMade(str(c["name"]), dict(c["arguments"]), c.get("status"))
            for c in data["tool_calls"]
        ]
        structured = data.get("structured")
        error = data.get("error")
        return cls(
            index=int(data["index"]),
            case_id=str(data["id"]),
            input=str(data["input"]),
            answer=str(data.get("answer", "")),
            structured=dict(structured) if structured is not None else None,
            passed=bool(data["passed"]),
            grades=grades,
            latency=float(data.get("latency", 0.0)),
            input_tokens=int(data.get("input_tokens", 0)),
            output_tokens=int(data.get("output_tokens", 0)),
            model_calls=int(data.get("model_calls", 0)),
            format_errors=int(data.get("format_errors", 0)),
            models=[str(m) for m in data.get("models", [])],
            tool_calls=calls,
            finished_reason=str(data.get("finished_reason", "")),
            error=str(error) if error is not None else None,
            session_id=str(data.get("session_id", "")),
        )


@dataclass(slots=True)
class RunFacts:
    """What ``summary.json`` holds: the run and the figures of its cases.

    Attributes:
        dataset: the dataset file.
        agent: the agent evaluated.
        label: a name for the run (``--label``; the agent and the time by default).
        judge: the judge agent of ``judge`` graders that name none.
        concurrency: cases run at once.
        timeout: seconds a case's reply may take (unless the case says).
        started_at: Unix time of the start.
        finished_at: Unix time of the end (0 while it runs).
        cases: cases in the dataset.
        done: cases that ended (graded, or failed with an error).
        passed: cases that passed.
        errors: cases that failed with an error.
        pass_rate: ``passed / done`` (0 with none done).
        latency_p50: the median latency (seconds).
        latency_p90: the 90th percentile.
        latency_max: the longest.
        input_tokens: tokens read, all cases.
        output_tokens: tokens written, all cases.
        tool_calls: tool calls made, all cases.
        models: the models that answered, by how many model calls.
        graders: per grader kind, ``[passed, graded]``.
    """

    dataset: str
    agent: str
    label: str
    judge: str | None = None
    concurrency: int = 0
    timeout: float = 0.0
    started_at: float = 0.0
    finished_at: float = 0.0
    cases: int = 0
    done: int = 0
    passed: int = 0
    errors: int = 0
    pass_rate: float = 0.0
    latency_p50: float = 0.0
    latency_p90: float = 0.0
    latency_max: float = 0.0
    input_tokens: int = 0
    output_tokens: int = 0
    tool_calls: int = 0
    models: dict[str, int] = field(default_factory=dict)
    graders: dict[str, list[int]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunFacts:
        """``summary.json``'s object (fields it does not know are ignored).

        Raises:
            TypeError: it is not one (a field missing, or not of its type).
        """
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        facts = cls(**known)
        for name in ("dataset", "agent", "label"):
            if not isinstance(getattr(facts, name), str):
                raise TypeError(f"{name} is not a string")
        return facts


def summarize(facts: RunFacts, results: Sequence[CaseResult]) -> RunFacts:
    """``facts`` with the figures of ``results`` (the other fields kept)."""
    latencies = sorted(r.latency for r in results)
    models: dict[str, int] = {}
    graders: dict[str, list[int]] = {}
    for r in results:
        for model in r.models:
            models[model] = models.get(model, 0) + 1
        for g in r.grades:
            counts = graders.setdefault(g.kind, [0, 0])
            counts[0] += g.passed
            counts[1] += 1
    passed = sum(r.passed for r in results)
    facts.done = len(results)
    facts.passed = passed
    facts.errors = sum(r.error is not None for r in results)
    facts.pass_rate = passed / len(results) if results else 0.0
    facts.latency_p50 = quantile(latencies, 0.5) if latencies else 0.0
    facts.latency_p90 = quantile(latencies, 0.9) if latencies else 0.0
    facts.latency_max = latencies[-1] if latencies else 0.0
    facts.input_tokens = sum(r.input_tokens for r in results)
    facts.output_tokens = sum(r.output_tokens for r in results)
    facts.tool_calls = sum(len(r.tool_calls) for r in results)
    facts.models = models
    facts.graders = graders
    return facts


class EvalFiles:
    """The files of a run's directory ``out``."""

    RESULTS: ClassVar[str] = "results.jsonl"
    SUMMARY: ClassVar[str] = "summary.json"
    REPORT: ClassVar[str] = "report.html"

    def __init__(self, out: str | os.PathLike[str]) -> None:
        self.out = Path(out)
        self.results = self.out / self.RESULTS
        self.summary = self.out / self.SUMMARY
        self.report = self.out / self.REPORT

    def prepare(self) -> None:
        """Make the directory, which must hold no run yet.

        Raises:
            ConfigError: it holds a run, or cannot be made.
        """
        if self.results.exists() or self.summary.exists():
            raise ConfigError(
                f"{self.out} already holds an evaluation run: give another --out "
                "(compare the two with `fleetbus eval report OLD NEW`)"
            )
        try:
            self.out.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"cannot make {self.out}: {exc.strerror or exc}") from exc

    def write_summary(self, facts: RunFacts) -> None:
        """Write ``summary.json``, replacing it whole.

        Raises:
            ConfigError: it cannot be written.
        """
        tmp = self.summary.with_name(f".{self.SUMMARY}.tmp")
        try:
            tmp.write_bytes(orjson.dumps(facts.to_dict(), option=orjson.OPT_INDENT_2))
            os.replace(tmp, self.summary)
        except OSError as exc:
            raise ConfigError(f"cannot write {self.summary}: {exc.strerror or exc}") from exc


@dataclass(slots=True)
class EvalRun:
    """A run read back from its directory.

    Attributes:
        out: the directory.
        facts: its ``summary.json``.
        results: its cases, in the dataset's order.
        notes: what the page should say about the files (lines not read).
    """

    out: Path
    facts: RunFacts
    results: list[CaseResult]
    notes: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        """The run's label, else its directory's name."""
        return self.facts.label or self.out.name


def read_run(out: str | os.PathLike[str]) -> EvalRun:
    """The run in the directory ``out``.

    Raises:
        ConfigError: ``out`` is not a directory, holds no evaluation run (no
            ``summary.json``), or its files cannot be read.
    """
    files = EvalFiles(out)
    if not files.out.is_dir():
        raise ConfigError(f"{files.out} is not a directory (give the --out of `fleetbus eval`)")
    try:
        facts = RunFacts.from_dict(orjson.loads(files.summary.read_bytes()))
    except FileNotFoundError:
        raise ConfigError(
            f"{files.out} is not an evaluation run: it has no {files.SUMMARY}"
        ) from None
    except (OSError, orjson.JSONDecodeError, TypeError, AttributeError) as exc:
        raise ConfigError(f"cannot read {files.summary}: {exc}") from exc
    results: list[CaseResult] = []
    notes: list[str] = []
    unreadable = 0
    try:
        with files.results.open("rb") as f:
            for line in f:
                if not line.strip():
                    continue
                try:
                    results.append(CaseResult.from_dict(orjson.loads(line)))
                except (orjson.JSONDecodeError, TypeError, KeyError, ValueError, AttributeError):
                    unreadable += 1
    except FileNotFoundError:
        notes.append(f"{files.RESULTS} is missing: no case to show.")
    except OSError as exc:
        raise ConfigError(f"cannot read {files.results}: {exc.strerror or exc}") from exc
    if unreadable:
        notes.append(f"{unreadable:,} lines of {files.RESULTS} cannot be read.")
    if not facts.finished_at:
        notes.append(
            f"The run has not finished ({len(results)} of {facts.cases} cases): it is under way, "
            "or was interrupted."
        )
    results.sort(key=lambda r: r.index)
    # The figures of the cases read (those of an interrupted run were never written).
    return EvalRun(files.out, summarize(facts, results), results, notes)
