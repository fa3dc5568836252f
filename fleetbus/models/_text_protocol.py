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
parse error in place of that result. So does a step that reports an
observation no tool made (``Observation from calculator: …`` written by the
model itself): a call before it still counts, the invented result never does.

Native requests show format errors the same way, as text
(:func:`format_errors_as_text`): a call to a tool that was never offered, with
arguments that are not JSON, is refused by some servers and misleads models.
Pure functions; no I/O.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from fleetbus.models import _text_calls as tc
from fleetbus.models._openai_format import output_text
from fleetbus.models.model import FINISH_TOOL, FORMAT_ERROR_TOOL
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
    "ECHOED_REMINDER",
    "ECHOED_REQUEST",
    "FORMAT_ERROR_TOOL",
    "Action",
    "as_text_messages",
    "echoes_reminder",
    "echoes_request",
    "format_errors_as_text",
    "format_errors_in_a_row",
    "instructions",
    "loads_object",
    "parse_action",
    "text_call_steps",
]

loads_object = tc.loads_object

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
_NOISE = re.compile(r"```[A-Za-z0-9_-]*|</?tool_call>")
"""Left of a step's text once its action is taken out: fences, tags."""
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
    observed = tc.find_observation(text)
    if observed is not None:
        before = text[: observed[0]]
        action = parse_action(before, must_call=must_call) if before.strip() else None
        if action is not None and action.tool is not None:
            return action
        return Action(error=tc.invented(observed[1]))
    error: str | None = None
    for start, end in tc.json_spans(text, "{"):
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
        prose = _NOISE.sub("", tc.without_spans(text, [(start, end)])).strip()
        return Action(action.tool, action.arguments, action.answer, prose)
    if error is not None:
        return Action(error=error)
    stripped = _FENCE.sub("", text).strip()
    if not stripped:
        return Action(error="the answer is empty")
    if must_call:
        return Action(error="there is no JSON action in it, and this step must call a tool")
    return Action(answer=text.strip())


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


def text_call_steps(messages: Sequence[ChatMessage]) -> int | None:
    """How many assistant steps called tools in text (calls read from the
    text, see :data:`~fleetbus.models._text_calls.TEXT_CALL_PREFIX`); ``None``
    once any step made a native call. Format errors and structured answers
    count neither way."""
    steps = 0
    for message in messages:
        if message.role != "assistant":
            continue
        uses = [
            b
            for b in message.content
            if isinstance(b, ToolUseBlock) and b.name not in (FORMAT_ERROR_TOOL, FINISH_TOOL)
        ]
        if any(not u.id.startswith(tc.TEXT_CALL_PREFIX) for u in uses):
            return None
        steps += bool(uses)
    return steps


def format_errors_as_text(
    messages: Sequence[ChatMessage], offered: Collection[str]
) -> list[ChatMessage]:
    """For a native request: each format error as what the model wrote (an
    assistant message) and a reminder (a user message) in place of its result."""
    if not any(
        isinstance(b, ToolUseBlock) and b.name == FORMAT_ERROR_TOOL
        for m in messages
        for b in m.content
    ):
        return list(messages)
    errors: dict[str, ToolUseBlock] = {}
    out: list[ChatMessage] = []
    for message in messages:
        if message.role == "assistant":
            content: list[ContentBlock] = []
            for block in message.content:
                if isinstance(block, ToolUseBlock) and block.name == FORMAT_ERROR_TOOL:
                    errors[block.id] = block
                    block = TextBlock(text=block.raw_arguments or "")
                content.append(block)
            out.append(msgspec.structs.replace(message, content=content))
            continue
        answered = [b for b in message.content if isinstance(b, ToolResultBlock) and b.id in errors]
        rest = [b for b in message.content if b not in answered]
        if rest or not answered:
            out.append(msgspec.structs.replace(message, content=rest))
        out.extend(
            ChatMessage(role="user", content=[TextBlock(text=_reminder(errors[b.id], offered))])
            for b in answered
        )
    return out


_REMINDED = (
    "Your last message could not be used",
    "To use a tool, call it; its result comes in the next message. Otherwise give your "
    "final answer.",
)
"""The fixed parts of :func:`_reminder`."""

ECHOED_REMINDER = "it only repeats the reminder: call a tool, or give your final answer"
"""The format error of a step that answered with words of a reminder."""


def _reminder(use: ToolUseBlock, offered: Collection[str]) -> str:
    """What a native request says about a step that could not be used."""
    error = use.input.get("error") if isinstance(use.input, dict) else None
    if not isinstance(error, str) or not error:
        error = tc.read_calls(use.raw_arguments or "", offered).error
    why = f": {error}" if error else ""
    return f"{_REMINDED[0]}{why}. {_REMINDED[1]}"


def echoes_reminder(text: str) -> bool:
    """Whether ``text`` says nothing but words of a reminder (small models
    answer with them, a reminder later): not an answer, a format error."""
    said = _plain(text)
    return len(said) >= 12 and any(said in _plain(part) for part in _REMINDED)


ECHOED_REQUEST = (
    "it only repeats the user's request: work it out (call a tool if one helps), "
    "then give your final answer"
)
"""The format error of a step that answered with the user's own words."""


def echoes_request(text: str, messages: Sequence[ChatMessage]) -> bool:
    """Whether ``text`` says nothing but the words of a user's message of the
    conversation (small models answer a question with the question itself):
    not an answer, a format error."""
    said = _plain(text)
    if len(said) < 12:
        return False
    for message in reversed(messages):
        if message.role != "user":
            continue
        asked = " ".join(b.text for b in message.content if isinstance(b, TextBlock))
        if asked and said == _plain(asked):
            return True
    return False


def _plain(text: str) -> str:
    """``text`` lower-cased, its punctuation and runs of whitespace made one space."""
    return " ".join(re.sub(r"[^\w\s]", " ", text.lower()).split())


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
    if isinstance(value.get("function"), dict):  # OpenAI's {"type": "function", "function": …}
        value = value["function"]
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
