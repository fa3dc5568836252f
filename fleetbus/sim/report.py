"""One self-contained HTML page of a run's charts: ``fleetbus sim report RUN_DIR``.

:func:`read_run` reads what a run wrote (:class:`~fleetbus.sim.results.RunFiles`):
the round summaries of ``state.json`` (else ``summary.json``), the run's facts
of ``summary.json``, and the records of ``results.jsonl`` up to the size the
state recorded — the finished rounds; what a runner killed in a round left
after them is dropped when the run resumes, and not shown. :func:`render_report`
makes the page and :func:`write_report` writes it (``RUN_DIR/report.html`` by
default).

The page holds aggregates only, so its size does not grow with the agents,
and little with the rounds: agents per round by status, latency percentiles
per round, the answers per round (a heat map of value bins and the median
for numbers; the most frequent answers for anything else), the figures
``apply`` returned, the most frequent errors, and a table of the rounds.
Past :data:`MAX_COLUMNS` rounds, the bars and cells of a chart stand for a
group of consecutive rounds; lines keep one point per round.

Charts are inline SVG, styles inline CSS; the page has no script and loads
nothing (its Content-Security-Policy forbids it), so it opens from a
``file://`` URL anywhere. Hovering a round shows its figures (SVG titles).
"""

from __future__ import annotations

import math
import os
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fleetbus._report_page import (
    BOTTOM,
    CSS,
    LEFT,
    MAX_COLUMNS,
    RIGHT,
    SMALL,
    TEMPLATE,
    TOP,
    WIDTH,
    Plot,
    axis_number,
    esc,
    group_columns,
    legend_list,
    nice,
    quantile,
    seconds,
    show,
    svg,
    svg_path,
    when,
    write_page,
)
from fleetbus.sim._report_data import (
    OTHER,
    STATUSES,
    ErrorKind,
    RoundData,
    RunReport,
    finite,
    is_number,
    read_run,
)
from fleetbus.sim.results import RunFiles

__all__ = [
    "MAX_COLUMNS",
    "REPORT_NAME",
    "ErrorKind",
    "RoundData",
    "RunReport",
    "read_run",
    "render_report",
    "write_report",
]

REPORT_NAME = "report.html"
"""The page's name in the run's directory, by default."""
VALUE_BINS = 30
"""Bins of a numeric answer's heat map and histogram, at most."""
CATEGORIES_SHOWN = 10
"""Answers (not numbers) shown by name; the others are counted as "other"."""
ERRORS_SHOWN = 12
"""Rows of the table of errors."""
TABLE_ROWS = 200
"""Rows of the table of rounds: the first and last half of them past that."""
METRIC_CHARTS = 24
"""Charts of ``apply``'s figures at most."""
METRIC_COLUMNS = 40
"""Columns of ``apply``'s figures in the table of rounds at most."""

_STATUS_COLOURS = {"ok": "#2f9e44", "error": "#e03131", "late": "#f08c00", "missing": "#868e96"}
_PALETTE = (
    "#4263eb", "#f76707", "#2f9e44", "#e64980", "#7048e8",
    "#0c8599", "#f59f00", "#c92a2a", "#5c940d", "#a61e4d",
)  # fmt: skip
_NUMBERS = "(numbers)"


def write_report(out: str | os.PathLike[str], path: str | os.PathLike[str] | None = None) -> Path:
    """Write the page of the run in ``out`` to ``path`` (``out/report.html``
    by default), replacing it whole; the path written.

    Raises:
        ConfigError: ``out`` holds no run, or the page cannot be written.
    """
    page = render_report(out)
    return write_page(page, Path(path) if path is not None else Path(out) / REPORT_NAME)


def render_report(out: str | os.PathLike[str]) -> str:
    """The page of the run in ``out``, as HTML.

    Raises:
        ConfigError: ``out`` holds no run (see :func:`read_run`).
    """
    return _Page(read_run(out)).render()


@dataclass(frozen=True, slots=True)
class _Bins:
    """Bins of numbers: ``count`` of them, ``step`` wide, from ``start``."""

    start: float
    step: float
    count: int

    @classmethod
    def over(cls, groups: Sequence[Sequence[float]]) -> _Bins:
        """At most :data:`VALUE_BINS` bins of a nice width over the numbers of
        ``groups`` (some of them not empty); one a number for a few integers."""
        filled = [g for g in groups if g]
        lo, hi = min(min(g) for g in filled), max(max(g) for g in filled)
        step = nice((hi - lo) / VALUE_BINS) if hi > lo else 1.0
        start = math.floor(lo / step) * step
        if all(v.is_integer() for g in filled for v in g):
            step = max(1.0, math.ceil(step))
            start = math.floor(lo / step) * step - (0.5 if step == 1 else 0.0)
        count = max(1, min(math.floor((hi - start) / step) + 1, VALUE_BINS + 1))
        return cls(start, step, count)

    def edge(self, b: int) -> float:
        """Where bin ``b`` starts."""
        return self.start + b * self.step

    def counts(self, values: Iterable[float]) -> list[int]:
        """How many ``values`` each bin holds."""
        found = [0] * self.count
        for v in values:
            found[min(max(int((v - self.start) / self.step), 0), self.count - 1)] += 1
        return found


class _Page:
    """The HTML of one :class:`RunReport`."""

    def __init__(self, report: RunReport) -> None:
        self.report = report
        self.rounds = report.rounds
        self.numbers = [r.round for r in self.rounds]
        self.columns = group_columns(self.numbers, "round")  # MAX_COLUMNS at most
        self.latencies = [sorted(r.latencies) for r in self.rounds]

    def render(self) -> str:
        report = self.report
        name = report.facts.get("simulation") or (
            report.state.simulation if report.state else report.out.name
        )
        body = [f"<h1>{esc(name)}</h1>", self._facts()]
        body += [f'<p class="note">{esc(note)}</p>' for note in report.notes]
        if not self.rounds:
            body.append('<p class="empty">No round has finished yet.</p>')
        else:
            body += [
                self._section("agents", "Agents per round", self._status()),
                self._section("latency", "Latency per round", self._latency()),
                self._section("answers", "Answers per round", self._answers()),
                self._section("metrics", "Figures per round", self._metrics()),
                self._section("errors", "Errors", self._errors()),
                self._section("rounds", "Rounds", self._table()),
            ]
        generated = when(time.time())
        return TEMPLATE.format(
            title=esc(f"{name}: simulation report"),
            css=CSS,
            body="\n".join(body),
            footer=esc(f"fleetbus sim report {report.out}, {generated}"),
        )

    @staticmethod
    def _section(section_id: str, title: str, content: str) -> str:
        return f'<section id="{section_id}"><h2>{esc(title)}</h2>{content}</section>'

    # -- the run's facts

    def _facts(self) -> str:
        report, facts, state = self.report, self.report.facts, self.report.state
        completed = state.completed if state is not None else len(self.rounds)
        planned = facts.get("rounds")
        if facts.get("finished") is True:
            progress = f"{completed} of {planned}: finished"
        elif is_number(planned):
            progress = (
                f"{completed} of {planned} finished: the run is under way, or was "
                "interrupted (the same `fleetbus sim run` command resumes it)"
            )
        else:
            progress = f"{completed} finished"
        totals = Counter({s: sum(r.status(s) for r in self.rounds) for s in STATUSES})
        rows = [
            ("description", facts.get("description") or None),
            ("run", facts.get("run_id") or (state.run_id if state else None)),
            ("agents", facts.get("agents") or (state.agents if state else None)),
            ("rounds", progress),
            ("order", facts.get("order")),
            (
                "deadline",
                seconds(facts["deadline"]) if is_number(facts.get("deadline")) else None,
            ),
            ("records", f"{report.records:,} read from {RunFiles.RESULTS}"),
            ("answers", ", ".join(f"{totals[s]:,} {s}" for s in STATUSES)),
            ("started", when(facts.get("started_at") or (state.started_at if state else 0))),
            ("updated", when(facts.get("updated_at")) if "updated_at" in facts else None),
            ("directory", str(report.out)),
        ]
        cells = "".join(
            f"<dt>{esc(k)}</dt><dd>{esc(v if isinstance(v, str) else show(v))}</dd>"
            for k, v in rows
            if v is not None
        )
        return f'<dl class="facts">{cells}</dl>'

    # -- agents per round

    def _status(self) -> str:
        columns, rounds = self.columns, self.rounds
        means = []  # a column's agents by status, per round
        for c in columns:
            group = rounds[c.start : c.end]
            means.append({s: sum(r.status(s) for r in group) / len(group) for s in STATUSES})
        plot = Plot(len(rounds), max((sum(m.values()) for m in means), default=1.0) or 1.0)
        parts = plot.frame(self.numbers, axis_number)
        for status in STATUSES:
            parts.append(f'<g fill="{_STATUS_COLOURS[status]}" class="bars">')
            for c, mean in zip(columns, means, strict=True):
                if not mean[status]:
                    continue
                below = sum(mean[s] for s in STATUSES[: STATUSES.index(status)])
                x0, x1 = plot.x(c.start), plot.x(c.end)
                top, bottom = plot.y(below + mean[status]), plot.y(below)
                parts.append(
                    f'<rect x="{x0 + 0.5:.1f}" y="{top:.1f}" width="{max(x1 - x0 - 1, 0.5):.1f}" '
                    f'height="{bottom - top:.1f}"/>'
                )
            parts.append("</g>")
        titles = [
            f"{c.label}{' (mean per round)' if c.end - c.start > 1 else ''}: "
            + ", ".join(f"{m[s]:,.4g} {s}" for s in STATUSES)
            for c, m in zip(columns, means, strict=True)
        ]
        parts += plot.hovers(columns, titles)
        legend = legend_list([(s, _STATUS_COLOURS[s]) for s in STATUSES])
        durations = [r.summary.duration if r.summary else None for r in rounds]
        rates = [r.summary.rate if r.summary else None for r in rounds]
        small = [
            self._line("chart-duration", "seconds per round", durations, seconds),
            self._line("chart-rate", "answers per second", rates, axis_number),
        ]
        return (
            svg("chart-status", "agents per round by status", parts)
            + legend
            + '<p class="caption">ok: answered in time; error: answered with an error, or an '
            "answer the simulation could not read; late: not answered by the deadline; "
            "missing: not asked before the deadline, or served by nobody.</p>"
            + f'<div class="small">{"".join(s for s in small if s)}</div>'
        )

    # -- latency per round

    def _latency(self) -> str:
        rounds, columns, ordered = self.rounds, self.columns, self.latencies
        if not any(ordered):
            return '<p class="empty">No latency recorded.</p>'
        q = [
            {p: quantile(o, p) for p in (0.1, 0.5, 0.9, 0.99, 1.0)} if o else None for o in ordered
        ]
        high = max(v[1.0] for v in q if v is not None)
        deadline = finite(self.report.facts.get("deadline"))
        if deadline is not None and deadline > high * 1.5:
            deadline = None  # far above every answer: it would flatten them
        plot = Plot(len(rounds), max(high, deadline or 0.0) or 1.0)
        parts = plot.frame(self.numbers, seconds)

        def line(p: float) -> str:
            points = [
                (plot.x(i + 0.5), plot.y(v[p])) if v is not None else None for i, v in enumerate(q)
            ]
            return svg_path(points)

        band_up = [(plot.x(i + 0.5), plot.y(v[0.9])) for i, v in enumerate(q) if v is not None]
        band_down = [(plot.x(i + 0.5), plot.y(v[0.1])) for i, v in enumerate(q) if v is not None]
        if len(band_up) == 1:  # one round: a band needs some width
            (x, up), (_, down) = band_up[0], band_down[0]
            band_up, band_down = [(x - 4, up), (x + 4, up)], [(x - 4, down), (x + 4, down)]
        parts.append(f'<path class="band" d="{svg_path(band_up + band_down[::-1])}Z"/>')
        parts.append(f'<path class="line p50" d="{line(0.5)}"/>')
        parts.append(f'<path class="line p99" d="{line(0.99)}"/>')
        parts.append(f'<path class="line max" d="{line(1.0)}"/>')
        dots = "".join(
            f'<circle cx="{plot.x(i + 0.5):.1f}" cy="{plot.y(v[0.5]):.1f}" r="2.5"/>'
            for i, v in enumerate(q)
            if v is not None and len(rounds) <= MAX_COLUMNS
        )
        parts.append(f'<g class="dots p50">{dots}</g>')
        if deadline is not None:
            y = plot.y(deadline)
            parts.append(
                f'<line class="deadline" x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{y:.1f}" '
                f'y2="{y:.1f}"/><text class="deadline" x="{WIDTH - RIGHT - 4}" y="{y - 4:.1f}" '
                f'text-anchor="end">deadline {seconds(deadline)}</text>'
            )
        titles = []
        for c in columns:
            merged = sorted(x for o in ordered[c.start : c.end] for x in o)
            if not merged:
                titles.append(f"{c.label}: no latency recorded")
                continue
            titles.append(
                f"{c.label}: {len(merged):,} answered; "
                + ", ".join(
                    f"{name} {seconds(quantile(merged, p))}"
                    for name, p in (("p10", 0.1), ("p50", 0.5), ("p90", 0.9), ("p99", 0.99))
                )
                + f", max {seconds(merged[-1])}"
            )
        parts += plot.hovers(columns, titles)
        legend = legend_list(
            [("p10-p90", "#a5d8ff"), ("median", "#1c7ed6"), ("p99", "#7048e8"), ("max", "#adb5bd")]
        )
        return (
            svg("chart-latency", "latency per round: percentiles", parts)
            + legend
            + '<p class="caption">Seconds from an agent\'s request to its answer, of the '
            "requests answered (ok or error); a late request has no latency.</p>"
        )

    # -- answers per round

    def _answers(self) -> str:
        rounds = self.rounds
        out = []
        if any(r.numbers for r in rounds):
            out.append(self._numbers())
        categories = [r.values for r in rounds]
        what = "values"
        if any(categories) and any(r.numbers for r in rounds):
            categories = [r.values + Counter({_NUMBERS: len(r.numbers)}) for r in rounds]
        if not any(categories) and not any(r.numbers for r in rounds):
            categories, what = [r.texts for r in rounds], "answers"
        if any(categories):
            out.append(self._categories(categories, what))
        return "".join(out) or '<p class="empty">No answer recorded.</p>'

    def _numbers(self) -> str:
        rounds, columns = self.rounds, self.columns
        bins = _Bins.over([r.numbers for r in rounds])
        grid = [bins.counts(v for r in rounds[c.start : c.end] for v in r.numbers) for c in columns]
        shares = [[n / (sum(g) or 1) for n in g] for g in grid]
        top = max(max(s) for s in shares) or 1.0
        tick = max(nice((bins.edge(bins.count) - bins.start) / 5), bins.step)
        plot = Plot(len(rounds), bins.edge(bins.count), low=bins.start, step=tick)
        parts = plot.frame(self.numbers, axis_number)
        parts.append('<g class="cells" fill="#1c7ed6">')
        for c, row in zip(columns, shares, strict=True):
            x0, x1 = plot.x(c.start), plot.x(c.end)
            for b, share in enumerate(row):
                if share:
                    y1, y0 = plot.y(bins.edge(b)), plot.y(bins.edge(b + 1))
                    parts.append(
                        f'<rect x="{x0:.1f}" y="{y0:.1f}" width="{x1 - x0:.1f}" '
                        f'height="{y1 - y0:.1f}" fill-opacity="{0.08 + 0.92 * share / top:.2f}"/>'
                    )
        parts.append("</g>")
        medians = [
            (plot.x(i + 0.5), plot.y(quantile(sorted(r.numbers), 0.5))) if r.numbers else None
            for i, r in enumerate(rounds)
        ]
        parts.append(f'<path class="line median" d="{svg_path(medians)}"/>')
        titles = []
        for c in columns:
            values = sorted(v for r in rounds[c.start : c.end] for v in r.numbers)
            if not values:
                titles.append(f"{c.label}: no numeric answer")
                continue
            titles.append(
                f"{c.label}: {len(values):,} answers; min {show(values[0])}, "
                f"p10 {show(quantile(values, 0.1))}, median {show(quantile(values, 0.5))}, "
                f"p90 {show(quantile(values, 0.9))}, max {show(values[-1])}"
            )
        parts += plot.hovers(columns, titles)
        last = rounds[max(i for i, r in enumerate(rounds) if r.numbers)]
        legend = [("share of the round's answers in a bin", "#1c7ed6"), ("median", "#e8590c")]
        return (
            svg("chart-answers", "numeric answers per round: share in each bin", parts)
            + legend_list(legend)
            + self._histogram(last)
        )

    def _histogram(self, data: RoundData) -> str:
        """The numeric answers of one round, in bins of their own."""
        bins = _Bins.over([data.numbers])
        found = bins.counts(data.numbers)
        size = (WIDTH, 200)
        inner = size[1] - TOP - BOTTOM
        width = (WIDTH - LEFT - RIGHT) / bins.count
        top = max(found) or 1
        parts = ['<g class="axis">']
        every = max(1, math.ceil(bins.count / 10))
        for b in range(0, bins.count + 1, every):
            x = LEFT + b * width
            parts.append(
                f'<text x="{x:.1f}" y="{size[1] - BOTTOM + 16}" text-anchor="middle">'
                f"{esc(axis_number(bins.edge(b)))}</text>"
            )
        parts.append(
            f'<text x="{LEFT - 6}" y="{TOP + 4}" text-anchor="end">{top:,}</text>'
            f'<text x="{LEFT - 6}" y="{TOP + inner + 4}" text-anchor="end">0</text></g>'
            '<g class="bars" fill="#1c7ed6">'
        )
        for b, n in enumerate(found):
            h = inner * n / top
            low, high = axis_number(bins.edge(b)), axis_number(bins.edge(b + 1))
            parts.append(
                f'<rect x="{LEFT + b * width + 0.5:.1f}" y="{TOP + inner - h:.1f}" '
                f'width="{max(width - 1, 0.5):.1f}" height="{h:.1f}">'
                f"<title>{esc(low)} to {esc(high)}: {n:,}</title></rect>"
            )
        parts.append("</g>")
        label = f"the answers of round {data.round}"
        return f"<h3>{esc(label.capitalize())}</h3>" + svg(
            "chart-histogram", label, parts, size=size
        )

    def _categories(self, categories: Sequence[Counter[str]], what: str) -> str:
        rounds, columns = self.rounds, self.columns
        total: Counter[str] = Counter()
        for counter in categories:
            total.update(counter)
        named = [name for name, _ in total.most_common() if name != OTHER][:CATEGORIES_SHOWN]
        colours = {name: _PALETTE[i % len(_PALETTE)] for i, name in enumerate(named)}
        plot = Plot(len(rounds), 1.0, step=0.25)
        parts = plot.frame(self.numbers, lambda v: f"{v:.0%}")
        titles = []
        for c in columns:
            merged: Counter[str] = Counter()
            for counter in categories[c.start : c.end]:
                merged.update(counter)
            size = sum(merged.values())
            if not size:
                titles.append(f"{c.label}: no answer")
                continue
            x0, x1 = plot.x(c.start), plot.x(c.end)
            below = 0.0
            shares = [(name, merged[name]) for name in named if merged[name]]
            shares.append((OTHER, size - sum(n for _, n in shares)))
            for name, n in shares:
                if not n:
                    continue
                top, bottom = plot.y(below + n / size), plot.y(below)
                parts.append(
                    f'<rect x="{x0 + 0.5:.1f}" y="{top:.1f}" width="{max(x1 - x0 - 1, 0.5):.1f}" '
                    f'height="{bottom - top:.1f}" fill="{colours.get(name, "#ced4da")}"/>'
                )
                below += n / size
            titles.append(
                f"{c.label}: {size:,} answers; "
                + ", ".join(f"{name} {n:,}" for name, n in merged.most_common(6))
            )
        parts += plot.hovers(columns, titles)
        legend = [(name, colours[name]) for name in named]
        if len(total) > len(named):
            legend.append((OTHER, "#ced4da"))
        caption = (
            "The parsed value of each answer that is ok"
            if what == "values"
            else "The text of each answer that is ok (the simulation reads no value from it)"
        )
        return (
            svg("chart-categories", f"most frequent {what} per round", parts)
            + legend_list(legend)
            + f'<p class="caption">{caption}: the {len(named)} most frequent, by share of '
            "the round's answers.</p>"
        )

    # -- figures per round

    def _metrics(self) -> str:
        rows = [_flat(r.summary.metrics) if r.summary else {} for r in self.rounds]
        names: dict[str, None] = {}
        for row in rows:
            names.update(dict.fromkeys(row))
        numeric = [
            n for n in names
            if all(is_number(row.get(n)) or row.get(n) is None for row in rows)
            and any(is_number(row.get(n)) for row in rows)
        ]  # fmt: skip
        if not numeric:
            return (
                '<p class="empty">No numeric figures (what the simulation\'s apply returned).</p>'
            )
        charts = [
            self._line(f"chart-metric-{i}", name, [row.get(name) for row in rows], axis_number)
            for i, name in enumerate(numeric[:METRIC_CHARTS])
        ]
        more = len(numeric) - METRIC_CHARTS
        note = (
            f'<p class="caption">And {more:,} more in {RunFiles.SUMMARY}.</p>' if more > 0 else ""
        )
        return f'<div class="small">{"".join(c for c in charts if c)}</div>{note}'

    def _line(
        self, chart_id: str, name: str, values: Sequence[Any], fmt: Callable[[float], str]
    ) -> str:
        """A small chart of one figure per round."""
        numbers = [finite(v) for v in values]
        known = [v for v in numbers if v is not None]
        if not known:
            return ""
        lo, hi = min(*known, 0.0), max(known)
        plot = Plot(len(values), hi if hi > lo else lo + 1.0, low=lo, size=SMALL)
        parts = plot.frame(self.numbers, fmt)
        points = [
            (plot.x(i + 0.5), plot.y(v)) if v is not None else None for i, v in enumerate(numbers)
        ]
        parts.append(f'<path class="line metric" d="{svg_path(points)}"/>')
        if len(values) <= MAX_COLUMNS:
            parts.append('<g class="dots metric">')
            parts += [f'<circle cx="{p[0]:.1f}" cy="{p[1]:.1f}" r="3"/>' for p in points if p]
            parts.append("</g>")
        titles = []
        for c in self.columns:
            shown = [
                f"{self.rounds[i].round}: {fmt(v)}"
                for i in range(c.start, c.end)
                if (v := numbers[i]) is not None
            ]
            titles.append(f"{name}, round " + "; ".join(shown[:12]) if shown else c.label)
        parts += plot.hovers(self.columns, titles)
        chart = svg(chart_id, name, parts, size=SMALL)
        return f"<figure><figcaption>{esc(name)}</figcaption>{chart}</figure>"

    # -- errors

    def _errors(self) -> str:
        kinds = sorted(self.report.errors.values(), key=lambda k: -k.count)
        if not kinds:
            return '<p class="empty">No agent failed in a round.</p>'
        rows = "".join(
            f'<tr><td class="status-{esc(k.status)}">{esc(k.status)}</td>'
            f'<td>{esc(k.kind)}</td><td class="n">{k.count:,}</td>'
            f'<td class="n">{k.first}{"" if k.first == k.last else f"-{k.last}"}</td>'
            f'<td class="example">{esc(k.example)}</td></tr>'
            for k in kinds[:ERRORS_SHOWN]
        )
        more = len(kinds) - ERRORS_SHOWN
        note = f'<p class="caption">{more} more kinds.</p>' if more > 0 else ""
        return (
            '<p class="caption">The agents that were not ok (their counts per round are in '
            '"Agents per round"), by what failed.</p><div class="scroll"><table class="errors">'
            "<thead><tr><th>status</th><th>what</th><th>agents</th><th>rounds</th>"
            f"<th>one of them</th></tr></thead><tbody>{rows}</tbody></table></div>{note}"
        )

    # -- the table of rounds

    def _table(self) -> str:
        rounds = self.rounds
        metrics = [_flat(r.summary.metrics) if r.summary else {} for r in rounds]
        found: dict[str, None] = {}
        for row in metrics:
            found.update(dict.fromkeys(row))
        names = list(found)[:METRIC_COLUMNS]
        head = ["round", *STATUSES, "seconds", "per s", "p50", "p99", *names]
        shown = list(range(len(rounds)))
        if len(shown) > TABLE_ROWS:
            shown = [*shown[: TABLE_ROWS // 2], -1, *shown[-TABLE_ROWS // 2 :]]
        rows = []
        for i in shown:
            if i < 0:
                rows.append(
                    f'<tr class="gap"><td colspan="{len(head)}">… {len(rounds) - TABLE_ROWS:,} '
                    f"rounds not shown (all in {RunFiles.SUMMARY}) …</td></tr>"
                )
                continue
            r, o = rounds[i], self.latencies[i]
            cells = [str(r.round), *(f"{r.status(s):,}" for s in STATUSES)]
            cells += (
                [f"{r.summary.duration:.2f}", f"{r.summary.rate:,.1f}"] if r.summary else ["", ""]
            )
            cells += [seconds(quantile(o, p)) if o else "" for p in (0.5, 0.99)]
            cells += [show(metrics[i].get(n)) for n in names]
            rows.append("<tr>" + "".join(f"<td>{esc(c)}</td>" for c in cells) + "</tr>")
        header = "".join(f"<th>{esc(h)}</th>" for h in head)
        more = len(found) - len(names)
        note = f'<p class="caption">And {more:,} more figures in {RunFiles.SUMMARY}.</p>'
        return (
            '<div class="scroll rounds-table"><table class="rounds">'
            f"<thead><tr>{header}</tr></thead><tbody>{''.join(rows)}</tbody></table></div>"
            + (note if more > 0 else "")
        )


def _flat(metrics: dict[str, Any]) -> dict[str, Any]:
    """``apply``'s figures, a dict of figures as ``name.key``."""
    flat: dict[str, Any] = {}
    for name, value in metrics.items():
        if isinstance(value, dict):
            flat.update({f"{name}.{k}": v for k, v in value.items()})
        else:
            flat[str(name)] = value
    return flat
