"""The model worker: serves a :class:`~fleetbus.models.model.ChatModel` on the bus.

The worker holds the API key and the rate limits of a model; agents reach it
with :class:`~fleetbus.models.bus_model.BusChatModel`. It serves
``<prefix>.model.<name>`` in queue group ``model.<name>``, so every process
serving a model shares its load, and registers as the NATS micro service
``fleetbus-models`` with one endpoint (the model).

One ``llm_prompt`` gets, on its reply subject:

- when ``stream`` is set, an ``event`` per delta as the model produces it
  (``text_delta`` with ``{"text": piece}``, ``thinking_delta`` with
  ``{"thinking": piece}``; the prompt's ``call_id``; ``seq`` from 0);
- then exactly one final message: the ``llm_response``, or an ``error``.

Error codes, since an ``error`` message carries no "retryable" flag:

- ``overloaded``: trying again later may succeed. The worker's queue is
  full, a call waited ``queue_timeout`` for a place in vain, or the worker is
  at its per-minute request/token budget (the message says which and roughly
  when to retry), the model failed with a retryable
  :class:`~fleetbus.models.model.ModelError` (rate limit, 5xx), the model was
  unreachable (``ConnectionError``), or the worker is shutting down.
- ``timeout``: the model did not answer within ``call_timeout`` (or its
  adapter timed out); also worth a retry.
- ``internal``: a non-retryable ``ModelError``, a bug, a stream without a
  response.
- ``malformed`` (and the codec's codes): the request was not an ``llm_prompt``.

Each worker also serves a subject of its own, an inbox, named in every
``llm_response`` it sends (``next_subject``): :class:`BusChatModel
<fleetbus.models.bus_model.BusChatModel>` sends a session's next call there,
to the worker that answered its last one, whose model server may still hold
the conversation in its prompt cache.

A prompt that finds every one of the ``concurrency`` places taken waits for
one, in arrival order, if fewer than ``queue`` others wait already; otherwise
it is refused at once. The queue is kept shallow on purpose: a prompt that
would wait long here is better refused, so that its caller tries again and
another worker of the queue group may take it. The subject chooses the model;
the prompt's ``model`` field is not checked.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections import deque
from dataclasses import dataclass

from pydantic import BaseModel, Field

from fleetbus._version import __version__
from fleetbus.bus import Bus, EndpointInfo, Lifecycle, MicroService, Request, check_name
from fleetbus.errors import BusError
from fleetbus.models.model import (
    ChatModel,
    ModelError,
    ModelRequest,
    ModelResponse,
    TextDelta,
    ThinkingDelta,
    supports_required_tool_choice,
)
from fleetbus.models.settings import check_ranges
from fleetbus.protocol import (
    ErrorCode,
    ErrorMessage,
    Event,
    LlmPrompt,
    LlmResponse,
    Message,
    error_reply,
)
from fleetbus.protocol.codec import clip

__all__ = ["MODEL_SERVICE_NAME", "ModelWorker"]

logger = logging.getLogger(__name__)

MODEL_SERVICE_NAME = "fleetbus-models"
"""The NATS micro service name model workers register under."""

WINDOW = 60.0
"""Seconds of the sliding window of the per-minute limits."""

# Handlers allowed past the serving loop's semaphore beyond ``concurrency``
# and ``queue``: room to refuse extra prompts at once with ``overloaded``
# instead of leaving them unread in the subscription.
_SPARE_HANDLERS = 64


@dataclass(slots=True)
class _Spent:
    """One admitted call in the window: when, and its tokens (estimated, then actual)."""

    at: float
    tokens: int


class _Budget:
    """Per-minute request and token budgets over a sliding 60 s window."""

    def __init__(self, requests_per_minute: int | None, tokens_per_minute: int | None) -> None:
        self.requests_per_minute = requests_per_minute
        self.tokens_per_minute = tokens_per_minute
        self._window: deque[_Spent] = deque()

    def _expire(self, now: float) -> None:
        while self._window and self._window[0].at <= now - WINDOW:
            self._window.popleft()

    def admit(self, estimate: int) -> _Spent | tuple[str, float]:
        """Record a call of ~``estimate`` tokens, or say why it must wait, and how long."""
        now = time.monotonic()
        self._expire(now)
        rpm = self.requests_per_minute
        if rpm is not None and len(self._window) >= rpm:
            wait = self._window[len(self._window) - rpm].at + WINDOW - now
            why = f"its limit of {rpm} requests per minute is reached; retry in ~{_secs(wait)}"
            return why, wait
        tpm = self.tokens_per_minute
        used = sum(s.tokens for s in self._window)
        # A prompt larger than the whole budget still runs when the window is
        # empty: refusing it for ever would only hide the problem.
        if tpm is not None and used and used + estimate > tpm:
            freed, wait = 0, WINDOW
            for spent in self._window:
                freed += spent.tokens
                if used - freed + estimate <= tpm:
                    wait = spent.at + WINDOW - now
                    break
            why = (
                f"its limit of {tpm} tokens per minute is reached (~{used} used, this prompt "
                f"~{estimate}); retry in ~{_secs(wait)}"
            )
            return why, wait
        spent = _Spent(now, estimate)
        self._window.append(spent)
        return spent


def _secs(seconds: float) -> str:
    return f"{max(1, round(seconds))} s"


class _Limits(BaseModel):
    concurrency: int = Field(ge=1)
    queue: int = Field(ge=0)
    queue_timeout: float = Field(gt=0)
    requests_per_minute: int | None = Field(ge=1)
    tokens_per_minute: int | None = Field(ge=1)
    call_timeout: float = Field(gt=0)


class ModelWorker(Lifecycle):
    """Serves one model on the bus, within its concurrency and rate limits.

    Args:
        bus: the connection.
        model: the model to serve (it holds the API key).
        name: the name it is served as, one subject token; ``model.name`` by default.
        worker_id: this worker's id (``sender`` of its messages); host-pid by default.
        concurrency: calls run at once.
        queue: calls that may wait for a place when all are taken, in arrival
            order; more are refused at once with ``overloaded``. ``None``:
            as many as ``concurrency``.
        queue_timeout: seconds a call waits for a place before it is refused
            with ``overloaded``.
        requests_per_minute: calls admitted in any 60 s; unlimited when ``None``.
        tokens_per_minute: tokens admitted in any 60 s, counting each prompt
            as ~bytes/4 when it starts and as its reported usage once done;
            unlimited when ``None``.
        drain_timeout: seconds in-flight calls get to finish on stop.
        call_timeout: seconds one model call may take.

    Raises:
        ConfigError: the name is not a subject token, or a limit is below 1.
    """

    def __init__(
        self,
        bus: Bus,
        model: ChatModel,
        *,
        name: str | None = None,
        worker_id: str | None = None,
        concurrency: int = 8,
        queue: int | None = None,
        queue_timeout: float = 30.0,
        requests_per_minute: int | None = None,
        tokens_per_minute: int | None = None,
        drain_timeout: float = 30.0,
        call_timeout: float = 300.0,
    ) -> None:
        self.name = check_name(model.name if name is None else name, what="model name")
        queue = concurrency if queue is None else queue
        check_ranges(
            _Limits,
            "ModelWorker",
            concurrency=concurrency,
            queue=queue,
            queue_timeout=queue_timeout,
            requests_per_minute=requests_per_minute,
            tokens_per_minute=tokens_per_minute,
            call_timeout=call_timeout,
        )
        self.bus = bus
        self.model = model
        self.worker_id = worker_id or f"model-worker.{socket.gethostname()}-{os.getpid()}"
        self.concurrency = concurrency
        self.queue = queue
        self.queue_timeout = queue_timeout
        self.drain_timeout = drain_timeout
        self.call_timeout = call_timeout
        self._budget = _Budget(requests_per_minute, tokens_per_minute)
        self._running = 0
        self._own_subject = bus.new_inbox()
        """This worker's own subject (an inbox: every agent may send to it)."""
        self._places = asyncio.Semaphore(concurrency)
        self._waiting = 0
        self._call_secs = 1.0
        """A moving average of how long a model call takes (seconds)."""
        super().__init__()
        limits = {"concurrency": str(concurrency), "queue": str(queue)}
        if requests_per_minute is not None:
            limits["requests_per_minute"] = str(requests_per_minute)
        if tokens_per_minute is not None:
            limits["tokens_per_minute"] = str(tokens_per_minute)
        self.service = MicroService(
            bus,
            name=MODEL_SERVICE_NAME,
            version=__version__,
            description="fleetbus model worker",
            metadata={"fleetbus_prefix": bus.prefix, "worker_id": self.worker_id},
            endpoints=[
                EndpointInfo(
                    name=self.name,
                    subject=bus.subjects.model(self.name),
                    queue_group=bus.subjects.model_queue(self.name),
                    metadata={"model": model.name, **limits},
                )
            ],
        )
        self.calls = 0
        """Model calls started."""
        self.refused = 0
        """Prompts answered ``overloaded`` without calling the model."""

    @property
    def requests_per_minute(self) -> int | None:
        """The per-minute request limit."""
        return self._budget.requests_per_minute

    @property
    def tokens_per_minute(self) -> int | None:
        """The per-minute token limit."""
        return self._budget.tokens_per_minute

    @property
    def running(self) -> int:
        """Model calls in progress."""
        return self._running

    @property
    def own_subject(self) -> str:
        """The subject this worker alone serves (``next_subject`` of its answers)."""
        return self._own_subject

    @property
    def waiting(self) -> int:
        """Calls waiting for a place."""
        return self._waiting

    async def run(self) -> None:
        """Serve until :meth:`stop`; then finish in-flight calls and return.

        Raises:
            ConnectionClosedError: the bus closed.
        """
        loop_ready, own_ready, service_ready = asyncio.Event(), asyncio.Event(), asyncio.Event()
        logger.info("model worker %s serving %s as %s", self.worker_id, self.model.name, self.name)
        subjects = self.bus.subjects
        limiter = asyncio.Semaphore(self.concurrency + self.queue + _SPARE_HANDLERS)
        async with asyncio.TaskGroup() as tg:
            # The model's subject, shared by its workers; and this worker's
            # own, where a session's next call comes to the worker that
            # served it (BusChatModel): its prompt may still be cached here.
            for subject, queue, ready in (
                (subjects.model(self.name), subjects.model_queue(self.name), loop_ready),
                (self._own_subject, None, own_ready),
            ):
                tg.create_task(
                    self.bus.serve(
                        subject,
                        self._handle,
                        stop=self._stop,
                        queue=queue,
                        limiter=limiter,
                        drain_timeout=self.drain_timeout,
                        ready=ready,
                        component=self.worker_id,
                        span_name="fleetbus model worker",
                    )
                )
            tg.create_task(self.service.run(self._stop, ready=service_ready))
            tg.create_task(self._announce_ready(loop_ready, own_ready, service_ready))
        logger.info(
            "model worker %s stopped after %d call(s), %d refused",
            self.worker_id,
            self.calls,
            self.refused,
        )

    async def _handle(self, request: Request) -> Message | None:
        started = time.perf_counter_ns()
        reply = await self._answer(request)
        if reply is not None:
            error = f"{reply.code}: {reply.message}" if isinstance(reply, ErrorMessage) else None
            self.service.record(self.name, started, error)
        return reply

    async def _answer(self, request: Request) -> Message | None:
        prompt = request.message
        if not isinstance(prompt, LlmPrompt):
            tag = type(prompt).__struct_config__.tag
            return self._error(
                prompt, "malformed", f"expected an 'llm_prompt' on {request.subject}, got {tag!r}"
            )
        if not request.reply:
            # Nobody could read the answer: do not spend the model's budget on it.
            logger.warning(
                "llm_prompt on %s has no reply subject; not run",
                request.subject,
                extra={"call_id": prompt.call_id},
            )
            return None
        busy = await self._place()
        if busy is not None:
            # A place frees about every (call time / concurrency) seconds.
            text = f"model {self.name} is busy: {busy}"
            return self._refuse(prompt, text, self._call_secs / self.concurrency)
        try:
            admitted = self._budget.admit(max(1, request.size // 4))
            if isinstance(admitted, tuple):
                why, wait = admitted
                return self._refuse(prompt, f"model {self.name}: {why}", wait)
            self._running += 1
            self.calls += 1
            started = time.monotonic()
            try:
                return await self._call(prompt, request.reply, admitted)
            finally:
                self._running -= 1
                self._call_secs += (time.monotonic() - started - self._call_secs) / 8
        finally:
            self._places.release()

    def _refuse(self, prompt: LlmPrompt, text: str, retry_after: float) -> ErrorMessage:
        """``overloaded`` before the model was called: retrying after ``retry_after`` s may pass."""
        self.refused += 1
        return error_reply(
            prompt,
            "overloaded",
            clip(text),
            source=self.worker_id,
            retry_after=round(max(0.05, retry_after), 3),
        )

    async def _place(self) -> str | None:
        """Take a place to run a call, waiting in the queue if there is room.

        Returns:
            ``None`` once a place is taken (release it); why not otherwise.
        """
        if not self._places.locked():
            await self._places.acquire()  # free: returns at once
            return None
        if self._waiting >= self.queue or self._stop.is_set():
            return (
                f"{self.concurrency} call(s) running and {self._waiting} waiting; "
                "retry in a few seconds"
            )
        self._waiting += 1
        try:
            async with asyncio.timeout(self.queue_timeout):
                await self._places.acquire()
        except TimeoutError:
            return f"no place came free within {self.queue_timeout:g} s; retry later"
        except asyncio.CancelledError:
            if self._stop.is_set():
                # Draining ran out of time: answer so the caller retries elsewhere.
                return f"model worker {self.worker_id} is shutting down"
            raise
        finally:
            self._waiting -= 1
        return None

    async def _call(self, prompt: LlmPrompt, reply: str, spent: _Spent) -> Message:
        choice = prompt.tool_choice
        if choice == "required" and not supports_required_tool_choice(self.model):
            choice = "auto"  # the caller's loop reminds a model it cannot force
        request = ModelRequest(
            messages=list(prompt.messages),
            tools=list(prompt.tools),
            tool_choice=choice,
            options=dict(prompt.options),
            session_id=prompt.session_id,
        )
        final: ModelResponse | None = None
        seq = 0
        extra = {"call_id": prompt.call_id, "session_id": prompt.session_id}
        try:
            async with asyncio.timeout(self.call_timeout) as deadline:
                async for item in self.model.stream(request):
                    if isinstance(item, ModelResponse):
                        final = item
                    elif prompt.stream:
                        await self._send_delta(prompt, reply, item, seq)
                        seq += 1
        except asyncio.CancelledError:
            if self._stop.is_set():
                # Draining ran out of time: answer so the caller retries elsewhere.
                return self._error(
                    prompt, "overloaded", f"model worker {self.worker_id} is shutting down"
                )
            raise
        except ModelError as exc:
            logger.warning("model %s failed: %s", self.model.name, clip(str(exc)), extra=extra)
            code: ErrorCode = "overloaded" if exc.retryable else "internal"
            return self._error(prompt, code, f"model {self.model.name} failed: {exc}")
        except TimeoutError as exc:
            why = (
                f"did not answer within {self.call_timeout:g} s"
                if deadline.expired()
                else f"timed out: {exc or type(exc).__name__}"
            )
            logger.warning("model %s %s", self.model.name, why, extra=extra)
            return self._error(prompt, "timeout", f"model {self.model.name} {why}")
        except ConnectionError as exc:
            logger.warning("model %s unreachable: %s", self.model.name, clip(str(exc)), extra=extra)
            return self._error(prompt, "overloaded", f"model {self.model.name} unreachable: {exc}")
        except Exception as exc:  # a bug in the adapter must not take the worker down
            logger.exception("model %s raised", self.model.name, extra=extra)
            return self._error(
                prompt,
                "internal",
                f"model {self.model.name} raised {type(exc).__name__}: {exc}",
            )
        if final is None:
            return self._error(
                prompt, "internal", f"model {self.model.name} ended its stream without a response"
            )
        if final.usage is not None:
            spent.tokens = final.usage.input_tokens + final.usage.output_tokens
        return LlmResponse(
            sender=self.worker_id,
            session_id=prompt.session_id,
            call_id=prompt.call_id,
            model=final.model or self.model.name,
            thought=final.thinking or None,
            content=list(final.content),
            usage=final.usage,
            finish_reason=final.finish_reason,
            next_subject=self._own_subject,
        )

    async def _send_delta(
        self, prompt: LlmPrompt, reply: str, item: TextDelta | ThinkingDelta, seq: int
    ) -> None:
        if isinstance(item, TextDelta):
            name, data = "text_delta", {"text": item.text}
        else:
            name, data = "thinking_delta", {"thinking": item.thinking}
        event = Event(
            sender=self.worker_id,
            session_id=prompt.session_id,
            call_id=prompt.call_id,
            event=name,
            data=data,
            seq=seq,
        )
        try:
            await self.bus.publish(reply, event)
        except BusError as exc:
            # The final response carries the whole answer; a lost delta is not fatal.
            logger.warning("delta not sent: %s", exc, extra={"call_id": prompt.call_id})

    def _error(self, about: Message, code: ErrorCode, text: str) -> ErrorMessage:
        # The text may quote the model's error, which may quote the prompt.
        return error_reply(about, code, clip(text), source=self.worker_id)
