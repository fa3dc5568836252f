"""What a run's directory holds, gathered for its report (:mod:`fleetbus.sim.report`).

:func:`read_run` reads the round summaries of ``state.json`` (else of
``summary.json``), the run's facts of ``summary.json``, and the records of
``results.jsonl`` up to the size the state recorded: the finished rounds.
What a runner killed in a round left after them is dropped when the run
resumes, and is not read. Each round keeps its latencies and numeric answers
(16 bytes a record at most) and its most frequent other answers; errors are
counted by kind.
"""

from __future__ import annotations

import os
from array import array
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from fleetbus._report_page import finite, is_number
from fleetbus.errors import ConfigError
from fleetbus.sim.results import RoundSummary, RunFiles, RunState

__all__ = [
    "OTHER",
    "STATUSES",
    "ErrorKind",
    "RoundData",
    "RunReport",
    "finite",
    "is_number",
    "read_run",
]

CATEGORIES_KEPT = 50
"""Answers a finished round keeps by name while the file is read."""
ERROR_KINDS = 500
"""Kinds of errors told apart while reading; more are one "other" kind."""

STATUSES = ("ok", "error", "late", "missing")
"""How an agent's round ends (:data:`fleetbus.sim.ReplyStatus`)."""
OTHER = "(other)"
"""The label of the answers (or errors) not told apart."""


@dataclass(slots=True)
class RoundData:
    """One round, as the report sees it.

    Attributes:
        round: its number.
        summary: its summary, when the run's state (or summary) has it.
        counts: its records by status.
        latencies: the latencies of its answered requests (seconds).
        numbers: the numeric values of its ``ok`` records.
        values: its ``ok`` records' other values, by label.
        texts: its ``ok`` records' answers, by label, when they have no value.
    """

    round: int
    summary: RoundSummary | None = None
    counts: Counter[str] = field(default_factory=Counter)
    latencies: array[float] = field(default_factory=lambda: array("d"))
    numbers: array[float] = field(default_factory=lambda: array("d"))
    values: Counter[str] = field(default_factory=Counter)
    texts: Counter[str] = field(default_factory=Counter)

    def status(self, name: str) -> int:
        """Its agents of a status: the summary's count, else the records'."""
        if self.summary is not None:
            s = self.summary
            return {"ok": s.ok, "error": s.errors, "late": s.late, "missing": s.missing}[name]
        return self.counts[name]


@dataclass(slots=True)
class ErrorKind:
    """The records of one status (not ``ok``) and kind of error.

    Attributes:
        status: ``error``, ``late`` or ``missing``.
        kind: the error's text up to its second ``": "`` (what failed, and why).
        count: how many records.
        first: the first round with one.
        last: the last round with one.
        example: the error of one of them (300 characters at most).
    """

    status: str
    kind: str
    count: int = 0
    first: int = 0
    last: int = 0
    example: str = ""


@dataclass(slots=True)
class RunReport:
    """What a run's directory holds, gathered for the page.

    Attributes:
        out: the run's directory.
        facts: ``summary.json`` (empty when it is missing).
        state: ``state.json`` (``None`` when it is missing).
        rounds: the rounds, in order.
        errors: the errors by status and kind.
        notes: what the page should say about the files (missing, cut).
        records: the records read.
    """

    out: Path
    facts: dict[str, Any]
    state: RunState | None
    rounds: list[RoundData]
    errors: dict[tuple[str, str], ErrorKind]
    notes: list[str]
    records: int = 0


def read_run(out: str | os.PathLike[str]) -> RunReport:
    """Gather what the run in ``out`` wrote.

    Raises:
        ConfigError: ``out`` is not a directory, holds no run (no
            ``state.json``, ``summary.json`` or ``results.jsonl``), or its
            state cannot be read.
    """
    files = RunFiles(out)
    if not files.out.is_dir():
        raise ConfigError(f"{files.out} is not a directory (give the --out of `fleetbus sim run`)")
    if not any(p.exists() for p in (files.state, files.summary, files.results)):
        raise ConfigError(
            f"{files.out} is not a simulation run: it has no {files.STATE}, "
            f"{files.SUMMARY} or {files.RESULTS}"
        )
    state = files.load_state()
    notes: list[str] = []
    facts = _read_facts(files, notes)
    rounds: dict[int, RoundData] = {}
    summaries: Sequence[RoundSummary | None] = (
        state.rounds if state is not None else _summaries(facts.get("per_round"))
    )
    unread = 0
    for s in summaries:
        if s is not None and _readable(s):
            rounds[s.round] = RoundData(s.round, summary=s)
        else:
            unread += 1
    if unread:
        where = files.STATE if state is not None else files.SUMMARY
        notes.append(f"{unread:,} round summaries of {where} cannot be read.")
    report = RunReport(files.out, facts, state, [], {}, notes)
    if files.results.exists():
        _read_records(files, state, rounds, report)
    else:
        notes.append(f"{files.RESULTS} is missing: no answers, latencies or errors to show.")
    report.rounds = [rounds[n] for n in sorted(rounds)]
    return report


def _read_facts(files: RunFiles, notes: list[str]) -> dict[str, Any]:
    try:
        data = orjson.loads(files.summary.read_bytes())
    except FileNotFoundError:
        return {}
    except (OSError, orjson.JSONDecodeError) as exc:
        notes.append(f"{files.SUMMARY} cannot be read ({exc}).")
        return {}
    if not isinstance(data, dict):
        notes.append(f"{files.SUMMARY} is not a run's summary.")
        return {}
    return data


def _summaries(items: Any) -> list[RoundSummary | None]:
    """The round summaries of ``summary.json``'s ``per_round``, ``None`` for
    one that is not a summary (:func:`_readable` checks the others)."""
    summaries: list[RoundSummary | None] = []
    for item in items if isinstance(items, list) else []:
        try:
            summaries.append(RoundSummary.from_dict(item))
        except (TypeError, AttributeError):
            summaries.append(None)
    return summaries


def _readable(s: RoundSummary) -> bool:
    """Whether a summary's figures are of the types the runner writes."""
    counts = (s.round, s.agents, s.ok, s.errors, s.late, s.missing)
    return (
        all(isinstance(n, int) and not isinstance(n, bool) for n in counts)
        and s.round >= 0
        and is_number(s.duration)
        and is_number(s.rate)
        and isinstance(s.metrics, dict)
    )


def _read_records(
    files: RunFiles, state: RunState | None, rounds: dict[int, RoundData], report: RunReport
) -> None:
    limit = state.results_bytes if state is not None else None
    unreadable = 0
    current: RoundData | None = None
    try:
        with files.results.open("rb") as f:
            for line in _lines(f, limit):
                try:
                    record = orjson.loads(line)
                    number = record["round"]
                    if not isinstance(number, int) or isinstance(number, bool):
                        raise TypeError(number)
                except (orjson.JSONDecodeError, KeyError, TypeError):
                    unreadable += line.strip() != b""
                    continue
                data = rounds.get(number)
                if data is None:
                    data = rounds[number] = RoundData(number)
                if data is not current:
                    if current is not None:
                        _compact(current)  # a round's records are together (RunFiles)
                    current = data
                _add(data, record, report)
            size = f.seek(0, os.SEEK_END)
    except OSError as exc:
        raise ConfigError(f"cannot read {files.results}: {exc.strerror or exc}") from exc
    if current is not None:
        _compact(current)
    if unreadable:
        report.notes.append(f"{unreadable:,} lines of {files.RESULTS} cannot be read.")
    if limit is not None and size > limit:
        report.notes.append(
            f"{files.RESULTS} holds {size - limit:,} bytes past the last finished round: "
            "a round under way or interrupted (resuming the run writes it again). Not shown."
        )
    if limit is not None and size < limit:
        report.notes.append(
            f"{files.RESULTS} is shorter than its state recorded ({size:,} < {limit:,} bytes)."
        )


def _lines(f: Any, limit: int | None) -> Iterator[bytes]:
    """The lines of ``f`` in its first ``limit`` bytes (all without a limit)."""
    read = 0
    for line in f:
        read += len(line)
        if limit is not None and read > limit:
            return
        yield line


def _add(data: RoundData, record: dict[str, Any], report: RunReport) -> None:
    report.records += 1
    status = record.get("status")
    if status not in STATUSES:
        status = "error"
    data.counts[status] += 1
    latency = finite(record.get("latency"))
    if latency is not None:
        data.latencies.append(latency)
    if status == "ok":
        value = record.get("value")
        number = finite(value)
        if number is not None:
            data.numbers.append(number)
        elif value is not None:
            data.values[_label(value)] += 1
        elif isinstance(record.get("answer"), str):
            data.texts[_label(record["answer"])] += 1
        return
    error = record.get("error")
    text = " ".join(str(error).split()) if error is not None else "(no error recorded)"
    key = (str(status), _error_kind(text))
    kind = report.errors.get(key)
    if kind is None:
        if len(report.errors) >= ERROR_KINDS:
            key = (str(status), OTHER)
            kind = report.errors.get(key)
        if kind is None:
            kind = report.errors[key] = ErrorKind(*key, first=data.round, example=text[:300])
    kind.count += 1
    kind.first = min(kind.first, data.round)
    kind.last = max(kind.last, data.round)


def _compact(data: RoundData) -> None:
    """Keep a read round's most frequent answers by name, the rest as one."""
    for counter in (data.values, data.texts):
        if len(counter) > CATEGORIES_KEPT:
            kept = Counter(dict(counter.most_common(CATEGORIES_KEPT)))
            kept[OTHER] += sum(counter.values()) - sum(kept.values())
            counter.clear()
            counter.update(kept)


def _label(value: Any) -> str:
    if isinstance(value, str):
        text = " ".join(value.split())
    else:
        text = orjson.dumps(value, default=str, option=orjson.OPT_SORT_KEYS).decode()
    return text if len(text) <= 60 else text[:59] + "…"


def _error_kind(text: str) -> str:
    """An error's kind: its text up to the second ``": "`` (what failed and
    why, without the details), at most 100 characters."""
    kind = ": ".join(text.split(": ")[:2])
    return kind if len(kind) <= 100 else kind[:99] + "…"
