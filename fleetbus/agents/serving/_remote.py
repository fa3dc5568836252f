"""What :class:`~fleetbus.agents.serving.remote.RemoteAgent` needs of a bus,
and the pieces of its streams.

The contract with the server: a ``user_request`` or an ``agent_message`` with
``reply=True`` is answered by the ``final_answer`` of the reply; an
``agent_message`` with ``reply=False`` is added to memory and acknowledged by
an ``event`` named ``observed``; a ``confirm_result`` or ``external_result``
resumes the paused reply of its session and is answered by its
``final_answer``; anything it cannot handle is answered by an ``error``
message. Every event of a reply is also published on
``<prefix>.events.<agent>.<session_id>.<owner>``, the owner being the
identity in the request's reply subject (:meth:`Subjects.reply_owner
<fleetbus.bus.Subjects.reply_owner>`; the answer is not published: it is
stored once, in the session's journal, and sent once, to the requester); a replica
that takes a session over after a crash sends the final answer to the
original request's reply subject. A ``cancel`` published on
``<prefix>.agent.<name>.control`` interrupts the reply running in its
session.
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

import pydantic

from fleetbus.bus import Observation, Subjects
from fleetbus.errors import CallTimeoutError, UnexpectedMessageError
from fleetbus.protocol import (
    AgentMessage,
    AnyMessage,
    ConfirmResult,
    ContentBlock,
    Event,
    ExternalResult,
    Message,
    UserRequest,
)

__all__ = ["MessageBus", "OutputSchema", "RemoteInput"]

RemoteInput = str | list[ContentBlock] | UserRequest | AgentMessage | ConfirmResult | ExternalResult
"""What :meth:`RemoteAgent.reply_stream` sends: text or content blocks (a
``user_request``), or a message as it is — another agent's message, or a
``confirm_result`` / ``external_result`` resuming a paused reply."""

# The error code an external result of each failed status carries.
STATUS_CODES: dict[str, str] = {
    "error": "tool_error",
    "timeout": "timeout",
    "denied": "denied",
    "cancelled": "cancelled",
}

Request = UserRequest | AgentMessage | ConfirmResult | ExternalResult

OutputSchema = dict[str, Any] | type[pydantic.BaseModel]
"""The shape a reply's answer is asked in: a JSON Schema, or a pydantic model
(its JSON Schema is sent)."""


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

    @property
    def inbox_prefix(self) -> str:
        """Where replies to this client travel (whose events it reads follows
        from it: :meth:`Subjects.inbox_owner <fleetbus.bus.Subjects.inbox_owner>`)."""
        ...

    async def request(
        self,
        subject: str,
        message: Message,
        *,
        timeout: float,
        attempts: int = 1,
        resend: float | None = None,
    ) -> AnyMessage:
        """Send a request and return its decoded reply."""
        ...

    async def publish(self, subject: str, message: Message) -> None:
        """Publish a message."""
        ...

    async def observe(self, subject: str, *, timeout: float = 5.0) -> Observation:
        """Subscribe to a subject."""
        ...

    async def flush(self, timeout: float) -> None:
        """Wait until the server has processed everything sent so far."""
        ...


def json_schema(schema: OutputSchema | None) -> dict[str, Any] | None:
    """``schema`` as a JSON Schema (a model's, without its title, as a local
    agent offers it)."""
    if schema is None or isinstance(schema, dict):
        return schema
    rendered = schema.model_json_schema()
    rendered.pop("title", None)
    return rendered


async def flush_through(bus: MessageBus, timeout: float) -> None:
    """A round trip to the server that a cancellation does not cut short.

    nats-py (2.16) leaves the future of a cancelled flush waiting for its PONG,
    and that PONG then stops the connection's read loop: nothing more arrives
    on the connection. So the flush runs to its end — its own ``timeout``
    bounds it — and a cancellation takes effect after.

    Raises:
        CallTimeoutError: no PONG within ``timeout``.
        ConnectionClosedError: the bus is closed.
    """
    flushing = asyncio.ensure_future(bus.flush(timeout=timeout))
    try:
        await asyncio.shield(flushing)
    except asyncio.CancelledError:
        await asyncio.wait({flushing})
        if not flushing.cancelled():
            flushing.exception()  # the cancellation wins over how the flush ended
        raise


async def forward(observation: Observation, queue: asyncio.Queue[AnyMessage | None]) -> None:
    """Hand each message seen on the events subject to the stream."""
    async for item in observation:
        queue.put_nowait(item)


def settled(asking: asyncio.Task[AnyMessage]) -> bool:
    """Whether the request got its answer (or a refusal): nothing runs for it then."""
    if not asking.done() or asking.cancelled():
        return False
    return not isinstance(asking.exception(), CallTimeoutError)


def unexpected(answer: AnyMessage, expected: str, call_id: str | None) -> UnexpectedMessageError:
    tag = type(answer).__struct_config__.tag
    got = f"{tag!r} ({answer.event!r})" if isinstance(answer, Event) else repr(tag)
    return UnexpectedMessageError(
        f"expected {expected} reply, got {got}",
        call_id=call_id,
        session_id=answer.session_id,
        message_type=tag,  # type: ignore[arg-type]
    )
