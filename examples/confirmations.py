"""Confirmations that do more than yes or no: a person changes a call's input
before allowing it, and accepts a rule that the agent's later sessions keep.

The agent ``notes`` may write notes, but asks before every ``write_note``
(``Permissions.from_strings(ask=["write_note"])``). Three sessions, each a
clone of the agent's definition:

1. the model asks to write ``notes/meeting.md``; the reply pauses, and the
   ``require_user_confirm`` event suggests rules for calls like it. The person
   corrects the note's text and folder (``parameters``) and accepts one of the
   suggestions, ``write_note(path=notes/*)``: the edited call is what runs and
   what memory records;
2. a later session writes ``notes/todo.md``: the accepted rule lets it through,
   nobody is asked;
3. a call outside the rule (``diary.md``) still asks; the person denies it.

The model is scripted (``ScriptedModel``), so the example runs offline and the
same every time; the notes go to a temporary folder::

    python examples/confirmations.py

Served on the bus (``fleetbus agent``) the same happens across replicas: the
accepted rules are kept in JetStream, and the person answers with
``fleetbus confirm SESSION --edit CALL_ID '{...}' --accept-rules 'RULE'``.
"""

from __future__ import annotations

import asyncio
import json
import tempfile
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from fleetbus import Agent, Toolkit, tool
from fleetbus.agents import Permissions
from fleetbus.protocol import Event, FinalAnswer
from fleetbus.testing import ScriptedModel

console = Console()


def notes_toolkit(root: Path) -> Toolkit:
    """``write_note``, writing under ``root``."""

    @tool
    def write_note(path: str, text: str) -> str:
        """Write a note.

        Args:
            path: where, relative to the notes folder (``notes/…``).
            text: what the note says.
        """
        target = root / path
        if root.resolve() not in target.resolve().parents:
            raise ValueError(f"{path!r} is outside the notes folder")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text + "\n", encoding="utf-8")
        return f"wrote {path}"

    return Toolkit([write_note])


def scripted_model() -> ScriptedModel:
    """The model's turns, in the order the three sessions use them."""
    return ScriptedModel(
        [
            ScriptedModel.call(
                "write_note", {"path": "notes/meeting.md", "text": "Meeting at 10"}, call_id="c1"
            ),
            ScriptedModel.text("The meeting note is saved."),
            ScriptedModel.call(
                "write_note", {"path": "notes/todo.md", "text": "Book the room"}, call_id="c2"
            ),
            ScriptedModel.text("The to-do is saved."),
            ScriptedModel.call(
                "write_note", {"path": "diary.md", "text": "Dear diary"}, call_id="c3"
            ),
            ScriptedModel.text("I will not write the diary."),
        ]
    )


async def reply(agent: Agent, text: str) -> tuple[list[Event], FinalAnswer]:
    """Stream a reply: its events, and its end."""
    console.print(f"\n[bold]user:[/] {escape(text)}")
    events: list[Event] = []
    final: FinalAnswer | None = None
    async for item in agent.reply_stream(text):
        if isinstance(item, Event):
            events.append(item)
        else:
            final = item
    assert final is not None
    return events, final


def show_pause(events: list[Event]) -> dict[str, object]:
    """Print the calls a pause asks about, with the rules it suggests; the first call."""
    asked = [e for e in events if e.event == "require_user_confirm"]
    (call,) = asked[-1].data["calls"]
    console.print(
        f"[yellow]⏸ asks to run[/] {call['tool_name']} {escape(json.dumps(call['parameters']))}"
    )
    for rule in call["suggested_rules"]:
        console.print(f"    suggested rule: [cyan]{escape(rule)}[/]")
    return dict(call)


async def main() -> None:
    with tempfile.TemporaryDirectory(prefix="fleetbus-notes-") as folder:
        root = Path(folder)
        definition = Agent(
            "notes",
            "You keep the user's notes.",
            scripted_model(),
            toolkit=notes_toolkit(root),
            permissions=Permissions.from_strings(ask=["write_note"]),
        )

        console.rule("session 1: edit the call, accept a rule")
        first = definition.clone()
        events, final = await reply(first, "Note that the meeting is at 10.")
        assert final.finished_reason == "paused"
        call = show_pause(events)
        edited = {"path": "notes/2026/meeting.md", "text": "Meeting at 10:30, room B"}
        rule = "write_note(path=notes/*)"
        assert rule in call["suggested_rules"]  # type: ignore[operator]
        console.print(
            f"[bold]person:[/] allow {call['call_id']} as {escape(json.dumps(edited))}, "
            f"accept [cyan]{escape(rule)}[/]"
        )
        final = await first.confirm(
            str(call["call_id"]), allow=True, parameters=edited, accept_rules=[rule]
        )
        console.print(f"[green]✓ {final.finished_reason}[/] — {escape(str(final.content))}")
        (asking,) = [m for m in first.memory if m.tool_uses]
        console.print(
            f"  memory records the call as {escape(json.dumps(asking.tool_uses[0].input))}"
        )
        written = (root / "notes/2026/meeting.md").read_text(encoding="utf-8").strip()
        console.print(f"  notes/2026/meeting.md says: {escape(written)}")
        assert written == edited["text"]
        assert not (root / "notes/meeting.md").exists()

        console.rule("session 2: a later session, not asked")
        second = definition.clone()
        events, final = await reply(second, "Add a to-do: book the room.")
        asked = [e for e in events if e.event == "require_user_confirm"]
        console.print(
            f"[green]✓ {final.finished_reason}[/] — {escape(str(final.content))} "
            f"(confirmations asked: {len(asked)}; the rule "
            f"{escape(str(second.state.permissions.agent_accepted[0]))} let it through)"
        )
        assert final.finished_reason == "completed"
        assert not asked
        assert (root / "notes/todo.md").exists()

        console.rule("session 3: outside the rule, still asked")
        third = definition.clone()
        events, final = await reply(third, "Write in my diary.")
        assert final.finished_reason == "paused"
        call = show_pause(events)
        console.print(f"[bold]person:[/] deny {call['call_id']}")
        final = await third.confirm(str(call["call_id"]), allow=False)
        console.print(f"[green]✓ {final.finished_reason}[/] — {escape(str(final.content))}")
        assert not (root / "diary.md").exists()


if __name__ == "__main__":
    asyncio.run(main())
