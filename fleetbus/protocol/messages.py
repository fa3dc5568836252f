"""The wire messages of protocol version 1.

Every message is one JSON object tagged on ``type``. All carry the common
fields of :class:`Message`; unknown fields are ignored on decode, so a newer
minor revision that adds optional fields is still understood.
"""

from __future__ import annotations

import os
from datetime import UTC, datetime
from typing import Annotated, Any, Literal, get_args

import msgspec

from fleetbus.protocol.content import ContentBlock

__all__ = [
    "AGENT_TOOL_PARAMETERS",
    "ERROR_CODES",
    "FINISHED_REASONS",
    "PROTOCOL_VERSION",
    "TOOL_STATUSES",
    "AgentMessage",
    "Asking",
    "Cancel",
    "ChatMessage",
    "ConfirmResult",
    "Confirmation",
    "ErrorCode",
    "ErrorDetail",
    "ErrorMessage",
    "Event",
    "ExternalOutput",
    "ExternalResult",
    "FinalAnswer",
    "FinishedReason",
    "GuardrailTrip",
    "Handoff",
    "LlmPrompt",
    "LlmResponse",
    "Message",
    "ToolCall",
    "ToolResult",
    "ToolSpec",
    "ToolStatus",
    "Usage",
    "UserRequest",
    "error_reply",
    "new_id",
    "utc_now",
]

PROTOCOL_VERSION = 1
"""The protocol major version this code speaks."""

ErrorCode = Literal[
    "malformed",
    "unsupported_version",
    "unknown_tool",
    "invalid_parameters",
    "tool_error",
    "timeout",
    "denied",
    "cancelled",
    "overloaded",
    "internal",
]
ERROR_CODES: tuple[str, ...] = get_args(ErrorCode)
"""Every error code, in the order of the protocol document."""

ToolStatus = Literal["success", "error", "timeout", "denied", "cancelled"]
TOOL_STATUSES: tuple[str, ...] = get_args(ToolStatus)

FinishedReason = Literal[
    "completed",
    "exceed_max_iters",
    "repeated_action",
    "paused",
    "interrupted",
    "error",
    "handed_off",
    "guardrail_tripped",
]
FINISHED_REASONS: tuple[str, ...] = get_args(FinishedReason)


AGENT_TOOL_PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {"request": {"type": "string", "description": "What to ask the agent."}},
    "required": ["request"],
    "additionalProperties": False,
}
"""JSON Schema of a ``tool_call``'s parameters when the tool is an agent
(the call goes to the agent's inbox)."""


_ID_BATCH = 256
"""Ids made from one read of random bytes."""

_ids: list[str] = []
"""Ids read ahead, handed out from the end."""

os.register_at_fork(after_in_child=_ids.clear)  # a child must not repeat its parent's ids


def new_id() -> str:
    """A fresh random message or call id: 32 hex digits of 128 random bits.

    The random bytes are read ahead, 256 ids at a time: a ``getrandom``
    system call per id would cost more than making the id, and a served
    reply makes a few dozen ids (messages, events, calls, writes). As
    random; safe across threads (``list.pop`` is atomic) and across ``fork``
    (the child drops what it inherited).
    """
    try:
        return _ids.pop()
    except IndexError:
        hexed = os.urandom(16 * _ID_BATCH).hex()
        _ids.extend([hexed[i : i + 32] for i in range(32, len(hexed), 32)])
        return hexed[:32]


def utc_now() -> datetime:
    """The current time, timezone-aware UTC (encoded as RFC 3339 with ``Z``)."""
    return datetime.now(UTC)


class ErrorDetail(msgspec.Struct, frozen=True, kw_only=True):
    """Why a call did not succeed."""

    code: str
    """One of :data:`ERROR_CODES`. Open-ended: a receiver treats a code it does
    not know like ``internal``, so new codes are not a breaking change."""
    message: str
    """A sentence for a person (or a model) to read."""


class Usage(msgspec.Struct, frozen=True, kw_only=True):
    """Token usage of one model call."""

    input_tokens: int = 0
    output_tokens: int = 0


class ToolSpec(msgspec.Struct, frozen=True, kw_only=True):
    """A tool as offered to a model."""

    name: str
    description: str = ""
    parameters: dict[str, Any] = msgspec.field(default_factory=dict)
    """JSON Schema of the arguments object."""


class ChatMessage(msgspec.Struct, frozen=True, kw_only=True):
    """One entry of a conversation sent to a model."""

    role: Literal["system", "user", "assistant", "tool"]
    content: list[ContentBlock]
    name: str | None = None


class Handoff(msgspec.Struct, frozen=True, kw_only=True):
    """A conversation handed from one agent to another: the model of ``by``
    called its ``transfer_to_<agent>`` tool."""

    agent: str
    """The agent that takes the conversation over."""
    by: str
    """The agent that handed it over."""
    reason: str = ""
    """Why, as the model of ``by`` said it (may be empty)."""
    messages: list[ChatMessage] = msgspec.field(default_factory=list)
    """The conversation as ``agent`` gets it: ``by``'s memory through the
    handoff's input filter (without its system prompt)."""
    reply_to: str | None = None
    """In a ``user_request`` carrying the handoff: where its answer goes (the
    reply subject of the request handed over); the request's own reply
    subject gets its receipt. ``None``: the answer goes to the request's
    reply subject."""


class Message(msgspec.Struct, frozen=True, kw_only=True, tag_field="type"):
    """Fields every message carries."""

    version: Annotated[int, msgspec.Meta(ge=1)] = PROTOCOL_VERSION
    """Protocol major version. A receiver answers a higher one with
    ``unsupported_version``."""
    id: str = msgspec.field(default_factory=new_id)
    """Unique id of this message."""
    timestamp: Annotated[datetime, msgspec.Meta(tz=True)] = msgspec.field(default_factory=utc_now)
    """When the sender made it (RFC 3339 with a UTC offset; fleetbus sends ``Z``)."""
    sender: str = ""
    """Id of the agent, worker or client that sent it."""
    session_id: str | None = None
    """The conversation it belongs to, if any."""
    call_id: str | None = None
    """Correlation: a request and its answer carry the same one."""


class Asking(Message, frozen=True, kw_only=True):
    """Fields of the messages that ask an agent for a reply: ``user_request``,
    ``agent_message``, ``confirm_result``, ``external_result``."""

    receipt: bool = False
    """Ask for a receipt: the agent's host sends an empty message (no body,
    no headers) to the reply subject once the request is durably taken (held
    by its session's lease, which a take-over finishes), before the answer.
    A requester that has no receipt after a while sends the request again,
    the same message to the same reply subject: a host answers it once."""


class UserRequest(Asking, frozen=True, kw_only=True, tag="user_request"):
    """A person's (or program's) request to an agent."""

    content: str | list[ContentBlock]
    """The request: text, or content blocks."""
    metadata: dict[str, Any] = msgspec.field(default_factory=dict)
    """Free-form data for the agent and its middleware."""
    output_schema: dict[str, Any] | None = None
    """The JSON Schema (of an object) the answer must fit: the reply ends
    with the validated object in ``final_answer.structured``, or with
    ``error`` when the model gives none that fits."""
    handoff: Handoff | None = None
    """A conversation handed over to this agent: its ``messages`` take the
    place of what the session held, and the reply answers the last of them
    (``content``, when not empty, is added after them as a user message)."""


class LlmPrompt(Message, frozen=True, kw_only=True, tag="llm_prompt"):
    """A model call: the conversation, the tools on offer, and options."""

    model: str
    """Which model to use (the worker's name for it)."""
    messages: list[ChatMessage]
    tools: list[ToolSpec] = msgspec.field(default_factory=list)
    tool_choice: str | None = None
    """``auto``, ``none``, ``required``, or a tool name."""
    options: dict[str, Any] = msgspec.field(default_factory=dict)
    """Model options (temperature, max tokens…)."""
    stream: bool = False
    """Send ``event`` messages with deltas while the response is produced."""


class LlmResponse(Message, frozen=True, kw_only=True, tag="llm_response"):
    """A model's answer to an ``llm_prompt``."""

    model: str = ""
    thought: str | None = None
    """The reasoning text, when the model returned one."""
    content: list[ContentBlock] = msgspec.field(default_factory=list)
    usage: Usage | None = None
    finish_reason: str | None = None
    """As the model reported it (``stop``, ``tool_calls``, ``length``…)."""
    next_subject: str | None = None
    """Where to send the next prompt of the same session to reach the worker
    that answered, whose model server may still hold the conversation in its
    prompt cache. It answers there as on the model's subject; nobody does
    once it is gone."""


class ToolCall(Message, frozen=True, kw_only=True, tag="tool_call"):
    """Run a tool. Answered by a ``tool_result`` with the same ``call_id``."""

    tool_name: str
    parameters: dict[str, Any] = msgspec.field(default_factory=dict)
    """The arguments, a JSON object."""
    timeout: float | None = None
    """Seconds the tool may run; the worker's default when absent."""
    attempt: Annotated[int, msgspec.Meta(ge=1)] = 1
    """1 for the first send, 2… for retries of the same ``call_id``."""
    stream: bool = False
    """``true``: the caller takes the deltas of a streamed result (``tool_result``
    messages with ``final`` false) before the answer; without it a worker
    sends the answer alone."""


class ToolResult(Message, frozen=True, kw_only=True, tag="tool_result"):
    """The outcome of a ``tool_call``."""

    tool_name: str
    status: ToolStatus
    content: Any = None
    """What the tool returned (any JSON value); ``null`` unless ``success``.
    With ``content_by_reference``, a ``data`` content block instead."""
    error_detail: ErrorDetail | None = None
    """Set on every status but ``success``."""
    content_by_reference: bool = False
    """``content`` is a ``data`` block (``nats-object://bucket/name``) whose
    object holds the JSON of what the tool returned: the result was too large
    for one message."""
    final: bool = True
    """``false``: a *delta* of a streamed result, one chunk the tool yielded
    (in ``content``, status ``success``), sent to the call's reply subject as
    it comes to a call that asked for them (``stream``); more follow, and the
    call's answer is the one ``tool_result`` with ``final`` true, last, whose
    ``content`` is the whole result."""

    @property
    def ok(self) -> bool:
        """Whether the tool succeeded."""
        return self.status == "success"


class GuardrailTrip(msgspec.Struct, frozen=True, kw_only=True):
    """The guardrail that stopped a reply (``finished_reason``
    ``guardrail_tripped``)."""

    name: str
    """The guardrail's name."""
    stage: str
    """What it checked: ``input`` (the request), ``output`` (the answer),
    ``tool_input`` (a tool call before it ran) or ``tool_output`` (a tool's
    result). Open-ended: a reader shows a stage it does not know as it is."""
    reason: str
    """Why it tripped, in a sentence."""


class FinalAnswer(Message, frozen=True, kw_only=True, tag="final_answer"):
    """The end of an agent's reply."""

    content: str | list[ContentBlock]
    structured: dict[str, Any] | None = None
    """The validated structured output, when one was asked for."""
    finished_reason: FinishedReason = "completed"
    sources: list[str] = msgspec.field(default_factory=list)
    """Where the knowledge shown to the model in this reply came from: the
    ``source`` of each passage retrieved from the agent's knowledge bases (for
    a folder, ``path:first-last`` and the headings above), in the order shown."""
    handoff: Handoff | None = None
    """With ``handed_off``: the conversation goes on with ``handoff.agent``.
    An agent's host does not send this answer to the requester: it sends
    the requester's request on, as a ``user_request`` carrying the handoff,
    to that agent, whose answer goes to the same reply subject."""
    guardrail: GuardrailTrip | None = None
    """With ``finished_reason`` ``guardrail_tripped``: the guardrail that
    stopped the reply, the stage it checked, and why; ``null`` otherwise."""


class ErrorMessage(Message, frozen=True, kw_only=True, tag="error"):
    """A message that could not be handled at all."""

    code: str
    """One of :data:`ERROR_CODES` (open-ended, as in :class:`ErrorDetail`)."""
    message: str
    source_component: str = ""
    """Who could not handle it (``worker.calc-1``, ``agent.planner``…)."""
    retry_after: float | None = None
    """With ``overloaded``: the request was refused before any work started
    (a full queue, a rate limit), and a retry after about this many seconds
    may succeed. ``None``: no such promise (the work may have been tried)."""


def error_reply(
    about: Message | None,
    code: ErrorCode,
    text: str,
    *,
    source: str,
    retry_after: float | None = None,
) -> ErrorMessage:
    """The ``error`` message answering ``about`` (its session and call ids),
    sent and signed by ``source``."""
    return ErrorMessage(
        sender=source,
        session_id=about.session_id if about is not None else None,
        call_id=about.call_id if about is not None else None,
        code=code,
        message=text,
        source_component=source,
        retry_after=retry_after,
    )


class AgentMessage(Asking, frozen=True, kw_only=True, tag="agent_message"):
    """Agent-to-agent chat."""

    content: list[ContentBlock]
    name: str = ""
    """Display name of the speaking agent."""
    reply: bool = True
    """Sent to an inbox: ``True`` asks for a reply, ``False`` only adds to memory."""
    output_schema: dict[str, Any] | None = None
    """With ``reply=True``: the JSON Schema the answer must fit, as in
    ``user_request``."""


class Event(Message, frozen=True, kw_only=True, tag="event"):
    """Streaming progress of a reply (or of a model response)."""

    event: str
    """What happened: ``reply_start``, ``text_delta``, ``tool_call``…"""
    data: dict[str, Any] = msgspec.field(default_factory=dict)
    seq: int = 0
    """Position in the stream of this reply, from 0."""


class Cancel(Message, frozen=True, kw_only=True, tag="cancel"):
    """Stop work in progress: a reply (by ``session_id``) or a tool call (by ``call_id``).

    On an agent's inbox or control subject it interrupts the reply running in
    ``session_id`` (it ends ``interrupted``); on a tool's control subject it
    cancels the call ``call_id`` that ``sender`` made.
    """

    reason: str = ""
    """Why, for the logs and the final answer."""


class Confirmation(msgspec.Struct, frozen=True, kw_only=True):
    """A person's decision on one paused tool call."""

    call_id: str
    """The ``call_id`` of the pending tool call."""
    confirmed: bool
    always: bool = False
    """Also add a rule so that calls like this one are not asked again."""
    parameters: dict[str, Any] | None = None
    """With ``confirmed``: the call's input as the person changed it, run (and
    recorded in memory) instead of the model's; ``None`` keeps the model's."""
    accept_rules: list[str] = msgspec.field(default_factory=list)
    """Allow rules (permission rule text, e.g. ``write_file(path=notes/*)``,
    often one of the call's ``suggested_rules``) the agent keeps: calls they
    match run without asking, in this session and the agent's later ones."""


class ConfirmResult(Asking, frozen=True, kw_only=True, tag="confirm_result"):
    """Resumes a reply paused for confirmation."""

    confirmations: list[Confirmation]


class ExternalOutput(msgspec.Struct, frozen=True, kw_only=True):
    """The result of one tool call executed outside the agent."""

    call_id: str
    status: ToolStatus = "success"
    content: Any = None
    error_detail: ErrorDetail | None = None


class ExternalResult(Asking, frozen=True, kw_only=True, tag="external_result"):
    """Resumes a reply paused for external execution."""

    results: list[ExternalOutput]
