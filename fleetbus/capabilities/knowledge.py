"""Knowledge bases: documents searched before the agent reasons.

An agent given knowledge bases (``Agent(capabilities=[Knowledge([…])])``) searches each of
them before the first reasoning step of a reply, with the user's input — or,
with ``KnowledgeConfig(rewrite_query=True)``, with a search query the model
first writes from the input and the conversation before it. The passages
found are shown to the model as a hint with every model call of that reply:
each with its source, just before the input, never stored in the
conversation. The reply's ``final_answer`` lists those sources
(``sources``).

A knowledge base is anything with the :class:`KnowledgeBase` method
``retrieve(query, limit, score_threshold)`` returning hits that have a
``text``, a ``source`` and a ``score``:

- ``fleetbus.tools_workers.knowledge.KnowledgeIndex``: a folder of text and
  Markdown files, chunked and indexed with SQLite FTS5 (BM25), in-process;
- :class:`BusKnowledgeBase`: the same served on the bus (``fleetbus worker
  fleetbus.tools_workers.knowledge``), reached through its tool;
- an embedding store of your own, by having the method.

A knowledge base that fails or is slow (``timeout``) does not fail the
reply: the model is told it could not be searched, and the failure is logged.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Protocol, runtime_checkable

import msgspec
import pydantic

from fleetbus.agents.messages import Msg
from fleetbus.agents.middleware import Middleware, ReplyContext
from fleetbus.bus import Bus, ToolClient
from fleetbus.capabilities._hints import with_hint
from fleetbus.capabilities._worker_tools import WorkerTools
from fleetbus.errors import ConfigError, RemoteError
from fleetbus.models.model import ChatModel, ModelRequest, ModelResponse, complete
from fleetbus.models.settings import check_ranges
from fleetbus.protocol import ChatMessage, FinalAnswer, TextBlock

if TYPE_CHECKING:
    from fleetbus.agents.capability import AgentView
    from fleetbus.agents.state import AgentState

__all__ = [
    "DEFAULT_KNOWLEDGE_TOOL",
    "BusKnowledgeBase",
    "Knowledge",
    "KnowledgeBase",
    "KnowledgeConfig",
    "KnowledgeHit",
    "KnowledgeRetrieval",
    "Passage",
]

logger = logging.getLogger(__name__)

DEFAULT_KNOWLEDGE_TOOL: Final = "knowledge_search"
"""The tool a knowledge worker serves by default (the same name as
``fleetbus.tools_workers.knowledge.DEFAULT_TOOL_NAME``)."""

_EXTRA: Final = "knowledge"
"""Where the hint of a reply is kept in its ``ReplyContext.extra``."""
_QUERY_CHARS: Final = 2000
"""Characters of the input searched with (and sent to a knowledge worker)."""
_TEXT_CHARS: Final = 8000
"""Longest passage taken from a knowledge base (a worker's answer is not trusted to be short)."""
_SOURCE_CHARS: Final = 300
_CONTEXT_MESSAGES: Final = 6
"""Earlier messages the query rewrite sees."""
_CONTEXT_CHARS: Final = 500
"""Characters of each of them."""
_REWRITE_PROMPT: Final = (
    "You turn a request into a search query for a knowledge base of documents. Answer with "
    "the query only, on one line: the words and names to look up, with what the earlier "
    "conversation says the request is about. No explanation."
)


@runtime_checkable
class KnowledgeHit(Protocol):
    """One passage a knowledge base found (any object with these attributes)."""

    @property
    def text(self) -> str:
        """The passage."""
        ...

    @property
    def source(self) -> str:
        """Where it comes from, for a person to find it (a file and its lines, a URL)."""
        ...

    @property
    def score(self) -> float:
        """How relevant it is; higher is more relevant (the scale is the base's)."""
        ...


@dataclass(frozen=True, slots=True)
class Passage:
    """A plain :class:`KnowledgeHit`, for knowledge bases of your own.

    Attributes:
        text: the passage.
        source: where it comes from.
        score: how relevant it is (higher is more).
    """

    text: str
    source: str
    score: float = 0.0


@runtime_checkable
class KnowledgeBase(Protocol):
    """Documents an agent can search."""

    async def retrieve(
        self, query: str, limit: int = 5, score_threshold: float | None = None
    ) -> Sequence[KnowledgeHit]:
        """The passages most relevant to ``query``, most relevant first.

        Args:
            query: what to look for (any text: it must not raise for syntax).
            limit: at most this many.
            score_threshold: leave out hits scoring below it.
        """
        ...


@dataclass(frozen=True, slots=True)
class KnowledgeConfig:
    """How an agent uses its knowledge bases.

    Attributes:
        limit: passages asked of each knowledge base (1 to 20).
        score_threshold: leave out passages scoring below it (on the
            base's scale: BM25 for a folder index).
        rewrite_query: before searching, have the model write a search query
            from the input and the conversation before it (one more model
            call a reply, and again when a paused reply resumes); the input
            itself is searched when the model fails.
        max_chars: the most characters of passages shown to the model in one
            reply, all bases together (the rest is cut).
        timeout: seconds one search, and the query rewrite, may take.

    Raises:
        ConfigError: a value is out of range.
    """

    limit: int = 5
    score_threshold: float | None = None
    rewrite_query: bool = False
    max_chars: int = 6000
    timeout: float = 10.0

    def __post_init__(self) -> None:
        check_ranges(
            _KnowledgeRanges,
            "KnowledgeConfig",
            limit=self.limit,
            max_chars=self.max_chars,
            timeout=self.timeout,
        )


class _KnowledgeRanges(pydantic.BaseModel):
    """The ranges of :class:`KnowledgeConfig`'s values."""

    limit: int = pydantic.Field(ge=1, le=20)
    max_chars: int = pydantic.Field(ge=200, le=100_000)
    timeout: float = pydantic.Field(gt=0)


class BusKnowledgeBase:
    """A knowledge base served on the bus (``fleetbus worker
    fleetbus.tools_workers.knowledge``), searched through its tool.

    Args:
        tool: the worker's tool (``knowledge_search`` unless the worker was
            given another name with ``FLEETBUS_KNOWLEDGE_TOOL``).
        bus: the bus (or a :class:`~fleetbus.bus.ToolClient` of it). Without
            one, it uses the bus of the reply's host: an agent served by
            ``fleetbus agent`` (any :class:`~fleetbus.agents.AgentHost`)
            needs none; elsewhere call :meth:`bind`.
        timeout: seconds the worker may take to answer one attempt.
        attempts: how many times a search is sent.

    Raises:
        ConfigError: the timeout is not positive, or no attempt is allowed.
    """

    def __init__(
        self,
        tool: str = DEFAULT_KNOWLEDGE_TOOL,
        *,
        bus: Bus | ToolClient | None = None,
        timeout: float = 10.0,
        attempts: int = 2,
    ) -> None:
        self._tools = WorkerTools(
            f"BusKnowledgeBase({tool!r})", bus, timeout=timeout, attempts=attempts
        )
        self.tool = tool
        self.timeout = timeout
        self.attempts = attempts

    def __repr__(self) -> str:
        return f"BusKnowledgeBase({self.tool!r})"

    def bind(self, bus: Bus | ToolClient) -> None:
        """Search over ``bus`` from now on."""
        self._tools.bind(bus)

    async def retrieve(
        self, query: str, limit: int = 5, score_threshold: float | None = None
    ) -> list[Passage]:
        """See :meth:`KnowledgeBase.retrieve`.

        Raises:
            ConfigError: no bus: none given, and the reply is not served by a host.
            RemoteError: the worker answered an error (its code and message),
                or an answer that is not a list of passages.
            BusError: no worker answered (``NoRespondersError``,
                ``CallTimeoutError``…).
        """
        parameters: dict[str, Any] = {"query": query[:_QUERY_CHARS], "limit": limit}
        if score_threshold is not None:
            parameters["score_threshold"] = score_threshold
        content = await self._tools.call(self.tool, parameters)
        try:
            hits = msgspec.convert(content, type=list[_WireHit])
        except msgspec.ValidationError as exc:
            raise RemoteError(
                f"knowledge base {self.tool} answered something else than passages: {exc}",
                code="internal",
                source_component=self.tool,
            ) from exc
        return [
            Passage(text=h.text[:_TEXT_CHARS], source=h.source[:_SOURCE_CHARS], score=h.score)
            for h in hits[:limit]
        ]


class _WireHit(msgspec.Struct):
    """A passage as the knowledge worker's tool returns it (other fields ignored)."""

    text: str
    source: str
    score: float = 0.0


@dataclass(frozen=True, slots=True)
class _Retrieved:
    """What a reply found: the hint, the sources, where the hint goes."""

    hint: str
    sources: list[str]
    anchor: ChatMessage | None


class KnowledgeRetrieval(Middleware):
    """The middleware that searches the knowledge bases and shows the model
    what they found (the layer of :class:`Knowledge`).

    Args:
        bases: the knowledge bases, searched at once.
        config: how many passages, the threshold, the query rewrite, bounds.
        model: the model that rewrites the query (with ``rewrite_query``).

    Raises:
        ConfigError: a base is not a knowledge base, or ``rewrite_query``
            without a model.
    """

    def __init__(
        self,
        bases: Iterable[KnowledgeBase],
        config: KnowledgeConfig | None = None,
        *,
        model: ChatModel | None = None,
    ) -> None:
        self.bases = list(bases)
        self.config = config or KnowledgeConfig()
        self.model = model
        for base in self.bases:
            if not isinstance(base, KnowledgeBase):
                raise ConfigError(f"{base!r} is not a knowledge base (it has no retrieve())")
        if self.config.rewrite_query and model is None:
            raise ConfigError("rewrite_query needs a model to rewrite the query with")

    async def on_reply(
        self, ctx: ReplyContext, call_next: Callable[[], Awaitable[FinalAnswer]]
    ) -> FinalAnswer:
        retrieved = await self._retrieve(ctx)
        if retrieved is None:
            return await call_next()
        ctx.extra[_EXTRA] = retrieved
        final = await call_next()
        if not retrieved.sources:
            return final
        return msgspec.structs.replace(final, sources=list(retrieved.sources))

    async def on_model_call(
        self,
        ctx: ReplyContext,
        request: ModelRequest,
        call_next: Callable[[ModelRequest], Awaitable[ModelResponse]],
    ) -> ModelResponse:
        retrieved = ctx.extra.get(_EXTRA)
        if isinstance(retrieved, _Retrieved):
            messages = with_hint(request.messages, retrieved.hint, retrieved.anchor)
            request = dataclasses.replace(request, messages=messages)
        return await call_next(request)

    async def _retrieve(self, ctx: ReplyContext) -> _Retrieved | None:
        """Search every base with the reply's input; ``None`` when there is
        nothing to search with, or nothing was found (and nothing failed)."""
        memory = ctx.state.memory
        start, end = _input_span(memory, ctx.iteration)
        inputs = _searched(memory[start:end])
        query = "\n".join(m.text for m in inputs).strip()[:_QUERY_CHARS]
        if not self.bases or not query:
            return None
        config = self.config
        searched = query
        if config.rewrite_query:
            searched = await self._rewritten(ctx, query, memory[:start])
        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(self._search(ctx, base, searched)) for base in self.bases]
        found = [task.result() for task in tasks]
        hits = _interleaved([h for h in found if not isinstance(h, str)])
        failures = [
            f"knowledge base {i} could not be searched: {h}"
            for i, h in enumerate(found, 1)
            if isinstance(h, str)
        ]
        shown = _bounded(hits, config.max_chars)
        if not shown and not failures:
            return None
        sources = list(dict.fromkeys(hit.source for hit in shown))
        hint = _render(shown, failures, searched if searched != query else None)
        anchor = memory[start].to_chat()
        return _Retrieved(hint=hint, sources=sources, anchor=anchor)

    async def _search(
        self, ctx: ReplyContext, base: KnowledgeBase, query: str
    ) -> list[KnowledgeHit] | str:
        """The hits of one base (bounded, threshold applied), or why it failed."""
        config = self.config
        try:
            async with asyncio.timeout(config.timeout):
                hits = await base.retrieve(query, config.limit, config.score_threshold)
            threshold = config.score_threshold
            return [
                hit
                for hit in list(hits)[: config.limit]
                if threshold is None or hit.score >= threshold
            ]
        except Exception as exc:  # a base of any kind: its failure is the model's to know
            why = _describe(exc, config.timeout)
            logger.warning(
                "%s: knowledge base %r could not be searched: %s",
                ctx.agent_name,
                base,
                why,
                extra={"session_id": ctx.session_id, "call_id": ctx.reply_id},
            )
            return why

    async def _rewritten(self, ctx: ReplyContext, query: str, before: list[Msg]) -> str:
        """The model's search query for ``query``; ``query`` itself when it fails."""
        assert self.model is not None  # checked when made
        lines = [
            f"{m.role}: {m.text[:_CONTEXT_CHARS]}"
            for m in before
            if m.role in ("user", "assistant") and m.text.strip() and not m.marks & {"hint"}
        ][-_CONTEXT_MESSAGES:]
        asked = f"The request: {query}"
        if lines:
            asked = "The conversation so far:\n" + "\n".join(lines) + "\n\n" + asked
        request = ModelRequest(
            messages=[
                ChatMessage(role="system", content=[TextBlock(text=_REWRITE_PROMPT)]),
                ChatMessage(role="user", content=[TextBlock(text=asked)]),
            ],
            tool_choice="none",
        )
        try:
            async with asyncio.timeout(self.config.timeout):
                response = await complete(self.model, request)
        except Exception as exc:  # the input itself is searched then
            logger.warning(
                "%s: the query rewrite failed, searching the input: %s",
                ctx.agent_name,
                _describe(exc, self.config.timeout),
                extra={"session_id": ctx.session_id, "call_id": ctx.reply_id},
            )
            return query
        if response.usage is not None:
            ctx.input_tokens += response.usage.input_tokens
            ctx.output_tokens += response.usage.output_tokens
        line = next((s.strip() for s in response.text.splitlines() if s.strip()), "")
        line = line.removeprefix("Query:").removeprefix("query:").strip().strip("\"'`").strip()
        return line[:_QUERY_CHARS] or query


class Knowledge:
    """The knowledge capability: knowledge bases searched before the first
    reasoning step of each reply; what they find is shown to the model with
    its sources, which the final answer lists (``sources``).

    Args:
        bases: the knowledge bases, searched at once.
        config: passages per base, score threshold, query rewrite (by the
            agent's model), bounds and timeout of the search.

    Raises:
        ConfigError: a base is not a knowledge base.
    """

    def __init__(
        self, bases: Iterable[KnowledgeBase], config: KnowledgeConfig | None = None
    ) -> None:
        self.bases = list(bases)
        self.config = config or KnowledgeConfig()
        for base in self.bases:
            if not isinstance(base, KnowledgeBase):
                raise ConfigError(f"{base!r} is not a knowledge base (it has no retrieve())")

    def middlewares(self, agent: AgentView) -> Sequence[Middleware]:
        """The search, with the agent's model to rewrite the query (none without bases)."""
        if not self.bases:
            return ()
        return (KnowledgeRetrieval(self.bases, self.config, model=agent.model),)

    def prepare_state(self, state: AgentState) -> None:
        """Nothing: the bases are searched anew in each reply."""


def _input_span(memory: list[Msg], steps: int) -> tuple[int, int]:
    """Where the reply's input is in memory: the user messages just before
    the reply's first model message (the reply has made ``steps``, one model
    message each; none yet: the user messages at the end)."""
    end = len(memory)
    seen = 0
    while end > 0 and seen < steps:
        end -= 1
        if memory[end].role == "assistant":
            seen += 1
    start = end
    while (
        start > 0
        and memory[start - 1].role == "user"
        and not memory[start - 1].marks & {"hint", "compressed"}
    ):
        start -= 1
    return start, end


def _searched(inputs: list[Msg]) -> list[Msg]:
    """The messages searched with: the input, without what was only observed
    before it (unless that is all there is, as when a reply answers what it heard)."""
    said = [m for m in inputs if "observed" not in m.marks]
    return said or inputs


def _interleaved(found: list[list[KnowledgeHit]]) -> list[KnowledgeHit]:
    """Each base's best first, then each base's second…: scores of different
    bases do not compare."""
    hits: list[KnowledgeHit] = []
    for rank in range(max((len(f) for f in found), default=0)):
        hits.extend(f[rank] for f in found if rank < len(f))
    return hits


def _bounded(hits: list[KnowledgeHit], max_chars: int) -> list[KnowledgeHit]:
    """The hits whose texts fit in ``max_chars`` together (the last one cut to fit)."""
    kept: list[KnowledgeHit] = []
    room = max_chars
    for hit in hits:
        text = hit.text.strip()[:_TEXT_CHARS]
        if not text:
            continue
        if room < 100:
            break
        if len(text) > room:
            text = text[: room - 1] + "…"
        kept.append(Passage(text=text, source=hit.source[:_SOURCE_CHARS], score=hit.score))
        room -= len(text)
    return kept


def _render(hits: list[KnowledgeHit], failures: list[str], query: str | None) -> str:
    searched = f' (searched for "{query}")' if query else ""
    parts = [
        "<knowledge>",
        "Passages retrieved from the knowledge base for the request that follows"
        f"{searched}. They are not the user's words: use what is relevant, and name the "
        "sources you use.",
    ]
    for number, hit in enumerate(hits, 1):
        parts.append(f"\n[{number}] {hit.source}, score {hit.score:.3g}\n{hit.text}")
    parts.extend(f"\n({failure})" for failure in failures)
    parts.append("</knowledge>")
    return "\n".join(parts)


def _describe(exc: BaseException, timeout: float) -> str:
    if isinstance(exc, TimeoutError) and not str(exc):
        return f"it did not answer within {timeout:g} s"
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
