"""Evaluations: a dataset of cases sent to an agent of the fleet, each
answer graded, a report written (``fleetbus eval``, docs/evals.md).

:func:`load_dataset` reads a dataset (JSON lines, one :class:`Case` a line,
each with its graders); :class:`Evaluation` runs it against an agent over
the bus and writes the run's directory (:class:`EvalFiles`: JSON lines of
:class:`CaseResult` and a summary); :func:`read_run` reads a run back;
:func:`write_report` writes the HTML page of a run, or of two runs compared
side by side. :func:`grade` is what each grader checks.
"""

from fleetbus.evals.dataset import (
    GRADER_KINDS,
    Case,
    Dataset,
    ExactGrader,
    Grader,
    JsonSchemaGrader,
    JudgeGrader,
    NumericGrader,
    RegexGrader,
    ToolCallGrader,
    load_dataset,
    parse_case,
)
from fleetbus.evals.graders import VERDICT_SCHEMA, Grade, Reply, ToolCallMade, grade
from fleetbus.evals.report import render_report, write_report
from fleetbus.evals.results import CaseResult, EvalFiles, EvalRun, RunFacts, read_run
from fleetbus.evals.runner import (
    DEFAULT_CONCURRENCY,
    DEFAULT_TIMEOUT,
    EvalListener,
    Evaluation,
)

__all__ = [
    "DEFAULT_CONCURRENCY",
    "DEFAULT_TIMEOUT",
    "GRADER_KINDS",
    "VERDICT_SCHEMA",
    "Case",
    "CaseResult",
    "Dataset",
    "EvalFiles",
    "EvalListener",
    "EvalRun",
    "Evaluation",
    "ExactGrader",
    "Grade",
    "Grader",
    "JsonSchemaGrader",
    "JudgeGrader",
    "NumericGrader",
    "RegexGrader",
    "Reply",
    "RunFacts",
    "ToolCallGrader",
    "ToolCallMade",
    "grade",
    "load_dataset",
    "parse_case",
    "read_run",
    "render_report",
    "write_report",
]
