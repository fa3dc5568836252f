"""Evaluations on a real bus, the agents served in this process: the shipped
datasets against the offline model; a judge agent (a scripted model) that
grades answers; an agent that fails, hangs or is not served making failed
cases, never a crashed run; two runs compared."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from pathlib import Path

from fleetbus.agents import Agent
from fleetbus.bus import Bus, EmbeddedServer
from fleetbus.evals import CaseResult, Evaluation, load_dataset, read_run, write_report
from fleetbus.models import FINISH_TOOL, ModelError, ModelRequest, ModelResponse, OfflineModel
from fleetbus.models.model import FORMAT_ERROR_TOOL
from fleetbus.protocol import TextBlock, Usage
from fleetbus.testing import ScriptedModel
from fleetbus.tools_workers import Toolkit
from fleetbus.tools_workers.builtin import calculator, current_time
from tests.helpers import ROOT, serving

EXAMPLES = ROOT / "examples" / "evals"


def solver(name: str = "solver") -> Agent:
    """The offline model with the calculator and the clock, in its own toolkit."""
    return Agent(name, "You solve.", OfflineModel(), toolkit=Toolkit([calculator, current_time]))


def last_user_text(request: ModelRequest) -> str:
    user = [m for m in request.messages if m.role == "user"]
    return "\n".join(b.text for b in user[-1].content if isinstance(b, TextBlock))


async def test_the_shipped_datasets_pass_against_the_offline_model(
    nats_server: EmbeddedServer, bus: Bus, tmp_path: Path
) -> None:
    async with serving(nats_server.url, bus.prefix, solver()):
        for name in ("arithmetic", "multistep"):
            dataset = load_dataset(EXAMPLES / f"{name}.jsonl")
            run = await Evaluation(bus, dataset, agent="solver", timeout=30).run(tmp_path / name)
            failed = [(r.case_id, r.error, r.grades) for r in run.results if not r.passed]
            assert failed == [], failed
            assert run.facts.passed == run.facts.done == len(dataset.cases)
            assert all(r.model_calls >= 2 and r.input_tokens > 0 for r in run.results)
            assert run.facts.models == {"fleetbus-offline": len(dataset.cases)}
    arithmetic = cases(tmp_path / "arithmetic")
    subtract = arithmetic["subtract"]
    assert [(c.name, c.arguments, c.status) for c in subtract.tool_calls] == [
        ("calculator", {"expr": "2026 - 1991"}, "success")
    ]
    assert subtract.answer.endswith("calculator: 2026 - 1991 = 35.")
    assert arithmetic["structured"].structured == {"result": 42}  # the finish tool is no call
    assert [c.name for c in arithmetic["structured"].tool_calls] == ["calculator"]
    multistep = cases(tmp_path / "multistep")
    assert [c.name for c in multistep["time-and-arithmetic"].tool_calls] == [
        "current_time",
        "calculator",
    ]


def cases(out: Path) -> dict[str, CaseResult]:
    """The cases of the run in ``out``, by id."""
    return {r.case_id: r for r in read_run(out).results}


def judging(request: ModelRequest) -> ModelResponse:
    """A judge: the answer passes when it ends with the number the criteria name."""
    asked = last_user_text(request)
    criteria = re.search(r"<criteria>\n(.*?)\n</criteria>", asked, re.S)
    answer = re.search(r"<answer>\n(.*?)\n</answer>", asked, re.S)
    assert criteria is not None, asked
    assert answer is not None, asked
    wanted = re.findall(r"\d+", criteria.group(1))[-1]
    passed = answer.group(1).rstrip(".").endswith(f"= {wanted}")
    reason = f"the answer {'gives' if passed else 'does not give'} {wanted}"
    return ScriptedModel.call(FINISH_TOOL, {"pass": passed, "reason": reason})


async def test_a_judge_agent_grades_the_answers(
    nats_server: EmbeddedServer, bus: Bus, tmp_path: Path
) -> None:
    judge_model = ScriptedModel([judging], repeat_last=True)
    path = tmp_path / "judged.jsonl"
    path.write_text(
        '{"id": "right", "input": "What is 2026 - 1991?", "expect": [{"kind": "judge", '
        '"criteria": "The answer is 35."}, {"kind": "numeric", "value": 35}]}\n'
        '{"id": "wrong", "input": "What is 2 + 2?", "expect": {"kind": "judge", '
        '"criteria": "The answer is 5.", "agent": "strict"}}\n'
    )
    dataset = load_dataset(path)
    async with (
        serving(nats_server.url, bus.prefix, solver(), replica="s"),
        serving(
            nats_server.url, bus.prefix, Agent("critic", "You grade.", judge_model), replica="c"
        ),
        serving(
            nats_server.url,
            bus.prefix,
            Agent("strict", "You grade.", ScriptedModel([judging], repeat_last=True)),
            replica="t",
        ),
    ):
        run = await Evaluation(bus, dataset, agent="solver", judge="critic", timeout=30).run(
            tmp_path / "run"
        )
    right, wrong = run.results
    assert right.passed
    assert [(g.kind, g.passed, g.reason) for g in right.grades] == [
        ("judge", True, "the judge: the answer gives 35"),
        ("numeric", True, "35 is 35"),
    ]
    assert not wrong.passed
    assert [(g.kind, g.passed, g.reason) for g in wrong.grades] == [
        ("judge", False, "the judge: the answer does not give 5"),
    ]
    # The run's judge saw the case, its criteria, the answer and the calls
    # made, and was asked for the verdict's shape; "wrong" went to "strict".
    (request,) = judge_model.requests
    asked = last_user_text(request)
    assert "<question>\nWhat is 2026 - 1991?\n</question>" in asked
    assert "calculator: 2026 - 1991 = 35." in asked
    assert '- calculator(expr="2026 - 1991")' in asked
    offered = {spec.name: spec.parameters for spec in request.tools}
    assert offered[FINISH_TOOL]["required"] == ["pass", "reason"]
    assert run.facts.graders == {"judge": [1, 2], "numeric": [1, 1]}


class Flaky:
    """A model that fails for "fail", never answers "hang", and answers the rest."""

    name = "flaky"

    def __init__(self) -> None:
        self.hanging = asyncio.Event()

    async def stream(self, request: ModelRequest) -> AsyncIterator[ModelResponse]:
        asked = last_user_text(request)
        if "fail" in asked:
            raise ModelError("the model is down", retryable=False)
        if "hang" in asked:
            self.hanging.set()
            await asyncio.Event().wait()  # until the reply is cancelled
        yield ModelResponse(
            content=[TextBlock(text="The answer is 7.")],
            usage=Usage(input_tokens=11, output_tokens=5),
            finish_reason="stop",
        )


async def test_an_agent_that_fails_hangs_or_is_not_served_fails_its_cases_not_the_run(
    nats_server: EmbeddedServer, bus: Bus, tmp_path: Path
) -> None:
    path = tmp_path / "flaky.jsonl"
    path.write_text(
        '{"id": "fails", "input": "please fail", "expect": {"kind": "numeric", "value": 7}}\n'
        '{"id": "hangs", "input": "please hang", "timeout": 2,'
        ' "expect": {"kind": "numeric", "value": 7}}\n'
        '{"id": "fine", "input": "what is seven", "expect": {"kind": "numeric", "value": 7}}\n'
    )
    dataset = load_dataset(path)
    model = Flaky()
    async with serving(nats_server.url, bus.prefix, Agent("flaky", "", model)):
        run = await Evaluation(bus, dataset, agent="flaky", timeout=30).run(tmp_path / "run")
    assert model.hanging.is_set()
    fails, hangs, fine = run.results
    assert not fails.passed
    assert fails.grades == []
    assert fails.finished_reason == "error"
    assert fails.error == (
        "the reply ended error: The model failed: flaky: ModelError: the model is down"
    )
    assert not hangs.passed
    assert hangs.error is not None
    assert hangs.error.startswith("CallTimeoutError: "), hangs.error
    assert 2 <= hangs.latency < 10
    assert fine.passed
    assert fine.error is None
    assert (fine.input_tokens, fine.output_tokens, fine.model_calls) == (11, 5, 1)
    assert (run.facts.done, run.facts.passed, run.facts.errors) == (3, 1, 2)
    # An agent nobody serves: each case fails with that (or with its own
    # timeout, shorter than the seconds a request to nobody is sent again),
    # and the run ends.
    alone = await Evaluation(bus, dataset, agent="nobody", timeout=30, concurrency=3).run(
        tmp_path / "nobody"
    )
    assert [str(r.error).split(":")[0] for r in alone.results] == [
        "NoRespondersError",
        "CallTimeoutError",
        "NoRespondersError",
    ]
    assert alone.facts.passed == 0


def sloppy() -> Agent:
    """Answers every question 42, without a tool."""
    return Agent("sloppy", "", ScriptedModel(["It is 42."], repeat_last=True))


async def test_two_runs_compared_side_by_side(
    nats_server: EmbeddedServer, bus: Bus, tmp_path: Path
) -> None:
    dataset = load_dataset(EXAMPLES / "arithmetic.jsonl")
    async with (
        serving(nats_server.url, bus.prefix, solver(), replica="a"),
        serving(nats_server.url, bus.prefix, sloppy(), replica="b"),
    ):
        good = await Evaluation(bus, dataset, agent="solver", label="offline").run(tmp_path / "a")
        bad = await Evaluation(bus, dataset, agent="sloppy", label="sloppy").run(tmp_path / "b")
    assert good.facts.pass_rate == 1.0
    # "structured" asks for a schema the scripted text does not give: an error.
    assert bad.facts.passed == 0
    assert [r.case_id for r in bad.results if r.error] == ["structured"]
    page = write_report(bad.out, baseline=good.out).read_text()
    cases = len(dataset.cases)
    assert f"0 fixed, {cases} regressed, 0 still passing, 0 still failing." in page
    assert '<td>pass rate</td><td>100.0%</td><td>0.0%</td><td class="worse">-100.0%</td>' in page
    assert "<h1>offline vs sloppy</h1>" in page


async def test_a_step_the_model_wrote_unusably_is_counted_apart_from_the_tool_calls(
    nats_server: EmbeddedServer, bus: Bus, tmp_path: Path
) -> None:
    model = ScriptedModel(
        [
            ScriptedModel.call(FORMAT_ERROR_TOOL, {"error": "not a call, not an answer"}),
            ScriptedModel.call("calculator", {"expr": "1 + 1"}),
            "It is 2.",
        ]
    )
    path = tmp_path / "one.jsonl"
    path.write_text(
        '{"id": "add", "input": "1 + 1?", "expect": {"kind": "tool_call", "tool": "calculator",'
        ' "arguments": {"expr": 2}, "max_calls": 1}}\n'
    )
    agent = Agent("clumsy", "", model, toolkit=Toolkit([calculator]))
    async with serving(nats_server.url, bus.prefix, agent):
        run = await Evaluation(bus, load_dataset(path), agent="clumsy").run(tmp_path / "run")
    (result,) = run.results
    assert result.passed, result.grades
    assert [(c.name, c.status) for c in result.tool_calls] == [("calculator", "success")]
    assert result.format_errors == 1
    assert result.model_calls == 3
