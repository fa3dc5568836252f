"""A client for an agent served on the bus, usable like a local agent.

Another process serves the agent on ``<prefix>.agent.<name>.inbox``;
:class:`RemoteAgent` talks to it with requests, one conversation (session) per
instance unless told otherwise::

    writer = RemoteAgent(bus, "writer")
    answer = await writer.reply("Draft the release notes.")
    async for item in writer.reply_stream("Shorter, please."):   # same session
        print(item)                 # each event as it happens, the final answer last
    await writer.observe("The release moved to Friday.")
    notes = await writer.reply("As a list.", schema=ReleaseNotes)  # notes.structured

The contract with the server is in :mod:`._remote`.

Where a streamed reply's answer comes from: the request's reply, which
answers this request and no other, and which the replica that wrote the
session's end sends. The events published before it are already on their
way when it arrives: one round trip to the server (a flush) lets them in,
with no timer, and they are handed out before the answer. An event still
missing after that is dropped — events are best effort, the answer is not.
A client that follows a session rather than asking reads its journal
(:meth:`fleetbus.agents.serving.SessionStore.history`, ``fleetbus watch``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, Sequence
from typing import Any, Final

import msgspec

from fleetbus import tracing
from fleetbus._retry import Retry
from fleetbus.agents.events import REPLY_END
from fleetbus.agents.permissions import checked_confirmation
from fleetbus.agents.serving._remote import (
    STATUS_CODES,
    MessageBus,
    OutputSchema,
    RemoteInput,
    Request,
    flush_through,
    forward,
    json_schema,
    settled,
    unexpected,
)
from fleetbus.bus import RESEND_AFTER
from fleetbus.bus.subjects import ANY_AGENT
from fleetbus.errors import (
    BusError,
    CallTimeoutError,
    ConfigError,
    NoRespondersError,
    RemoteError,
)
from fleetbus.protocol import (
    AgentMessage,
    AnyMessage,
    Cancel,
    ConfirmResult,
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

__all__ = ["MessageBus", "OutputSchema", "RemoteAgent", "RemoteInput"]

logger = logging.getLogger(__name__)

OBSERVED_EVENT = "observed"
"""The ``event`` a server acknowledges an observed message with."""

CANCEL_TIMEOUT: Final = 2.0
"""Seconds a stream left early gives the ``cancel`` it sends to be published,
and then again to be confirmed by the server."""

SETTLE_TIMEOUT: Final = 2.0
"""Seconds at most the round trip waits that lets in the events published
just before the answer."""

NO_RESPONDERS_GRACE: Final = 5.0
"""Seconds a request that finds nobody serving the agent is sent again (with
a growing backoff) before :class:`~fleetbus.errors.NoRespondersError`: the
agent's replicas reconnect within seconds when their server dies."""


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
            included), unless a call gives its own.
        sender: the ``sender`` of the messages; the bus's client name by
            default.
        resend_after: seconds a request that asks for a reply waits for its
            receipt (the agent's host sends one once the request is in its
            session's lease) before it is sent again, the same message to the
            same reply subject; twice as long before each next sending. A
            replica that dies with the request before taking it loses
            nothing: another replica takes it, and the agent answers it once.
            ``None``: sent once (a request lost so is a timeout).

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
        resend_after: float | None = RESEND_AFTER,
    ) -> None:
        self._bus = bus
        self._name = name
        self._inbox = bus.subjects.agent_inbox(name)  # validates the name now
        # Whose events the replies to this client's requests are: its identity.
        self._owner = bus.subjects.inbox_owner(bus.inbox_prefix)
        self._session_id = session_id or new_id()
        self.timeout = timeout
        self.sender = sender or bus.client_name
        self.resend_after = resend_after

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
        inputs: RemoteInput | None = None,
        *,
        session_id: str | None = None,
        timeout: float | None = None,
        schema: OutputSchema | None = None,
    ) -> FinalAnswer:
        """Ask the agent to reply and return its final answer.

        The answer of :meth:`reply_stream`, whose events are skipped; so
        cancelling the call interrupts the remote reply too.

        Args:
            inputs: text or content blocks (sent as a ``user_request``),
                another agent's message (sent with ``reply=True``), or a
                ``user_request`` / ``confirm_result`` / ``external_result``
                (sent as it is); a message is sent in the call's session,
                with its own ``call_id`` when it has one, else a new one, and
                its ``sender`` when it has one.
                ``None`` sends an empty request: the agent continues the reply
                in progress, or answers its memory as it is.
            session_id: the conversation, for this call only.
            timeout: seconds the whole reply may take; the instance's
                ``timeout`` by default.
            schema: ask for a structured answer: a JSON Schema of an object,
                or a pydantic model (its schema is sent), carried as the
                request's ``output_schema``. The answer's ``structured`` is
                the object the agent validated (a dict: validate it into the
                model if you want one); a model that gives none that fits
                ends the reply ``error``. Only with a new request (text,
                blocks, a ``user_request`` or an ``agent_message``): a resumed
                reply keeps the schema it started with.

        Raises:
            RemoteError: the agent answered an ``error`` message.
            UnexpectedMessageError: it answered something else than a
                ``final_answer``.
            CallTimeoutError: no answer within ``timeout``.
            NoRespondersError: nobody serves the agent.
            InvalidSubjectError: the session id cannot be a subject token.
            ConfigError: a ``schema`` with a ``confirm_result`` or
                ``external_result``.
        """
        stream = self.reply_stream(inputs, session_id=session_id, timeout=timeout, schema=schema)
        async with contextlib.aclosing(stream):
            async for item in stream:
                if isinstance(item, FinalAnswer):
                    return item
        raise AssertionError("a reply stream ends with a final answer or raises")

    async def reply_stream(
        self,
        inputs: RemoteInput | None = None,
        *,
        session_id: str | None = None,
        timeout: float | None = None,
        schema: OutputSchema | None = None,
    ) -> AsyncGenerator[Event | FinalAnswer, None]:
        """Ask the agent to reply, yielding each event as it happens and the
        final answer last, once.

        Subscribes to the session's events subject of this client's identity,
        ``<prefix>.events.<agent>.<session>.<identity>`` (and makes sure the
        server has the subscription) before it sends the request; a client
        without credentials subscribes to every owner's (``.*``), and one
        with an inbox prefix of its own to ``._``
        (:meth:`Subjects.inbox_owner <fleetbus.bus.Subjects.inbox_owner>`).
        The events are those published in the session for this client until
        the answer: in a session that
        another replica's crash left a reply in, the end of that reply comes
        first. The final answer is the request's reply (see the module
        docstring). A reply that
        pauses ends with a ``paused`` answer: resume it with a
        ``confirm_result`` or ``external_result`` as ``inputs``, whose
        continuation streams the same way.

        Leaving the iteration early — ``break``, then the stream being closed
        (``aclose()``, ``contextlib.aclosing``, or garbage collection, at once
        for ``async for … in remote.reply_stream(…)``) — or cancelling the
        task reading it, or the deadline passing, publishes a ``cancel`` for
        the session on the agent's control subject (best effort, within twice
        :data:`CANCEL_TIMEOUT` seconds, a warning logged when it fails): the
        remote reply ends ``interrupted``. Then the stream unsubscribes. No
        ``cancel`` is sent once the request is answered.

        Args:
            inputs: what :meth:`reply` takes.
            session_id: the conversation, for this call only.
            timeout: seconds from the call until the final answer arrives
                (the time the reader spends between items included; what
                arrived in time is still handed out); the instance's
                ``timeout`` (300 s unless set) by default.
            schema: what :meth:`reply` takes.

        Raises:
            RemoteError: the agent answered an ``error`` message.
            UnexpectedMessageError: it answered something else than a
                ``final_answer``.
            CallTimeoutError: no answer within ``timeout`` (the error names
                the agent and the session).
            NoRespondersError: nobody serves the agent.
            InvalidSubjectError: the session id cannot be a subject token.
            ConfigError: a ``schema`` with a ``confirm_result`` or
                ``external_result``.
        """
        message = self._message(inputs, session_id or self._session_id, json_schema(schema))
        session = message.session_id
        assert session is not None
        limit = self.timeout if timeout is None else timeout
        loop = asyncio.get_running_loop()
        deadline = loop.time() + limit
        logger.debug(
            "%s: %s to %s, streamed",
            self.sender,
            type(message).__name__,
            self._name,
            extra={"call_id": message.call_id, "session_id": session},
        )
        try:
            # Any agent's: a reply handed over goes on under another agent.
            observation = await self._bus.observe(
                self._bus.subjects.events(ANY_AGENT, session, self._owner),
                timeout=max(deadline - loop.time(), 0.001),
            )
        except CallTimeoutError as exc:
            raise self._timed_out(message, limit) from exc
        # Owned here: both are cancelled and awaited in `finally`, however the stream ends.
        reader: asyncio.Task[None] | None = None
        asking: asyncio.Task[AnyMessage] | None = None
        span: Any = None
        # The events, then None once the request is answered (or failed).
        queue: asyncio.Queue[AnyMessage | None] = asyncio.Queue()
        holder = self._name  # the agent running the reply (another once handed over)
        try:
            try:
                await flush_through(self._bus, max(deadline - loop.time(), 0.001))
            except CallTimeoutError as exc:
                raise self._timed_out(message, limit) from exc
            reader = loop.create_task(forward(observation, queue))
            span = tracing.begin(
                "fleetbus ask",
                kind=tracing.SpanKind.CLIENT,
                attributes={
                    "fleetbus.agent": self._name,
                    "fleetbus.session_id": session,
                    "fleetbus.call_id": message.call_id,
                },
            )
            with tracing.current(span):  # the request carries it to the agent
                asking = loop.create_task(self._ask(message, deadline))
            asking.add_done_callback(lambda _: queue.put_nowait(None))
            while True:
                if queue.empty():  # what arrived in time is handed out, even past the deadline
                    try:
                        async with asyncio.timeout_at(deadline):
                            item = await queue.get()
                    except TimeoutError:
                        raise self._timed_out(message, limit) from None
                else:
                    item = queue.get_nowait()
                if item is None:
                    break
                if isinstance(item, Event):
                    holder = _handed_to(item) or holder
                    yield item
                else:
                    logger.debug("ignored a %s on the events subject", type(item).__name__)
            answer = self._answer(asking, message, limit)
            # The events published before the answer are here, or one round
            # trip to the server away: let them in, then hand them out.
            reader.cancel()
            await asyncio.wait([reader])
            await self._settle(deadline)
            late = [queue.get_nowait() for _ in range(queue.qsize())]
            for item in [*late, *await observation.received()]:
                if isinstance(item, Event):
                    yield item
            yield answer
        finally:
            # A request still unanswered (or timed out) means a reply may still run for nobody.
            running = asking is not None and not settled(asking)
            owned = {task for task in (reader, asking) if task is not None}
            for task in owned:
                task.cancel()
            if owned:
                await asyncio.wait(owned)
            if reader is not None and not reader.cancelled() and reader.exception() is not None:
                logger.warning(
                    "reading the events of session %s failed: %s",
                    session,
                    reader.exception(),
                    extra={"session_id": session},
                )
            if running:
                await self._interrupt(session, holder)
            await observation.close()
            if span is not None:
                span.end()

    async def _ask(self, message: AnyMessage, deadline: float) -> AnyMessage:
        """Send the request, and wait for its answer until ``deadline``
        (event-loop time). Nobody serving the agent is asked again for a few
        seconds (:data:`NO_RESPONDERS_GRACE`): its replicas may be moving to
        another server of the cluster, one of which just died, or starting."""
        loop = asyncio.get_running_loop()

        async def send() -> AnyMessage:
            return await self._bus.request(
                self._inbox,
                message,
                timeout=max(deadline - loop.time(), 0.001),
                resend=self.resend_after,
            )

        grace = min(NO_RESPONDERS_GRACE, deadline - loop.time())
        retry = Retry(on=NoRespondersError, attempts=None, backoff=0.1, timeout=grace)
        return await retry.call(send)

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
            logger.debug(
                "%s: AgentMessage to %s, observed",
                self.sender,
                self._name,
                extra={"call_id": message.call_id, "session_id": message.session_id},
            )
            answer = await self._bus.request(self._inbox, message, timeout=self.timeout, attempts=1)
            self._check(answer, message)
            if not (isinstance(answer, Event) and answer.event == OBSERVED_EVENT):
                raise unexpected(answer, f"an {OBSERVED_EVENT!r} event", message.call_id)

    async def cancel(self, reason: str = "", *, session_id: str | None = None) -> None:
        """Interrupt the reply running in the session (it ends ``interrupted``).

        Published to every replica of the agent; nothing answers it.

        Raises:
            ConnectionClosedError: the bus is closed.
        """
        await self._cancel_at(self._name, reason, session_id or self._session_id)

    async def _cancel_at(self, agent: str, reason: str, session_id: str | None) -> None:
        message = Cancel(sender=self.sender, session_id=session_id, reason=reason)
        await self._bus.publish(self._bus.subjects.agent_control(agent), message)

    async def confirm(
        self,
        call_id: str,
        *,
        allow: bool,
        always: bool = False,
        parameters: dict[str, Any] | None = None,
        accept_rules: Sequence[str] = (),
        session_id: str | None = None,
    ) -> FinalAnswer:
        """Answer a tool call the paused reply asks to confirm, and continue it.

        To stream the continuation, give ``reply_stream`` a ``confirm_result``.

        Args:
            call_id: the ``call_id`` of the pending tool call.
            allow: run it (``True``) or deny it.
            always: also remember the decision for calls like this one.
            parameters: run it with this input instead of the model's (the
                agent checks it like any call, and its memory records it).
            accept_rules: allow rules (often the call's ``suggested_rules``)
                the agent keeps for the rest of this session and its later
                sessions, whichever replica serves them.
            session_id: the conversation, for this call only.

        Returns:
            The continued reply's end; ``finished_reason="error"``, the reply
            still paused, when the agent refuses the confirmation (nothing
            waits for ``call_id``).

        Raises:
            ConfigError: a rule does not parse, or ``parameters`` is not a
                dict or goes with a denial (nothing is sent).
            RemoteError: the agent answered an ``error`` message.
            UnexpectedMessageError: it answered something else than a
                ``final_answer``.
            CallTimeoutError: no answer within ``timeout``.
        """
        confirmation = checked_confirmation(
            call_id, allow=allow, always=always, parameters=parameters, accept_rules=accept_rules
        )
        message = ConfirmResult(sender=self.sender, confirmations=[confirmation])
        return await self.reply(message, session_id=session_id)

    async def external_result(
        self,
        call_id: str,
        content: Any,
        *,
        status: ToolStatus = "success",
        session_id: str | None = None,
    ) -> FinalAnswer:
        """Give the paused reply the result of a call run outside the agent.

        To stream the continuation, give ``reply_stream`` an ``external_result``.

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
                code=STATUS_CODES.get(status, "internal"),
                message=status if content is None else str(content),
            )
            output = ExternalOutput(call_id=call_id, status=status, error_detail=detail)
        message = ExternalResult(sender=self.sender, results=[output])
        return await self.reply(message, session_id=session_id)

    # -- helpers -------------------------------------------------------------------------

    def _message(
        self, inputs: RemoteInput | None, session: str, schema: dict[str, Any] | None
    ) -> Request:
        """The request to send: in ``session``, with its ``call_id`` or a new one (and
        ``schema`` as its ``output_schema``, when given), asking for a
        receipt unless requests are not sent again."""
        receipt = self.resend_after is not None
        if isinstance(inputs, AgentMessage):
            return msgspec.structs.replace(
                inputs,
                reply=True,
                sender=inputs.sender or self.sender,
                session_id=session,
                call_id=inputs.call_id or new_id(),
                output_schema=inputs.output_schema if schema is None else schema,
                receipt=receipt,
            )
        if isinstance(inputs, UserRequest):
            return msgspec.structs.replace(
                inputs,
                sender=inputs.sender or self.sender,
                session_id=session,
                call_id=inputs.call_id or new_id(),
                output_schema=inputs.output_schema if schema is None else schema,
                receipt=receipt,
            )
        if isinstance(inputs, ConfirmResult | ExternalResult):
            if schema is not None:
                raise ConfigError(
                    f"a schema goes with a new request, not a {type(inputs).__name__}: "
                    "the paused reply keeps the schema it started with"
                )
            return msgspec.structs.replace(
                inputs,
                sender=inputs.sender or self.sender,
                session_id=session,
                call_id=inputs.call_id or new_id(),
                receipt=receipt,
            )
        return UserRequest(
            sender=self.sender,
            session_id=session,
            call_id=new_id(),
            content=[] if inputs is None else inputs,
            output_schema=schema,
            receipt=receipt,
        )

    def _answer(
        self, asking: asyncio.Task[AnyMessage], message: Message, limit: float
    ) -> FinalAnswer:
        """The final answer the request got, or the error it stands for."""
        try:
            answer = asking.result()
        except CallTimeoutError as exc:
            raise self._timed_out(message, limit) from exc
        self._check(answer, message)
        if not isinstance(answer, FinalAnswer):
            raise unexpected(answer, "a 'final_answer'", message.call_id)
        return answer

    def _check(self, answer: AnyMessage, message: Message) -> None:
        """Raise the ``error`` message ``answer`` is, if it is one."""
        if isinstance(answer, ErrorMessage):
            raise RemoteError(
                f"{answer.source_component or 'agent ' + repr(self._name)} could not handle "
                f"the {type(message).__name__}: {answer.code}: {answer.message}",
                code=answer.code,
                source_component=answer.source_component,
                call_id=answer.call_id or message.call_id,
            )

    def _timed_out(self, message: Message, limit: float) -> CallTimeoutError:
        return CallTimeoutError(
            f"agent {self._name!r} gave no final answer in session {message.session_id!r} "
            f"within {limit:g}s",
            subject=self._inbox,
            call_id=message.call_id,
        )

    async def _settle(self, deadline: float) -> None:
        """One round trip to the server, within the deadline (best effort)."""
        remaining = deadline - asyncio.get_running_loop().time()
        if remaining <= 0:
            return
        try:
            await flush_through(self._bus, min(remaining, SETTLE_TIMEOUT))
        except BusError as exc:  # the answer is here: do not lose it for late events
            logger.debug("no round trip after the answer: %s", exc)

    async def _interrupt(self, session: str, holder: str) -> None:
        """Cancel the session's reply, which nobody reads any more (best
        effort): at this agent, and at ``holder`` too when the reply was
        handed over to it."""
        try:
            async with asyncio.timeout(CANCEL_TIMEOUT):
                for agent in dict.fromkeys((self._name, holder)):
                    await self._cancel_at(agent, "the client stopped reading the reply", session)
            await flush_through(self._bus, CANCEL_TIMEOUT)
        except (BusError, TimeoutError) as exc:
            logger.warning(
                "%s: the cancel of session %s of %s may not have been sent: %s",
                self.sender,
                session,
                self._name,
                exc,
                extra={"session_id": session},
            )
        else:
            logger.info(
                "%s: stopped reading; cancel sent for session %s of %s",
                self.sender,
                session,
                self._name,
                extra={"session_id": session},
            )


def _handed_to(event: Event) -> str | None:
    """The agent a reply was handed over to, when ``event`` is the end of a
    reply that handed it over."""
    if event.event != REPLY_END:
        return None
    handoff = event.data.get("handoff")
    agent = handoff.get("agent") if isinstance(handoff, dict) else None
    return agent if isinstance(agent, str) and agent else None
