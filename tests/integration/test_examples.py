"""The examples run as people run them (``python examples/<name>.py`` from the
project root), finish, and leave nothing running."""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT

DEBATERS = ("optimist", "skeptic", "moderator")
TIMEOUT = 120.0

pytestmark = pytest.mark.timeout(TIMEOUT + 30)


def run_example(*args: str, env: dict[str, str] | None = None) -> str:
    """Run an example to its end; its output (stdout), after checking it exited 0."""
    clean = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("FLEETBUS_") and k != "OPENAI_API_KEY"
    }
    # Wide enough that rich puts every statement and table row on one line.
    proc = subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        env={**clean, "COLUMNS": "1000", **(env or {})},
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=False,
    )
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def is_running(pid: int) -> bool:
    """Whether a process lives (a zombie does not count)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state != "Z"


def server_pid(out: str) -> int:
    """The embedded nats-server's pid, as the example said it started and stopped it."""
    started = re.search(r"started nats-server \(pid (\d+)\)", out)
    assert started is not None, out
    assert f"stopped nats-server (pid {started.group(1)})" in out
    return int(started.group(1))


def statements(out: str) -> list[str]:
    """The debaters' statements, in order (``name: text``)."""
    return re.findall(rf"^(?:{'|'.join(DEBATERS)}): .+$", out, re.M)


def assert_every_debater_spoke(out: str, rounds: int) -> None:
    said = statements(out)
    for name in DEBATERS:
        mine = [s for s in said if s.startswith(f"{name}: ")]
        assert len(mine) == rounds, out
        assert all(len(s.split()) > 5 for s in mine), mine
    assert [s.split(":")[0] for s in said] == list(DEBATERS) * rounds
    summary = re.findall(rf"│ ({'|'.join(DEBATERS)}) +│ +(\d+) │", out)
    assert summary == [(name, str(rounds)) for name in DEBATERS], out


def test_the_debate_over_the_bus() -> None:
    out = run_example("examples/debate.py", "--rounds", "1")
    assert "serving optimist, skeptic, moderator as AgentServices" in out
    assert_every_debater_spoke(out, rounds=1)
    # Each takes the stance its system prompt gives it.
    said = dict(s.split(": ", 1) for s in statements(out))
    assert "the evidence does not yet show that" in said["skeptic"]
    assert "both sides have a point" in said["moderator"]
    assert not is_running(server_pid(out))


def test_the_debate_with_an_agent_process_each() -> None:
    out = run_example(
        "examples/debate.py", "Cities should ban cars", "--rounds", "1", "--processes"
    )
    assert_every_debater_spoke(out, rounds=1)
    assert "Cities should ban cars" in statements(out)[0]
    children = [int(pid) for pid in re.findall(r"AgentService in process (\d+)", out)]
    assert len(children) == len(DEBATERS)
    for pid in children:
        assert f"stopped the agent process {pid} (exit 0)" in out
        assert not is_running(pid)
    assert not is_running(server_pid(out))


def test_the_debate_with_local_agents_and_the_openai_note() -> None:
    out = run_example(
        "examples/debate.py", "--rounds", "2", "--local", env={"OPENAI_API_KEY": "sk-not-used"}
    )
    assert "model: built-in offline model" in out  # a key alone names no model
    assert_every_debater_spoke(out, rounds=2)
    # Broadcast works: each answers the one who spoke before it, by name.
    said = statements(out)
    for before, after in itertools.pairwise(said):
        assert before.split(":")[0] in after.split(": ", 1)[1], (before, after)
    assert "nats-server" not in out


def test_the_debate_is_the_same_over_the_bus_and_locally() -> None:
    local = statements(run_example("examples/debate.py", "--local"))
    remote = statements(run_example("examples/debate.py"))
    assert remote == local


def test_the_planner() -> None:
    out = run_example("examples/planner.py")
    rows = {
        match.group(2): (match.group(3), match.group(4), match.group(5))
        for match in re.finditer(r"^│ (\d) │ (.+?) +│ (\w+) +│ (.+?) +│ (.+?) +│$", out, re.M)
    }
    assert rows.keys() == {
        "What is 1234 * 5678",
        "what time is it in Tokyo",
        "save a note 'meeting at 3' to notes/plan.md",
    }, out
    worker, answer, reason = rows["What is 1234 * 5678"]
    assert (worker, reason) == ("mathematician", "completed")
    assert "7006652" in answer
    worker, answer, reason = rows["what time is it in Tokyo"]
    assert (worker, reason) == ("clerk", "completed")
    assert re.search(r"Asia/Tokyo: \w+ \d{4}-\d\d-\d\dT\d\d:\d\d:\d\d", answer), answer
    worker, answer, reason = rows["save a note 'meeting at 3' to notes/plan.md"]
    # The write paused for a person's confirmation; the planner gave it.
    assert (worker, reason) == ("clerk", "paused → completed")
    assert "wrote notes/plan.md" in answer
    assert "clerk paused: it asks to run write_file" in out
    assert "A human would be asked here" in out
    assert re.search(r"^notes/plan\.md now holds: .*meeting at 3", out, re.M), out
    assert not is_running(server_pid(out))


def test_the_knowledge_base_answers_from_the_passages_with_their_sources() -> None:
    out = " ".join(run_example("examples/knowledge_base.py", "Do you ship to Canada?").split())

    assert "A: We ship to the European Union, the United Kingdom, Canada" in out
    assert "sources: shipping.md:8-11 (Shipping > International)" in out


def test_the_long_term_memory_carries_a_fact_to_the_next_session_of_its_user() -> None:
    out = run_example("examples/long_term_memory.py")

    assert (
        "[tuesday] rememberer: You told me before: My sister's name is Clara and she lives "
        "in Porto." in out
    )
    assert "[wednesday] rememberer: I do not know that yet." in out


@pytest.mark.parametrize(
    ("example", "said"),
    [
        (["examples/knowledge_base.py", "Do you ship to Canada?"], "A: The model says so."),
        (["examples/long_term_memory.py"], "[tuesday] rememberer: The model says so."),
    ],
    ids=["knowledge_base", "long_term_memory"],
)
def test_an_example_uses_the_model_fleetbus_model_names(example: list[str], said: str) -> None:
    from tests.openai_server import FakeOpenAIServer, completion

    with FakeOpenAIServer(fallback=completion("The model says so.")) as server:
        env = {"FLEETBUS_MODEL": "openai:local-model", "OPENAI_BASE_URL": server.url}
        out = " ".join(run_example(*example, env=env).split())
        bodies = server.bodies

    assert said in out
    assert bodies
    assert {body["model"] for body in bodies} == {"local-model"}
    if example[0].endswith("knowledge_base.py"):  # the passages went to the model
        assert "shipping.md" in json.dumps(bodies[0]["messages"])


def test_the_triage_desk_hands_over_and_its_guardrail_trips() -> None:
    out = run_example("examples/triage.py")
    assert "serving triage, billing, refunds from triage.toml" in out
    assert out.count("↪ handed over to billing") == 1
    assert "calculator: 19.99 * 2 = 39.98" in out
    assert "↪ handed over to refunds" in out
    assert "⛔ guardrail no-card-numbers on input: trip" in out
    assert re.findall(r"answered by (\w+): (\w+)", out) == [
        ("billing", "completed"),
        ("refunds", "completed"),
        ("triage", "guardrail_tripped"),
    ]
    assert not is_running(server_pid(out))
