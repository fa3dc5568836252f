"""A client for an agent served on the bus, usable like a local agent.

Another process serves the agent on ``<prefix>.agent.<name>.inbox``;
:class:`RemoteAgent` talks to it with requests, one conversation (session) per
instance unless told otherwise::

    writer = RemoteAgent(bus, "writer")
    answer = await writer.reply("Draft the release notes.")
    answer = await writer.reply("Shorter, please.")   # same session
    await writer.observe("The release moved to Friday.")

The contract with the server: a ``user_request`` or an ``agent_message`` with
``reply=True`` is answered by the ``final_answer`` of the reply; an
``agent_message`` with ``reply=False`` is added to memory and acknowledged by
an ``event`` named ``observed``; a ``confirm_result`` or ``external_result``
resumes the paused reply of its session and is answered by its
``final_answer``; anything it cannot handle is answered by an ``error``
message. A ``cancel`` published on ``<prefix>.agent.<name>.control``
interrupts the reply running in its session.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Protocol

import msgspec

from fleetbus.bus import Subjects
from fleetbus.errors import RemoteError, UnexpectedMessageError
from fleetbus.protocol import (
    AgentMessage,
    AnyMessage,
    Cancel,
    Confirmation,
    ConfirmResult,
    ContentBlock,
    ErrorDetail,
    ErrorMessage,
    Event,
    ExternalOutput,
    ExternalResult,
    FinalAnswer,
    Message,
    TextBlock,
    ToolStatus,
    UserRequest,
    new_id,
)

__all__ = ["MessageBus", "RemoteAgent"]

logger = logging.getLogger(__name__)

OBSERVED_EVENT = "observed"
"""The ``event`` a server acknowledges an observed message with."""

# The error code an external result of each failed status carries.
_STATUS_CODES: dict[str, str] = {
    "error": "tool_error",
    "timeout": "timeout",
    "denied": "denied",
    "cancelled": "cancelled",
}


class MessageBus(Protocol):
    """What :class:`RemoteAgent` needs of a :class:`~fleetbus.bus.Bus`."""

    @property
    def subjects(self) -> Subjects:
        """The fleet's subject names."""
        ...

    @property
    def client_name(self) -> str:
        """The default ``sender`` of messages."""
        ...

    async def request(
        self, subject: str, message: Message, *, timeout: float, attempts: int
    ) -> AnyMessage:
        """Send a request and return its decoded reply."""
        ...

    async def publish(self, subject: str, message: Message) -> None:
        """Publish a message."""
        ...


class RemoteAgent:
    """An agent served on the bus by another process.

    Every call is one NATS request to the agent's inbox, with a new
    ``call_id``, in the instance's session unless a call names another, so
    consecutive calls continue one conversation.

    Args:
        bus: the connection (a :class:`~fleetbus.bus.Bus`).
        name: the served agent's name.
        session_id: the conversation to talk in; a new one by default.
        timeout: seconds to wait for each answer (a whole reply, tools
            included).
        sender: the ``sender`` of the messages; the bus's client name by
            default.

    Raises:
        InvalidSubjectError: ``name`` cannot be a subject token.
    """

    def __init__(
        self,
        bus: MessageBus,
        name: str,
        *,
        session_id: str | None = None,
        timeout: float = 300.0,
        sender: str | None = None,
    ) -> None:
        self._bus = bus
        self._name = name
        self._inbox = bus.subjects.agent_inbox(name)  # validates the name now
        self._session_id = session_id or new_id()
        self.timeout = timeout
        self.sender = sender or bus.client_name

    def __repr__(self) -> str:
        return f"RemoteAgent({self._name!r}, session_id={self._session_id!r})"

    @property
    def name(self) -> str:
        """The served agent's name."""
        return self._name

    @property
    def session_id(self) -> str:
        """The conversation this client talks in (unless a call names another)."""
        return self._session_id

    async def reply(
        self,
        inputs: str | list[ContentBlock] | AgentMessage | None = None,
        *,
        session_id: str | None = None,
    ) -> FinalAnswer:
        """Ask the agent to reply and return its final answer.

        Args:
            inputs: text or content blocks (sent as a ``user_request``), or
                another agent's message (sent as it is, with ``reply=True``);
                ``None`` sends an empty request: the agent continues the
                reply in progress, or answers its memory as it is.
            session_id: the conversation, for this call only.

        Raises:
            RemoteError: the agent answered an ``error`` message.
            UnexpectedMessageError: it answered something else than a
                ``final_answer``.
            CallTimeoutError: no answer within ``timeout``.
            NoRespondersError: nobody serves the agent.
        """
        session = session_id or self._session_id
        message: Message
        if isinstance(inputs, AgentMessage):
            message = msgspec.structs.replace(
                inputs,
                reply=True,
                sender=inputs.sender or self.sender,
                session_id=session,
                call_id=new_id(),
            )
        else:
            message = UserRequest(
                sender=self.sender,
                session_id=session,
                call_id=new_id(),
                content=[] if inputs is None else inputs,
            )
        return await self._ask(message)

    async def observe(self, messages: str | AgentMessage | Sequence[str | AgentMessage]) -> None:
        """Add messages to the agent's memory without a reply, in order.

        Each is sent as an ``agent_message`` with ``reply=False`` (text as one
        text block) and acknowledged before the next is sent.

        Raises:
            RemoteError: the agent answered an ``error`` message.
            UnexpectedMessageError: it answered something else than the
                ``observed`` event.
            CallTimeoutError: no acknowledgement within ``timeout``.
            NoRespondersError: nobody serves the agent.
        """
        items: Sequence[str | AgentMessage] = (
            [messages] if isinstance(messages, str | AgentMessage) else messages
        )
        for item in items:
            if isinstance(item, str):
                message = AgentMessage(
                    sender=self.sender,
                    session_id=self._session_id,
                    call_id=new_id(),
                    content=[TextBlock(text=item)],
                    reply=False,
                )
            else:
                message = msgspec.structs.replace(
                    item,
                    reply=False,
                    sender=item.sender or self.sender,
                    session_id=self._session_id,
                    call_id=new_id(),
                )
            answer = await self._request(message)
            if not (isinstance(answer, Event) and answer.event == OBSERVED_EVENT):
                raise _unexpected(answer, f"an {OBSERVED_EVENT!r} event", message.call_id)

    async def cancel(self, reason: str = "", *, session_id: str | None = None) -> None:
        """Interrupt the reply running in the session (it ends ``interrupted``).

        Published to every replica of the agent; nothing answers it.

        Raises:
            ConnectionClosedError: the bus is closed.
        """
        message = Cancel(
            sender=self.sender,
            session_id=session_id or self._session_id,
            reason=reason,
        )
        await self._bus.publish(self._bus.subjects.agent_control(self._name), message)

    async def confirm(
        self,
        call_id: str,
        *,
        allow: bool,
        always: bool = False,
        session_id: str | None = None,
    ) -> FinalAnswer:
        """Answer a tool call the paused reply asks to confirm, and continue it.

        Args:
            call_id: the ``call_id`` of the pending tool call.
            allow: run it (``True``) or deny it.
            always: also remember the decision for calls like this one.
            session_id: the conversation, for this call only.

        Raises:
            RemoteError: the agent answered an ``error`` message.
            UnexpectedMessageError: it answered something else than a
                ``final_answer``.
            CallTimeoutError: no answer within ``timeout``.
        """
        message = ConfirmResult(
            sender=self.sender,
            session_id=session_id or self._session_id,
            call_id=new_id(),
            confirmations=[Confirmation(call_id=call_id, confirmed=allow, always=always)],
        )
        return await self._ask(message)

    async def external_result(
        self,
        call_id: str,
        content: Any,
        *,
        status: ToolStatus = "success",
        session_id: str | None = None,
    ) -> FinalAnswer:
        """Give the paused reply the result of a call run outside the agent.

        Args:
            call_id: the ``call_id`` of the pending tool call.
            content: what the call returned (any JSON value); on another
                status than ``success``, the error message the model sees.
            status: how the call ended.
            session_id: the conversation, for this call only.

        Raises:
            RemoteError: the agent answered an ``error`` message.
            UnexpectedMessageError: it answered something else than a
                ``final_answer``.
            CallTimeoutError: no answer within ``timeout``.
        """
        if status == "success":
            output = ExternalOutput(call_id=call_id, content=content)
        else:
            detail = ErrorDetail(
                code=_STATUS_CODES.get(status, "internal"),
                message=status if content is None else str(content),
            )
            output = ExternalOutput(call_id=call_id, status=status, error_detail=detail)
        message = ExternalResult(
            sender=self.sender,
            session_id=session_id or self._session_id,
            call_id=new_id(),
            results=[output],
        )
        return await self._ask(message)

    async def _ask(self, message: Message) -> FinalAnswer:
        answer = await self._request(message)
        if not isinstance(answer, FinalAnswer):
            raise _unexpected(answer, "a 'final_answer'", message.call_id)
        return answer

    async def _request(self, message: Message) -> AnyMessage:
        logger.debug(
            "%s: %s to %s",
            self.sender,
            type(message).__name__,
            self._name,
            extra={"call_id": message.call_id, "session_id": message.session_id},
        )
        answer = await self._bus.request(self._inbox, message, timeout=self.timeout, attempts=1)
        if isinstance(answer, ErrorMessage):
            raise RemoteError(
                f"{answer.source_component or 'agent ' + repr(self._name)} could not handle "
                f"the {type(message).__name__}: {answer.code}: {answer.message}",
                code=answer.code,
                source_component=answer.source_component,
                call_id=answer.call_id or message.call_id,
            )
        return answer


def _unexpected(answer: AnyMessage, expected: str, call_id: str | None) -> UnexpectedMessageError:
    tag = type(answer).__struct_config__.tag
    got = f"{tag!r} ({answer.event!r})" if isinstance(answer, Event) else repr(tag)
    return UnexpectedMessageError(
        f"expected {expected} reply, got {got}",
        call_id=call_id,
        session_id=answer.session_id,
        message_type=tag,  # type: ignore[arg-type]
    )
