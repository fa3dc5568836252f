"""A2A tasks as the fleet keeps them: what a task id names, a message read
as a request or as the answer to a paused reply, and a session's journal
read as a task (see :mod:`fleetbus.gateway.a2a`)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

import orjson
from a2a.helpers import get_data_parts, new_data_part, new_text_part
from a2a.server.events import Event as A2AEvent
from a2a.types import (
    Artifact,
    InvalidParamsError,
    Message,
    Part,
    Role,
    Task,
    TaskArtifactUpdateEvent,
    TaskNotFoundError,
    TaskState,
    TaskStatus,
    TaskStatusUpdateEvent,
)

from fleetbus.agents.events import TEXT_DELTA, TOOL_CALL, TOOL_RESULT
from fleetbus.agents.messages import Msg
from fleetbus.agents.serving.client import confirm_result, external_result
from fleetbus.agents.serving.facts import SessionRecord
from fleetbus.agents.state import PendingCall
from fleetbus.errors import ConfigError
from fleetbus.gateway._common import call_list, yes_or_no
from fleetbus.gateway.auth import Caller
from fleetbus.gateway.fleet import Ask
from fleetbus.protocol import ContentBlock, Event, TextBlock, new_id

__all__ = [
    "CANCELED",
    "COMPLETED",
    "INPUT_REQUIRED",
    "TASK_MARK",
    "WORKING",
    "TaskRef",
    "answer_to",
    "context_of",
    "end_events",
    "make_task",
    "message_content",
    "outcome",
    "progress",
    "stamped",
    "struct_json",
    "task_of",
]

TASK_MARK: Final = "a2a_task"
"""The key of a request's ``metadata`` that holds the mark of its task."""

_ANSWER: Final = "answer"
"""The id and name of a task's one artifact."""
_SHOWN_EVENTS: Final = frozenset({TEXT_DELTA, TOOL_CALL, TOOL_RESULT})
_NOT_A_REQUEST: Final = frozenset({"hint", "observed"})
"""Marks of user messages that do not start a reply."""
_REQUESTS: Final = frozenset({"user_request", "agent_message"})
"""The messages that start a reply."""

WORKING: Final = TaskState.TASK_STATE_WORKING
COMPLETED: Final = TaskState.TASK_STATE_COMPLETED
FAILED: Final = TaskState.TASK_STATE_FAILED
CANCELED: Final = TaskState.TASK_STATE_CANCELED
INPUT_REQUIRED: Final = TaskState.TASK_STATE_INPUT_REQUIRED
REJECTED: Final = TaskState.TASK_STATE_REJECTED
_ENDS: Final[dict[str, TaskState]] = {
    "completed": COMPLETED,
    "exceed_max_iters": COMPLETED,
    "repeated_action": COMPLETED,
    "paused": INPUT_REQUIRED,
    "interrupted": CANCELED,
    "error": FAILED,
    "guardrail_tripped": REJECTED,
}
"""The task state of each ``finished_reason`` (a guardrail's trip: the agent
would not do the task)."""

_TOKEN: Final = re.compile(r"^[A-Za-z0-9_-]{1,128}$")


@dataclass(frozen=True, slots=True)
class TaskRef:
    """What a task id names: a reply of an agent in a session."""

    agent: str
    session_id: str
    mark: str

    @property
    def task_id(self) -> str:
        """``<agent>.<session_id>.<mark>``."""
        return f"{self.agent}.{self.session_id}.{self.mark}"

    @classmethod
    def parse(cls, task_id: str, agent: str) -> TaskRef:
        """The task ``task_id`` of ``agent``.

        Raises:
            TaskNotFoundError: it cannot be one.
        """
        parts = task_id.split(".")
        if len(parts) != 3 or parts[0] != agent or not all(_TOKEN.match(p) for p in parts):
            raise TaskNotFoundError(f"no task {task_id!r}")
        return cls(*parts)


def context_of(caller: Caller, session_id: str) -> str:
    """The ``contextId`` of a session: the conversation's name, without the
    caller's tag (``GatewayFleet.session_id`` puts it back)."""
    own = f"{caller.tag}-"
    return session_id[len(own) :] if session_id.startswith(own) else session_id


def message_content(parts: Sequence[Part]) -> list[ContentBlock]:
    """A message's parts as a request's content.

    Raises:
        InvalidParamsError: a part is a file, or there is nothing to say.
    """
    blocks: list[ContentBlock] = []
    for part in parts:
        if part.HasField("text"):
            if part.text.strip():
                blocks.append(TextBlock(text=part.text))
        elif part.HasField("data"):
            data = plain(get_data_parts([part])[0])
            blocks.append(TextBlock(text=orjson.dumps(data).decode()))
        else:
            raise InvalidParamsError("only text and data parts are accepted, not files")
    if not blocks:
        raise InvalidParamsError("the message says nothing: give a text or a data part")
    return blocks


def answer_to(message: Message, pending: Sequence[PendingCall]) -> Ask:
    """What a message answering a paused task means (see :mod:`fleetbus.gateway.a2a`).

    Raises:
        InvalidParamsError: it does not answer it.
    """
    confirm = [p.call_id for p in pending if p.kind == "confirm"]
    external = [p.call_id for p in pending if p.kind == "external"]
    try:
        for data in (plain(d) for d in get_data_parts(message.parts)):
            if isinstance(data, dict) and isinstance(data.get("confirm"), dict):
                decisions: dict[str, Any] = data["confirm"]
                _known(decisions, confirm, "waits for no confirmation of")
                if not all(isinstance(v, bool) for v in decisions.values()):
                    raise InvalidParamsError('"confirm" maps call ids to true or false')
                return confirm_result(
                    "",
                    allow=[c for c, ok in decisions.items() if ok],
                    deny=[c for c, ok in decisions.items() if not ok],
                )
            if isinstance(data, dict) and isinstance(data.get("results"), dict):
                results: dict[str, Any] = data["results"]
                _known(results, external, "waits for no result of")
                return external_result("", results=results.items())
        text = " ".join(p.text for p in message.parts if p.HasField("text"))
        verdict = yes_or_no(text)
        if verdict is not None and confirm:
            return confirm_result(
                "", allow=confirm if verdict else (), deny=() if verdict else confirm
            )
    except ConfigError as exc:
        raise InvalidParamsError(str(exc)) from exc
    raise InvalidParamsError(
        "the task waits for input: answer 'yes' or 'no', or send a data part "
        '{"confirm": {"<call_id>": true}} or {"results": {"<call_id>": …}}'
    )


def _known(given: dict[str, Any], waiting: Sequence[str], what: str) -> None:
    unknown = [c for c in given if c not in waiting]
    if unknown:
        raise InvalidParamsError(f"the task {what} {', '.join(map(repr, unknown))}")


def stamped(message: Message, ref: TaskRef, context_id: str) -> Message:
    """A copy of ``message`` in its task and context."""
    copy = Message()
    copy.CopyFrom(message)
    copy.task_id = ref.task_id
    copy.context_id = context_id
    if not copy.message_id:
        copy.message_id = new_id()
    return copy


def struct_json(struct: Any) -> dict[str, Any]:
    """A protobuf ``Struct`` as a dict (read as a data part is)."""
    part = Part()
    part.data.struct_value.CopyFrom(struct)
    found = plain(get_data_parts([part])[0])
    return found if isinstance(found, dict) else {}


def plain(value: Any) -> Any:
    """JSON read from protobuf, whose numbers are all floats: whole ones as ints."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v) for v in value]
    return value


def make_task(
    ref: TaskRef,
    context_id: str,
    state: TaskState,
    history: Sequence[Message],
    *,
    note: Message | None = None,
    artifacts: Sequence[Artifact] = (),
) -> Task:
    """A task of ``ref`` in ``state``."""
    status = TaskStatus(state=state)
    if note is not None:
        status.message.CopyFrom(note)
    return Task(
        id=ref.task_id, context_id=context_id, status=status, history=history, artifacts=artifacts
    )


def agent_says(ref: TaskRef, context_id: str, parts: Sequence[Part]) -> Message:
    """A message of the agent in task ``ref``."""
    return Message(
        message_id=new_id(),
        role=Role.ROLE_AGENT,
        parts=parts,
        task_id=ref.task_id,
        context_id=context_id,
    )


def outcome(
    ref: TaskRef,
    context_id: str,
    history: Sequence[Message],
    *,
    reason: str,
    text: str,
    structured: dict[str, Any] | None,
    pending: Sequence[PendingCall],
) -> Task:
    """The task a reply that ended ``reason`` makes."""
    state = _ENDS.get(reason, COMPLETED)
    if state == COMPLETED:
        part = new_data_part(structured) if structured is not None else new_text_part(text)
        answer = Artifact(artifact_id=_ANSWER, name=_ANSWER, parts=[part])
        return make_task(ref, context_id, state, history, artifacts=[answer])
    if state == INPUT_REQUIRED:
        note = agent_says(ref, context_id, _waiting(pending))
        return make_task(ref, context_id, state, history, note=note)
    told = text or {CANCELED: "the reply was interrupted", REJECTED: "the reply was refused"}.get(
        state, "the reply failed"
    )
    return make_task(
        ref, context_id, state, history, note=agent_says(ref, context_id, [new_text_part(told)])
    )


def _waiting(pending: Sequence[PendingCall]) -> list[Part]:
    """What a paused reply waits for: in words, and as data."""
    confirm = [p for p in pending if p.kind == "confirm"]
    external = [p for p in pending if p.kind == "external"]
    lines = []
    if confirm:
        calls = call_list(confirm)
        lines.append(
            f"The agent asks to run {calls}. Answer 'yes' or 'no' in this task, or send a data "
            f'part {{"confirm": {{"{confirm[0].call_id}": true}}}}.'
        )
    if external:
        calls = call_list(external)
        lines.append(
            f"The agent waits for the result of {calls}, run outside the fleet: send a data "
            f'part {{"results": {{"{external[0].call_id}": …}}}} in this task.'
        )
    pending_data = [p.model_dump(mode="json") for p in pending]
    return [
        new_text_part("\n\n".join(lines) or "The agent's reply is paused."),
        new_data_part({"pending": pending_data}),
    ]


def progress(ref: TaskRef, context_id: str, event: Event) -> TaskStatusUpdateEvent | None:
    """A status update telling an event of the reply (``None``: not told)."""
    if event.event not in _SHOWN_EVENTS:
        return None
    if event.event == TEXT_DELTA:
        part = new_text_part(str(event.data.get("text", "")))
    else:
        part = new_data_part(orjson.loads(orjson.dumps(event.data)))
    update = TaskStatusUpdateEvent(
        task_id=ref.task_id,
        context_id=context_id,
        status=TaskStatus(state=WORKING, message=agent_says(ref, context_id, [part])),
    )
    update.metadata.update({"event": event.event})
    return update


def end_events(task: Task) -> list[A2AEvent]:
    """The last events of a streamed task: its artifacts, then its status."""
    events: list[A2AEvent] = [
        TaskArtifactUpdateEvent(
            task_id=task.id, context_id=task.context_id, artifact=artifact, last_chunk=True
        )
        for artifact in task.artifacts
    ]
    events.append(
        TaskStatusUpdateEvent(task_id=task.id, context_id=task.context_id, status=task.status)
    )
    return events


def task_of(record: SessionRecord, ref: TaskRef, context_id: str) -> Task:
    """The task ``ref`` as the session ``record`` tells it.

    Raises:
        TaskNotFoundError: the session holds no such task.
    """
    memory = record.state.memory
    pending_input = record.pending_input or {}
    waiting = (pending_input.get("metadata") or {}).get(TASK_MARK)
    # A request taken but not yet in memory starts another task (an answer
    # to a paused reply, a confirm_result or an external_result, does not).
    another = pending_input.get("type") in _REQUESTS and waiting != ref.mark
    at = next(
        (
            i
            for i in range(len(memory) - 1, -1, -1)
            if memory[i].role == "user" and memory[i].metadata.get(TASK_MARK) == ref.mark
        ),
        None,
    )
    if at is None:
        if waiting == ref.mark:  # taken, not yet in memory
            asked = _user_message(ref, context_id, ref.mark, _text_of(pending_input.get("content")))
            return make_task(ref, context_id, WORKING, [asked])
        raise TaskNotFoundError(f"no task {ref.task_id!r}")
    request = memory[at]
    history = [_user_message(ref, context_id, request.msg_id, request.text)]
    after = memory[at + 1 :]
    later = next((i for i, m in enumerate(after) if _starts_reply(m)), None)
    if later is not None or another:
        # An earlier task of the conversation: over, its answer the last text it gave.
        told = _last_text(after[:later])
        return outcome(
            ref, context_id, history, reason="completed", text=told, structured=None, pending=()
        )
    if record.status == "running":
        return make_task(ref, context_id, WORKING, history)
    if record.state.paused and record.state.reply is not None:
        return outcome(
            ref,
            context_id,
            history,
            reason="paused",
            text="",
            structured=None,
            pending=record.state.reply.pending,
        )
    final = record.final or {}
    structured = final.get("structured")
    return outcome(
        ref,
        context_id,
        history,
        reason=str(final.get("finished_reason") or "completed"),
        text=_text_of(final.get("content")) if final else _last_text(after),
        structured=structured if isinstance(structured, dict) else None,
        pending=(),
    )


def _starts_reply(message: Msg) -> bool:
    return message.role == "user" and not (message.marks & _NOT_A_REQUEST)


def _last_text(messages: Sequence[Msg]) -> str:
    for message in reversed(messages):
        if message.role == "assistant" and message.text:
            return message.text
    return ""


def _text_of(content: Any) -> str:
    """The text of a message's ``content`` as JSON (a string, or blocks)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n\n".join(
            str(b.get("text", ""))
            for b in content
            if isinstance(b, dict) and b.get("type") == "text"
        )
    return ""


def _user_message(ref: TaskRef, context_id: str, message_id: str, text: str) -> Message:
    return Message(
        message_id=message_id,
        role=Role.ROLE_USER,
        parts=[new_text_part(text)],
        task_id=ref.task_id,
        context_id=context_id,
    )
