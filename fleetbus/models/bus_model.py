"""A chat model reached over the bus: the client of a model worker.

:class:`BusChatModel` is a :class:`~fleetbus.models.model.ChatModel` like any
other, so an agent uses it unchanged, while the API keys and rate limits stay
with the :class:`~fleetbus.models.model_worker.ModelWorker` processes::

    agent = Agent("helper", "You help.", BusChatModel(bus, "gpt-4o-mini"), toolkit=kit)

One call sends an ``llm_prompt`` to ``<prefix>.model.<name>`` with a fresh
inbox as its reply subject, and reads from that inbox the ``event`` deltas
(yielded as they arrive) and then the final ``llm_response`` or ``error``. A
plain NATS request would not do: it keeps only the first reply.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections import OrderedDict
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Protocol

from fleetbus import tracing
from fleetbus._retry import Retry
from fleetbus.bus import Bus
from fleetbus.errors import BusError, ConfigError, ProtocolError
from fleetbus.models.model import (
    ModelError,
    ModelRequest,
    ModelResponse,
    ModelStreamItem,
    TextDelta,
    ThinkingDelta,
)
from fleetbus.protocol import (
    ErrorMessage,
    Event,
    LlmPrompt,
    LlmResponse,
    ThinkingBlock,
    decode,
    encode,
    new_id,
)

__all__ = ["RETRYABLE_CODES", "BusChatModel"]

logger = logging.getLogger(__name__)

RETRYABLE_CODES = frozenset({"overloaded", "timeout"})
"""Error codes of a model worker after which trying again may succeed."""

_REMEMBERED_SESSIONS = 10_000
"""Sessions whose last worker a :class:`BusChatModel` remembers."""

_NO_RESPONDERS = "503"
"""The status NATS sends to the reply subject when nobody serves a subject."""


class _Msg(Protocol):
    """What is read of a NATS message (nats stays inside fleetbus.bus)."""

    data: bytes
    headers: dict[str, str] | None


class _Unserved(ModelError):
    """No worker took the prompt: none serves the model (yet), or the one
    that got it answered ``overloaded``. Worth sending it again, a few times."""


class _Busy(_Unserved):
    """The worker refused the prompt before calling the model (its queue is
    full, or a rate limit holds), and said when a retry may pass: worth
    sending it again until the call's time is up."""

    def __init__(self, message: str, retry_after: float) -> None:
        super().__init__(message, retryable=True)
        self.retry_after = retry_after


class _Call:
    """One call's state across its attempts."""

    def __init__(
        self,
        call_id: str,
        inbox: str,
        next_msg: Callable[[float], Awaitable[_Msg]],
        deadline: float,
        subject: str,
        session_id: str | None,
    ) -> None:
        self.call_id = call_id
        self.inbox = inbox
        self.subject = subject
        """Where the prompt goes: the session's last worker, or the model's subject."""
        self.session_id = session_id
        self.next_msg = next_msg
        self.deadline = deadline
        """Event-loop time by which the call must be over, retries included."""
        self.sends = 0
        self.unserved = 0
        """Sends that found no worker serving the model."""
        self.heard = False
        """Anything at all arrived."""
        self.produced = False
        """A delta was yielded: the call can no longer be sent again."""


class BusChatModel:
    """A model served by model workers on the bus.

    Args:
        bus: the connection.
        model_name: the name the model is served as (a subject token).
        timeout: seconds the whole call may take, retries included.
        stream: ask the worker for deltas while the answer is produced.
        attempts: how many times a prompt is sent while no worker serves the
            model (one may be starting), or a worker answers ``overloaded``
            because the model failed in a way worth retrying (a rate limit
            or outage upstream).
        retry_backoff: seconds before the first resend (plus jitter),
            doubling after each up to 5 s; no wait runs past ``timeout``.

    A session's next call goes first to the worker that answered its last
    one (its model server may still hold the conversation in its prompt
    cache); if that worker is gone or busy, to any worker of the model.

    A worker that refuses the prompt before calling the model (its queue is
    full, or it is at its rate limit: ``overloaded`` with ``retry_after``)
    gets it again after a backoff and about the wait it asked for, as often
    as ``timeout`` allows: a busy model is the normal state of a fleet that
    keeps its models saturated, not a failure, so it uses up neither
    ``attempts`` here nor the agent's ``ModelConfig.max_retries``. Another
    worker of the queue group may take the resent prompt.

    Raises:
        ConfigError: the name is not a subject token, or a setting is out of range.
    """

    def __init__(
        self,
        bus: Bus,
        model_name: str,
        *,
        timeout: float = 120.0,
        stream: bool = True,
        attempts: int = 2,
        retry_backoff: float = 0.1,
    ) -> None:
        if not timeout > 0:
            raise ConfigError("timeout must be positive")
        if attempts < 1:
            raise ConfigError("attempts must be at least 1")
        if retry_backoff < 0:
            raise ConfigError("retry_backoff must not be negative")
        self.bus = bus
        self.subject = bus.subjects.model(model_name)
        self._name = model_name
        self.timeout = timeout
        self.streaming = stream
        self.attempts = attempts
        self.retry_backoff = retry_backoff
        self._inboxes = bus.subjects.inbox_root() + "."
        self._workers: OrderedDict[str, str] = OrderedDict()
        """The subject of the worker that answered each session's last call,
        the most recent :data:`_REMEMBERED_SESSIONS`."""

    supports_required_tool_choice = True
    """A structured reply may ask for ``tool_choice="required"``: the model
    worker passes it to a model that honours it and asks one that does not
    for ``auto`` (the agent's reminder in words then does the rest)."""

    @property
    def name(self) -> str:
        """The model's name on the bus."""
        return self._name

    async def stream(self, request: ModelRequest) -> AsyncGenerator[ModelStreamItem, None]:
        """Run the call on a model worker, yielding its deltas and then its response.

        Raises:
            ModelError: the worker answered an ``error`` (retryable for
                ``overloaded`` and ``timeout``), no worker answered within
                ``timeout``, the call did not finish in time, or a message
                could not be sent or decoded.
        """
        call_id = new_id()
        prompt = LlmPrompt(
            sender=self.bus.client_name,
            session_id=request.session_id,
            call_id=call_id,
            model=self._name,
            messages=list(request.messages),
            tools=list(request.tools),
            tool_choice=request.tool_choice,
            options=dict(request.options),
            stream=self.streaming,
        )
        try:
            payload = encode(prompt)
        except ProtocolError as exc:
            raise ModelError(f"cannot send the prompt: {exc}", retryable=False) from exc
        if len(payload) > self.bus.max_payload:
            raise ModelError(
                f"the prompt is {len(payload)} bytes; the server accepts at most "
                f"{self.bus.max_payload}",
                retryable=False,
            )
        deadline = asyncio.get_running_loop().time() + self.timeout
        inbox = self.bus.new_inbox()
        try:
            listener = await self.bus.listen(inbox)
        except BusError as exc:
            raise ModelError(f"cannot listen for the answer: {exc}", retryable=True) from exc
        session = request.session_id
        sticky = self._workers.get(session) if session else None
        call = _Call(call_id, inbox, listener.next, deadline, sticky or self.subject, session)

        # Resent (same call_id) while no worker took it; once one did, never.
        def resend(exc: Exception) -> bool:
            return isinstance(exc, _Busy) or (
                isinstance(exc, _Unserved) and call.unserved < self.attempts
            )

        retry = Retry(on=resend, attempts=None, backoff=self.retry_backoff, timeout=self.timeout)
        try:
            try:
                item = await retry.call(self._send, call, payload)
            except _Unserved as exc:
                tries = f" (after {call.sends} attempts)" if call.sends > 1 else ""
                late = asyncio.get_running_loop().time() >= deadline
                reason = f"{exc}{tries}{'; no time left to retry' if late else ''}"
                # The call's whole time is spent: another try would wait as long again.
                raise ModelError(reason, retryable=not late) from exc
            while True:
                yield item
                if isinstance(item, ModelResponse):
                    return
                item = await self._next_item(call)
        finally:
            await listener.unsubscribe()

    async def _send(self, call: _Call, payload: bytes) -> ModelStreamItem:
        """One attempt: send the prompt, wait for the first delta or the response.

        The session's last worker gets it first; if that one is gone or busy,
        any worker of the model at once.

        Raises:
            _Unserved: no worker took the prompt; another attempt may find one.
            ModelError: anything else.
        """
        if call.subject != self.subject:
            try:
                return await self._attempt(call, payload)
            except _Unserved:
                call.subject, call.unserved = self.subject, 0
                if call.session_id:
                    self._workers.pop(call.session_id, None)
        try:
            return await self._attempt(call, payload)
        except _Busy as exc:
            await self._wait(call, exc.retry_after)
            raise

    async def _attempt(self, call: _Call, payload: bytes) -> ModelStreamItem:
        call.sends += 1
        try:
            await self.bus.publish_bytes(
                call.subject, payload, reply=call.inbox, headers=tracing.inject(None)
            )
        except BusError as exc:
            raise ModelError(
                f"cannot send the prompt to {call.subject}: {exc}", retryable=True
            ) from exc
        try:
            return await self._next_item(call)
        except _Unserved as exc:
            logger.debug(
                "model %s: %s (attempt %d)",
                self._name,
                exc,
                call.sends,
                extra={"call_id": call.call_id},
            )
            raise

    async def _next_item(self, call: _Call) -> ModelStreamItem:
        """The next delta, or the response, of the worker's answer.

        Raises:
            _Unserved: no worker serves the model, or the one that got it
                answered ``overloaded`` before producing anything.
            ModelError: anything else.
        """
        while True:
            msg = await self._receive(call.next_msg, call.deadline, call.heard)
            if not msg.data and (msg.headers or {}).get("Status") == _NO_RESPONDERS:
                call.unserved += 1
                raise _Unserved(f"no model worker serves {self.subject}", retryable=True)
            call.heard = True
            try:
                message = decode(msg.data)
            except ProtocolError as exc:
                raise ModelError(
                    f"bad answer from the model worker: {exc}", retryable=False
                ) from exc
            if message.call_id is not None and message.call_id != call.call_id:
                continue  # not ours (an inbox is ours alone; be safe anyway)
            if isinstance(message, Event):
                item = _delta(message)
                if item is not None:
                    call.produced = True
                    return item
            elif isinstance(message, LlmResponse):
                if call.session_id:
                    self._remember(call.session_id, message.next_subject)
                return self._response(message)
            elif isinstance(message, ErrorMessage):
                error = _error(self._name, message)
                if message.code == "overloaded" and not call.produced:
                    # It, or another worker of the group, may be free on a resend.
                    if message.retry_after is not None:
                        raise _Busy(str(error), message.retry_after)
                    call.unserved += 1
                    raise _Unserved(str(error), retryable=True)
                raise error
            else:
                tag = type(message).__struct_config__.tag
                raise ModelError(
                    f"unexpected {tag!r} message from the model worker", retryable=False
                )

    def _remember(self, session_id: str, subject: str | None) -> None:
        # Only a fleet's inbox: a worker cannot send the agent's prompts elsewhere.
        if not subject or not subject.startswith(self._inboxes):
            self._workers.pop(session_id, None)
            return
        self._workers[session_id] = subject
        self._workers.move_to_end(session_id)
        if len(self._workers) > _REMEMBERED_SESSIONS:
            self._workers.popitem(last=False)

    async def _wait(self, call: _Call, retry_after: float) -> None:
        """Part of the wait a refusing worker asked for (the retry's backoff
        adds the rest); callers refused together spread out."""
        remaining = call.deadline - asyncio.get_running_loop().time()
        await asyncio.sleep(max(0.0, min(random.uniform(0, retry_after), remaining)))

    async def _receive(
        self, next_msg: Callable[[float], Awaitable[_Msg]], deadline: float, heard: bool
    ) -> _Msg:
        # A deadline per receive, not one asyncio.timeout around the whole
        # generator: a timeout must not fire while the consumer holds a delta.
        remaining = deadline - asyncio.get_running_loop().time()
        try:
            if remaining <= 0:
                raise TimeoutError
            return await next_msg(remaining)
        except TimeoutError as exc:
            if not heard:
                raise ModelError(
                    f"no model worker answered on {self.subject} within {self.timeout:g} s",
                    retryable=True,
                ) from exc
            raise ModelError(
                f"model {self._name} did not finish within {self.timeout:g} s", retryable=True
            ) from exc
        except BusError as exc:
            raise ModelError(f"lost the answer of model {self._name}: {exc}") from exc

    def _response(self, message: LlmResponse) -> ModelResponse:
        content = list(message.content)
        if message.thought and not any(isinstance(b, ThinkingBlock) for b in content):
            content.insert(0, ThinkingBlock(thinking=message.thought))
        return ModelResponse(
            content=content,
            usage=message.usage,
            finish_reason=message.finish_reason,
            model=message.model or self._name,
        )


def _delta(event: Event) -> TextDelta | ThinkingDelta | None:
    if event.event == "text_delta":
        text = event.data.get("text")
        return TextDelta(text) if isinstance(text, str) else None
    if event.event == "thinking_delta":
        thinking = event.data.get("thinking")
        return ThinkingDelta(thinking) if isinstance(thinking, str) else None
    return None


def _error(model_name: str, message: ErrorMessage) -> ModelError:
    who = message.source_component or f"the worker of model {model_name}"
    return ModelError(
        f"{who}: {message.code}: {message.message}",
        retryable=message.code in RETRYABLE_CODES,
    )
