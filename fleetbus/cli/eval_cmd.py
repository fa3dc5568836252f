"""``fleetbus eval``: evaluate an agent of the fleet on a dataset (docs/evals.md).

- ``eval DATASET.jsonl --agent NAME`` — sends each case to the agent
  (``--concurrency`` at a time), grades each answer, shows a progress bar
  and a table of the cases, and writes the run's directory (``--out``;
  ``eval-<dataset>-<agent>-<time>`` by default): ``results.jsonl``,
  ``summary.json`` and ``report.html``, whose path it prints last. With
  ``--compare RUN_DIR`` the page compares the run with that earlier one.
  Exits 0 when the pass rate reaches ``--min-pass-rate`` (every case, by
  default), 1 otherwise.
- ``eval report RUN_DIR`` — writes the page of a run again
  (``RUN_DIR/report.html``, or ``--out FILE``); ``eval report OLD NEW``
  the page comparing two runs, OLD the baseline (``NEW/compare.html``).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn
from rich.table import Table

from fleetbus._report_page import seconds as duration
from fleetbus.cli._common import connect, console, run
from fleetbus.cli._parsers import EVAL_REPORT
from fleetbus.cli._parsers import add_eval_parser as add_parser
from fleetbus.evals import (
    DEFAULT_CONCURRENCY,
    DEFAULT_TIMEOUT,
    CaseResult,
    EvalFiles,
    EvalListener,
    EvalRun,
    Evaluation,
    load_dataset,
    read_run,
    write_report,
)

__all__ = ["add_parser", "cmd"]

_RUN_OPTIONS = ("agent", "concurrency", "timeout", "judge", "label", "compare", "min_pass_rate")


def cmd(args: argparse.Namespace) -> int:
    """Run ``fleetbus eval …``."""
    words: list[str] = args.words
    reporting = words[0] == EVAL_REPORT
    problem = _misuse(args, reporting)
    if problem is not None:
        # As argparse tells a misuse: the usage, the problem, exit code 2.
        sys.stderr.write(f"{args.eval_usage}fleetbus eval: error: {problem}\n")
        return 2
    if reporting:
        return cmd_report(args)
    return cmd_run(args)


def _misuse(args: argparse.Namespace, reporting: bool) -> str | None:
    words: list[str] = args.words
    if reporting:
        given = [f"--{o.replace('_', '-')}" for o in _RUN_OPTIONS if getattr(args, o) is not None]
        if not 2 <= len(words) <= 3:
            return "report takes one run directory, or two to compare (the baseline first)"
        if given:
            return f"{', '.join(given)} go with running a dataset, not with report"
        return None
    if len(words) != 1:
        return "give one DATASET.jsonl (or: report RUN_DIR [NEW_RUN_DIR])"
    if args.agent is None:
        return "give the agent to evaluate: --agent NAME"
    return None


def cmd_run(args: argparse.Namespace) -> int:
    """Run a dataset against an agent; write and show the results."""
    dataset = load_dataset(args.words[0])
    if args.compare is not None:
        read_run(args.compare)  # a wrong directory is said before the run, not after
    out: Path = args.out or Path(
        f"eval-{dataset.name}-{args.agent}-{time.strftime('%Y%m%d-%H%M%S')}"
    )
    files = EvalFiles(out)
    files.prepare()

    async def main() -> int:
        bus = await connect(args.nats, args.prefix, f"eval-{args.agent}")
        try:
            listener = _Progress(len(dataset.cases))
            evaluation = Evaluation(
                bus,
                dataset,
                agent=args.agent,
                judge=args.judge,
                concurrency=args.concurrency or DEFAULT_CONCURRENCY,
                timeout=args.timeout or DEFAULT_TIMEOUT,
                label=args.label,
                listener=listener,
            )
            with listener.progress:
                await evaluation.run(out)
        finally:
            await bus.close()
        return 0

    run(main())
    result = read_run(out)
    _print_cases(result)
    # Compared, the run's page is the comparison; the run alone is `eval report RUN_DIR`.
    page = write_report(out, files.report, baseline=args.compare)
    facts = result.facts
    console.print(
        f"{facts.passed} of {facts.done} cases passed ({facts.pass_rate:.1%}); latency p50 "
        f"{duration(facts.latency_p50)}, p90 {duration(facts.latency_p90)}; "
        f"{facts.input_tokens + facts.output_tokens:,} tokens; {facts.tool_calls} tool calls",
        highlight=False,
    )
    console.print(f"results in {files.results}", highlight=False, soft_wrap=True)
    console.print(str(page), highlight=False, soft_wrap=True)
    wanted = 1.0 if args.min_pass_rate is None else args.min_pass_rate
    return 0 if facts.done and facts.pass_rate >= wanted - 1e-12 else 1


def cmd_report(args: argparse.Namespace) -> int:
    """Write the page of a run, or of two runs compared; print its path."""
    dirs = [Path(w) for w in args.words[1:]]
    if len(dirs) == 1:
        path = write_report(dirs[0], args.out)
    else:
        path = write_report(dirs[1], args.out, baseline=dirs[0])
    console.print(str(path), highlight=False, soft_wrap=True)
    return 0


class _Progress(EvalListener):
    """A progress bar of the cases: passed, failed, errors."""

    def __init__(self, total: int) -> None:
        self.progress = Progress(
            TextColumn("[bold]cases"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("[green]{task.fields[passed]} passed"),
            TextColumn("[red]{task.fields[failed]} failed"),
            TextColumn("[dim]{task.fields[errors]} errors"),
            console=console,
        )
        self._passed = self._failed = self._errors = 0
        self._task = self.progress.add_task("cases", total=total, passed=0, failed=0, errors=0)

    def case_finished(self, result: CaseResult) -> None:
        self._passed += result.passed
        self._failed += not result.passed
        self._errors += result.error is not None
        self.progress.update(
            self._task,
            advance=1,
            passed=self._passed,
            failed=self._failed,
            errors=self._errors,
        )


def _print_cases(result: EvalRun) -> None:
    table = Table(title=f"{result.name}: {result.facts.agent} on {result.facts.dataset}")
    table.add_column("case")
    table.add_column("result")
    for column in ("seconds", "tokens", "tools"):
        table.add_column(column, justify="right")
    table.add_column("why")
    for r in result.results:
        if r.error is not None:
            outcome, why = "[dim]error[/]", r.error
        elif r.passed:
            outcome, why = "[green]pass[/]", ""
        else:
            outcome = "[red]fail[/]"
            why = "; ".join(f"{g.kind}: {g.reason}" for g in r.grades if not g.passed)
        table.add_row(
            r.case_id,
            outcome,
            f"{r.latency:.2f}",
            f"{r.tokens:,}",
            str(len(r.tool_calls)),
            _clip(why, 160),
        )
    console.print(table)


def _clip(text: str, limit: int) -> str:
    text = " ".join(text.split())
    return escape(text if len(text) <= limit else text[: limit - 1] + "…")
