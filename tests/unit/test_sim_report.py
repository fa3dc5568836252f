"""``fleetbus sim report``: the page of a run written as the runner writes one
(RunFiles), of a run under way or interrupted, of a run with only some of
its files, of a large run; a directory that is not a run gets one line."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pytest

from fleetbus.cli.main import main
from fleetbus.errors import ConfigError
from fleetbus.sim import RoundSummary, RunFiles, RunState
from fleetbus.sim.report import MAX_COLUMNS, read_run, render_report, write_report

Record = Callable[[int, int], dict[str, Any]]


def guess(round_no: int, i: int) -> dict[str, Any]:
    """Agent ``i``'s record of a round: a guess falling round after round; agent 3
    could not be read, agent 4 is late, agent 5 is missing (of every ten)."""
    record: dict[str, Any] = {
        "round": round_no,
        "agent": f"p-{i}",
        "status": "ok",
        "value": round(50 / round_no + i % 10, 2),
        "answer": "my guess",
        "latency": 0.1 * (1 + i % 10),
        "finished_reason": "completed",
        "error": None,
        "params": {"k": i % 4},
    }
    if i % 10 == 3:
        record |= {"status": "error", "value": None, "error": "the answer could not be read: "
                   f"ValueError: no number in 'hmm {i}'"}  # fmt: skip
    elif i % 10 == 4:
        record |= {"status": "late", "value": None, "answer": None, "latency": None,
                   "error": "no answer within 2 s"}  # fmt: skip
    elif i % 10 == 5:
        record |= {"status": "missing", "value": None, "answer": None, "latency": None,
                   "error": "not asked: the round's deadline passed"}  # fmt: skip
    return record


def make_run(
    out: Path,
    *,
    agents: int = 20,
    rounds: int = 3,
    planned: int | None = None,
    record: Record = guess,
    metrics: Callable[[int], dict[str, Any]] | None = None,
) -> RunFiles:
    """A run's directory as the runner writes it, ``rounds`` of ``planned`` finished
    (its state written once, at the end)."""
    files = RunFiles(out)
    files.prepare()
    state = RunState(simulation="guess", run_id="r1", agents=agents, started_at=time.time())
    files.truncate_results(0)
    files.write_snapshot(0, {})
    for round_no in range(1, rounds + 1):
        records = [record(round_no, i) for i in range(agents)]
        size, count = files.append_records(records)
        counts = {s: sum(r["status"] == s for r in records) for s in ("ok", "error", "late")}
        state.rounds.append(
            RoundSummary(
                round=round_no, agents=agents, ok=counts["ok"], errors=counts["error"],
                late=counts["late"], missing=agents - sum(counts.values()), duration=1.5,
                rate=agents / 1.5, started_at=time.time(),
                metrics=(metrics or default_metrics)(round_no),
            )
        )  # fmt: skip
        state.completed, state.results_bytes = round_no, size
        state.records += count
    files.write_snapshot(rounds, {"mean": 1})
    files.save_state(state)
    files.write_summary(
        {
            "simulation": "guess", "description": "guess 2/3 of the average", "run_id": "r1",
            "agents": agents, "order": "parallel", "rounds": planned or rounds,
            "completed": rounds, "finished": rounds >= (planned or rounds), "deadline": 2.0,
            "records": state.records, "started_at": state.started_at, "updated_at": time.time(),
            "per_round": [r.to_dict() for r in state.rounds],
        }
    )  # fmt: skip
    return files


def default_metrics(round_no: int) -> dict[str, Any]:
    return {"mean": 50 / round_no, "winner": f"p-{round_no}", "counts": {"low": round_no}}


def charts(page: str) -> set[str]:
    return set(re.findall(r'<svg id="([\w-]+)"', page))


def test_the_page_of_a_run_has_its_charts_and_figures(tmp_path: Path) -> None:
    files = make_run(tmp_path / "run", rounds=3)
    path = write_report(files.out)
    assert path == files.out / "report.html"
    page = path.read_text()
    assert charts(page) >= {
        "chart-status", "chart-duration", "chart-rate", "chart-latency", "chart-answers",
        "chart-histogram", "chart-metric-0", "chart-metric-1",
    }  # fmt: skip
    assert "<h1>guess</h1>" in page
    assert "3 of 3: finished" in page
    assert "guess 2/3 of the average" in page
    assert "60 read from results.jsonl" in page
    assert "42 ok, 6 error, 6 late, 6 missing" in page  # 3 rounds of 20 agents
    # Apply's figures: numbers charted (a dict's as name.key), the rest in the table.
    assert "<figcaption>mean</figcaption>" in page
    assert "<figcaption>counts.low</figcaption>" in page
    assert "<td>p-3</td>" in page
    # Latency per round: agents 0-9 (twice) answer in 0.1-1.0 s but 4 and 5
    # (late, missing): 0.1, 0.2, 0.3, 0.4, 0.7, 0.8, 0.9, 1.0, each twice.
    assert "round 1: 16 answered; p10 150 ms, p50 550 ms, p90 950 ms, p99 1 s, max 1 s" in page
    # The errors by kind, without their details; the rounds they came in.
    assert "the answer could not be read: ValueError" in page
    assert re.search(
        r"<td>no answer within 2 s</td><td class=\"n\">6</td><td class=\"n\">1-3", page
    )
    # Answers: round 1's guesses are 50 plus 0-9 (not 3, 4, 5).
    assert "round 1: 14 answers; min 50, p10 50.3, median 56, p90 58.7, max 59" in page


def test_the_page_is_self_contained_and_loads_nothing(tmp_path: Path) -> None:
    page = write_report(make_run(tmp_path / "run").out).read_text()
    assert page.startswith("<!DOCTYPE html>")
    assert "Content-Security-Policy" in page
    assert "default-src 'none'" in page
    for needle in ("http:", "https:", "//cdn", "<script", "<link", "<img", "@import", "url("):
        assert needle not in page


def test_text_of_the_run_is_escaped(tmp_path: Path) -> None:
    hostile = '<script>alert("x")</script>'

    def record(round_no: int, i: int) -> dict[str, Any]:
        return guess(round_no, i) | {"value": hostile if i % 2 else "hold"}

    files = make_run(tmp_path / "run", record=record, metrics=lambda n: {hostile: n})
    page = render_report(files.out)
    assert "<script" not in page
    assert "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;" in page


def test_answers_that_are_not_numbers_are_counted_by_value(tmp_path: Path) -> None:
    choices = ["buy", "sell", "hold"]

    def record(round_no: int, i: int) -> dict[str, Any]:
        return guess(round_no, i) | {"value": choices[(i + round_no) % 3]}

    page = render_report(make_run(tmp_path / "run", record=record).out)
    assert "chart-categories" in charts(page)
    assert "chart-answers" not in charts(page)
    for choice in choices:
        assert f"</span>{choice}</li>" in page
    assert "most frequent values per round" in page


def test_without_a_parse_the_answers_text_is_counted(tmp_path: Path) -> None:
    def record(round_no: int, i: int) -> dict[str, Any]:
        return guess(round_no, i) | {"value": None, "answer": "I  pick\nseven" if i else "no"}

    page = render_report(make_run(tmp_path / "run", record=record).out)
    assert "chart-categories" in charts(page)
    assert "</span>I pick seven</li>" in page
    assert "reads no value from it" in page


def test_a_run_under_way_shows_its_finished_rounds_only(tmp_path: Path) -> None:
    files = make_run(tmp_path / "run", rounds=2, planned=5)
    # Round 3 is being written (or was, by a runner killed since): records
    # past the state's size, the last one cut.
    files.append_records([guess(3, i) for i in range(20)])
    with files.results.open("ab") as f:
        f.write(b'{"round": 3, "agent": "p-9", "sta')
    report = read_run(files.out)
    assert [r.round for r in report.rounds] == [1, 2]
    assert report.records == 40
    page = render_report(files.out)
    assert "2 of 5 finished: the run is under way, or was interrupted" in page
    assert "past the last finished round" in page
    assert "round 3" not in page


def test_a_run_before_its_first_round_says_so(tmp_path: Path) -> None:
    files = make_run(tmp_path / "run", rounds=0, planned=4)
    page = render_report(files.out)
    assert "No round has finished yet." in page
    assert "0 of 4 finished" in page
    assert not charts(page)


def test_a_run_with_only_its_state_and_results_and_records_of_fewer_fields(
    tmp_path: Path,
) -> None:
    """What a run's directory holds may be less than the runner writes today:
    no summary.json, records without latency, params or finished_reason."""

    def record(round_no: int, i: int) -> dict[str, Any]:
        return {"round": round_no, "agent": f"p-{i}", "status": "ok", "value": i + round_no}

    files = make_run(tmp_path / "run", record=record)
    files.summary.unlink()
    page = render_report(files.out)
    assert "3 finished" in page
    assert "No latency recorded." in page
    assert "No agent failed in a round." in page
    assert {"chart-status", "chart-answers", "chart-metric-0"} <= charts(page)


def test_results_alone_make_a_page_and_bad_lines_are_counted(tmp_path: Path) -> None:
    files = make_run(tmp_path / "run")
    files.state.unlink()
    files.summary.unlink()
    with files.results.open("ab") as f:
        f.write(b"not json\n[1, 2]\n")
    report = read_run(files.out)
    assert [(r.round, r.summary) for r in report.rounds] == [(1, None), (2, None), (3, None)]
    assert [r.status("ok") for r in report.rounds] == [14, 14, 14]
    page = render_report(files.out)
    assert "2 lines of results.jsonl cannot be read." in page
    assert "chart-latency" in charts(page)


def test_summaries_of_the_wrong_shape_are_left_out(tmp_path: Path) -> None:
    files = make_run(tmp_path / "run")
    files.state.unlink()
    summary = orjson.loads(files.summary.read_bytes())
    summary["per_round"][1]["ok"] = "many"
    summary["per_round"].append([1, 2])
    files.summary.write_bytes(orjson.dumps(summary))
    report = read_run(files.out)
    assert [(r.round, r.summary is not None) for r in report.rounds] == [
        (1, True), (2, False), (3, True)
    ]  # fmt: skip
    assert "2 round summaries of summary.json cannot be read." in render_report(files.out)

    summary["per_round"] = 7
    files.summary.write_bytes(orjson.dumps(summary))
    assert [r.summary for r in read_run(files.out).rounds] == [None, None, None]


def test_a_large_run_makes_a_small_page(tmp_path: Path) -> None:
    """Ten thousand agents weigh no more than twenty, and many rounds share
    the bars of a chart."""
    small = len(render_report(make_run(tmp_path / "small", agents=20, rounds=2).out))
    large = len(render_report(make_run(tmp_path / "large", agents=10_000, rounds=2).out))
    assert large < small * 1.2, (small, large)

    many = render_report(make_run(tmp_path / "many", agents=10, rounds=500).out)
    assert len(many) < 1_000_000, len(many)
    status = re.search(r'<svg id="chart-status".*?</svg>', many, re.S)
    assert status is not None
    assert len(re.findall(r"<title>rounds \d+-\d+", status.group(0))) <= MAX_COLUMNS
    assert "<title>rounds 1-5 (mean per round): 7 ok, 1 error" in status.group(0)
    assert "300 rounds not shown" in many

    def per_agent(round_no: int) -> dict[str, Any]:
        return {"guesses": {f"p-{i}": i * round_no for i in range(10_000)}}

    figures = render_report(make_run(tmp_path / "figures", rounds=2, metrics=per_agent).out)
    assert len(figures) < 100_000, len(figures)
    assert "And 9,976 more in summary.json." in figures  # not charted
    assert "And 9,960 more figures in summary.json." in figures  # not in the table


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        (lambda d: None, "is not a simulation run: it has no state.json, summary.json or"),
        (lambda d: d.rmdir(), "is not a directory"),
        (lambda d: (d / "state.json").write_text("{"), "cannot read"),
    ],
)
def test_a_directory_that_is_not_a_run_gets_one_line(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    setup: Callable[[Path], None],
    message: str,
) -> None:
    directory = tmp_path / "nothing"
    directory.mkdir()
    setup(directory)
    assert main(["sim", "report", str(directory)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error:"), err
    assert message in " ".join(err.split())
    assert "Traceback" not in err
    assert not (directory / "report.html").exists()
    with pytest.raises(ConfigError):
        read_run(directory)


def test_the_command_prints_the_path_it_wrote(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    files = make_run(tmp_path / "run")
    assert main(["sim", "report", str(files.out)]) == 0
    assert capsys.readouterr().out.strip() == str(files.out / "report.html")
    assert (files.out / "report.html").stat().st_size > 10_000

    chosen = tmp_path / "elsewhere.html"
    assert main(["sim", "report", str(files.out), "--out", str(chosen)]) == 0
    assert capsys.readouterr().out.strip() == str(chosen)
    assert chosen.read_text().startswith("<!DOCTYPE html>")

    assert main(["sim", "report", str(files.out), "--out", str(tmp_path / "no" / "x.html")]) == 1
    assert "error: cannot write" in capsys.readouterr().err


def test_summary_json_alone_gives_the_rounds_figures(tmp_path: Path) -> None:
    files = make_run(tmp_path / "run")
    files.state.unlink()
    files.results.unlink()
    report = read_run(files.out)
    assert [r.summary.metrics["mean"] for r in report.rounds if r.summary] == [50, 25, 50 / 3]
    page = render_report(files.out)
    assert "results.jsonl is missing" in page
    assert {"chart-status", "chart-metric-0"} <= charts(page)
    assert orjson.loads(files.summary.read_bytes())["rounds"] == 3
