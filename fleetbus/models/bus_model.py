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
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import TypeVar

from fleetbus.bus import Bus
from fleetbus.errors import ConfigError, ProtocolError
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

_M = TypeVar("_M")

_NO_RESPONDERS = "503"
"""The status NATS sends to the reply subject when nobody serves a subject."""


class BusChatModel:
    """A model served by model workers on the bus.

    Args:
        bus: the connection.
        model_name: the name the model is served as (a subject token).
        timeout: seconds the whole call may take, retries included.
        stream: ask the worker for deltas while the answer is produced.
        attempts: how many times a prompt is sent when no worker serves the
            model or a worker answers ``overloaded`` before anything else
            (another worker of the queue group may be free).
        retry_backoff: seconds before the first resend, doubling after each.

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
        self.bus = bus
        self.subject = bus.subjects.model(model_name)
        self._name = model_name
        self.timeout = timeout
        self.streaming = stream
        self.attempts = attempts
        self.retry_backoff = retry_backoff

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
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        nc = self.bus.nc
        inbox = nc.new_inbox()
        try:
            sub = await nc.subscribe(inbox)
        except Exception as exc:  # nats errors stay inside fleetbus.bus
            raise ModelError(f"cannot subscribe for the answer: {exc}", retryable=True) from exc
        heard = False  # anything at all arrived
        try:
            delay = self.retry_backoff
            for attempt in range(1, self.attempts + 1):
                try:
                    await nc.publish(self.subject, payload, reply=inbox)
                except Exception as exc:  # nats errors stay inside fleetbus.bus
                    raise ModelError(
                        f"cannot send the prompt to {self.subject}: {exc}", retryable=True
                    ) from exc
                retry_reason: str | None = None
                produced = False
                while retry_reason is None:
                    msg = await self._receive(sub.next_msg, deadline, heard)
                    headers = msg.headers or {}
                    if not msg.data and headers.get("Status") == _NO_RESPONDERS:
                        retry_reason = f"no model worker serves {self.subject}"
                        continue
                    heard = True
                    try:
                        message = decode(msg.data)
                    except ProtocolError as exc:
                        raise ModelError(
                            f"bad answer from the model worker: {exc}", retryable=False
                        ) from exc
                    if message.call_id is not None and message.call_id != call_id:
                        continue  # not ours (an inbox is ours alone; be safe anyway)
                    if isinstance(message, Event):
                        item = _delta(message)
                        if item is not None:
                            produced = True
                            yield item
                    elif isinstance(message, LlmResponse):
                        yield self._response(message)
                        return
                    elif isinstance(message, ErrorMessage):
                        error = _error(self._name, message)
                        if message.code != "overloaded" or produced:
                            raise error
                        retry_reason = str(error)
                    else:
                        tag = type(message).__struct_config__.tag
                        raise ModelError(
                            f"unexpected {tag!r} message from the model worker", retryable=False
                        )
                logger.debug(
                    "model %s: %s (attempt %d/%d)",
                    self._name,
                    retry_reason,
                    attempt,
                    self.attempts,
                    extra={"call_id": call_id},
                )
                if attempt == self.attempts:
                    tries = f" (after {attempt} attempts)" if attempt > 1 else ""
                    raise ModelError(f"{retry_reason}{tries}", retryable=True)
                if loop.time() + delay >= deadline:
                    raise ModelError(f"{retry_reason}; no time left to retry", retryable=True)
                await asyncio.sleep(delay)
                delay *= 2
        finally:
            try:
                await sub.unsubscribe()
            except Exception:  # nats errors stay inside fleetbus.bus; already gone
                pass

    async def _receive(
        self, next_msg: Callable[[float], Awaitable[_M]], deadline: float, heard: bool
    ) -> _M:
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
        except Exception as exc:  # nats errors stay inside fleetbus.bus
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
