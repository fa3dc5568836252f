"""``fleetbus watch`` reads the fleet's subjects and the reply inboxes with two
subscriptions, read by two tasks: a reply can be read before its request."""

from __future__ import annotations

import io
from dataclasses import dataclass

from rich.console import Console

from fleetbus.bus import Subjects
from fleetbus.cli.watch import _Watcher
from fleetbus.protocol import ToolCall, ToolResult, encode


@dataclass
class Msg:
    subject: str
    reply: str
    data: bytes


def test_a_reply_read_before_its_request_is_still_shown() -> None:
    out = io.StringIO()
    watcher = _Watcher(
        Subjects("fleet"),
        session=None,
        agent=None,
        json_output=False,
        console=Console(file=out, width=200),
    )
    call = ToolCall(tool_name="echo", call_id="c-1", parameters={"text": "hi"})
    result = ToolResult(tool_name="echo", call_id="c-1", status="success", content="hi")
    watcher.receive(Msg("_INBOX.abc.1", "", encode(result)))  # the reply first
    watcher.receive(Msg("fleet.tool.echo", "_INBOX.abc.1", encode(call)))
    assert watcher.shown == 2
    text = out.getvalue()
    assert text.index("tool_call") < text.index("tool_result")


def test_someone_elses_reply_is_not_shown() -> None:
    watcher = _Watcher(
        Subjects("fleet"),
        session=None,
        agent=None,
        json_output=False,
        console=Console(file=io.StringIO()),
    )
    result = ToolResult(tool_name="echo", call_id="c-2", status="success", content="hi")
    watcher.receive(Msg("_INBOX.other.1", "", encode(result)))
    assert watcher.shown == 0
