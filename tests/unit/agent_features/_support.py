"""Small helpers shared by the agent feature tests."""

from __future__ import annotations

from collections.abc import Sequence

from fleetbus.agents import Msg
from fleetbus.protocol import ChatMessage, TextBlock, ToolResultBlock


def text_of(message: ChatMessage) -> str:
    """The text blocks of a message sent to the model, joined."""
    return "".join(b.text for b in message.content if isinstance(b, TextBlock))


def results_of(message: ChatMessage) -> list[ToolResultBlock]:
    """The tool_result blocks of a message sent to the model."""
    return [b for b in message.content if isinstance(b, ToolResultBlock)]


def unanswered(memory: Sequence[Msg]) -> list[str]:
    """The ids of tool calls in ``memory`` that have no tool_result after them."""
    missing: list[str] = []
    for index, message in enumerate(memory):
        later = {r.id for m in memory[index + 1 :] for r in m.tool_results}
        missing.extend(u.id for u in message.tool_uses if u.id not in later)
    return missing


def result_for(memory: Sequence[Msg], call_id: str) -> ToolResultBlock:
    """The one tool_result in ``memory`` answering ``call_id``."""
    found = [r for m in memory for r in m.tool_results if r.id == call_id]
    assert len(found) == 1, f"{len(found)} results for {call_id}"
    return found[0]
