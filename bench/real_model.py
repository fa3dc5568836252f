"""The demo agent against a real OpenAI-compatible model: ten questions that
need the calculator, their answers checked, one JSON line.

Optional and not in CI: it needs ``OPENAI_BASE_URL`` (and ``FLEETBUS_MODEL``
as the README sets them, e.g. for ``../shared/local-llm/setup.sh serve``);
without it the line says ``skipped``. Each question is a fresh conversation
of the demo fleet's assistant (its system prompt, model and settings) with
the built-in calculator and clock as local tools — the same tools the demo's
workers serve.

Reported: right answers, questions in which the calculator ran, tool calls
made, seconds per question (median and total), and each question's outcome.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import statistics
import sys
import time
from typing import Any

from fleetbus.agents import Agent, AgentSettings
from fleetbus.cli.demo_fleet import agents, describe_model
from fleetbus.models import ModelConfig
from fleetbus.protocol import Event, FinalAnswer
from fleetbus.tools_workers import Toolkit
from fleetbus.tools_workers.builtin import calculator, current_time

QUESTIONS: list[tuple[str, str]] = [
    ("What is 17 * 23 + 4?", "395"),
    ("What is 2026 - 1991?", "35"),
    ("What is 144 / 16?", "9"),
    ("What is 2 to the power of 20?", "1048576"),
    ("What is 987654 + 123456?", "1111110"),
    ("What is (45 + 55) * 3?", "300"),
    ("What is 1001 - 777?", "224"),
    ("What is 19 * 21?", "399"),
    ("What is the square root of 1764?", "42"),
    ("How many hours are in 365 days?", "8760"),
]


def _numbers(text: str) -> set[str]:
    """The numbers a text states, with thousands separators and trailing
    ``.0`` removed."""
    found = re.findall(r"-?\d[\d,]*(?:\.\d+)?", text)
    return {n.replace(",", "").removesuffix(".0") for n in found}


async def ask(agent: Agent, question: str, expected: str) -> dict[str, Any]:
    """One fresh conversation: the answer, the tool calls, the seconds."""
    fresh = agent.clone()
    calls: list[str] = []
    started = time.perf_counter()
    final: FinalAnswer | None = None
    async for item in fresh.reply_stream(question):
        if isinstance(item, Event) and item.event == "tool_call":
            calls.append(f"{item.data.get('tool_name')}({json.dumps(item.data.get('parameters'))})")
        elif isinstance(item, FinalAnswer):
            final = item
    seconds = time.perf_counter() - started
    content = str(final.content) if final is not None else ""
    return {
        "question": question,
        "expected": expected,
        "answer": content[:200],
        "finished_reason": final.finished_reason if final is not None else None,
        # A number the question states proves nothing (a tool call echoed as text).
        "right": expected in _numbers(content) - _numbers(question),
        "tool_calls": calls,
        "seconds": round(seconds, 2),
    }


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--questions", type=int, default=len(QUESTIONS))
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per model call")
    args = parser.parse_args()
    line: dict[str, Any] = {
        "bench": "real_model",
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
    }
    if not os.environ.get("OPENAI_BASE_URL"):
        line["skipped"] = "OPENAI_BASE_URL is not set (see ../shared/local-llm/README.md)"
        print(json.dumps(line))
        return 0
    agent = agents()[0]
    demo = Agent(
        agent.name,
        agent.system_prompt,
        agent.model,
        toolkit=Toolkit([calculator, current_time]),
        settings=AgentSettings(
            max_iters=agent.settings.max_iters,
            model_calls=ModelConfig(timeout=args.timeout, max_retries=1),
        ),
    )
    results = [await ask(demo, q, a) for q, a in QUESTIONS[: args.questions]]
    seconds = [r["seconds"] for r in results]
    line.update(
        model=describe_model(),
        base_url=os.environ["OPENAI_BASE_URL"],
        questions=len(results),
        right=sum(r["right"] for r in results),
        with_calculator=sum(
            any(c.startswith("calculator") for c in r["tool_calls"]) for r in results
        ),
        tool_calls=sum(len(r["tool_calls"]) for r in results),
        seconds_median=round(statistics.median(seconds), 2),
        seconds_total=round(sum(seconds), 2),
        results=results,
    )
    print(json.dumps(line, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
