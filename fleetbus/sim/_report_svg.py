"""The pieces of a simulation report's page: those every report shares
(:mod:`fleetbus._report_page`), with the rounds across the charts.

A :class:`Plot` maps rounds across (one column each, or a group of rounds
per column past :data:`MAX_COLUMNS`: :func:`group_rounds`) and a value up.
"""

from __future__ import annotations

from collections.abc import Sequence

from fleetbus._report_page import (
    BOTTOM,
    CSS,
    HEIGHT,
    LEFT,
    MAX_COLUMNS,
    RIGHT,
    SMALL,
    TEMPLATE,
    TOP,
    WIDTH,
    Column,
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
)

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
    "group_rounds",
    "legend_list",
    "nice",
    "quantile",
    "seconds",
    "show",
    "svg",
    "svg_path",
    "when",
]


def group_rounds(numbers: Sequence[int]) -> list[Column]:
    """The columns of a chart of the rounds ``numbers``: one a round, or
    groups of consecutive rounds, :data:`MAX_COLUMNS` at most."""
    return group_columns(numbers, "round")
