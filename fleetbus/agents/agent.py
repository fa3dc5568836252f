"""The ReAct agent: reason, act, observe, repeat.

::

    agent = Agent("helper", "You help.", model, toolkit=Toolkit([calculator]))
    planner = Agent(
        "planner", "You plan.", model,
        capabilities=[Planning()],  # fleetbus.capabilities
        settings=AgentSettings(max_iters=20),
    )
    answer = await agent.reply("What is 2026 - 1991?")
    async for item in agent.reply_stream("And times two?"):
        ...  # Event messages as they happen, then the FinalAnswer

Every failure on the way — the model erring or answering garbage, arguments
that are not JSON or do not fit the schema, an unknown tool, a tool that
raises or times out, a denied call, the same failing call repeated, a model
going round in a loop (a call repeated after it succeeded, a cycle) — becomes
an observation the model sees or a clear ``finished_reason``; never a crash,
a hang, or a memory where a tool call lacks its result.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterable, Sequence
from typing import Any, Unpack

import pydantic

from fleetbus import tracing
from fleetbus.agents._deprecated import (
    OldKeywords,
    from_old_keywords,
)
from fleetbus.agents._reply import ReplyRun
from fleetbus.agents._reply_scope import ReplyScope
from fleetbus.agents._reply_settings import ReplySettings
from fleetbus.agents.capability import Capability
from fleetbus.agents.compression import (
    ApproxTokenCounter,
    CompressionResult,
    ContextConfig,
    compress,
    summarize_with_model,
)
from fleetbus.agents.messages import Msg
from fleetbus.agents.middleware import Middleware
from fleetbus.agents.permissions import (
    AcceptedRules,
    Permissions,
    RuleBook,
    checked_confirmation,
)
from fleetbus.agents.plan import PlanNotebook
from fleetbus.agents.settings import AgentSettings
from fleetbus.agents.state import AgentState, ReplyState
from fleetbus.agents.tools import ToolSource
from fleetbus.errors import ConfigError
from fleetbus.models.model import ChatModel, ModelConfig
from fleetbus.protocol import (
    AgentMessage,
    ConfirmResult,
    Event,
    ExternalResult,
    FinalAnswer,
    Handoff,
    ToolResultBlock,
    UserRequest,
    new_id,
)

__all__ = ["MAX_DESCRIPTION_CHARS", "Agent", "ReplyInput", "check_description", "handed_over"]

logger = logging.getLogger(__name__)

ReplyInput = (
    str
    | Msg
    | UserRequest
    | AgentMessage
    | ConfirmResult
    | ExternalResult
    | Sequence["str | Msg | UserRequest | AgentMessage"]
    | None
)
"""What ``reply`` takes: new input, a resume message, or nothing (continue
the reply in progress, or answer the memory as it is)."""

MAX_DESCRIPTION_CHARS = 1024
"""Most characters of an agent's ``description``: it travels in the agents'
directory on the bus (:mod:`fleetbus.agents.serving.directory`), one entry
per served agent."""


def check_description(description: object, where: str) -> str:
    """``description`` if it can be an agent's: a string of at most
    ``MAX_DESCRIPTION_CHARS`` characters.

    Args:
        description: the value to check.
        where: what has it, for the error (``agent 'helper'``).

    Raises:
        ConfigError: it is not a string, or is longer.
    """
    if not isinstance(description, str):
        raise ConfigError(
            f"{where}: the description must be a string, not {type(description).__name__}"
        )
    if len(description) > MAX_DESCRIPTION_CHARS:
        raise ConfigError(
            f"{where}: the description has {len(description)} characters; "
            f"at most {MAX_DESCRIPTION_CHARS} are allowed"
        )
    return description


class Agent:
    """An LLM agent that runs the ReAct loop.

    Args:
        name: the agent's name (a subject token when it serves on the bus).
        system_prompt: who it is and how it works.
        model: the model it reasons with.
        description: what the agent does, in one line (at most
            ``MAX_DESCRIPTION_CHARS`` characters): for those who choose an
            agent, not for its model. A host lists it in the agents'
            directory on the bus.
        toolkit: its tools (``fleetbus.Toolkit``: local and remote alike).
        permissions: allow / deny / ask rules checked before every call.
        accepted_rules: the allow rules a person accepted when confirming
            calls (rule texts, or a ``RuleBook`` keeping them elsewhere),
            shared with the agent's clones: a rule accepted in one session
            holds in the later ones (each reply loads them as it starts).
        middlewares: hooks around the reply, reasoning, model and tool calls.
        capabilities: what it is given beyond the loop
            (:class:`~fleetbus.agents.Capability`; the built-in ones are in
            :mod:`fleetbus.capabilities`: long-term memory, knowledge,
            planning, offloading, speech, talk). Their layers wrap the
            agent's middleware, the first outermost.
        settings: the loop's tuning knobs (steps, parallel calls, timeouts,
            loop detection, structured retries, context, model calls,
            token counting); the defaults of :class:`AgentSettings` when
            ``None``.
        state: a saved state to continue from (its name must match).
        checkpoint: awaited with the state ahead of every side effect (the
            input recorded, a step's tool calls before they are sent, each
            result as it arrives, each step, the end): to save it.
        **old_keywords: the keywords this took before ``settings`` and
            ``capabilities`` (``max_iters=``, ``plan=``, ``knowledge=``,
            ``long_term_memory=``, ``offloader=``, …): still taken for one
            release, with a ``DeprecationWarning``.

    Raises:
        ConfigError: no model, a description that is not a string or is too
            long, a state of another agent, a capability that is not one, or
            an old keyword out of range.
    """

    def __init__(
        self,
        name: str,
        system_prompt: str = "",
        model: ChatModel | None = None,
        *,
        description: str = "",
        toolkit: ToolSource | None = None,
        permissions: Permissions | None = None,
        accepted_rules: RuleBook | Iterable[str] = (),
        middlewares: Iterable[Middleware] = (),
        capabilities: Iterable[Capability] = (),
        settings: AgentSettings | None = None,
        state: AgentState | None = None,
        checkpoint: Callable[[AgentState], Awaitable[None]] | None = None,
        **old_keywords: Unpack[OldKeywords],
    ) -> None:
        if model is None:
            raise ConfigError(f"agent {name!r} needs a model")
        check_description(description, f"agent {name!r}")
        capabilities = list(capabilities)
        start_plan: PlanNotebook | None = None
        if old_keywords:
            settings, older, start_plan = from_old_keywords(old_keywords, settings)
            capabilities = [*older, *capabilities]
        for capability in capabilities:
            if not isinstance(capability, Capability):
                raise ConfigError(
                    f"{capability!r} is not a capability "
                    "(it has no middlewares() and prepare_state())"
                )
        self.name = name
        self.system_prompt = system_prompt
        self.description = description
        """What the agent does, in one line (shared with its clones)."""
        self.model = model
        self.toolkit = toolkit
        self.middlewares = list(middlewares)
        self.capabilities: list[Capability] = capabilities
        """What the agent is given beyond the loop (its layers are asked for at each reply)."""
        self.settings = settings or AgentSettings()
        """The loop's tuning knobs (a new value holds from the next reply)."""
        self._checkpoint = checkpoint
        if state is not None:
            if state.agent_name != name:
                raise ConfigError(f"the state is agent {state.agent_name!r}'s, not {name!r}'s")
            self._state = state
        else:
            self._state = AgentState(agent_name=name)
        if permissions is not None:
            self._state.permissions = permissions
        if start_plan is not None:
            self._state.plan = start_plan
        for capability in self.capabilities:
            capability.prepare_state(self._state)
        # What a new session of this agent starts from (see clone()).
        self._initial_permissions = (
            permissions.model_copy(deep=True) if permissions is not None else None
        )
        self.accepted_rules: RuleBook = (
            AcceptedRules(accepted_rules)
            if isinstance(accepted_rules, Iterable)
            else accepted_rules
        )
        """Where the rules accepted in this agent's sessions are kept (shared by its clones)."""
        self._lock = asyncio.Lock()
        self._running: asyncio.Task[Any] | None = None
        self._interrupted = False
        self._interrupt_next = False
        self._stalled = False
        """The running reply waits for a reader that has not read its events."""

    @property
    def model_config(self) -> ModelConfig:
        """Retries, backoff, timeout and fallback of model calls
        (``settings.model_calls``; assigning it replaces that setting)."""
        return self.settings.model_calls

    @model_config.setter
    def model_config(self, value: ModelConfig) -> None:
        self.settings = self.settings.model_copy(update={"model_calls": value})

    def clone(
        self,
        *,
        state: AgentState | None = None,
        checkpoint: Callable[[AgentState], Awaitable[None]] | None = None,
    ) -> Agent:
        """The same agent (description, model, tools, settings) with another state: a saved
        session's, or a fresh one with the permissions it was built with and
        what its capabilities set up (:meth:`initial_state`). Used to serve many sessions from one
        definition.

        The settings are shared, not validated again: a host makes a clone
        for every message it serves, and building one through ``__init__``
        would validate the settings and deep-copy the permissions each time,
        a cost that shows on a busy simulation host (``bench/simulation.py``).

        Raises:
            ConfigError: ``state`` is another agent's.
        """
        if state is not None and state.agent_name != self.name:
            raise ConfigError(f"the state is agent {state.agent_name!r}'s, not {self.name!r}'s")
        twin = object.__new__(Agent)
        twin.__dict__.update(self.__dict__)
        twin.middlewares = list(self.middlewares)
        twin.capabilities = list(self.capabilities)
        twin._state = state if state is not None else self.initial_state()
        twin._checkpoint = checkpoint
        twin._lock = asyncio.Lock()
        twin._running = None
        twin._interrupted = twin._interrupt_next = twin._stalled = False
        return twin

    def initial_state(self) -> AgentState:
        """The state a new session of this agent starts from: empty memory,
        the permissions it was built with, and what its capabilities set up
        (an empty plan notebook, with planning)."""
        state = AgentState(agent_name=self.name)  # (default permissions: the state's own)
        if self._initial_permissions is not None:
            state.permissions = self._initial_permissions.model_copy(deep=True)
        for capability in self.capabilities:
            capability.prepare_state(state)
        return state

    @property
    def state(self) -> AgentState:
        """Everything needed to continue this agent (live: updated in place)."""
        return self._state

    @property
    def memory(self) -> list[Msg]:
        """The messages of the conversation, oldest first."""
        return self._state.memory

    async def checkpoint(self) -> None:
        """Hand the state to the ``checkpoint`` callback (at every write-ahead point)."""
        if self._checkpoint is not None:
            await self._checkpoint(self._state)

    async def observe(self, messages: str | Msg | AgentMessage | Sequence[Any]) -> None:
        """Add messages to memory without replying."""
        for message in _as_messages(messages):
            self._state.memory.append(message.marked("observed"))
        await self.checkpoint()

    async def compress_context(self, config: ContextConfig | None = None) -> CompressionResult:
        """Compress memory now, below the trigger too (``config`` or the agent's).

        Everything older than the most recent ``reserve_ratio`` of the context
        is summarized; when the whole memory fits in that reserve there is
        nothing to compress (``method="none"``): pass a config with a smaller
        ``reserve_ratio`` to keep less verbatim.
        """
        async with self._lock:
            counter = self._token_counter()
            model = self.model

            async def summarize(messages: list[Msg]) -> Any:
                return await summarize_with_model(model, messages)

            result = await compress(
                self._state.memory,
                config or self.settings.context,
                counter,
                summarize,
                system_tokens=counter.count_text(self.system_prompt),
                force=True,
            )
            if result.method != "none":
                self._state.memory[:] = result.messages
                if result.summary is not None:
                    self._state.summary = result.summary
            return result

    def interrupt(self, *, pending: bool = False) -> None:
        """Stop the reply in progress: what it waits for is cut short, nothing
        new starts, and it ends with ``finished_reason="interrupted"`` (an
        interrupt after its last model call and tool call leaves its answer
        as it is).

        Idempotent: once the reply is being interrupted, further calls do
        nothing (they must not cut short the saving of its end).

        Args:
            pending: when no reply runs yet, interrupt the next one as it
                starts (a cancel that came while its reply was being set up).
        """
        if self._running is None or self._running.done():
            self._interrupt_next = self._interrupt_next or pending
            return
        if not self._interrupted:
            self._interrupted = True
            self._running.cancel()

    async def reply(
        self,
        inputs: ReplyInput = None,
        *,
        structured_model: type[pydantic.BaseModel] | None = None,
        structured_schema: dict[str, Any] | None = None,
        session_id: str | None = None,
    ) -> FinalAnswer:
        """Reply to ``inputs`` and return the final message.

        Args:
            inputs: text, messages, or a ``confirm_result`` /
                ``external_result`` resuming a paused reply; ``None``
                continues a reply in progress (after a restore) or answers
                the memory as it is.
            structured_model: the answer must validate against this model;
                it is on the final message as ``structured``.
            structured_schema: the same with a JSON Schema (of an object)
                instead of a model. The answer is checked with the
                ``jsonschema`` library, in the dialect the schema names
                (2020-12 when it names none): types, required fields,
                enums, lengths, ranges, nested objects and arrays, local
                ``$ref``s. A
                ``user_request`` or ``agent_message`` given as ``inputs``
                can ask for one with its ``output_schema``; the arguments
                win over it. A reply that continues (a resume, a restore)
                keeps the schema it started with.
            session_id: carried by the reply's events and final message.

        Its events are not made (but for the middleware that watches them):
        :meth:`reply_stream` streams them. Cancelling the caller interrupts
        the reply: it ends ``interrupted`` with memory consistent, then the
        cancellation goes on.

        Raises:
            ConfigError: both ``structured_model`` and ``structured_schema``.
        """
        if structured_model is not None and structured_schema is not None:
            raise ConfigError("give structured_model or structured_schema, not both")
        return await self._final_only(inputs, structured_model, structured_schema, session_id)

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
        """Answer a tool call the paused reply asks to confirm, and continue it
        (``reply`` with a ``confirm_result``; give ``reply_stream`` one to stream).

        Args:
            call_id: the ``call_id`` of the pending call.
            allow: run it (``True``) or deny it.
            always: also add a rule so that calls of this tool are not asked again.
            parameters: run it with this input instead of the model's (checked
                like any call; memory records it).
            accept_rules: allow rules (often the call's ``suggested_rules``) this
                agent keeps for the rest of this session and its later sessions.
            session_id: carried by the reply's events and final message.

        Returns:
            The continued reply's end; ``finished_reason="error"`` when nothing
            waits for ``call_id`` (the reply stays paused).

        Raises:
            ConfigError: a rule does not parse, ``parameters`` is not a dict,
                or ``parameters`` goes with a denial.
        """
        confirmation = checked_confirmation(
            call_id, allow=allow, always=always, parameters=parameters, accept_rules=accept_rules
        )
        return await self.reply(
            ConfirmResult(sender="user", confirmations=[confirmation]), session_id=session_id
        )

    async def reply_stream(
        self,
        inputs: ReplyInput = None,
        *,
        structured_model: type[pydantic.BaseModel] | None = None,
        structured_schema: dict[str, Any] | None = None,
        session_id: str | None = None,
        events: bool = True,
    ) -> AsyncGenerator[Event | FinalAnswer, None]:
        """Reply, yielding each event as it happens and the final message last.

        The arguments are those of :meth:`reply`; with ``events=False`` only
        the final message is yielded, and events are not made at all (but for
        the middleware that watches them): a host that publishes only final
        answers would otherwise make every event only to drop it.

        Leaving the iteration early (``break``) interrupts the reply: it starts
        no model call and no tool call until its events are read, so nothing
        new happens after the reader left; closing the stream (``aclose()``,
        ``contextlib.aclosing``, or the stream being garbage collected, at
        once for ``async for … in agent.reply_stream(…)``) ends it
        ``interrupted`` with memory consistent. Replies of one agent run one
        at a time.

        Raises:
            ConfigError: both ``structured_model`` and ``structured_schema``.
        """
        if structured_model is not None and structured_schema is not None:
            raise ConfigError("give structured_model or structured_schema, not both")
        if not events:  # the final answer alone: nothing to queue, nobody to wait for
            yield await self._final_only(inputs, structured_model, structured_schema, session_id)
            return
        queue: asyncio.Queue[Event | FinalAnswer | None] = asyncio.Queue()
        reading = asyncio.Event()
        """Set while the reader waits on an empty queue: it has read everything."""

        def emit(item: Event | FinalAnswer) -> None:
            reading.clear()
            queue.put_nowait(item)

        async def demand() -> None:
            if reading.is_set():
                return
            self._stalled = True
            try:
                await reading.wait()
            finally:
                self._stalled = False

        task = asyncio.get_running_loop().create_task(
            self._run(inputs, structured_model, structured_schema, session_id, emit, demand)
        )
        # The end of the task, however it ends, wakes the reader.
        task.add_done_callback(lambda _: queue.put_nowait(None))
        try:
            while True:
                if queue.empty():
                    reading.set()  # the reader has read everything and waits
                item = await queue.get()
                reading.clear()
                if item is None:
                    break
                yield item
                if isinstance(item, FinalAnswer):
                    return
            task.result()  # re-raises whatever ended the reply without an answer
            raise RuntimeError("the reply ended without a final answer")
        finally:
            await self._end_task(task)

    async def _final_only(
        self,
        inputs: ReplyInput,
        structured_model: type[pydantic.BaseModel] | None,
        structured_schema: dict[str, Any] | None,
        session_id: str | None,
    ) -> FinalAnswer:
        """The reply's final answer, its events not made (but for the
        middleware watching them). The reply runs in a task of its own, as a
        streamed one does (an interrupt cancels that task, not the caller); a
        cancel of the caller interrupts it, waits for its end, and goes on."""
        task = asyncio.get_running_loop().create_task(
            self._run(inputs, structured_model, structured_schema, session_id, None, None)
        )
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            await self._end_task(task)  # the caller's cancel wins
            raise

    async def _end_task(self, task: asyncio.Task[Any]) -> None:
        """Interrupt the reply's own task if it still runs, wait for its end
        without letting that end cancel us, and see how it ended (whether or
        not the caller raised it)."""
        if not task.done():
            if self._running is task:
                self._interrupted = True
            task.cancel()
        await asyncio.wait({task})
        if not task.cancelled():
            task.exception()

    async def _run(
        self,
        inputs: ReplyInput,
        structured_model: type[pydantic.BaseModel] | None,
        structured_schema: dict[str, Any] | None,
        session_id: str | None,
        emit: Callable[[Event | FinalAnswer], None] | None,
        demand: Callable[[], Awaitable[Any]] | None,
    ) -> FinalAnswer:
        """The task of a reply: one at a time, each interruptible (``emit``:
        where its events and final answer go, ``None`` for none; ``demand``:
        awaited before each model call and tool call, :meth:`_landing` when
        ``None``)."""
        if self._lock.locked() and self._stalled:
            self.interrupt()  # the previous reply's reader left: end it
        # The task holds the lock, not the generator: a reply that ends
        # frees the agent even while its abandoned stream is not closed.
        async with self._lock:
            self._interrupted = False
            task = self._running = asyncio.current_task()
            if self._interrupt_next:
                self._interrupt_next = False
                self.interrupt()  # cancels this task at its first wait
            try:
                final = await self._reply(
                    inputs,
                    structured_model,
                    structured_schema,
                    session_id,
                    emit,
                    demand or self._landing,
                )
            finally:
                self._running = None
        if task is not None and task.cancelling():
            # An interrupt that came after the reply's last wait: the reply
            # ended all the same, and its answer must not be lost to it.
            try:
                await asyncio.sleep(0)
            except asyncio.CancelledError:
                task.uncancel()
        return final

    async def _landing(self) -> None:
        """Awaited before each model call and tool call of a reply nobody
        streams: once it is being interrupted, a wait, where the interrupt
        lands before anything new starts (a reply whose model and tools
        never wait would run to its end otherwise)."""
        if self._interrupted:
            await asyncio.sleep(0)

    async def _reply(
        self,
        inputs: ReplyInput,
        structured_model: type[pydantic.BaseModel] | None,
        structured_schema: dict[str, Any] | None,
        session_id: str | None,
        emit: Callable[[Event | FinalAnswer], None] | None,
        demand: Callable[[], Awaitable[Any]] | None = None,
    ) -> FinalAnswer:
        run: ReplyRun | None = None
        try:
            prepared = self._prepare(inputs, structured_model, structured_schema, session_id)
            if isinstance(prepared, FinalAnswer):
                if emit is not None:
                    emit(prepared)
                return prepared
            reply, resume = prepared
            if self._state.permissions.asks:  # accepted rules only ever answer an ask
                self._state.permissions.agent_accepted = await self.accepted_rules.load()
            run = ReplyRun(
                ReplyScope(
                    self._reply_settings(),
                    self._state,
                    reply,
                    structured_model=structured_model,
                    emit=emit,
                    demand=demand,
                    checkpoint=self.checkpoint,
                )
            )
            if resume is None and reply.iteration == 0 and not reply.answered:
                # Write-ahead: the input is durable before any work starts.
                await self.checkpoint()
                run.scope.event("reply_start", reply_id=reply.reply_id)
            with tracing.span(
                "fleetbus reply",
                attributes={
                    "fleetbus.agent": self.name,
                    "fleetbus.session_id": reply.session_id,
                    "fleetbus.call_id": reply.request_id,
                    "fleetbus.reply_id": reply.reply_id,
                },
            ) as span:
                final = await run.run(resume)
                if span is not None:
                    span.set_attribute("fleetbus.finished_reason", final.finished_reason)
        except asyncio.CancelledError:
            if not self._interrupted or run is None:
                raise
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()
            final = run.scope.finish("interrupted", "The reply was interrupted.")
        except Exception as exc:  # a bug must not take the caller down with it
            logger.exception("%s: reply failed", self.name)
            self._state.reply = None
            final = FinalAnswer(
                sender=self.name,
                session_id=session_id,
                call_id=_request_id(inputs),
                content=f"internal error: {type(exc).__name__}: {exc}",
                finished_reason="error",
            )
        with contextlib.suppress(Exception):
            await self.checkpoint()
        if emit is not None:
            emit(final)
        return final

    def _reply_settings(self) -> ReplySettings:
        """The settings of a reply about to start, taken from the attributes
        now: assigned ones (``agent.toolkit = …``) hold from the next reply."""
        settings = self.settings
        return ReplySettings(
            name=self.name,
            system_prompt=self.system_prompt,
            model=self.model,
            toolkit=self.toolkit,
            max_iters=settings.max_iters,
            parallel_tool_calls=settings.parallel_tool_calls,
            middlewares=self._reply_middlewares(),
            context=settings.context,
            model_config=settings.model_calls,
            token_counter=self._token_counter(),
            tool_timeout=settings.tool_timeout,
            max_repeated_failures=settings.max_repeated_failures,
            max_repeated_calls=settings.max_repeated_calls,
            structured_retries=settings.structured_retries,
            accepted_rules=self.accepted_rules,
        )

    def _token_counter(self) -> Any:
        counter = self.settings.token_counter
        return counter if counter is not None else _APPROX_COUNTER

    def _reply_middlewares(self) -> tuple[Middleware, ...]:
        """The capabilities' layers (the first outermost), then the agent's
        middleware: every layer of the agent sees the hints they add."""
        if not self.capabilities:
            return tuple(self.middlewares)
        layers = [m for c in self.capabilities for m in c.middlewares(self)]
        return (*layers, *self.middlewares)

    def _prepare(
        self,
        inputs: ReplyInput,
        structured_model: type[pydantic.BaseModel] | None,
        structured_schema: dict[str, Any] | None,
        session_id: str | None,
    ) -> tuple[ReplyState, ConfirmResult | ExternalResult | None] | FinalAnswer:
        state = self._state
        if isinstance(inputs, ConfirmResult | ExternalResult):
            if state.reply is None or not state.reply.pending:
                what = (
                    "a confirmation" if isinstance(inputs, ConfirmResult) else "an external result"
                )
                return FinalAnswer(
                    sender=self.name,
                    session_id=session_id or inputs.session_id,
                    call_id=inputs.call_id,
                    content=f"Nothing is waiting for {what}.",
                    finished_reason="error",
                )
            if inputs.call_id is not None:
                state.reply.request_id = inputs.call_id
            return state.reply, inputs
        if state.reply is not None and inputs is None and not state.reply.pending:
            return state.reply, None  # continue a restored reply (with its schema)
        schema: dict[str, Any] | None = None
        name: str | None = None
        if structured_model is not None:
            schema = structured_model.model_json_schema()
            schema.pop("title", None)
            name = structured_model.__name__
        else:
            schema = structured_schema if structured_schema is not None else _schema_of(inputs)
            if schema is not None:
                if schema.get("type", "object") != "object":
                    return FinalAnswer(
                        sender=self.name,
                        session_id=session_id or _session_of(inputs),
                        call_id=_request_id(inputs),
                        content="The output schema must describe a JSON object "
                        '("type": "object"): the answer is given as the arguments of a tool.',
                        finished_reason="error",
                    )
                schema = copy.deepcopy(schema)
                title = schema.get("title")
                name = title if isinstance(title, str) else None
        if state.reply is not None:
            self._abandon_reply()
        if isinstance(inputs, UserRequest) and inputs.handoff is not None:
            # The conversation handed over takes the place of what this
            # session held: one conversation, whichever agent holds it.
            state.memory[:] = handed_over(inputs.handoff)
        elif isinstance(inputs, UserRequest) and inputs.call_id:
            _forget_attempt(state.memory, inputs.call_id)
        for message in _as_messages(inputs):
            state.memory.append(message)
        reply = ReplyState(
            reply_id=new_id(),
            session_id=session_id or _session_of(inputs),
            request_id=_request_id(inputs),
            structured_name=name,
            structured_schema=schema,
        )
        state.reply = reply
        return reply, None

    def _abandon_reply(self) -> None:
        """A new input while a reply is paused or unfinished: close its calls."""
        reply = self._state.reply
        assert reply is not None
        answered = {b.id for m in self._state.memory for b in m.tool_results}
        for message in reversed(self._state.memory):
            if message.role == "assistant":
                for use in message.tool_uses:
                    if use.id not in answered:
                        block = ToolResultBlock(
                            id=use.id,
                            name=use.name,
                            output="cancelled: a new message came before this call was run.",
                            state="cancelled",
                        )
                        self._state.memory.append(Msg(role="tool", name=use.name, content=[block]))
                break
        self._state.reply = None


_APPROX_COUNTER = ApproxTokenCounter()
"""The token counter of the agents whose settings name none: one for all, so
that what it has counted (its cache, the tool specs' tokens) serves every
agent of a population, each built afresh for a message."""


def _as_messages(inputs: Any) -> list[Msg]:
    if inputs is None:
        return []
    if isinstance(inputs, str):
        return [Msg.text_message("user", inputs)]
    if isinstance(inputs, Msg):
        return [inputs]
    if isinstance(inputs, UserRequest):
        content = inputs.content
        if not content or (isinstance(content, str) and not content.strip()):
            return []  # a request with no content: answer the memory as it is
        # The request's call_id is its message's id: a retry finds its attempt.
        ids = {"msg_id": inputs.call_id} if inputs.call_id else {}
        return [Msg(role="user", content=content, metadata=dict(inputs.metadata), **ids)]
    if isinstance(inputs, AgentMessage):
        return [Msg(role="user", name=inputs.name or inputs.sender, content=inputs.content)]
    if isinstance(inputs, Sequence):
        return [m for item in inputs for m in _as_messages(item)]
    raise ConfigError(f"cannot reply to a {type(inputs).__name__}")


def handed_over(handoff: Handoff) -> list[Msg]:
    """The messages of a conversation handed over, as memory (each marked
    with who handed it over: ``metadata["handed_over_by"]``)."""
    mark = {"handed_over_by": handoff.by}
    return [
        Msg(role=m.role, content=m.content, name=m.name or "", metadata=dict(mark))
        for m in handoff.messages
        if m.role != "system"
    ]


def _forget_attempt(memory: list[Msg], call_id: str) -> None:
    """Drop an earlier attempt at the request ``call_id`` from ``memory``: its
    message and everything after it.

    A request asked again (a client's retry, a simulation round asked again
    after its runner resumed from the round before) replaces its attempt, so
    memory holds it once and what follows it is what the new attempt does.
    """
    for index in range(len(memory) - 1, -1, -1):
        message = memory[index]
        if message.msg_id == call_id and message.role == "user":
            del memory[index:]
            return


def _schema_of(inputs: Any) -> dict[str, Any] | None:
    """The ``output_schema`` a request or agent message asks its answer in."""
    if isinstance(inputs, UserRequest | AgentMessage):
        return inputs.output_schema
    return None


def _request_id(inputs: Any) -> str | None:
    """The ``call_id`` of a protocol message given as input (``None`` for text
    and memory messages)."""
    call_id = getattr(inputs, "call_id", None)
    return call_id if isinstance(call_id, str) else None


def _session_of(inputs: Any) -> str | None:
    session = getattr(inputs, "session_id", None)
    return session if isinstance(session, str) else None
