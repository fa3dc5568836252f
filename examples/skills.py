"""An agent with skills: it sees each skill's name and description, loads the
instructions of the one it needs, and follows them by running the skill's script.

The skills are the folders under ``examples/skills/`` (a ``SKILL.md`` each):

- ``rot13``: encode or decode ROT13, with a script, ``scripts/rot13.py``;
- ``release-notes``: how to write release notes, with a ``template.md``.

The agent's toolkit is ``Toolkit(skills=["examples/skills"])`` (the tool
``load_skill``) and the coding tools (``Bash``…) rooted at the project. Its
model is a small scripted policy (``ScriptedModel`` playing functions of the
request), so the example runs offline and the same every time: it picks the
skill whose name the task mentions, loads it, runs the command the
instructions give (or reads the file they point to), and answers with what
it got. The example prints what
each model request carried, showing that the instructions reach the model
only once it has chosen the skill::

    python examples/skills.py
    python examples/skills.py "Encode this in rot13: meet me at noon"
    python examples/skills.py "Write the release notes of 2.0"
    python examples/skills.py --bus   # the skills served by a tool worker

With ``--bus`` an embedded nats-server starts, a :class:`~fleetbus.ToolWorker`
serves the skills and the coding tools, and the agent finds them on the bus.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import re
import shlex
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape

from fleetbus import Agent, Bus, EmbeddedServer, ToolClient, Toolkit, ToolWorker
from fleetbus.models import ModelRequest, ModelResponse
from fleetbus.protocol import Event, FinalAnswer, TextBlock, ToolResultBlock
from fleetbus.testing import ScriptedModel
from fleetbus.tools_workers.coding import coding_tools

ROOT = Path(__file__).resolve().parent.parent
SKILLS = ROOT / "examples" / "skills"
DEFAULT_TASK = "Decode this ROT13 message: Uryyb sebz gur syrrg!"
TIMEOUT = 30.0

console = Console()


def toolkit() -> Toolkit:
    """The skills (``load_skill``) and the coding tools, rooted at the project."""
    kit = Toolkit(skills=[SKILLS])
    for coding_tool in coding_tools(ROOT, bash_timeout=20):
        kit.add(coding_tool)
    return kit


def user_text(request: ModelRequest) -> str:
    """The latest text the user sent."""
    for message in reversed(request.messages):
        if message.role == "user":
            text = "".join(b.text for b in message.content if isinstance(b, TextBlock))
            if text:
                return text
    return ""


def last_result(request: ModelRequest) -> Any:
    """The output of the latest tool result."""
    for message in reversed(request.messages):
        for block in message.content:
            if isinstance(block, ToolResultBlock):
                return block.output
    return None


def choose_skill(request: ModelRequest) -> ModelResponse | str:
    """Step 1: the skill whose name the task mentions, from ``load_skill``'s description."""
    offered = next(spec for spec in request.tools if spec.name == "load_skill")
    names = re.findall(r"^- ([a-z0-9-]+): ", offered.description, re.M)
    task = user_text(request).lower()
    chosen = next((name for name in names if name.replace("-", " ") in task), None)
    if chosen is None:
        return f"None of my skills ({', '.join(names)}) fits that task."
    return ScriptedModel.call("load_skill", {"skill": chosen})


def follow_instructions(request: ModelRequest) -> ModelResponse | str:
    """Step 2: run the command the instructions give, in the skill's folder, or
    read the file they point to."""
    instructions = str(last_result(request))
    skill = re.search(r"^# Skill (\S+)", instructions, re.M)
    folder = re.search(r"^Folder: (\S+)", instructions, re.M)
    command = re.search(r"^\s*(python3 scripts/\S+) \"TEXT\"$", instructions, re.M)
    to_read = re.search(r"Read `([^`]+)`", instructions)
    if skill is None or folder is None:
        return str(instructions)
    if command is not None:
        text = user_text(request).split(":", 1)[-1].strip()
        return ScriptedModel.call(
            "Bash", {"command": f"{command.group(1)} {shlex.quote(text)}", "cwd": folder.group(1)}
        )
    if to_read is not None:
        return ScriptedModel.call("load_skill", {"skill": skill.group(1), "file": to_read.group(1)})
    return "The skill's instructions give me nothing to run or read."


def answer(request: ModelRequest) -> ModelResponse | str:
    """Step 3: what the script printed, or the file that was read."""
    result = last_result(request)
    if isinstance(result, dict):
        if result.get("exit_code") != 0:
            return f"The skill's script failed: {result}"
        return f"The skill's script says: {str(result['output']).strip()}"
    return f"The skill asks for this outline:\n{result}"


def show(model: ScriptedModel, instructions_marker: str) -> None:
    """What each model request carried."""
    for number, request in enumerate(model.requests, 1):
        carried = instructions_marker in repr(request)
        console.print(
            f"request {number}: {len(request.messages)} messages, "
            f"instructions of the skill {'[green]present[/]' if carried else 'absent'}"
        )


async def run(task: str, kit: Toolkit) -> int:
    """One reply; print what happened. 0 when it completed."""
    model = ScriptedModel([choose_skill, follow_instructions, answer])
    agent = Agent("skilled", "You use your skills for the tasks they fit.", model, toolkit=kit)
    spec = kit.get("load_skill").spec()
    console.print(f"[bold]load_skill[/] offers:\n{escape(spec.description.split('Skills:')[1])}\n")
    console.print(f"task: {escape(task)}")
    final = None
    async for item in agent.reply_stream(task):
        if isinstance(item, Event) and item.event == "tool_call":
            arguments = ", ".join(f"{k}={v!r}" for k, v in item.data["parameters"].items())
            console.print(f"  the model calls {item.data['tool_name']}({escape(arguments)})")
        final = item
    assert isinstance(final, FinalAnswer)
    if len(model.requests) > 1:
        loaded = str(last_result(model.requests[1]))
        console.print("\n[bold]load_skill[/] returned (its first lines):")
        console.print(f"[dim]{escape(chr(10).join(loaded.splitlines()[:6]))}\n…[/]\n")
    show(model, "# Skill ")
    console.print(f"\nanswer ({final.finished_reason}): {escape(str(final.content))}")
    return 0 if final.finished_reason == "completed" else 1


@contextlib.asynccontextmanager
async def served(bus: Bus) -> AsyncIterator[Toolkit]:
    """The skills and coding tools served by a tool worker; the agent's toolkit of them."""
    worker = ToolWorker(bus, toolkit(), drain_timeout=5.0)
    async with asyncio.TaskGroup() as group:
        group.create_task(worker.run())
        try:
            await worker.wait_ready(TIMEOUT)
            console.print(f"[dim]tool worker serving {', '.join(worker.toolkit.names)}[/]")
            remote = Toolkit()
            await remote.add_remote(ToolClient(bus, sender="agent.skilled", timeout=TIMEOUT))
            yield remote
        finally:
            worker.stop()


async def over_the_bus(url: str, task: str) -> int:
    bus = await Bus.connect(url, prefix="skills", name="skills-example", timeout=TIMEOUT)
    try:
        async with served(bus) as remote:
            return await run(task, remote)
    finally:
        await bus.close()


def main() -> int:
    """Run the example; exit 0 when the reply completed."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("task", nargs="?", default=DEFAULT_TASK, help="what to get done")
    parser.add_argument("--bus", action="store_true", help="serve the skills from a tool worker")
    args = parser.parse_args()
    if not args.bus:
        return asyncio.run(run(args.task, toolkit()))
    with EmbeddedServer() as server:
        pid = server.pid
        console.print(f"[dim]started nats-server (pid {pid}) on {server.url}[/]")
        code = asyncio.run(over_the_bus(server.url, args.task))
    console.print(f"[dim]stopped nats-server (pid {pid})[/]")
    return code


if __name__ == "__main__":
    sys.exit(main())
