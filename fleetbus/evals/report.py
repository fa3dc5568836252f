"""One self-contained HTML page of an evaluation run, or of two side by side.

``fleetbus eval report RUN_DIR`` writes the page of a run
(``RUN_DIR/report.html`` by default); ``fleetbus eval report OLD NEW`` the
page comparing two runs of the same dataset (two models, two prompts), the
first taken as the baseline (``NEW/compare.html`` by default). The run's
page shows its facts and figures (pass rate, latency percentiles, tokens,
tool calls, the models that answered), the pass rate of each kind of
grader, the latency, tokens and tool calls of each case, and a table of the
cases: each grader's verdict and reason, the error, the tool calls, the
answer. Comparing, every figure is shown for both runs with the
difference, the cases are matched by ``id`` (fixed, regressed, unchanged),
and the charts draw both runs' bars side by side.

As ``fleetbus sim report``'s (it uses the same pieces,
:mod:`fleetbus._report_page`): charts are inline SVG, styles inline CSS,
no script, nothing loaded (a Content-Security-Policy forbids it), so it
opens from a ``file://`` URL anywhere; hovering a bar shows its figures.
Past :data:`~fleetbus._report_page.MAX_COLUMNS` cases, a bar stands for
the mean of consecutive cases.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import orjson

from fleetbus._report_page import (
    CSS,
    RIGHT,
    TEMPLATE,
    TOP,
    WIDTH,
    Column,
    Plot,
    axis_number,
    esc,
    group_columns,
    legend_list,
    seconds,
    show,
    svg,
    when,
    write_page,
)
from fleetbus.evals.results import CaseResult, EvalFiles, EvalRun, read_run

__all__ = ["COMPARE_NAME", "render_report", "write_report"]

COMPARE_NAME = "compare.html"
"""The comparison page's name in the newer run's directory, by default."""
TABLE_ROWS = 500
"""Rows of the table of cases: the first and last half of them past that."""
SHOWN = 400
"""Characters of an answer or input shown before "more"."""

_Figure = tuple[str, Callable[[EvalRun], float], Callable[[float], str], int]
"""A figure of a run: its name, how to get it, how to show it, which way is
better (1: up, -1: down, 0: neither)."""
_OUTCOME_COLOURS = {"pass": "#2f9e44", "fail": "#e03131", "error": "#868e96", "none": "#dee2e6"}
_RUN_COLOURS = ("#868e96", "#1c7ed6")
"""The baseline's bars, then the run's."""
_EXTRA_CSS = """
.outcome-pass { color: #2f9e44; font-weight: 600; } .outcome-fail { color: #e03131;
  font-weight: 600; } .outcome-error { color: #868e96; font-weight: 600; }
.change-fixed { color: #2f9e44; } .change-regressed { color: #e03131; font-weight: 600; }
.cases td { vertical-align: top; } .cases td.text { text-align: left; white-space: normal;
  max-width: 360px; overflow-wrap: anywhere; }
.cases th { text-align: left; } .cases td.id { text-align: left; }
.grades { list-style: none; margin: 0; padding: 0; }
.grades li { white-space: normal; }
.mono { font-family: ui-monospace, monospace; font-size: 11px; }
details summary { cursor: pointer; color: #495057; }
.figures td, .figures th { text-align: right; } .figures td:first-child { text-align: left; }
.better { color: #2f9e44; } .worse { color: #e03131; }
.cases-table { max-height: 720px; overflow-y: auto; }
"""


def write_report(
    run_dir: str | os.PathLike[str],
    path: str | os.PathLike[str] | None = None,
    *,
    baseline: str | os.PathLike[str] | None = None,
) -> Path:
    """Write the page of the run in ``run_dir`` — compared with the run in
    ``baseline`` when given — to ``path`` (by default ``run_dir/report.html``,
    or ``run_dir/compare.html`` when comparing), replacing it whole; the path
    written.

    Raises:
        ConfigError: a directory holds no run, or the page cannot be written.
    """
    run = read_run(run_dir)
    base = read_run(baseline) if baseline is not None else None
    name = EvalFiles.REPORT if base is None else COMPARE_NAME
    target = Path(path) if path is not None else run.out / name
    return write_page(render_report(run, base), target)


def render_report(run: EvalRun, baseline: EvalRun | None = None) -> str:
    """The page of ``run``, or of ``run`` compared with ``baseline``, as HTML."""
    return _Page(run, baseline).render()


@dataclass(frozen=True, slots=True)
class _Row:
    """One case of the page: its id and its result in each run (``None``:
    not in that run)."""

    case_id: str
    input: str
    results: tuple[CaseResult | None, ...]


def _outcome(result: CaseResult | None) -> str:
    if result is None:
        return "none"
    if result.error is not None:
        return "error"
    return "pass" if result.passed else "fail"


class _Page:
    """The HTML of a run (``runs`` of one) or of a baseline and a run (``runs`` of two)."""

    def __init__(self, run: EvalRun, baseline: EvalRun | None) -> None:
        self.run = run
        self.runs = [baseline, run] if baseline is not None else [run]
        self.comparing = baseline is not None
        order: dict[str, _Row] = {}
        by_id = [{r.case_id: r for r in each.results} for each in self.runs]
        for each in (run, *([baseline] if baseline else [])):
            for r in each.results:
                if r.case_id not in order:
                    found = tuple(ids.get(r.case_id) for ids in by_id)
                    order[r.case_id] = _Row(r.case_id, r.input, found)
        self.rows = list(order.values())
        self.numbers = list(range(1, len(self.rows) + 1))
        self.columns = group_columns(self.numbers, "case")

    def render(self) -> str:
        run = self.run
        title = f"{self.runs[0].name} vs {run.name}" if self.comparing else run.name
        body = [f"<h1>{esc(title)}</h1>", self._facts()]
        for each in self.runs:
            body += [f'<p class="note">{esc(each.name)}: {esc(note)}</p>' for note in each.notes]
        if not self.rows:
            body.append('<p class="empty">No case has finished yet.</p>')
        else:
            body += [
                self._section("graders", "Pass rate by grader", self._graders()),
                self._section("latency", "Latency per case", self._latency()),
                self._section("tokens", "Tokens per case", self._tokens()),
                self._section("tools", "Tool calls per case", self._tools()),
                self._section("cases", "Cases", self._table()),
            ]
        dirs = " ".join(str(each.out) for each in self.runs)
        what = "comparison" if self.comparing else "evaluation report"
        return TEMPLATE.format(
            title=esc(f"{title}: {what}"),
            css=CSS + _EXTRA_CSS,
            body="\n".join(body),
            footer=esc(f"fleetbus eval report {dirs}, {when(time.time())}"),
        )

    @staticmethod
    def _section(section_id: str, title: str, content: str) -> str:
        return f'<section id="{section_id}"><h2>{esc(title)}</h2>{content}</section>'

    # -- the facts and figures

    def _facts(self) -> str:
        runs = self.runs
        if not self.comparing:
            facts = runs[0].facts
            items = [
                ("dataset", facts.dataset),
                ("agent", facts.agent),
                ("models", _models(runs[0]) or None),
                ("judge", facts.judge),
                ("label", facts.label or None),
                ("started", when(facts.started_at)),
                ("finished", when(facts.finished_at) if facts.finished_at else "not yet"),
                ("concurrency", show(facts.concurrency)),
                ("timeout", seconds(facts.timeout) if facts.timeout else None),
                ("directory", str(runs[0].out)),
            ]
            cells = "".join(
                f"<dt>{esc(k)}</dt><dd>{esc(v)}</dd>" for k, v in items if v is not None
            )
            return f'<dl class="facts">{cells}</dl>' + self._figures()
        head = "".join(f"<th>{esc(each.name)}</th>" for each in runs)
        rows = [
            ("directory", [str(each.out) for each in runs]),
            ("dataset", [each.facts.dataset for each in runs]),
            ("agent", [each.facts.agent for each in runs]),
            ("models", [_models(each) for each in runs]),
            ("started", [when(each.facts.started_at) for each in runs]),
        ]
        body = "".join(
            f"<tr><td>{esc(k)}</td>" + "".join(f"<td>{esc(v)}</td>" for v in values) + "</tr>"
            for k, values in rows
        )
        table = (
            '<div class="scroll"><table class="figures runs"><thead><tr><th></th>'
            f"{head}</tr></thead><tbody>{body}</tbody></table></div>"
        )
        if self.runs[0].facts.dataset != self.runs[1].facts.dataset:
            table += (
                '<p class="note">The runs are of different datasets: only the cases with the '
                "same id are compared.</p>"
            )
        return table + self._figures() + self._changes()

    def _figures(self) -> str:
        """The figures of each run (and the change, comparing)."""
        figures: list[_Figure] = [
            ("cases", lambda r: r.facts.done, lambda v: f"{v:,.0f}", 0),
            ("passed", lambda r: r.facts.passed, lambda v: f"{v:,.0f}", 1),
            ("pass rate", lambda r: r.facts.pass_rate, lambda v: f"{v:.1%}", 1),
            ("errors", lambda r: r.facts.errors, lambda v: f"{v:,.0f}", -1),
            ("latency p50", lambda r: r.facts.latency_p50, seconds, -1),
            ("latency p90", lambda r: r.facts.latency_p90, seconds, -1),
            ("latency max", lambda r: r.facts.latency_max, seconds, -1),
            ("input tokens", lambda r: r.facts.input_tokens, lambda v: f"{v:,.0f}", -1),
            ("output tokens", lambda r: r.facts.output_tokens, lambda v: f"{v:,.0f}", -1),
            (
                "tokens per case",
                lambda r: (r.facts.input_tokens + r.facts.output_tokens) / (r.facts.done or 1),
                lambda v: f"{v:,.1f}",
                -1,
            ),
            ("tool calls", lambda r: r.facts.tool_calls, lambda v: f"{v:,.0f}", 0),
            (
                "tool calls per case",
                lambda r: r.facts.tool_calls / (r.facts.done or 1),
                lambda v: f"{v:.2f}",
                0,
            ),
        ]
        head = "".join(f"<th>{esc(each.name)}</th>" for each in self.runs)
        head += "<th>change</th>" if self.comparing else ""
        rows = []
        for name, get, fmt, better in figures:
            values = [get(each) for each in self.runs]
            cells = "".join(f"<td>{esc(fmt(v))}</td>" for v in values)
            if self.comparing:
                cells += _change(values[0], values[1], fmt, better, percent=name == "pass rate")
            rows.append(f"<tr><td>{esc(name)}</td>{cells}</tr>")
        return (
            '<div class="scroll"><table class="figures" id="figures"><thead><tr><th></th>'
            f"{head}</tr></thead><tbody>{''.join(rows)}</tbody></table></div>"
            '<p class="caption">Latency: seconds from the request to the answer. Tokens: what '
            "the reply's model calls report (the judges' are not counted).</p>"
        )

    def _changes(self) -> str:
        counts = {"fixed": 0, "regressed": 0, "still passing": 0, "still failing": 0}
        only = [0, 0]
        for row in self.rows:
            a, b = row.results
            if a is None or b is None:
                only[0 if b is None else 1] += 1
                continue
            counts[_change_of(a, b)] += 1
        parts = [f"{n:,} {what}" for what, n in counts.items()]
        names = [each.name for each in self.runs]
        parts += [f"{n:,} only in {name}" for n, name in zip(only, names, strict=True) if n]
        return f'<p id="changes"><b>Cases:</b> {esc(", ".join(parts))}.</p>'

    # -- charts

    def _graders(self) -> str:
        kinds: dict[str, None] = {}
        for each in self.runs:
            kinds.update(dict.fromkeys(each.facts.graders))
        kinds.update(dict.fromkeys(["all"]))
        names = list(kinds)
        size = (WIDTH, TOP + 36 + 30 * len(names) * len(self.runs))
        width = WIDTH - 200 - RIGHT - 80
        parts = ['<g class="axis">']
        for tick in (0.0, 0.25, 0.5, 0.75, 1.0):
            x = 200 + width * tick
            parts.append(
                f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{TOP}" y2="{size[1] - 24}" class="grid"/>'
                f'<text x="{x:.1f}" y="{size[1] - 8}" text-anchor="middle">{tick:.0%}</text>'
            )
        parts.append("</g>")
        y = TOP
        for kind in names:
            parts.append(
                f'<text x="{200 - 8}" y="{y + 15 * len(self.runs) + 4:.0f}" '
                f'text-anchor="end">{esc(kind)}</text>'
            )
            for i, each in enumerate(self.runs):
                if kind == "all":
                    passed, graded = each.facts.passed, each.facts.done
                else:
                    passed, graded = (each.facts.graders.get(kind) or [0, 0])[:2]
                rate = passed / graded if graded else 0.0
                colour = _RUN_COLOURS[i] if self.comparing else "#2f9e44"
                title = f"{each.name}: {kind} {passed:,} of {graded:,} passed ({rate:.0%})"
                if kind == "all":
                    title = f"{each.name}: {passed:,} of {graded:,} cases passed ({rate:.0%})"
                parts.append(
                    f'<g class="bars"><rect x="200" y="{y + 3}" width="{max(width * rate, 1):.1f}" '
                    f'height="24" fill="{colour}"><title>{esc(title)}</title></rect>'
                    f'<text x="{200 + width * rate + 6:.1f}" y="{y + 19}">{rate:.0%} '
                    f"({passed:,}/{graded:,})</text></g>"
                )
                y += 30
        legend = self._run_legend()
        return (
            svg("chart-graders", "pass rate by grader kind", parts, size=size)
            + legend
            + '<p class="caption">The share of the graders of each kind that passed; "all": '
            "the cases whose every grader passed (a case that failed with an error has no "
            "grader verdict).</p>"
        )

    def _run_legend(self) -> str:
        if not self.comparing:
            return ""
        return legend_list([(each.name, _RUN_COLOURS[i]) for i, each in enumerate(self.runs)])

    def _latency(self) -> str:
        values = [[r.latency if r else None for r in row.results] for row in self.rows]
        return self._bars(
            "chart-latency", "latency per case", values, seconds, lambda r: seconds(r.latency)
        )

    def _tokens(self) -> str:
        values = [[float(r.tokens) if r else None for r in row.results] for row in self.rows]
        return self._bars(
            "chart-tokens",
            "tokens per case",
            values,
            axis_number,
            lambda r: (
                f"{r.tokens:,} tokens ({r.input_tokens:,} in, {r.output_tokens:,} out, "
                f"{r.model_calls} model calls, {r.format_errors} format errors)"
            ),
        )

    def _tools(self) -> str:
        values = [
            [float(len(r.tool_calls)) if r else None for r in row.results] for row in self.rows
        ]
        return self._bars(
            "chart-tools",
            "tool calls per case",
            values,
            axis_number,
            lambda r: (
                f"{len(r.tool_calls)} tool calls"
                + (f": {', '.join(c.name for c in r.tool_calls[:8])}" if r.tool_calls else "")
            ),
        )

    def _bars(
        self,
        chart_id: str,
        label: str,
        values: Sequence[Sequence[float | None]],
        fmt: Callable[[float], str],
        describe: Callable[[CaseResult], str],
    ) -> str:
        """Bars of a figure per case (a column's mean past MAX_COLUMNS
        cases), one per run side by side; one run's coloured by outcome."""
        runs = len(self.runs)
        means: list[list[float | None]] = []
        for c in self.columns:
            row = []
            for i in range(runs):
                known = [x for v in values[c.start : c.end] if (x := v[i]) is not None]
                row.append(sum(known) / len(known) if known else None)
            means.append(row)
        high = max((v for m in means for v in m if v is not None), default=0.0)
        plot = Plot(len(self.rows), high or 1.0, unit="case", size=(WIDTH, 240))
        parts = plot.frame(self.numbers, fmt)
        parts.append('<g class="bars">')
        for c, row in zip(self.columns, means, strict=True):
            x0, x1 = plot.x(c.start), plot.x(c.end)
            step = (x1 - x0) / runs
            for i, value in enumerate(row):
                if value is None:
                    continue
                colour = _RUN_COLOURS[i] if self.comparing else self._column_colour(c)
                top, bottom = plot.y(value), plot.y(0.0)
                parts.append(
                    f'<rect x="{x0 + i * step + 0.5:.1f}" y="{top:.1f}" '
                    f'width="{max(step - 1, 0.5):.1f}" height="{max(bottom - top, 0.5):.1f}" '
                    f'fill="{colour}"/>'
                )
        parts.append("</g>")
        parts += plot.hovers(self.columns, [self._title(c, describe) for c in self.columns])
        if self.comparing:
            legend = self._run_legend()
        else:
            legend = legend_list([(k, _OUTCOME_COLOURS[k]) for k in ("pass", "fail", "error")])
        return svg(chart_id, label, parts, size=(WIDTH, 240)) + legend

    def _column_colour(self, column: Column) -> str:
        """One run's column: the colour of its case's outcome (a group's: fail
        if any failed, else error if any erred)."""
        outcomes = {_outcome(row.results[0]) for row in self.rows[column.start : column.end]}
        for outcome in ("fail", "error", "pass"):
            if outcome in outcomes:
                return _OUTCOME_COLOURS[outcome]
        return _OUTCOME_COLOURS["none"]

    def _title(self, column: Column, describe: Callable[[CaseResult], str]) -> str:
        rows = self.rows[column.start : column.end]
        lines = []
        for row in rows[:6]:
            for each, result in zip(self.runs, row.results, strict=True):
                who = f"{each.name}: " if self.comparing else ""
                if result is None:
                    lines.append(f"{row.case_id}: {who}not in this run")
                else:
                    lines.append(f"{row.case_id}: {who}{_outcome(result)}, {describe(result)}")
        if len(rows) > 6:
            lines.append(f"and {len(rows) - 6} more cases")
        return f"{column.label}\n" + "\n".join(lines)

    # -- the table of cases

    def _table(self) -> str:
        shown = list(range(len(self.rows)))
        if len(shown) > TABLE_ROWS:
            shown = [*shown[: TABLE_ROWS // 2], -1, *shown[-TABLE_ROWS // 2 :]]
        if self.comparing:
            names = [each.name for each in self.runs]
            head = ["#", "id", "input", *names, "change", "latency", "tokens", "tool calls"]
            head += [f"{names[1]}: graders, answer"]
        else:
            head = ["#", "id", "input", "result", "latency", "tokens", "tool calls"]
            head += ["graders", "answer"]
        rows = []
        for i in shown:
            if i < 0:
                rows.append(
                    f'<tr class="gap"><td colspan="{len(head)}">… '
                    f"{len(self.rows) - TABLE_ROWS:,} cases not shown (all in "
                    f"{EvalFiles.RESULTS}) …</td></tr>"
                )
                continue
            row = self.rows[i]
            cells = [
                f"<td>{i + 1}</td>",
                f'<td class="id mono">{esc(row.case_id)}</td>',
                f'<td class="text">{_long(row.input)}</td>',
            ]
            results = row.results
            cells += [f'<td class="outcome-{_outcome(r)}">{_outcome(r)}</td>' for r in results]
            if self.comparing:
                a, b = results
                change = _change_of(a, b) if a is not None and b is not None else ""
                cls = change.replace(" ", "-")
                cells.append(f'<td class="change-{cls}">{esc(change)}</td>')
            cells.append(_pair(results, lambda r: seconds(r.latency)))
            cells.append(_pair(results, lambda r: f"{r.tokens:,}"))
            cells.append(_pair(results, lambda r: f"{len(r.tool_calls)}"))
            last = results[-1]
            if last is None:
                cells.append("<td></td>" * (1 if self.comparing else 2))
            elif self.comparing:
                cells.append(f'<td class="text">{_grades(last)}{_answer(last)}</td>')
            else:
                cells.append(f'<td class="text">{_grades(last)}</td>')
                cells.append(f'<td class="text">{_answer(last)}</td>')
            rows.append("<tr>" + "".join(cells) + "</tr>")
        header = "".join(f"<th>{esc(h)}</th>" for h in head)
        return (
            '<div class="scroll cases-table"><table class="cases">'
            f"<thead><tr>{header}</tr></thead><tbody>{''.join(rows)}</tbody></table></div>"
        )


def _models(run: EvalRun) -> str:
    return ", ".join(f"{m} ({n:,} cases)" for m, n in run.facts.models.items())


def _change_of(a: CaseResult, b: CaseResult) -> str:
    if a.passed and b.passed:
        return "still passing"
    if a.passed:
        return "regressed"
    return "fixed" if b.passed else "still failing"


def _change(a: float, b: float, fmt: Callable[[float], str], better: int, *, percent: bool) -> str:
    """A figure's change from the baseline ``a`` to ``b``, coloured when
    ``better`` says which way is better (1: up, -1: down)."""
    delta = b - a
    if not delta:
        return "<td>=</td>"
    shown = f"{delta:+.1%}" if percent else ("+" if delta > 0 else "-") + fmt(abs(delta))
    cls = ""
    if better:
        cls = ' class="better"' if delta * better > 0 else ' class="worse"'
    return f"<td{cls}>{esc(shown)}</td>"


def _pair(results: Sequence[CaseResult | None], fmt: Callable[[CaseResult], str]) -> str:
    return "<td>" + esc(" → ".join(fmt(r) if r else "-" for r in results)) + "</td>"


def _long(text: str) -> str:
    """A text cell: short ones whole, long ones cut with the rest behind "more"."""
    if len(text) <= SHOWN:
        return esc(text)
    return f"{esc(text[:SHOWN])}… <details><summary>more</summary>{esc(text[SHOWN:])}</details>"


def _grades(result: CaseResult) -> str:
    if result.error is not None:
        return f'<p class="outcome-error">error: {esc(result.error)}</p>'
    items = "".join(
        f'<li><span class="outcome-{"pass" if g.passed else "fail"}">'
        f"{'✓' if g.passed else '✗'} {esc(g.kind)}</span>: {esc(g.reason)}</li>"
        for g in result.grades
    )
    return f'<ul class="grades">{items}</ul>'


def _answer(result: CaseResult) -> str:
    parts = []
    if result.tool_calls:
        calls = "; ".join(
            f"{c.name}({show(c.arguments)})" + (f" {c.status}" if c.status else "")
            for c in result.tool_calls[:12]
        )
        more = f" and {len(result.tool_calls) - 12} more" if len(result.tool_calls) > 12 else ""
        parts.append(f'<div class="mono">{esc(calls + more)}</div>')
    if result.structured is not None:
        parts.append(f'<div class="mono">{_long(orjson.dumps(result.structured).decode())}</div>')
    if result.answer:
        parts.append(f"<div>{_long(result.answer)}</div>")
    return "".join(parts)
