"""The pieces of a report's page, shared by the reports of simulations
(:mod:`fleetbus.sim.report`) and of evaluations (:mod:`fleetbus.evals.report`):
SVG charts drawn by hand, the template, the styles, the atomic write.

A :class:`Plot` maps numbered items across — rounds, cases — (one column
each, or a group of consecutive items per column past :data:`MAX_COLUMNS`:
:func:`group_columns`) and a value up; charts are built as lists of SVG
strings. Every text that comes from a run goes through :func:`esc`. The
page (:data:`TEMPLATE`) has no script and loads nothing: its
Content-Security-Policy forbids it.
"""

from __future__ import annotations

import html
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from fleetbus.errors import ConfigError

__all__ = [
    "BOTTOM",
    "CSS",
    "HEIGHT",
    "LEFT",
    "MAX_COLUMNS",
    "RIGHT",
    "SMALL",
    "TEMPLATE",
    "TOP",
    "WIDTH",
    "Column",
    "Plot",
    "axis_number",
    "esc",
    "finite",
    "group_columns",
    "is_number",
    "legend_list",
    "nice",
    "quantile",
    "seconds",
    "show",
    "svg",
    "svg_path",
    "when",
    "write_page",
]

MAX_COLUMNS = 120
"""Bars (or heat-map columns) in a chart at most; more items share them."""


def is_number(value: Any) -> bool:
    """Whether ``value`` is an int or a float (not a bool)."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def finite(value: Any) -> float | None:
    """``value`` as a float when it is a finite number (not a bool)."""
    if is_number(value) and math.isfinite(value):
        return float(value)
    return None


def write_page(page: str, target: Path) -> Path:
    """Write ``page`` to ``target``, replacing it whole; ``target``.

    Raises:
        ConfigError: the page cannot be written.
    """
    tmp = target.with_name(f".{target.name}.tmp")
    try:
        tmp.write_text(page, encoding="utf-8")
        os.replace(tmp, target)
    except OSError as exc:
        raise ConfigError(f"cannot write {target}: {exc.strerror or exc}") from exc
    return target


def esc(value: Any) -> str:
    """Text of a run, safe in HTML and SVG (text and attribute values)."""
    return html.escape(str(value), quote=True)


def show(value: Any) -> str:
    """A figure of a run in a table cell or a tooltip: short."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= 1e5 else f"{value:.4g}"
    text = value if isinstance(value, str) else orjson.dumps(value, default=str).decode()
    return text if len(text) <= 60 else text[:59] + "…"


def seconds(value: float) -> str:
    """A duration, in milliseconds under a second (whole seconds from 1,000)."""
    if value < 1:
        return f"{value * 1000:.0f} ms"
    return f"{value:.3g} s" if value < 1000 else f"{value:,.0f} s"


def when(stamp: Any) -> str:
    """A Unix time, in UTC ("unknown" when it is not one)."""
    if not is_number(stamp) or stamp <= 0:
        return "unknown"
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(stamp))


def quantile(ordered: Sequence[float], p: float) -> float:
    """The ``p`` quantile (0-1) of sorted values, interpolated linearly."""
    at = (len(ordered) - 1) * p
    low = math.floor(at)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (at - low)


def nice(x: float) -> float:
    """The smallest of 1, 2, 5 times a power of ten that is at least ``x``."""
    if not x > 0:
        return 1.0
    base = 10.0 ** math.floor(math.log10(x))
    return next(m * base for m in (1, 2, 5, 10) if m * base >= x * (1 - 1e-9))


@dataclass(slots=True)
class Column:
    """Items ``items[start:end]`` (rounds, cases), drawn as one bar."""

    start: int
    end: int
    label: str


def group_columns(numbers: Sequence[int], unit: str = "round") -> list[Column]:
    """The columns of a chart of the items numbered ``numbers`` (``unit``
    names one: ``round``, ``case``): one an item, or groups of consecutive
    items, :data:`MAX_COLUMNS` at most."""
    n = len(numbers)
    width = max(1, math.ceil(n / MAX_COLUMNS))
    columns = []
    for start in range(0, n, width):
        end = min(start + width, n)
        first, last = numbers[start], numbers[end - 1]
        label = f"{unit} {first}" if end == start + 1 else f"{unit}s {first}-{last}"
        columns.append(Column(start, end, label))
    return columns


WIDTH, HEIGHT = 960, 260
"""A chart's size (its SVG's view box), before the page scales it."""
SMALL = (480, 200)
"""The size of a small chart, two of them side by side."""
LEFT, RIGHT, TOP, BOTTOM = 64, 16, 14, 36
"""The margins around a chart's plot: its axes' labels."""


class Plot:
    """A chart's coordinates: ``n`` items across (rounds, or what ``unit``
    names, written under the axis), ``low`` to ``high`` up (widened to ticks
    ``step`` apart unless ``step`` is given), in a chart of ``size``."""

    def __init__(
        self,
        n: int,
        high: float,
        *,
        low: float = 0.0,
        step: float | None = None,
        size: tuple[int, int] = (WIDTH, HEIGHT),
        unit: str = "round",
    ) -> None:
        self.n = max(n, 1)
        self.size = size
        self.unit = unit
        if step is None:
            span = high - low
            step = nice(span / 4) if span > 0 else nice(abs(high) or 1.0)
            low = math.floor(low / step) * step
            high = max(math.ceil(high / step) * step, low + step)
        self.step, self.low, self.high = step, low, high
        self.width = size[0] - LEFT - RIGHT
        self.height = size[1] - TOP - BOTTOM

    def x(self, index: float) -> float:
        """The left edge of item ``index`` (its centre at ``index + 0.5``)."""
        return LEFT + index * self.width / self.n

    def y(self, value: float) -> float:
        return TOP + self.height * (1 - (value - self.low) / (self.high - self.low))

    def frame(self, numbers: Sequence[int], fmt: Callable[[float], str]) -> list[str]:
        """Grid lines, the value axis (``fmt`` writes a value) and the axis
        of the items ``numbers``."""
        parts = ['<g class="axis">']
        tick = math.ceil(self.low / self.step - 1e-9) * self.step
        while tick <= self.high + self.step / 1e6:
            y = self.y(tick)
            parts.append(
                f'<line x1="{LEFT}" x2="{LEFT + self.width}" y1="{y:.1f}" y2="{y:.1f}" '
                'class="grid"/>'
                f'<text x="{LEFT - 6}" y="{y + 4:.1f}" text-anchor="end">{esc(fmt(tick))}</text>'
            )
            tick += self.step
        every = max(1, int(nice(len(numbers) / (10 if self.size[0] >= WIDTH else 5))))
        shown = [i for i, number in enumerate(numbers) if number % every == 0]
        if not shown or shown[0] > every / 2:
            shown.insert(0, 0)
        for i in shown:
            x = self.x(i + 0.5)
            y = TOP + self.height + 16
            parts.append(f'<text x="{x:.1f}" y="{y}" text-anchor="middle">{numbers[i]}</text>')
        parts.append(
            f'<text x="{LEFT + self.width / 2:.0f}" y="{self.size[1] - 4}" text-anchor="middle" '
            f'class="label">{esc(self.unit)}</text></g>'
        )
        return parts

    def hovers(self, columns: Sequence[Column], titles: Sequence[str]) -> list[str]:
        """A transparent band per column whose title is its figures."""
        parts = ['<g class="hover">']
        for column, title in zip(columns, titles, strict=True):
            x0, x1 = self.x(column.start), self.x(column.end)
            parts.append(
                f'<rect x="{x0:.1f}" y="{TOP}" width="{x1 - x0:.1f}" height="{self.height}">'
                f"<title>{esc(title)}</title></rect>"
            )
        parts.append("</g>")
        return parts


def svg_path(points: Sequence[tuple[float, float] | None]) -> str:
    """An SVG path through the points, broken where one is ``None``."""
    out: list[str] = []
    pen = "M"
    for point in points:
        if point is None:
            pen = "M"
            continue
        out.append(f"{pen}{point[0]:.1f} {point[1]:.1f}")
        pen = "L"
    return "".join(out)


def svg(
    chart_id: str, label: str, parts: Sequence[str], *, size: tuple[int, int] = (WIDTH, HEIGHT)
) -> str:
    """A chart: an ``<svg>`` of ``parts``, named ``label`` for screen readers
    and as its tooltip."""
    return (
        f'<svg id="{chart_id}" class="chart" viewBox="0 0 {size[0]} {size[1]}" role="img" '
        f'aria-label="{esc(label)}"><title>{esc(label)}</title>{"".join(parts)}</svg>'
    )


def legend_list(items: Sequence[tuple[str, str]]) -> str:
    """A chart's legend: a swatch of each colour and its name."""
    entries = "".join(
        f'<li><span class="swatch" style="background:{colour}"></span>{esc(name)}</li>'
        for name, colour in items
    )
    return f'<ul class="legend">{entries}</ul>'


def axis_number(value: float) -> str:
    """A number on an axis or in a tooltip: four digits at most, but an integer part."""
    if abs(value) >= 1e4:
        return f"{value:,.0f}"
    return f"{value:.4g}"


TEMPLATE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; style-src 'unsafe-inline'">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{title}</title>
<style>{css}</style>
</head>
<body>
<main>
{body}
</main>
<footer>{footer}</footer>
</body>
</html>
"""

CSS = """
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; color: #212529;
  background: #f8f9fa; margin: 0; }
main { max-width: 1000px; margin: 0 auto; padding: 16px 20px 8px; }
h1 { font-size: 24px; margin: 8px 0 12px; }
h2 { font-size: 18px; margin: 28px 0 8px; border-bottom: 1px solid #dee2e6; padding-bottom: 4px; }
h3 { font-size: 14px; margin: 16px 0 4px; color: #495057; }
section { background: #fff; border: 1px solid #e9ecef; border-radius: 6px; padding: 4px 16px 12px;
  margin: 16px 0; }
.facts { display: grid; grid-template-columns: max-content 1fr; gap: 2px 16px; margin: 0; }
.facts dt { color: #868e96; } .facts dd { margin: 0; }
.note { background: #fff3bf; border: 1px solid #ffe066; border-radius: 4px; padding: 6px 10px; }
.empty, .caption { color: #868e96; } .caption { font-size: 12px; margin: 4px 0; }
svg.chart { display: block; width: 100%; height: auto; }
svg text { font-size: 11px; fill: #495057; }
.axis .grid { stroke: #e9ecef; stroke-width: 1; }
.axis .label { fill: #868e96; }
.hover rect { fill: transparent; } .hover rect:hover { fill: rgba(33, 37, 41, 0.07); }
.line { fill: none; stroke-width: 2; stroke-linejoin: round; }
.p50 { stroke: #1c7ed6; fill: #1c7ed6; } .dots.p50 { stroke: none; }
.p99 { stroke: #7048e8; stroke-dasharray: 5 3; } .max { stroke: #adb5bd; stroke-width: 1; }
.band { fill: #a5d8ff; fill-opacity: 0.6; stroke: none; }
.median { stroke: #e8590c; } .metric { stroke: #1c7ed6; } .dots.metric { fill: #1c7ed6; }
line.deadline { stroke: #e03131; stroke-dasharray: 2 3; } text.deadline { fill: #e03131; }
.legend { list-style: none; display: flex; flex-wrap: wrap; gap: 4px 16px; padding: 0;
  margin: 4px 0; font-size: 12px; }
.swatch { display: inline-block; width: 10px; height: 10px; border-radius: 2px;
  margin-right: 5px; vertical-align: -1px; }
.small { display: grid; grid-template-columns: repeat(auto-fill, minmax(420px, 1fr)); gap: 8px; }
.small svg.chart { max-height: 220px; }
figure { margin: 8px 0 0; } figcaption { font-weight: 600; font-size: 13px; }
.scroll { overflow-x: auto; }
table { border-collapse: collapse; font-size: 12px; width: 100%; }
th, td { border-bottom: 1px solid #e9ecef; padding: 3px 8px; text-align: right;
  white-space: nowrap; }
th { background: #f1f3f5; position: sticky; top: 0; }
.errors th, .errors td { text-align: left; } .errors td.n { text-align: right; }
.rounds-table { max-height: 520px; overflow-y: auto; }
.errors td.example { white-space: normal; color: #495057; font-family: ui-monospace, monospace; }
.status-error { color: #e03131; } .status-late { color: #f08c00; }
.status-missing { color: #868e96; }
tr.gap td { text-align: center; color: #868e96; }
footer { max-width: 1000px; margin: 0 auto; padding: 8px 20px 24px; color: #adb5bd;
  font-size: 12px; }
"""
