"""Guess 2/3 of the average (the p-beauty contest), as a fleetbus simulation.

Every agent picks a number between 0 and 100; whoever is closest to two
thirds of the average guess wins. Played again and again, the guesses fall
towards 0, the game's only Nash equilibrium, as in the laboratory (Nagel,
"Unraveling in guessing games", American Economic Review 85(5), 1995: first
rounds average in the thirties, later rounds fall towards 0).

Each agent has a background: a profession and a reasoning depth ``k`` (the
level-k model of Nagel, and of Camerer, Ho and Chong's cognitive hierarchy,
2004): a level-0 player guesses the last average (50 in the first round), a
level-k player two thirds of what level k-1 guesses, plus a small hunch of
its own (drawn anew each round). An agent's round is one ReAct step: it calls the ``calculator``,
served by a tool worker process, then answers with the number.

With the built-in offline model (the default; deterministic, no network) the
prompt spells out each agent's arithmetic, ``31.40 * (2/3)**2 + 0.85``, so
the guesses differ by depth and hunch. A real model gets the rules, its
background and last round's figures, and decides for itself::

    python examples/guess_two_thirds.py                               # 100 agents, offline
    python examples/guess_two_thirds.py --agents 10000 --hosts 2      # 10,000 agents
    python examples/guess_two_thirds.py --agents 12 --model openai:gpt-4o-mini
    fleetbus sim run examples/guess_two_thirds.py:simulation --agents 10000 --out runs/g23

The script runs ``fleetbus sim run`` (every option of it works here, ``--out``
defaults to a new temporary directory), then tabulates the mean guess of each
round and its winner from the run's ``summary.json``.
"""

from __future__ import annotations

import json
import os
import random
import re
import statistics
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from fleetbus.models.strings import parse_model_string
from fleetbus.sim import (
    AgentReply,
    AgentTemplate,
    AgentView,
    Population,
    RoundContext,
    Simulation,
)

NAME = "guess-two-thirds"
SEED = 1995
DEPTHS = (0, 1, 2, 3)
DEPTH_WEIGHTS = (0.30, 0.35, 0.25, 0.10)
"""Shares of reasoning depths 0-3, close to those estimated for first rounds."""
PROFESSIONS = (
    "a chess player", "a high-school teacher", "a bond trader", "a nurse",
    "a game theorist", "a poker player", "a journalist", "a software engineer",
    "a farmer", "a student of economics", "a retired engineer", "a painter",
)  # fmt: skip
RULES = (
    "You play a guessing game with many other players, over several rounds. Each "
    "round, every player picks a number between 0 and 100. The player whose number is "
    "closest to two thirds of the average of all numbers wins the round."
)

console = Console()


def params(i: int) -> dict[str, Any]:
    """Agent ``i``'s background: deterministic, so every process builds the same."""
    rng = random.Random(f"{SEED}-{i}")
    return {"k": rng.choices(DEPTHS, DEPTH_WEIGHTS)[0], "background": rng.choice(PROFESSIONS)}


def hunch(agent: AgentView, round_no: int) -> float:
    """An agent's hunch in a round: a little noise of its own, between -2 and 2."""
    return round(random.Random(f"{SEED}-{agent.index}-{round_no}").uniform(-2.0, 2.0), 2)


def guided() -> bool:
    """Whether the agents reason with the offline model (then the prompt
    spells out the arithmetic)."""
    text = os.environ.get("FLEETBUS_MODEL", "").strip() or "offline"
    return parse_model_string(text).kind == "offline"


def prompt(ctx: RoundContext, agent: AgentView) -> str:
    """An agent's prompt for a round: last round's figures, and (offline) its sum."""
    k = int(agent.params["k"])
    mean = ctx.state.get("mean")
    if mean is None:
        seen = "Nobody has played yet; a naive player would pick 50."
        base = 50.0
    else:
        seen = (
            f"Last round the mean was {mean:.2f}, the target {ctx.state['target']:.2f}, "
            f"and the winner picked {ctx.state['winning_guess']:.2f}."
        )
        base = float(mean)
    head = f"Round {ctx.round} of {ctx.rounds}. {seen}"
    if not guided():
        return (
            f"{head} Use the calculator tool once to work out your number, then reply "
            "with only your number, between 0 and 100."
        )
    noise = hunch(agent, ctx.round)
    sign = "+" if noise >= 0 else "-"
    expr = f"{base:.2f} * (2/3)**{k} {sign} {abs(noise):.2f}"
    return (
        f"{head} Thinking {k} steps ahead, with your hunch, you pick {expr}. "
        "Work it out with the calculator, then reply with only your number."
    )


_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def parse(text: str) -> float:
    """The guess in an answer: its last number, kept between 0 and 100.

    Raises:
        ValueError: the answer has no number.
    """
    numbers = _NUMBER.findall(text.replace(",", ""))
    if not numbers:
        raise ValueError(f"no number in {text[:80]!r}")
    return min(100.0, max(0.0, float(numbers[-1])))


async def apply(ctx: RoundContext, replies: Sequence[AgentReply]) -> dict[str, Any]:
    """Score the round: the mean, its two thirds, the winner; keep them in
    the environment for the next round's prompts."""
    guesses = [(r.agent, float(r.value)) for r in replies if r.ok and r.value is not None]
    if not guesses:
        return {"guesses": 0}
    mean = statistics.fmean(g for _, g in guesses)
    target = 2 / 3 * mean
    winner, best = min(guesses, key=lambda item: abs(item[1] - target))
    tied = sum(1 for _, g in guesses if abs(g - target) == abs(best - target))
    figures = {
        "guesses": len(guesses),
        "mean": round(mean, 4),
        "median": round(statistics.median(g for _, g in guesses), 4),
        "target": round(target, 4),
        "winner": winner,
        "winning_guess": round(best, 4),
        "tied": tied,
    }
    for key in ("mean", "target", "winning_guess"):
        await ctx.environment.set(key, figures[key])
    return figures


def simulation(agents: int = 100, rounds: int = 4) -> Simulation:
    """The game with ``agents`` players over ``rounds`` rounds."""
    template = AgentTemplate(
        system_prompt=RULES + " You are {background}. You usually think {k} steps ahead "
        "of the other players.",
        tools=["calculator"],
        max_iters=3,
    )
    return Simulation(
        name=NAME,
        description="Guess 2/3 of the average (Nagel 1995), level-k backgrounds",
        population=Population.generate(agents, params, template=template, name_prefix="p-"),
        prompt=prompt,
        parse=parse,
        apply=apply,
        rounds=rounds,
        tools=["fleetbus.tools_workers.builtin:calculator"],
        environment_tools=False,
        # Ten minutes, and 2 ms an agent past 300,000: a round of a million
        # takes about ten minutes on 2 cores, and an agent the deadline
        # leaves unasked is missing from the round.
        deadline=max(600.0, agents * 0.002),
        record_params=("k", "background"),
    )


def report(out: Path) -> None:
    """The mean guess of each round and its winner, from the run's summary."""
    summary = json.loads((out / "summary.json").read_text())
    table = Table(title=f"Guess 2/3 of the average: {summary['agents']:,} players")
    for column in ("round", "guesses", "mean", "median", "2/3 of mean", "winner", "winning guess"):
        table.add_column(column, justify="left" if column == "winner" else "right")
    for r in summary["per_round"]:
        m = r["metrics"]
        if not m.get("guesses"):
            table.add_row(str(r["round"]), "0", "", "", "", "", "")
            continue
        winner = m["winner"] + (f" (+{m['tied'] - 1} tied)" if m["tied"] > 1 else "")
        table.add_row(
            str(r["round"]), f"{m['guesses']:,}", f"{m['mean']:.2f}", f"{m['median']:.2f}",
            f"{m['target']:.2f}", winner, f"{m['winning_guess']:.2f}",
        )  # fmt: skip
    console.print(table)


def main(argv: Sequence[str] | None = None) -> int:
    """``fleetbus sim run`` on this file's simulation, then the table."""
    from fleetbus.cli.main import main as fleetbus

    args = list(sys.argv[1:] if argv is None else argv)
    if "--out" not in args:
        args += ["--out", tempfile.mkdtemp(prefix="guess-two-thirds-")]
    out = Path(args[args.index("--out") + 1])
    code = fleetbus(["sim", "run", f"{Path(__file__).resolve()}:simulation", *args])
    if code == 0:
        report(out)
        console.print(f"[dim]results: {out / 'results.jsonl'}[/]")
    return code


if __name__ == "__main__":
    sys.exit(main())
