"""The page of an evaluation run, and of two runs side by side, from the
files a run writes; ``fleetbus eval report`` and its misuses."""

from __future__ import annotations

import re
import time
from pathlib import Path

import orjson
import pytest

from fleetbus.cli.main import main
from fleetbus.errors import ConfigError
from fleetbus.evals import (
    CaseResult,
    EvalFiles,
    Grade,
    RunFacts,
    ToolCallMade,
    read_run,
    render_report,
    write_report,
)
from fleetbus.evals.results import summarize


def result(
    index: int, passed: bool, *, error: str | None = None, latency: float = 1.0
) -> CaseResult:
    grades = [] if error else [Grade("numeric", passed, "35 is 35" if passed else "36 is not 35")]
    return CaseResult(
        index=index,
        case_id=f"case-{index}",
        input=f"What is {index} + 1?",
        answer=f"It is {index + 1}.",
        passed=passed and error is None,
        grades=grades,
        latency=latency,
        input_tokens=100 + index,
        output_tokens=10,
        model_calls=2,
        models=["small-model"],
        tool_calls=[ToolCallMade("calculator", {"expr": f"{index} + 1"}, "success")],
        finished_reason="" if error else "completed",
        error=error,
    )


def make_run(
    out: Path, results: list[CaseResult], *, label: str = "", finished: bool = True
) -> Path:
    files = EvalFiles(out)
    files.prepare()
    facts = RunFacts(
        dataset="examples/evals/arithmetic.jsonl",
        agent="assistant",
        label=label,
        concurrency=4,
        timeout=120.0,
        started_at=time.time(),
        finished_at=time.time() if finished else 0.0,
        cases=len(results) + (0 if finished else 3),
    )
    # In the order they ended, as a run appends them.
    files.results.write_bytes(b"".join(orjson.dumps(r.to_dict()) + b"\n" for r in results[::-1]))
    files.write_summary(summarize(facts, results))
    return out


def charts(page: str) -> set[str]:
    return set(re.findall(r'<svg id="([\w-]+)"', page))


def test_the_page_of_a_run(tmp_path: Path) -> None:
    results = [
        result(0, True, latency=0.5),
        result(1, False),
        result(2, False, error="CallTimeoutError: no answer"),
    ]
    out = make_run(tmp_path / "run", results)
    run = read_run(out)
    assert [r.case_id for r in run.results] == ["case-0", "case-1", "case-2"]  # the dataset's order
    assert run.facts.passed == 1
    assert run.facts.errors == 1
    assert run.facts.graders == {"numeric": [1, 2]}
    path = write_report(out)
    assert path == out / "report.html"
    page = path.read_text()
    assert charts(page) == {"chart-graders", "chart-latency", "chart-tokens", "chart-tools"}
    assert "<h1>run</h1>" in page  # no label: the directory's name
    assert "<td>pass rate</td><td>33.3%</td>" in page
    assert "small-model (3 cases)" in page
    assert "36 is not 35" in page
    assert "CallTimeoutError: no answer" in page
    assert "calculator({&quot;expr&quot;:&quot;1 + 1&quot;}) success" in page
    assert "<title>case 2\ncase-1: fail, 1 s</title>" in page
    assert 'class="outcome-error">error</td>' in page
    for needle in ("http:", "https:", "<script", "<link", "<img", "@import", "url("):
        assert needle not in page


def test_two_runs_side_by_side(tmp_path: Path) -> None:
    old = make_run(
        tmp_path / "old", [result(0, True), result(1, False), result(2, True)], label="prompt A"
    )
    new = make_run(
        tmp_path / "new", [result(0, True), result(1, True), result(3, False)], label="prompt B"
    )
    path = write_report(new, baseline=old)
    assert path == new / "compare.html"
    page = path.read_text()
    assert "<h1>prompt A vs prompt B</h1>" in page
    assert charts(page) == {"chart-graders", "chart-latency", "chart-tokens", "chart-tools"}
    assert "1 fixed, 0 regressed, 1 still passing, 0 still failing, 1 only in prompt A, " in page
    assert "1 only in prompt B" in page
    # pass rate 2/3 -> 2/3 (a case in each run the other does not have)
    assert "<td>pass rate</td><td>66.7%</td><td>66.7%</td><td>=</td>" in page
    assert 'class="change-fixed">fixed</td>' in page
    assert re.search(r"case-1: prompt A: fail, [^\n]*\ncase-1: prompt B: pass", page)
    assert "case-3: prompt A: not in this run" in page


def test_a_run_that_has_not_finished(tmp_path: Path) -> None:
    out = make_run(tmp_path / "run", [result(0, True)], finished=False)
    with (out / "results.jsonl").open("ab") as f:
        f.write(b'{"index": 1, "broken\n')
    page = render_report(read_run(out))
    assert "The run has not finished (1 of 4 cases)" in page
    assert "1 lines of results.jsonl cannot be read." in page


def test_not_a_run(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"is not an evaluation run: it has no summary\.json"):
        read_run(tmp_path)
    with pytest.raises(ConfigError, match="is not a directory"):
        read_run(tmp_path / "nothing")
    out = make_run(tmp_path / "run", [result(0, True)])
    with pytest.raises(ConfigError, match="already holds an evaluation run"):
        EvalFiles(out).prepare()


def test_the_report_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    old = make_run(tmp_path / "old", [result(0, False)])
    new = make_run(tmp_path / "new", [result(0, True)])
    assert main(["eval", "report", str(new)]) == 0
    assert capsys.readouterr().out.strip() == str(new / "report.html")
    target = tmp_path / "both.html"
    assert main(["eval", "report", str(old), str(new), "--out", str(target)]) == 0
    assert capsys.readouterr().out.strip() == str(target)
    assert "1 fixed" in target.read_text()
    assert main(["eval", "report", str(tmp_path / "nothing")]) == 1
    assert "is not a directory" in " ".join(capsys.readouterr().err.split())


@pytest.mark.parametrize(
    ("argv", "problem"),
    [
        (["eval", "cases.jsonl"], "give the agent to evaluate: --agent NAME"),
        (["eval", "a.jsonl", "b.jsonl", "--agent", "x"], "give one DATASET.jsonl"),
        (["eval", "report"], "report takes one run directory, or two to compare"),
        (["eval", "report", "a", "b", "c"], "report takes one run directory, or two"),
        (["eval", "report", "a", "--agent", "x"], "--agent go with running a dataset"),
    ],
)
def test_misuses(argv: list[str], problem: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: fleetbus eval"), err
    assert f"fleetbus eval: error: {problem}" in err


def test_a_bad_dataset_is_said_before_connecting(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"id": "x", "input": "hi", "expect": {"kind": "fuzzy"}}\n')
    # No server on that port: the dataset's error comes first.
    argv = ["eval", str(path), "--agent", "a", "--nats", "nats://127.0.0.1:1"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert f"{path}:1: expect.0: unknown grader kind 'fuzzy'" in " ".join(err.split())
