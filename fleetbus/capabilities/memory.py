"""Long-term memory: what an agent keeps across conversations.

An agent given a :class:`LongTermMemory` as a capability uses it in one of
two modes, or both (``Agent(capabilities=[Memory(store, mode=…)])``):

- ``static``: before the reply, the memory is searched with the user's input
  and what it finds is shown to the model as a hint with every model call of
  that reply — just before the input, never stored in the conversation; after the
  reply (``completed``), the exchange — the input and the answer — is
  recorded;
- ``agent``: the model gets two tools, ``record_to_memory`` (facts to keep)
  and ``retrieve_from_memory`` (a search by keywords), and decides;
- ``both``.

Keys: every entry is kept under the agent's name and a key chosen by
:class:`LongTermMemoryConfig`'s ``scope``: ``user`` (``user:<id>``, the
default), ``session`` (``session:<id>``) or ``agent`` (one memory for all).
The user is named by the ``user_id`` field of the request's metadata
(``UserRequest(metadata={"user_id": "ann"})``; the field is ``user_field``):
the latest user message of the session that carries one. A request naming no
user falls back to its session, and an input without a session (an in-process
``agent.reply("…")``) to the agent's own key, so one user's memory is never
shown to another.

Stores: ``fleetbus.tools_workers.memory.SQLiteMemory`` in-process (SQLite
FTS5, BM25), or the same served on the bus (``fleetbus worker
fleetbus.tools_workers.memory``) and reached with :class:`BusMemory`, which
every replica of an agent shares. An embedding store plugs in by having the
protocol's two methods. The store's own tools (``long_term_memory_record``,
``long_term_memory_retrieve``) are never offered to a model, even when
``fleetbus agent`` adds every tool of the bus to an agent's toolkit: they
would let it read and write any agent's and any user's memory.

A memory that fails or is slow (``timeout``) does not fail the reply: the
static mode goes on without a hint (or without recording, logged), the tools
answer the model with an error.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Literal, Protocol, runtime_checkable

import pydantic

from fleetbus.agents.long_term_memory import STORE_RECORD_TOOL, STORE_RETRIEVE_TOOL
from fleetbus.agents.messages import Msg
from fleetbus.agents.middleware import Middleware, ReplyContext, ToolLayer
from fleetbus.bus import Bus, ToolClient
from fleetbus.capabilities._hints import with_hint
from fleetbus.capabilities._worker_tools import WorkerTools
from fleetbus.errors import ConfigError
from fleetbus.models.model import ModelRequest, ModelResponse
from fleetbus.models.settings import check_ranges
from fleetbus.protocol import FinalAnswer, ToolResultBlock, ToolSpec, ToolStatus, ToolUseBlock

if TYPE_CHECKING:
    from fleetbus.agents.capability import AgentView
    from fleetbus.agents.state import AgentState

__all__ = [
    "RECORD_TO_MEMORY_SPEC",
    "RETRIEVE_FROM_MEMORY_SPEC",
    "BusMemory",
    "LongTermMemory",
    "LongTermMemoryConfig",
    "LongTermMemoryMode",
    "Memory",
    "MemoryScope",
    "MemoryUse",
    "memory_key",
]

logger = logging.getLogger(__name__)

LongTermMemoryMode = Literal["static", "agent", "both"]
"""How an agent uses its long-term memory (see the module docstring)."""

MemoryScope = Literal["user", "session", "agent"]
"""What an agent's memory is keyed by, besides the agent."""

_MODES: Final = ("static", "agent", "both")
_QUERY_CHARS: Final = 4_000
"""Characters of a query sent to the store (it searches no further)."""
_TEXT_CHARS: Final = 8_000
"""Characters of one text sent to be recorded (the store keeps no more)."""
_PART_CHARS: Final = 3_000
"""Characters of the input, and of the answer, in a recorded exchange."""
_ID_CHARS: Final = 200
"""A user or session id longer than this is keyed by its digest."""
_MAX_ITEMS: Final = 20
"""Facts one ``record_to_memory`` call may keep, keywords one search may have."""
_HINT: Final = "long_term_memory.hint"
_ANCHOR: Final = "long_term_memory.anchor"

RECORD_TO_MEMORY_SPEC: Final = ToolSpec(
    name="record_to_memory",
    description=(
        "Remember facts for later conversations: what the user told you about themselves, "
        "their preferences, names, decisions, results worth keeping. Write each fact so that "
        "it makes sense on its own, later, without this conversation (which is not kept)."
    ),
    parameters={
        "type": "object",
        "properties": {
            "content": {
                "type": "array",
                "items": {"type": "string"},
                "minItems": 1,
                "maxItems": _MAX_ITEMS,
                "description": "The facts to remember, one per item.",
            }
        },
        "required": ["content"],
    },
)
"""The tool that records facts (``agent`` mode)."""

RETRIEVE_FROM_MEMORY_SPEC: Final = ToolSpec(
    name="retrieve_from_memory",
    description=(
        "Search what you remembered in earlier conversations (facts you recorded, and what "
        "was said), by keywords. The best matches come first."
    ),
    parameters={
        "type": "object",
        "properties": {
            "keywords": {
                "type": "array",
                "items": {"type": "string"},
                "minItems": 1,
                "maxItems": _MAX_ITEMS,
                "description": "Words to look for: names, topics, things.",
            }
        },
        "required": ["keywords"],
    },
)
"""The tool that searches the memory (``agent`` mode)."""


@runtime_checkable
class LongTermMemory(Protocol):
    """A store of texts kept under an agent's name and a key, searched by text.

    ``fleetbus.tools_workers.memory.SQLiteMemory`` (in-process) and
    :class:`BusMemory` (the same on the bus) are two; an embedding store is
    another, with these two methods.
    """

    async def record(
        self, agent_name: str, key: str, texts: Sequence[str], *, record_id: str | None = None
    ) -> int:
        """Keep ``texts`` under (``agent_name``, ``key``), each one entry.

        Recording a ``record_id`` again must add nothing: a reply run again
        after a take-over records with the same one.

        Returns:
            how many texts were added.
        """
        ...

    async def retrieve(
        self, agent_name: str, key: str, query: str, *, limit: int = 5, max_chars: int = 2000
    ) -> list[str]:
        """The texts under (``agent_name``, ``key``) that best match
        ``query``, the best first: at most ``limit`` of them, of at most
        ``max_chars`` characters together. Any text is a valid query."""
        ...


@dataclass(frozen=True, slots=True)
class LongTermMemoryConfig:
    """How an agent keys and bounds its long-term memory.

    Attributes:
        scope: ``user``, ``session`` or ``agent`` (see the module docstring).
        user_field: the metadata field of a request naming its user.
        limit: the most entries retrieved at once.
        max_chars: the most characters retrieved at once, entries together.
        timeout: seconds one retrieval or record may take.

    Raises:
        ConfigError: a value out of range.
    """

    scope: MemoryScope = "user"
    user_field: str = "user_id"
    limit: int = 5
    max_chars: int = 2000
    timeout: float = 10.0

    def __post_init__(self) -> None:
        if not self.user_field:
            raise ConfigError("user_field names a metadata field")
        check_ranges(
            _MemoryRanges,
            "LongTermMemoryConfig",
            scope=self.scope,
            limit=self.limit,
            max_chars=self.max_chars,
            timeout=self.timeout,
        )


class _MemoryRanges(pydantic.BaseModel):
    """The ranges of :class:`LongTermMemoryConfig`'s values."""

    scope: MemoryScope
    limit: int = pydantic.Field(ge=1, le=50)
    max_chars: int = pydantic.Field(ge=1, le=20_000)
    timeout: float = pydantic.Field(gt=0)


class BusMemory:
    """The long-term memory served on the bus (``fleetbus worker
    fleetbus.tools_workers.memory``), shared by every replica of an agent.

    Args:
        bus: the bus (or a :class:`~fleetbus.bus.ToolClient` of it). Without
            one, it uses the bus of the reply's host: an agent served by
            ``fleetbus agent`` (any :class:`~fleetbus.agents.AgentHost`)
            needs none; elsewhere call :meth:`bind`.
        timeout: seconds to wait for the worker's answer to one attempt.
        attempts: how many times a call is sent (a retry of a record is
            recorded once).

    Raises:
        ConfigError: the timeout is not positive, or no attempt is allowed.
    """

    def __init__(
        self, bus: Bus | ToolClient | None = None, *, timeout: float = 5.0, attempts: int = 2
    ) -> None:
        self._tools = WorkerTools("BusMemory", bus, timeout=timeout, attempts=attempts)
        self.timeout = timeout
        self.attempts = attempts

    @property
    def bound(self) -> bool:
        """Whether it was given a bus (else it uses the serving host's)."""
        return self._tools.bound

    def bind(self, bus: Bus | ToolClient) -> None:
        """Call the memory worker over ``bus`` from now on."""
        self._tools.bind(bus)

    async def record(
        self, agent_name: str, key: str, texts: Sequence[str], *, record_id: str | None = None
    ) -> int:
        """See :meth:`LongTermMemory.record`.

        Raises:
            ConfigError: not bound to a bus.
            RemoteError: the worker answered an error (its code and message).
            BusError: no worker answered (``NoRespondersError``,
                ``CallTimeoutError``…).
        """
        content = await self._call(
            STORE_RECORD_TOOL,
            {
                "agent_name": agent_name,
                "key": key,
                "texts": [t[:_TEXT_CHARS] for t in texts],
                "record_id": record_id,
            },
        )
        recorded = content.get("recorded") if isinstance(content, dict) else None
        return recorded if isinstance(recorded, int) else 0

    async def retrieve(
        self, agent_name: str, key: str, query: str, *, limit: int = 5, max_chars: int = 2000
    ) -> list[str]:
        """See :meth:`LongTermMemory.retrieve`.

        Raises:
            ConfigError: not bound to a bus.
            RemoteError: the worker answered an error (its code and message).
            BusError: no worker answered.
        """
        content = await self._call(
            STORE_RETRIEVE_TOOL,
            {
                "agent_name": agent_name,
                "key": key,
                "query": query[:_QUERY_CHARS],
                "limit": limit,
                "max_chars": max_chars,
            },
        )
        if not isinstance(content, list):
            return []
        return [t for t in content if isinstance(t, str)][:limit]

    async def _call(self, tool_name: str, parameters: dict[str, Any]) -> Any:
        # A call's retries share its call_id (the worker answers them from its
        # record); a record repeated later is told apart by its record_id.
        return await self._tools.call(tool_name, parameters)


def memory_key(scope: MemoryScope, *, user_id: str | None, session_id: str | None) -> str:
    """The key of a memory: ``user:<id>``, ``session:<id>`` or ``agent``.

    ``user`` without a user falls back to the session, and any scope without
    what it needs to the agent's own key (``agent``). An id longer than 200
    characters is replaced by its SHA-256 digest (``sha256:…``).
    """
    if scope == "user" and user_id:
        return f"user:{_short(user_id)}"
    if scope in ("user", "session") and session_id:
        return f"session:{_short(session_id)}"
    return "agent"


def _short(text: str) -> str:
    if len(text) <= _ID_CHARS:
        return text
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class MemoryUse:
    """How one agent uses a long-term memory in a reply: the store, the mode
    and the config (:class:`Memory` makes it from its arguments).

    Attributes:
        memory: the store.
        mode: ``static``, ``agent`` or ``both``.
        config: keys and bounds.
    """

    memory: LongTermMemory
    mode: LongTermMemoryMode = "static"
    config: LongTermMemoryConfig = dataclasses.field(default_factory=LongTermMemoryConfig)

    def __post_init__(self) -> None:
        if self.mode not in _MODES:
            raise ConfigError(
                f"the long-term memory's mode is one of {', '.join(_MODES)}, not {self.mode!r}"
            )
        if not isinstance(self.memory, LongTermMemory):
            raise ConfigError(
                f"a long-term memory must have async record and retrieve methods, "
                f"not be a {type(self.memory).__name__}"
            )

    @property
    def static(self) -> bool:
        """Whether the hint and the recording after the reply are on."""
        return self.mode in ("static", "both")

    @property
    def tools(self) -> bool:
        """Whether the model gets ``record_to_memory`` and ``retrieve_from_memory``."""
        return self.mode in ("agent", "both")

    def tool_specs(self) -> list[ToolSpec]:
        """The tools offered to the model."""
        return [RECORD_TO_MEMORY_SPEC, RETRIEVE_FROM_MEMORY_SPEC] if self.tools else []

    def handles(self, name: str) -> bool:
        """Whether ``name`` is one of the tools this memory answers."""
        return self.tools and name in (RECORD_TO_MEMORY_SPEC.name, RETRIEVE_FROM_MEMORY_SPEC.name)

    def key(self, ctx: ReplyContext) -> str:
        """The key of the reply's memory (see :func:`memory_key`)."""
        field = self.config.user_field
        user: str | None = None
        for message in reversed(ctx.state.memory):
            value = message.metadata.get(field) if message.role == "user" else None
            if isinstance(value, str | int) and not isinstance(value, bool) and str(value):
                user = str(value)
                break
        return memory_key(self.config.scope, user_id=user, session_id=ctx.session_id)

    async def retrieve(self, ctx: ReplyContext, query: str) -> list[str]:
        """What the memory has for ``query`` in this reply's key.

        Raises:
            TimeoutError: past the config's ``timeout``.
            Exception: whatever the store raises.
        """
        config = self.config
        async with asyncio.timeout(config.timeout):
            hits = await self.memory.retrieve(
                ctx.agent_name,
                self.key(ctx),
                query[:_QUERY_CHARS],
                limit=config.limit,
                max_chars=config.max_chars,
            )
        return _bounded(list(hits), config.limit, config.max_chars)

    async def record(self, ctx: ReplyContext, texts: list[str], *, record_id: str) -> int:
        """Keep ``texts`` in this reply's key.

        Raises:
            TimeoutError: past the config's ``timeout``.
            Exception: whatever the store raises.
        """
        async with asyncio.timeout(self.config.timeout):
            return await self.memory.record(
                ctx.agent_name, self.key(ctx), texts, record_id=record_id
            )

    async def run_tool(
        self, ctx: ReplyContext, name: str, arguments: dict[str, Any], *, record_id: str
    ) -> tuple[ToolStatus, str]:
        """Run ``record_to_memory`` or ``retrieve_from_memory``: its status and
        what the model is shown. Never raises for the store: its failure is
        an ``error`` the model sees."""
        field = "content" if name == RECORD_TO_MEMORY_SPEC.name else "keywords"
        items = _strings(arguments.get(field))
        if items is None:
            return "error", (
                f"invalid_parameters: {name} takes {field}, a list of 1 to {_MAX_ITEMS} "
                "non-empty strings"
            )
        try:
            if name == RECORD_TO_MEMORY_SPEC.name:
                added = await self.record(ctx, items, record_id=record_id)
                return "success", f"Remembered {added} fact(s)." if added else "Already remembered."
            hits = await self.retrieve(ctx, " ".join(items))
        except Exception as exc:  # the store's failure is the model's observation
            logger.warning("%s: long-term memory: %s failed: %s", ctx.agent_name, name, exc)
            return "error", f"tool_error: the long-term memory failed: {_describe(exc)}"
        if not hits:
            return "success", "Nothing in long-term memory matches these keywords."
        return "success", "\n".join(f"{i}. {hit}" for i, hit in enumerate(hits, 1))


class _StaticMemory(Middleware):
    """The static mode: a hint before the reply, the exchange recorded after."""

    def __init__(self, use: MemoryUse) -> None:
        self.use = use

    async def on_reply(
        self, ctx: ReplyContext, call_next: Callable[[], Awaitable[FinalAnswer]]
    ) -> FinalAnswer:
        given = _reply_input(ctx.state.memory)
        if given is not None:
            try:
                hits = await self.use.retrieve(ctx, given.text)
            except Exception as exc:  # no hint; the reply goes on
                logger.warning(
                    "%s: long-term memory: retrieval failed: %s",
                    ctx.agent_name,
                    _describe(exc),
                    extra={"session_id": ctx.session_id, "call_id": ctx.reply_id},
                )
                hits = []
            if hits:
                ctx.extra[_HINT] = _render(hits)
                ctx.extra[_ANCHOR] = given.to_chat()
        final = await call_next()
        content = final.content if isinstance(final.content, str) else ""
        if given is not None and final.finished_reason == "completed" and content.strip():
            exchange = f"user: {_clip(given.text)}\nassistant: {_clip(content)}"
            try:
                await self.use.record(ctx, [exchange], record_id=ctx.reply_id)
            except Exception as exc:  # the answer stands; the miss is logged
                logger.warning(
                    "%s: long-term memory: recording the exchange failed: %s",
                    ctx.agent_name,
                    _describe(exc),
                    extra={"session_id": ctx.session_id, "call_id": ctx.reply_id},
                )
        return final

    async def on_model_call(
        self,
        ctx: ReplyContext,
        request: ModelRequest,
        call_next: Callable[[ModelRequest], Awaitable[ModelResponse]],
    ) -> ModelResponse:
        hint = ctx.extra.get(_HINT)
        if isinstance(hint, str):
            anchor = ctx.extra.get(_ANCHOR)
            messages = with_hint(request.messages, hint, anchor)
            request = dataclasses.replace(request, messages=messages)
        return await call_next(request)


class _MemoryTools(ToolLayer):
    """The agent mode: ``record_to_memory`` and ``retrieve_from_memory``."""

    def __init__(self, use: MemoryUse) -> None:
        super().__init__(use.tool_specs())
        self.use = use

    async def answer(self, ctx: ReplyContext, call: ToolUseBlock) -> ToolResultBlock:
        # The call's id as the loop sends it to a worker: a retry records once.
        state, text = await self.use.run_tool(
            ctx, call.name, call.input, record_id=f"{ctx.reply_id}.{call.id}"
        )
        return ToolResultBlock(id=call.id, name=call.name, output=text, state=state)


class Memory:
    """The long-term memory capability: a :class:`LongTermMemory` used in one
    of the modes of the module docstring.

    Args:
        memory: the store (``SQLiteMemory`` in-process, :class:`BusMemory`
            for the one served on the bus).
        mode: ``static`` (a hint from the memory for the user's input, the
            exchange recorded after the reply), ``agent`` (the model gets
            ``record_to_memory`` and ``retrieve_from_memory``) or ``both``.
        config: what the memory is keyed by, how much one retrieval brings,
            and its timeout.

    Raises:
        ConfigError: not a memory, or an unknown mode.
    """

    def __init__(
        self,
        memory: LongTermMemory,
        *,
        mode: LongTermMemoryMode = "static",
        config: LongTermMemoryConfig | None = None,
    ) -> None:
        self.use = MemoryUse(memory, mode, config or LongTermMemoryConfig())

    @property
    def memory(self) -> LongTermMemory:
        """The store."""
        return self.use.memory

    @property
    def mode(self) -> LongTermMemoryMode:
        """``static``, ``agent`` or ``both``."""
        return self.use.mode

    @property
    def config(self) -> LongTermMemoryConfig:
        """Keys and bounds."""
        return self.use.config

    def middlewares(self, agent: AgentView) -> Sequence[Middleware]:
        """The static mode's layer (hint and recording), then the tools' layer."""
        layers: list[Middleware] = []
        if self.use.static:
            layers.append(_StaticMemory(self.use))
        if self.use.tools:
            layers.append(_MemoryTools(self.use))
        return layers

    def prepare_state(self, state: AgentState) -> None:
        """Nothing: the memory is kept by its store, not in the state."""


def _reply_input(memory: list[Msg]) -> Msg | None:
    """The user's input the reply answers: the latest user message with text
    that is not a hint, an observation or a summary of older messages."""
    for message in reversed(memory):
        if message.role == "user" and not message.marks & {"hint", "observed", "compressed"}:
            return message if message.text.strip() else None
    return None


def _render(hits: list[str]) -> str:
    lines = "\n".join(f"{i}. {hit}" for i, hit in enumerate(hits, 1))
    return (
        "<long_term_memory>\nFrom your long-term memory of earlier conversations, what may "
        "bear on this message (the most relevant first; it may be out of date):\n"
        f"{lines}\n</long_term_memory>"
    )


def _bounded(hits: list[str], limit: int, max_chars: int) -> list[str]:
    """At most ``limit`` texts of ``max_chars`` together, whatever the store returned."""
    kept: list[str] = []
    used = 0
    for hit in hits[:limit]:
        room = max_chars - used
        if room <= 0:
            break
        kept.append(hit if len(hit) <= room else hit[: room - 1] + "…")
        used += len(kept[-1])
    return kept


def _strings(value: Any) -> list[str] | None:
    """A model's list of strings (one string taken as a list), or ``None``."""
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value or len(value) > _MAX_ITEMS:
        return None
    if not all(isinstance(item, str) and item.strip() for item in value):
        return None
    return [item.strip() for item in value]


def _clip(text: str) -> str:
    return text if len(text) <= _PART_CHARS else text[: _PART_CHARS - 1] + "…"


def _describe(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError) and not str(exc):
        return "it did not answer in time"
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
