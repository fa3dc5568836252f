"""An agent and a tool for the chaos tests of sessions (``fleetbus agent
tests.integration.chaos_specs:chaos``, ``fleetbus worker
tests.integration.chaos_specs``).

Everything here is deterministic, so a test can compute from the requests
alone what a run without failures answers:

- :class:`ChaosModel` answers ``job <id> <k>`` by calling ``chaos_step`` k
  times in turn (one call per step, ``{"job": id, "step": n}``), then answers
  :func:`expected_answer`. Each model call takes 50-400 ms, a function of the
  conversation's text. ``slow-model=S`` in the request makes the first model
  call take S seconds more (not in a replica whose environment has
  ``CHAOS_FAST_MODEL``); ``slow-tool=S`` makes each step's tool take S
  seconds. The model gives its tool calls no id: the agent names them
  (randomly), so a call asked of the model twice travels with two call_ids.
- ``CHAOS_DIE_DIR`` in a replica's environment arms two self-kills (SIGKILL,
  once per session, noted in that directory), at points too brief to hit from
  outside: in session ``chaos-die-answered``, right before the end of a reply
  (its final answer) is appended to the session's journal (the model has
  answered; the session is not stored ``done`` yet, its requester not
  answered); in session
  ``chaos-die-stored``, right before the lease of the session, just stored
  ``done``, is released (its requester not answered yet).
- ``chaos_step`` returns :func:`step_value` after 100-800 ms (a function of its
  arguments, or ``delay``), and appends one line ``<job> <step>`` to the file
  ``$CHAOS_RUNS`` as each run starts, so a test counts real executions.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

from fleetbus.agents import Agent, AgentSettings
from fleetbus.agents.serving.sessions import session_key
from fleetbus.bus import KeyValueStore
from fleetbus.bus.journal import Journal
from fleetbus.models import ModelRequest, ModelResponse
from fleetbus.models.model import ModelStreamItem
from fleetbus.protocol import TextBlock, ToolResultBlock, ToolUseBlock, Usage
from fleetbus.tools_workers import Toolkit, tool

AGENT = "chaos"
RUNS_ENV = "CHAOS_RUNS"
"""The environment variable naming the file of tool runs."""
DIE_ENV = "CHAOS_DIE_DIR"
"""The environment variable that arms the self-kills (a directory)."""
FAST_ENV = "CHAOS_FAST_MODEL"
"""The environment variable that makes ``slow-model=S`` take no longer (any value)."""
DIE_ANSWERED = "chaos-die-answered"
"""The session whose replica dies right before writing its reply's end."""
DIE_STORED = "chaos-die-stored"
"""The session whose replica dies right before releasing its lease once stored done."""


def _digest(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")


def step_value(job: str, step: int) -> str:
    """What ``chaos_step`` returns for these arguments."""
    return f"{job}.{step}:{_digest(f'{job}/{step}') % 100_000:05d}"


def expected_answer(job: str, steps: int) -> str:
    """The final answer to ``job <job> <steps>`` of a run where every call succeeds."""
    return f"result {job}: " + ", ".join(step_value(job, n) for n in range(1, steps + 1))


def parse_job(text: str) -> tuple[str, int, dict[str, float]]:
    """``job <id> <k> [slow-model=S] [slow-tool=S]`` as (id, k, options)."""
    words = text.split()
    if len(words) < 3 or words[0] != "job":
        raise ValueError(f"not a job: {text!r}")
    options = {k: float(v) for k, _, v in (w.partition("=") for w in words[3:])}
    return words[1], int(words[2]), options


class ChaosModel:
    """A model whose answers depend only on the text of the conversation."""

    name = "chaos-model"

    async def stream(self, request: ModelRequest) -> AsyncIterator[ModelStreamItem]:
        user_index = max(
            (i for i, m in enumerate(request.messages) if m.role == "user" and _text(m.content)),
            default=-1,
        )
        text = _text(request.messages[user_index].content) if user_index >= 0 else ""
        done = [
            b
            for m in request.messages[user_index + 1 :]
            for b in m.content
            if isinstance(b, ToolResultBlock)
        ]
        outputs = [str(b.output) for b in done]
        # Ids are left out: the agent chooses them, the conversation's text does not.
        delay = 0.05 + _digest("|".join([text, *outputs])) % 351 / 1000
        job, steps, options = parse_job(text)
        if not done and not os.environ.get(FAST_ENV):
            delay += options.get("slow-model", 0.0)
        await asyncio.sleep(delay)
        if len(done) < steps:
            arguments: dict[str, object] = {"job": job, "step": len(done) + 1}
            if "slow-tool" in options:
                arguments["delay"] = options["slow-tool"]
            block = ToolUseBlock(id="", name="chaos_step", input=arguments)
            yield ModelResponse(content=[block], usage=Usage(input_tokens=1, output_tokens=1))
            return
        answer = f"result {job}: " + ", ".join(outputs)
        yield ModelResponse(
            content=[TextBlock(text=answer)], usage=Usage(input_tokens=1, output_tokens=1)
        )


def _text(blocks: Sequence[object]) -> str:
    return "".join(b.text for b in blocks if isinstance(b, TextBlock))


def chaos() -> Agent:
    """The agent of the chaos tests; ``chaos_step`` comes from the bus."""
    return Agent(AGENT, "", ChaosModel(), toolkit=Toolkit(), settings=AgentSettings(max_iters=10))


@tool
async def chaos_step(job: str, step: int, delay: float = 0.0) -> str:
    """One step of a job: note the run, wait, return the step's value.

    Args:
        job: the job's id.
        step: the step's number (from 1).
        delay: seconds to take; 0 for 100-800 ms, a function of the arguments.
    """
    await asyncio.to_thread(_note_run, f"{job} {step}\n")
    seconds = delay if delay > 0 else 0.1 + _digest(f"{job}#{step}") % 701 / 1000
    await asyncio.sleep(seconds)
    return step_value(job, step)


def _note_run(line: str) -> None:
    with open(os.environ[RUNS_ENV], "a") as runs:
        runs.write(line)


toolkit = Toolkit([chaos_step])


def _first_time(session: str) -> bool:
    """Whether this replica is the first to reach its self-kill in ``session``."""
    try:
        (Path(os.environ[DIE_ENV]) / session).touch(exist_ok=False)
    except FileExistsError:
        return False
    return True


def _arm_self_kills() -> None:
    """Wrap the bus calls that mark the two points (in this process only): a
    kill from outside cannot aim at a window of a few milliseconds."""
    append = Journal.append
    delete = KeyValueStore.delete
    purge = KeyValueStore.purge

    async def die_before_the_end(self: Journal, key: str, data: bytes, **how: Any) -> int:
        if (
            key == session_key(AGENT, DIE_ANSWERED)
            and b'"k":"end"' in data
            and b'"final"' in data
            and _first_time(DIE_ANSWERED)
        ):
            os.kill(os.getpid(), signal.SIGKILL)
        return await append(self, key, data, **how)

    def _dies_here(store: KeyValueStore, key: str) -> None:
        if (
            store.bucket.endswith("session_leases")
            and key == session_key(AGENT, DIE_STORED)
            and _first_time(DIE_STORED)
        ):
            os.kill(os.getpid(), signal.SIGKILL)

    async def die_before_delete(
        self: KeyValueStore, key: str, *, revision: int | None = None
    ) -> int:
        _dies_here(self, key)
        return await delete(self, key, revision=revision)

    async def die_before_purge(
        self: KeyValueStore, key: str, *, revision: int | None = None, ttl: float
    ) -> int:
        _dies_here(self, key)
        return await purge(self, key, revision=revision, ttl=ttl)

    # The lease is released by a purge (or a delete, on a server without
    # per-message TTLs): die just before either.
    Journal.append = die_before_the_end  # type: ignore[method-assign]
    KeyValueStore.delete = die_before_delete  # type: ignore[method-assign]
    KeyValueStore.purge = die_before_purge  # type: ignore[method-assign]


if os.environ.get(DIE_ENV):
    _arm_self_kills()
