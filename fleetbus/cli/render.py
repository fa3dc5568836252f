"""Protocol messages as lines for people, shared by ``fleetbus ask`` and
``fleetbus watch``.

- :class:`ReplyPrinter` prints the events of one reply as they stream —
  thinking (dim, italic) and text deltas on the line they continue, tool calls
  and results, what a paused reply waits for with the exact command that
  resumes it — and its end.
- :func:`describe` is one line for any message, for ``fleetbus watch``.

Both take whatever arrives off the wire: a missing key, a value of the wrong
type or an event name they do not know gives a ``?`` or a dim line, never an
exception.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Final, Literal

from rich.console import Console
from rich.text import Text

from fleetbus.protocol import (
    AgentMessage,
    Cancel,
    ConfirmResult,
    DataBlock,
    ErrorMessage,
    Event,
    ExternalResult,
    FinalAnswer,
    LlmPrompt,
    LlmResponse,
    Message,
    TextBlock,
    ThinkingBlock,
    ToolCall,
    ToolResult,
    ToolResultBlock,
    ToolUseBlock,
    UserRequest,
    to_builtins,
)

__all__ = ["STATUS_STYLES", "ReplyPrinter", "describe", "shorten"]

logger = logging.getLogger(__name__)

STATUS_STYLES: Final[dict[str, str]] = {
    "success": "green",
    "error": "red",
    "timeout": "yellow",
    "denied": "magenta",
    "cancelled": "yellow",
}
"""The colour of each tool status."""

_REASON_STYLES: Final[dict[str, tuple[str, str]]] = {
    "completed": ("✓", "bold green"),
    "paused": ("⏸", "bold yellow"),
    "error": ("✗", "bold red"),
    "interrupted": ("■", "yellow"),
    "handed_off": ("↪", "bold cyan"),
    "guardrail_tripped": ("⛔", "bold red"),
}
_ARGS_LIMIT: Final = 120
_OUTPUT_LIMIT: Final = 160
_PENDING_LIMIT: Final = 1000  # a person decides on these parameters: show most of them
_LINE_LIMIT: Final = 240
_COMMON_FIELDS: Final = ("version", "type", "id", "timestamp", "sender", "session_id", "call_id")


def shorten(text: str, limit: int = _OUTPUT_LIMIT) -> str:
    """``text`` on one line (whitespace runs folded), cut to ``limit`` characters with ``…``."""
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: max(limit - 1, 0)] + "…"


def _json(value: Any) -> str:
    try:
        return json.dumps(value, ensure_ascii=False, default=str)
    except (TypeError, ValueError):  # a circular structure: still show something
        return repr(value)


FORMAT_ERROR_TOOL: Final = "format_error"
"""The call an adapter makes of an unusable step (``fleetbus.models.model``'s,
repeated here: this module is imported by commands that load no model code)."""


def _show(value: Any, limit: int = _OUTPUT_LIMIT) -> str:
    """A value for a person: strings as they are, anything else as JSON."""
    return shorten(value if isinstance(value, str) else _json(value), limit)


def _str(data: dict[str, Any], key: str, default: str = "?") -> str:
    value = data.get(key)
    return value if isinstance(value, str) and value else default


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _calls(data: dict[str, Any]) -> list[dict[str, Any]]:
    calls = data.get("calls")
    return [c for c in calls if isinstance(c, dict)] if isinstance(calls, list) else []


def _content_text(content: Any) -> str:
    """The readable text of a ``content`` field: a string or content blocks."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return "" if content is None else _show(content)
    parts: list[str] = []
    for block in content:
        match block:
            case TextBlock():
                parts.append(block.text)
            case ThinkingBlock():
                parts.append(f"(thinking: {block.thinking})")
            case ToolUseBlock():
                parts.append(f"{block.name}({_show(block.input, _ARGS_LIMIT)})")
            case ToolResultBlock():
                parts.append(f"{block.name} {block.state} — {_show(block.output)}")
            case DataBlock():
                parts.append(f"[data {block.name or block.url}]")
            case {"text": str(text)}:
                parts.append(text)
            case _:
                parts.append(_show(block))
    return " ".join(parts)


def _type_name(message: Message) -> str:
    tag = type(message).__struct_config__.tag
    return tag if isinstance(tag, str) else type(message).__name__


def _call_line(tool_name: str, parameters: Any) -> str:
    return f"{tool_name}({_show(parameters, _ARGS_LIMIT)})"


def _event_summary(event: Event) -> str:
    data = event.data
    name = event.event
    match name:
        case "text_delta":
            return _json(data.get("text", ""))
        case "thinking_delta":
            return _json(data.get("thinking", ""))
        case "tool_call":
            call = _call_line(_str(data, "tool_name"), data.get("parameters", {}))
            return f"{call} tool_call_id={_str(data, 'call_id')}"
        case "tool_result":
            return (
                f"{_str(data, 'tool_name')} {_str(data, 'status')} — "
                f"{_show(data.get('output'))} tool_call_id={_str(data, 'call_id')}"
            )
        case "reply_end":
            to = _handed_to(data.get("handoff"))
            return (
                f"{_str(data, 'finished_reason')}{f' → {to}' if to else ''} — "
                f"{_content_text(data.get('content'))}"
            )
        case "guardrail":
            return _guardrail_line(data)
        case "model_call_start":
            return f"{_str(data, 'model')} step {data.get('iteration', '?')}"
        case "model_call_end":
            return (
                f"{_str(data, 'model')} {data.get('input_tokens', '?')} in / "
                f"{data.get('output_tokens', '?')} out tokens, {data.get('seconds', '?')} s"
            )
        case "require_user_confirm" | "require_external_execution":
            return ", ".join(f"{_str(c, 'tool_name')}[{_str(c, 'call_id')}]" for c in _calls(data))
        case "reply_start":
            return ""
        case _:
            return _show(data)


def _guardrail_line(data: dict[str, Any]) -> str:
    """A ``guardrail`` event: which check, on what, and what it found."""
    call = f" {_str(data, 'tool_name')}[{_str(data, 'call_id')}]" if "call_id" in data else ""
    failed = " (failed)" if data.get("failed") is True else ""
    reason = data.get("reason")
    said = f" — {_show(reason)}" if isinstance(reason, str) and reason else ""
    return (
        f"{_str(data, 'name')} on {_str(data, 'stage')}{call}: {_str(data, 'action')}{failed}{said}"
    )


def _essentials(message: Message) -> str:
    match message:
        case ToolCall():
            attempt = f" attempt {message.attempt}" if message.attempt > 1 else ""
            return _call_line(message.tool_name, message.parameters) + attempt
        case ToolResult():
            if message.ok:
                outcome = _show(message.content)
            elif message.error_detail is not None:
                outcome = f"{message.error_detail.code}: {message.error_detail.message}"
            else:
                outcome = _show(message.content)
            return f"{message.tool_name} {message.status} — {outcome}"
        case Event():
            return f"{message.event}#{message.seq} {_event_summary(message)}"
        case ErrorMessage():
            source = f" (from {message.source_component})" if message.source_component else ""
            return f"{message.code}: {message.message}{source}"
        case UserRequest():
            if message.handoff is not None:
                handoff = message.handoff
                said = f": {_content_text(message.content)}" if message.content else ""
                return f"handed over by {handoff.by} ({len(handoff.messages)} messages){said}"
            return _content_text(message.content)
        case FinalAnswer():
            structured = f" {_json(message.structured)}" if message.structured else ""
            to = f" → {message.handoff.agent}" if message.handoff is not None else ""
            trip = message.guardrail
            tripped = f" [guardrail {trip.name} on {trip.stage}]" if trip is not None else ""
            return (
                f"{message.finished_reason}{to}{tripped} — "
                f"{_content_text(message.content)}{structured}"
            )
        case AgentMessage():
            who = f"{message.name}: " if message.name else ""
            note = "" if message.reply else " (no reply asked)"
            return f"{who}{_content_text(message.content)}{note}"
        case LlmPrompt():
            last = _content_text(message.messages[-1].content) if message.messages else ""
            return (
                f"{message.model}: {len(message.messages)} messages, "
                f"{len(message.tools)} tools — {last}"
            )
        case LlmResponse():
            usage = message.usage
            tokens = f" ({usage.input_tokens} in / {usage.output_tokens} out)" if usage else ""
            return (
                f"{message.model or '?'} {message.finish_reason or '?'}{tokens} — "
                f"{_content_text(message.content)}"
            )
        case ConfirmResult():
            return ", ".join(
                f"{'allow' if c.confirmed else 'deny'} {c.call_id}{' always' if c.always else ''}"
                for c in message.confirmations
            )
        case ExternalResult():
            return ", ".join(f"{r.call_id} {r.status}" for r in message.results)
        case Cancel():
            return message.reason
        case _:
            fields = {k: v for k, v in to_builtins(message).items() if k not in _COMMON_FIELDS}
            return _show(fields)


def describe(message: Message, subject: str = "") -> str:
    """One line for a person about any protocol message (``fleetbus watch``).

    The type, sender, session and call id, then what matters for the type
    (tool and parameters of a ``tool_call``, status and content of a
    ``tool_result``, name of an ``event``, code and message of an ``error``,
    text of a request, answer or agent message), then the subject (left out
    for replies on an inbox). Long values are shortened.
    """
    ids = []
    if message.session_id:
        ids.append(f"session={message.session_id}")
    if message.call_id:
        ids.append(f"call={message.call_id}")
    try:
        body = shorten(_essentials(message), _LINE_LIMIT)
    except Exception:  # a line about a message must never break the watcher
        logger.debug("cannot describe a %s message", _type_name(message), exc_info=True)
        body = "(cannot describe)"
    where = ""
    if subject:
        where = "  @ reply" if subject.startswith("_INBOX.") else f"  @ {subject}"
    head = " ".join([f"{_type_name(message):<13}", message.sender or "?", *ids])
    return f"{head}  {body}{where}".rstrip()


class ReplyPrinter:
    """Prints the events of one reply, and its final answer, as they arrive.

    Feed it every message of a reply in order — the ``event`` messages of
    ``Agent.reply_stream`` or of ``<prefix>.events.<agent>.<session>.<owner>``, then the
    ``final_answer`` — with :meth:`handle`. Deltas continue the current line;
    other events start a new one. The end of the reply is printed once, with
    the answer when it was not streamed.

    Args:
        console: where to print.
        session_id: the session to name in resume commands when a message
            carries none.
        verbose: also print ``reply_start``, the model calls and the
            guardrail checks that passed (dim).
    """

    def __init__(
        self, console: Console, *, session_id: str | None = None, verbose: bool = False
    ) -> None:
        self.console = console
        self.session_id = session_id
        self.verbose = verbose
        self.text = ""
        """The text streamed so far in this reply."""
        self.thinking = ""
        """The reasoning streamed so far in this reply."""
        self.finished_reason: str | None = None
        """How the reply ended, once it has."""
        self._open: Literal["text", "thinking"] | None = None
        self._structured_shown = False

    def handle(self, message: Message) -> None:
        """Print what a message of the reply says. Never raises."""
        try:
            self._handle(message)
        except Exception:  # printing must not break the reply being read
            logger.debug("cannot render a %s message", _type_name(message), exc_info=True)
            self._line(Text(f"· (cannot show a {_type_name(message)} message)", style="dim"))

    def close(self) -> None:
        """End a line left open by streamed deltas."""
        if self._open is not None:
            self._open = None
            self.console.print()

    def _line(self, text: Text | str, **kwargs: Any) -> None:
        self.close()
        self.console.print(text, highlight=False, **kwargs)

    def _handle(self, message: Message) -> None:
        match message:
            case Event():
                self._event(message)
            case FinalAnswer():
                self._end(
                    message.finished_reason,
                    message.content,
                    message.session_id,
                    structured=message.structured,
                )
            case ErrorMessage():
                self._line(
                    Text.assemble(("error ", "bold red"), f"{message.code}: {message.message}")
                )
            case _:
                self._line(Text(describe(message), style="dim"))

    def _event(self, event: Event) -> None:
        data = event.data
        match event.event:
            case "thinking_delta":
                self._delta("thinking", data.get("thinking"))
            case "text_delta":
                self._delta("text", data.get("text"))
            case "tool_call" if data.get("tool_name") == FORMAT_ERROR_TOOL:
                # No tool: the model wrote a step that was neither a call nor an answer.
                parameters = data.get("parameters")
                why = parameters.get("error") if isinstance(parameters, dict) else None
                self._line(
                    Text.assemble(
                        ("⚠ ", "yellow"),
                        ("the model's step could not be used", "yellow"),
                        f": {_show(why)}" if why else "",
                        " — it is shown what it wrote and asked again",
                    )
                )
            case "tool_result" if data.get("tool_name") == FORMAT_ERROR_TOOL:
                pass  # said with its call
            case "tool_call":
                self._line(
                    Text.assemble(
                        ("→ ", "cyan"),
                        (_str(data, "tool_name"), "bold cyan"),
                        f"({_show(data.get('parameters', {}), _ARGS_LIMIT)})",
                    )
                )
            case "tool_result":
                status = _str(data, "status")
                style = STATUS_STYLES.get(status, "")
                self._line(
                    Text.assemble(
                        ("← ", style),
                        (_str(data, "tool_name"), "bold"),
                        ": ",
                        (status, style),
                        " — ",
                        _show(data.get("output")),
                    )
                )
            case "require_user_confirm":
                self._pending(event, confirm=True)
            case "require_external_execution":
                self._pending(event, confirm=False)
            case "reply_end":
                self._end(
                    _str(data, "finished_reason"),
                    data.get("content"),
                    event.session_id,
                    handed_to=_handed_to(data.get("handoff")),
                )
            case "guardrail" if data.get("tripped") is True:
                self._line(Text(f"⛔ guardrail {_guardrail_line(data)}", style="bold red"))
            case "guardrail" if data.get("action") in ("reject", "replace"):
                self._line(Text(f"⚠ guardrail {_guardrail_line(data)}", style="yellow"))
            case "guardrail":
                if self.verbose:
                    self._line(Text(f"· guardrail {_guardrail_line(data)}", style="dim"))
            case "reply_start":
                self.text = self.thinking = ""
                self.finished_reason = None
                self._structured_shown = False
                if self.verbose:
                    self._line(Text(f"· reply {_str(data, 'reply_id')} started", style="dim"))
            case "model_call_start" | "model_call_end":
                if self.verbose:
                    self._line(Text(f"· {event.event} {_event_summary(event)}", style="dim"))
            case _:
                self._line(Text(f"· {event.event} {_show(data)}", style="dim"))

    def _delta(self, kind: Literal["text", "thinking"], piece: Any) -> None:
        if not isinstance(piece, str) or not piece:
            return
        if self._open != kind:
            self.close()
            if kind == "thinking":
                self.console.print(Text("thinking: ", style="dim bold"), end="")
            self._open = kind
        if kind == "thinking":
            self.thinking += piece
            style = "dim italic"
        else:
            self.text += piece
            style = ""
        # soft_wrap: rich does not know the cursor column, so let the terminal wrap.
        self.console.print(Text(piece, style=style), end="", soft_wrap=True)

    def _pending(self, event: Event, *, confirm: bool) -> None:
        calls = _calls(event.data)
        session = event.session_id or self.session_id or "<session>"
        if confirm:
            head = f"⏸ confirm before running {len(calls)} tool call(s):"
        else:
            head = f"⏸ {len(calls)} tool call(s) to run outside the agent:"
        self._line(Text(head, style="bold yellow"))
        for call in calls:
            call_id = _str(call, "call_id")
            rule = call.get("rule")
            self._line(
                Text.assemble(
                    ("  • ", "yellow"),
                    (_str(call, "tool_name"), "bold"),
                    f" {_show(call.get('parameters', {}), _PENDING_LIMIT)}",
                    (f"  call_id {call_id}", "dim"),
                    (f"  (rule: {rule})" if isinstance(rule, str) and rule else "", "dim"),
                ),
                soft_wrap=True,
            )
            if confirm:
                for verb in ("allow", "deny"):
                    command = f"fleetbus confirm {session} --{verb} {call_id}"
                    self._line(
                        Text.assemble(f"    {verb + ':':<7}", (command, "bold")), soft_wrap=True
                    )
                # Single-quoted for the shell: an edited input, an accepted rule.
                parameters = json.dumps(call.get("parameters", {}), ensure_ascii=False)
                if len(parameters) <= 200:
                    quoted = "'" + parameters.replace("'", "'\\''") + "'"
                    command = f"fleetbus confirm {session} --edit {call_id} {quoted}"
                    self._line(Text.assemble("    edit:  ", (command, "bold")), soft_wrap=True)
                rules = call.get("suggested_rules")
                if isinstance(rules, list) and rules:
                    shown = " or ".join("'" + str(r).replace("'", "'\\''") + "'" for r in rules)
                    self._line(
                        Text.assemble("    rules: ", ("--accept-rules ", "bold"), shown),
                        soft_wrap=True,
                    )
            else:
                # JSON and MESSAGE are for the person to fill in: the output
                # of the call they ran, or why it failed.
                for verb, command in (
                    ("result", f"fleetbus resume {session} --result {call_id} JSON"),
                    ("failed", f"fleetbus resume {session} --error {call_id} MESSAGE"),
                ):
                    self._line(
                        Text.assemble(f"    {verb + ':':<7} ", (command, "bold")), soft_wrap=True
                    )

    def _end(
        self,
        finished_reason: str,
        content: Any,
        session_id: str | None,
        *,
        structured: dict[str, Any] | None = None,
        handed_to: str | None = None,
    ) -> None:
        if self.finished_reason is None:
            self.finished_reason = finished_reason
            mark, style = _REASON_STYLES.get(finished_reason, ("■", "yellow"))
            if handed_to is not None:  # the reply goes on under the other agent
                self._line(Text(f"{mark} handed over to {handed_to}", style=style))
                return
            answer = _content_text(content)
            if answer.strip() and " ".join(answer.split()) not in " ".join(self.text.split()):
                self._line(Text(answer))
            session = f" (session {session_id})" if session_id else ""
            self._line(Text(f"{mark} {finished_reason}{session}", style=style))
        else:
            self.close()
        if structured and not self._structured_shown:
            self._structured_shown = True
            self._line(Text(_json(structured), style="cyan"), soft_wrap=True)


def _handed_to(handoff: Any) -> str | None:
    """The agent a ``reply_end`` event's ``handoff`` names, if any."""
    agent = handoff.get("agent") if isinstance(handoff, dict) else None
    return agent if isinstance(agent, str) and agent else None
