"""Tool calling for models without native tool calls: a JSON action in the text.

The model is told (a system-prompt addendum) to answer each step with one
JSON object, ``{"tool": name, "arguments": {…}}`` or ``{"answer": "…"}``.
Its text is read tolerantly (code fences, prose around the object, trailing
commas, single quotes, Python ``True``/``False``/``None``). Earlier tool calls
are shown to it as the JSON it wrote, and tool results as user messages
starting with ``Observation from <tool>``.

A step that tried to write an action but could not be read becomes a tool
call named :data:`FORMAT_ERROR_TOOL` whose ``raw_arguments`` hold the whole
text: the agent answers it with an error result (as it does any malformed
arguments), and the next request shows the model a format reminder with the
parse error in place of that result. Pure functions; no I/O.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from fleetbus.models._openai_format import output_text
from fleetbus.protocol import (
    ChatMessage,
    ContentBlock,
    TextBlock,
    ThinkingBlock,
    ToolResultBlock,
    ToolSpec,
    ToolUseBlock,
)

__all__ = [
    "FORMAT_ERROR_TOOL",
    "Action",
    "as_text_messages",
    "format_errors_in_a_row",
    "instructions",
    "loads_object",
    "parse_action",
]

FORMAT_ERROR_TOOL = "format_error"
"""The name of the tool call that stands for a step the model wrote in the
wrong format (its ``raw_arguments`` hold what it wrote)."""

_FORMAT = (
    'Reply with exactly one JSON object: {"tool": "<tool name>", "arguments": {...}} '
    'to call a tool, or {"answer": "<your answer>"} to give your final answer.'
)
_ANSWER_KEYS = ("answer", "final_answer", "final answer")
_TOOL_KEYS = ("tool", "tool_name", "name", "action", "function")
_ARGUMENT_KEYS = ("arguments", "args", "parameters", "input", "action_input", "tool_input")
_FINAL_ACTIONS = frozenset({"final answer", "final_answer", "answer", "finish"})
_ACTION_KEY = re.compile(r"""["']?\b(?:tool|answer|arguments|action)\b["']?\s*:""")
_FENCE = re.compile(r"```[A-Za-z0-9_-]*")
_WORDS = {"True": "true", "False": "false", "None": "null"}
_EMPTY_SCHEMA: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True, slots=True)
class Action:
    """What one step of the model's text says.

    Exactly one of ``tool`` (with ``arguments``), ``answer`` or ``error`` is set;
    ``prose`` is the text around the JSON object.
    """

    tool: str | None = None
    arguments: dict[str, Any] = field(default_factory=dict)
    answer: str | None = None
    prose: str = ""
    error: str | None = None


def instructions(tools: Sequence[ToolSpec], choice: str | None) -> str:
    """The system-prompt addendum: the tools, and the action format."""
    lines = [
        "# Tools",
        "",
        "You can use these tools. Each takes a JSON object of arguments that fits its schema.",
        "",
    ]
    for spec in tools:
        schema = json.dumps(spec.parameters or _EMPTY_SCHEMA, ensure_ascii=False)
        lines.append(f"- {spec.name}: {spec.description or '(no description)'}")
        lines.append(f"  arguments schema: {schema}")
    lines += [
        "",
        "# How to answer",
        "",
        "Answer each step with exactly one JSON object, and nothing else:",
        '- to call a tool: {"tool": "<tool name>", "arguments": {...}}',
        '- to give your final answer: {"answer": "<your answer>"}',
        "Call one tool per step. Its result comes in the next message, which starts with "
        '"Observation from <tool name>".',
    ]
    if choice == "required":
        lines.append("This step must call a tool.")
    elif choice not in (None, "auto", "none"):
        lines.append(f"This step must call the tool {choice}.")
    return "\n".join(lines)


def parse_action(text: str, *, must_call: bool = False) -> Action:
    """Read one step of the model's text as an :class:`Action`.

    Text with no JSON action in it at all is the final answer (unless
    ``must_call``); an object that looks like an attempt at an action but
    cannot be read gives an ``error`` for the model to see.
    """
    error: str | None = None
    for start, end in _object_spans(text):
        candidate = text[start:end]
        try:
            value = loads_object(candidate)
        except ValueError as exc:
            if _ACTION_KEY.search(candidate):
                error = f"the JSON object is not valid ({exc})"
            continue
        action = _interpret(value)
        if action is None:
            continue
        if action.error is not None:
            error = action.error
            continue
        prose = _FENCE.sub("", text[:start] + text[end:]).strip()
        return Action(action.tool, action.arguments, action.answer, prose)
    if error is not None:
        return Action(error=error)
    stripped = _FENCE.sub("", text).strip()
    if not stripped:
        return Action(error="the answer is empty")
    if must_call:
        return Action(error="there is no JSON action in it, and this step must call a tool")
    return Action(answer=text.strip())


def loads_object(text: str) -> dict[str, Any]:
    """A JSON object, read tolerantly (the first object in ``text``).

    Raises:
        ValueError: no object could be read (the message says why).
    """
    spans = _object_spans(text)
    candidate = text[spans[0][0] : spans[0][1]] if spans else text
    problem = ""
    strict = _to_json(candidate)
    for attempt in (candidate, strict, _closed(strict)):
        try:
            value = json.loads(attempt, strict=False)
        except ValueError as exc:
            # Where the text as written went wrong: the repairs move the error.
            problem = problem or str(exc)
            continue
        if isinstance(value, dict):
            return value
    raise ValueError(problem or "not a JSON object")


def format_errors_in_a_row(messages: Sequence[ChatMessage]) -> int:
    """How many of the last assistant steps were format errors, back to back."""
    count = 0
    for message in reversed(messages):
        if message.role != "assistant":
            continue
        if not any(
            isinstance(b, ToolUseBlock) and b.name == FORMAT_ERROR_TOOL for b in message.content
        ):
            break
        count += 1
    return count


def as_text_messages(
    messages: Sequence[ChatMessage],
    *,
    addendum: str | None,
    keep_thinking: bool,
    bare_tool: str | None = None,
) -> list[ChatMessage]:
    """The conversation without tool blocks: calls as the JSON the model wrote,
    results as ``Observation from …`` user messages, ``addendum`` appended to
    the system prompt. Calls of ``bare_tool`` show only their arguments (the
    answers of ``response_format`` steps)."""
    uses: dict[str, ToolUseBlock] = {}
    out: list[ChatMessage] = []
    for message in messages:
        if message.role == "assistant":
            texts: list[str] = []
            thinking: list[ContentBlock] = []
            for block in message.content:
                if isinstance(block, ToolUseBlock):
                    uses[block.id] = block
                    texts.append(_written(block, bare_tool))
                elif isinstance(block, TextBlock) and block.text:
                    texts.append(block.text)
                elif isinstance(block, ThinkingBlock) and keep_thinking:
                    thinking.append(block)
            content = [*thinking, TextBlock(text="\n".join(texts))]
            out.append(ChatMessage(role="assistant", content=content, name=message.name))
            continue
        content = [
            TextBlock(text=_observation(b, uses.get(b.id))) if isinstance(b, ToolResultBlock) else b
            for b in message.content
        ]
        role = "user" if message.role == "tool" else message.role
        previous = out[-1] if out else None
        if role == "user" and previous is not None and previous.role == "user":
            # Several results of one step (and a hint after them) as one turn:
            # many chat templates insist that user and assistant alternate.
            out[-1] = ChatMessage(role="user", content=[*previous.content, *content])
        else:
            name = message.name if message.role != "tool" else None
            out.append(ChatMessage(role=role, content=content, name=name))
    if addendum:
        out = _with_addendum(out, addendum)
    return out


def _with_addendum(messages: list[ChatMessage], addendum: str) -> list[ChatMessage]:
    for i, message in enumerate(messages):
        if message.role == "system":
            text = "\n".join(b.text for b in message.content if isinstance(b, TextBlock))
            content: list[ContentBlock] = [
                TextBlock(text=f"{text}\n\n{addendum}" if text else addendum)
            ]
            messages[i] = ChatMessage(role="system", content=content, name=message.name)
            return messages
    return [ChatMessage(role="system", content=[TextBlock(text=addendum)]), *messages]


def _written(use: ToolUseBlock, bare_tool: str | None) -> str:
    if use.name == FORMAT_ERROR_TOOL:
        return use.raw_arguments or ""
    if use.raw_arguments is not None:
        arguments = use.raw_arguments
    else:
        arguments = json.dumps(use.input, ensure_ascii=False)
    if use.name == bare_tool:
        return arguments
    return f'{{"tool": {json.dumps(use.name, ensure_ascii=False)}, "arguments": {arguments}}}'


def _observation(result: ToolResultBlock, use: ToolUseBlock | None) -> str:
    if result.name == FORMAT_ERROR_TOOL:
        error = parse_action(use.raw_arguments or "").error if use is not None else None
        why = f": {error}" if error else ""
        return f"Your last message could not be read as an action{why}. {_FORMAT}"
    state = "" if result.state == "success" else f" ({result.state})"
    return f"Observation from {result.name}{state}:\n{output_text(result.output)}"


def _interpret(value: dict[str, Any]) -> Action | None:
    """An action from a JSON object; ``None`` when the object is not one."""
    answer_key = next((k for k in _ANSWER_KEYS if k in value), None)
    if answer_key is not None:
        return Action(answer=_as_text(value[answer_key]))
    name = next((value[k] for k in _TOOL_KEYS if isinstance(value.get(k), str)), None)
    key = next((k for k in _ARGUMENT_KEYS if k in value), None)
    if name is None:
        return None if key is None else Action(error='the JSON object does not name a "tool"')
    arguments: Any = value[key] if key is not None else {}
    if name.strip().lower() in _FINAL_ACTIONS:
        return Action(answer=_as_text(arguments))
    if isinstance(arguments, str):
        try:  # arguments encoded twice, as a JSON string
            arguments = loads_object(arguments) if arguments.strip() else {}
        except ValueError:
            pass
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        return Action(error=f'the "arguments" of {name} must be a JSON object')
    return Action(tool=name, arguments=arguments)


def _as_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _object_spans(text: str) -> list[tuple[int, int]]:
    """Where the top-level ``{…}`` objects are (the last one may run to the end)."""
    spans: list[tuple[int, int]] = []
    start = text.find("{")
    while start != -1:
        end = _closing(text, start)
        spans.append((start, end))
        start = text.find("{", end)
    return spans


def _closing(text: str, start: int) -> int:
    """The index after the brace that closes the one at ``start`` (or the end)."""
    depth = 0
    quote = ""
    i = start
    while i < len(text):
        c = text[i]
        if quote:
            if c == "\\":
                i += 1
            elif c == quote:
                quote = ""
        elif c in "\"'":
            quote = c
        elif c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return len(text)


def _closed(text: str) -> str:
    """``text`` with the brackets it leaves open closed, when only closing
    brackets are missing (a model that stopped one brace short)."""
    stack: list[str] = []
    quote = False
    escaped = False
    for c in text:
        if quote:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                quote = False
        elif c == '"':
            quote = True
        elif c in "{[":
            stack.append("}" if c == "{" else "]")
        elif c in "}]" and stack:
            stack.pop()
    if quote or not text.rstrip().endswith(("}", "]")):
        # Cut off inside a value: closing it would make up arguments.
        return text
    return text + "".join(reversed(stack))


def _to_json(text: str) -> str:
    """Sloppy JSON made strict: single-quoted strings and bare keys
    double-quoted, trailing commas dropped, Python's ``True``/``False``/``None``
    spelled as JSON's."""
    out: list[str] = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c in "\"'":
            j = i + 1
            while j < n and text[j] != c:
                j += 2 if text[j] == "\\" else 1
            body = text[i + 1 : min(j, n)]
            if c == "'":
                body = body.replace("\\'", "'").replace('\\"', '"').replace('"', '\\"')
            out.append(f'"{body}"')
            i = j + 1
        elif c == ",":
            k = i + 1
            while k < n and text[k].isspace():
                k += 1
            if k >= n or text[k] not in "}]":
                out.append(c)
            i += 1
        elif c.isalpha() or c == "_":
            j = i
            while j < n and (text[j].isalnum() or text[j] == "_"):
                j += 1
            word = text[i:j]
            k = j
            while k < n and text[k].isspace():
                k += 1
            # A bare key ({tool: "add"}) is quoted; a bare value only if Python's.
            out.append(json.dumps(word) if k < n and text[k] == ":" else _WORDS.get(word, word))
            i = j
        else:
            out.append(c)
            i += 1
    return "".join(out)
