"""Agents that speak A2A as fleetbus tools.

:class:`A2AAgentTool` is one agent of any A2A server (the fleetbus gateway's
``/a2a/{agent}``, a server built with a2a-sdk, another framework's) used
like a local tool: the model sends it a message and gets the remote agent's
answer. Its card, read once, names the tool and describes it::

    toolkit = Toolkit()
    await toolkit.add_a2a(
        "https://gateway.example.com/a2a/writer", headers={"authorization": "Bearer …"}
    )

:class:`A2ATools` reads the cards of several agents with the same settings
and keeps one HTTP connection pool for all their calls::

    async with A2ATools(["http://a.example/a2a/writer", "http://b.example"]) as remote:
        toolkit = Toolkit(remote.tools)

The tool's input is ``{"message": "…", "context_id": "…"?}``. Calls with the
same ``context_id`` continue one conversation of the remote agent (its A2A
``contextId`` is the ``context_id`` made a token and, for a call made in a
session, followed by a digest of the session id, so that two sessions never
share a remote conversation); a call without one starts a new conversation.

The answer is the remote task's: the text of its artifacts (else of its
final status message, else of its last message), or their data when they
hold only data (one data part: its value; more: a list). A task that asks
for input (``input-required``, ``auth-required``) is an ``error`` result
saying what it asks; a failed, rejected or cancelled task, an A2A error, an
HTTP error and a connection that fails are ``error`` results; a call past
its deadline is a ``timeout``. Messages are streamed when the card says the
agent streams, else sent and answered at once.

Needs a2a-sdk (``pip install 'fleetbus[a2a]'``), imported only when a tool
is made.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import re
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, Final

import orjson

from fleetbus._opening import Opening
from fleetbus.bus.subjects import check_name
from fleetbus.errors import ConfigError, InvalidSubjectError, ToolDefinitionError, ToolError
from fleetbus.protocol import ToolResult, ToolSpec, new_id
from fleetbus.protocol.codec import clip
from fleetbus.tools_workers.tool import tool_failure

if TYPE_CHECKING:
    import httpx
    from a2a.client import Client
    from a2a.types import AgentCard, Part, SendMessageRequest, StreamResponse, Task

__all__ = ["A2A_TOOL_PARAMETERS", "A2AAgentTool", "A2ATools"]

logger = logging.getLogger(__name__)

_INSTALL_HINT: Final = "A2A agents as tools need a2a-sdk 1.x: pip install 'fleetbus[a2a]'"
"""What to tell someone whose environment lacks the SDK."""

DEFAULT_TIMEOUT: Final = 300.0
"""Seconds a call may take when neither the caller nor the tool says."""

A2A_TOOL_PARAMETERS: Final[dict[str, Any]] = {
    "type": "object",
    "properties": {
        "message": {"type": "string", "description": "What to say to the agent."},
        "context_id": {
            "type": "string",
            "description": "A name for the conversation: calls with the same context_id "
            "continue it (the agent remembers what was said); without one, each call "
            "starts a new conversation.",
        },
    },
    "required": ["message"],
    "additionalProperties": False,
}
"""The JSON Schema of an A2A agent tool's input."""

_NOT_A_TOKEN: Final = re.compile(r"[^A-Za-z0-9_-]")
_CONTEXT_CHARS: Final = 64
_DESCRIPTION_CHARS: Final = 1024
_CARD_PATH: Final = "/.well-known/agent-card.json"


def _require_sdk() -> None:
    """Make sure a2a-sdk can be used.

    Raises:
        ConfigError: a2a-sdk (1.x) is not installed.
    """
    try:
        from a2a.client import ClientFactory  # noqa: F401
    except ImportError as exc:
        raise ConfigError(_INSTALL_HINT) from exc


class A2AAgentTool:
    """One A2A agent, used like a local tool.

    Made from the agent's card (:meth:`from_url`, :meth:`Toolkit.add_a2a
    <fleetbus.tools_workers.Toolkit.add_a2a>`, :class:`A2ATools`); its
    :meth:`run` has the contract of a local tool's: never raises for what
    happens to the call.

    Args:
        url: where the card was read (the agent's URL).
        card: the agent's card.
        name: the tool's name; by default the card's name, every character
            that cannot be in a subject token made ``_``.
        headers: HTTP headers of every request (``Authorization``…).
        timeout: seconds a call may take by default (``None``: the caller's,
            else :data:`DEFAULT_TIMEOUT`).
        group: the toolkit group it joins by default.
        http: an HTTP client to send the calls with (kept open by its
            owner); ``None``: one per call.

    Raises:
        ToolDefinitionError: the name cannot be a tool's.
    """

    def __init__(
        self,
        url: str,
        card: AgentCard,
        *,
        name: str | None = None,
        headers: Mapping[str, str] | None = None,
        timeout: float | None = None,
        group: str = "a2a",
        http: httpx.AsyncClient | None = None,
    ) -> None:
        tool_name = name if name is not None else _NOT_A_TOKEN.sub("_", card.name)
        try:
            check_name(tool_name, what=f"tool name for the A2A agent {card.name!r}")
        except InvalidSubjectError as exc:
            raise ToolDefinitionError(f"the A2A agent at {url}: {exc}") from exc
        self.url = url
        self.card = card
        self.name = tool_name
        self.description = _describe(card)
        self.parameters: dict[str, Any] = A2A_TOOL_PARAMETERS
        self.timeout = timeout
        self.concurrency_safe = True
        self.external = False
        self.group = group
        self.headers = dict(headers or {})
        self._http = http

    def __repr__(self) -> str:
        return f"A2AAgentTool({self.name!r}, url={self.url!r})"

    @classmethod
    async def from_url(
        cls,
        url: str,
        *,
        name: str | None = None,
        headers: Mapping[str, str] | None = None,
        timeout: float | None = None,
        group: str = "a2a",
        connect_timeout: float = 30.0,
        http: httpx.AsyncClient | None = None,
    ) -> A2AAgentTool:
        """The agent whose card is at ``url`` (the agent's URL, where
        ``/.well-known/agent-card.json`` is, or the card's own URL).

        Args:
            url: the agent's URL or its card's.
            name, headers, timeout, group, http: as the class takes them.
            connect_timeout: seconds reading the card may take.

        Raises:
            ConfigError: a2a-sdk is not installed, or ``url`` is not HTTP(S).
            ToolError: the card could not be read.
            ToolDefinitionError: the name cannot be a tool's.
        """
        _require_sdk()
        card = await _read_card(url, headers or {}, connect_timeout, http)
        return cls(url, card, name=name, headers=headers, timeout=timeout, group=group, http=http)

    def spec(self) -> ToolSpec:
        """The tool as offered to a model."""
        return ToolSpec(name=self.name, description=self.description, parameters=self.parameters)

    async def run(
        self,
        parameters: Any,
        *,
        timeout: float | None = None,
        call_id: str | None = None,
        session_id: str | None = None,
    ) -> ToolResult:
        """Send the message to the agent and say how it ended (a
        ``tool_result`` nobody sent: ``sender`` empty).

        Never raises, except ``CancelledError`` when the caller is cancelled.
        """
        from a2a.client import A2AClientTimeoutError
        from a2a.utils.errors import A2AError

        failed = partial(tool_failure, self.name, call_id=call_id, session_id=session_id)
        message = parameters.get("message") if isinstance(parameters, dict) else None
        context = parameters.get("context_id") if isinstance(parameters, dict) else None
        if not isinstance(message, str) or not message.strip():
            return failed("error", "invalid_parameters", "'message' must be a non-empty string")
        if context is not None and (not isinstance(context, str) or not context.strip()):
            return failed("error", "invalid_parameters", "'context_id' must be a non-empty string")
        limit = timeout if timeout is not None else self.timeout
        limit = limit if limit is not None else DEFAULT_TIMEOUT
        deadline = asyncio.timeout(limit)
        try:
            async with deadline, self._client() as client:
                task, answer = await _follow(
                    client.send_message(_request(message, _context_id(context, session_id)))
                )
        except TimeoutError:
            if deadline.expired():
                return failed("timeout", "timeout", f"{self.name} did not answer within {limit:g}s")
            return failed("error", "tool_error", f"the A2A agent {self.url} timed out")
        except A2AClientTimeoutError:
            return failed("error", "tool_error", f"the A2A agent {self.url} timed out")
        except A2AError as exc:
            return failed("error", "tool_error", f"the A2A agent {self.url} answered: {exc}")
        except Exception as exc:
            # The transport failing (httpx's errors, a card without a usable interface).
            return failed(
                "error",
                "tool_error",
                f"the A2A agent {self.url} failed: {type(exc).__name__}: {exc}",
            )
        return _result(self.name, task, answer, call_id=call_id, session_id=session_id)

    @contextlib.asynccontextmanager
    async def _client(self) -> AsyncIterator[Client]:
        """An A2A client of the agent, over the shared HTTP client or one of its own."""
        import httpx
        from a2a.client import ClientConfig, ClientFactory

        async with contextlib.AsyncExitStack() as stack:
            http = self._http
            if http is None:
                http = await stack.enter_async_context(
                    httpx.AsyncClient(headers=self.headers, timeout=None)
                )
            factory = ClientFactory(ClientConfig(httpx_client=http, streaming=True))
            client = factory.create(self.card)
            try:
                yield client
            finally:
                await client.close()


class A2ATools(Opening):
    """The agents of A2A servers, as tools, over one HTTP connection pool.

    Use it as an async context manager (or :meth:`open` and :meth:`close`);
    once open, :attr:`tools` holds one :class:`A2AAgentTool` per URL.

    Args:
        urls: the agents' URLs (or their cards').
        headers: HTTP headers of every request (``Authorization``…).
        name_prefix: put before every tool's name.
        group: the toolkit group the tools join.
        timeout: seconds each call may take (default: the caller's, else
            :data:`DEFAULT_TIMEOUT`).
        connect_timeout: seconds reading each card may take.

    Raises:
        ConfigError: a2a-sdk is not installed, or no URL is given.
    """

    def __init__(
        self,
        urls: Iterable[str],
        *,
        headers: Mapping[str, str] | None = None,
        name_prefix: str = "",
        group: str = "a2a",
        timeout: float | None = None,
        connect_timeout: float = 30.0,
    ) -> None:
        _require_sdk()
        self.urls = list(urls)
        if not self.urls:
            raise ConfigError("give at least one A2A agent's URL")
        self.headers = dict(headers or {})
        self.name_prefix = name_prefix
        self.group = group
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.tools: list[A2AAgentTool] = []
        """The agents' tools, once open."""
        self._http: httpx.AsyncClient | None = None

    def __repr__(self) -> str:
        return f"A2ATools({self.urls!r}, tools={[t.name for t in self.tools]})"

    async def open(self) -> None:
        """Read every agent's card and make its tool.

        Raises:
            ToolError: a card could not be read (or this was opened before).
            ToolDefinitionError: a name cannot be a tool's, or two agents
                get the same one.
        """
        import httpx

        if self._http is not None:
            raise ToolError("these A2A agents were opened before")
        self._http = httpx.AsyncClient(headers=self.headers, timeout=None)
        try:
            tools: dict[str, A2AAgentTool] = {}
            for url in self.urls:
                card = await _read_card(url, {}, self.connect_timeout, self._http)
                made = A2AAgentTool(
                    url,
                    card,
                    name=self.name_prefix + _NOT_A_TOKEN.sub("_", card.name),
                    headers=self.headers,
                    timeout=self.timeout,
                    group=self.group,
                    http=self._http,
                )
                if made.name in tools:
                    raise ToolDefinitionError(
                        f"the A2A agents at {tools[made.name].url} and {url} would both be "
                        f"named {made.name!r}"
                    )
                tools[made.name] = made
        except BaseException:
            await self.close()
            raise
        self.tools = list(tools.values())
        logger.info("A2A agents: %s", ", ".join(t.name for t in self.tools))

    async def close(self) -> None:
        """Close the connections; calls after this fail."""
        http, self._http = self._http, None
        if http is not None:
            await http.aclose()


async def _read_card(
    url: str, headers: Mapping[str, str], limit: float, http: httpx.AsyncClient | None
) -> AgentCard:
    """The card of the agent at ``url`` (its URL, or the card's own).

    Raises:
        ConfigError: ``url`` is not HTTP(S).
        ToolError: the card could not be read within ``limit`` seconds.
    """
    import httpx
    from a2a.client import A2ACardResolver
    from a2a.utils.errors import A2AError

    if not url.startswith(("http://", "https://")):
        raise ConfigError(f"an A2A agent's URL starts with http:// or https://, not {url!r}")
    # The agent's URL, under which the card is; or the card's own URL.
    path = "" if url.endswith(".json") else _CARD_PATH
    try:
        async with contextlib.AsyncExitStack() as stack:
            if http is None:
                http = await stack.enter_async_context(httpx.AsyncClient(headers=dict(headers)))
            async with asyncio.timeout(limit):
                return await A2ACardResolver(http, url, path).get_agent_card()
    except TimeoutError as exc:
        raise ToolError(f"the A2A agent at {url} gave no card within {limit:g}s") from exc
    except A2AError as exc:
        raise ToolError(f"cannot read the card of the A2A agent at {url}: {exc}") from exc


def _describe(card: AgentCard) -> str:
    """What the model is told about the agent: the card's description and skills."""
    text = card.description or f"The A2A agent {card.name}."
    skills = [f"{s.name}: {s.description}" if s.description else s.name for s in card.skills]
    if skills:
        text += "\nSkills: " + "; ".join(skills)
    return clip(text, _DESCRIPTION_CHARS)


def _context_id(context: str | None, session_id: str | None) -> str:
    """The remote ``contextId`` of the model's ``context`` in ``session_id`` ("": a new one)."""
    if context is None:
        return ""
    token = _NOT_A_TOKEN.sub("_", context.strip())[:_CONTEXT_CHARS]
    if session_id is None:
        return token
    return f"{token}-{hashlib.sha256(session_id.encode()).hexdigest()[:12]}"


def _request(text: str, context_id: str) -> SendMessageRequest:
    from a2a.types import Message, Part, Role, SendMessageRequest

    message = Message(
        role=Role.ROLE_USER, message_id=new_id(), parts=[Part(text=text)], context_id=context_id
    )
    return SendMessageRequest(message=message)


async def _follow(responses: AsyncIterator[StreamResponse]) -> tuple[Task | None, list[Part]]:
    """The task the responses end with (``None``: a message answered
    instead), and the parts of its answer: its artifacts' (appended chunks
    joined), else those of its final status message, else of its last
    agent message; the message's, for a message."""
    from a2a.types import Artifact, Role, Task

    task: Task | None = None
    artifacts: dict[str, Artifact] = {}
    async for response in responses:
        if response.HasField("message"):
            return None, list(response.message.parts)
        if response.HasField("task"):
            task = Task()
            task.CopyFrom(response.task)
            artifacts = {a.artifact_id: a for a in task.artifacts}
        elif response.HasField("status_update"):
            if task is None:
                task = Task(id=response.status_update.task_id)
            task.status.CopyFrom(response.status_update.status)
        elif response.HasField("artifact_update"):
            update = response.artifact_update
            known = artifacts.get(update.artifact.artifact_id)
            if update.append and known is not None:
                known.parts.extend(update.artifact.parts)
            else:
                artifacts[update.artifact.artifact_id] = update.artifact
    if task is None:
        return None, []
    parts = [p for a in artifacts.values() for p in a.parts]
    if not parts:
        parts = list(task.status.message.parts)
    if not parts:
        said = [m for m in task.history if m.role == Role.ROLE_AGENT]
        parts = list(said[-1].parts) if said else []
    return task, parts


def _result(
    name: str,
    task: Task | None,
    parts: Sequence[Part],
    *,
    call_id: str | None,
    session_id: str | None,
) -> ToolResult:
    """How a call ended, from the remote task and its answer."""
    from a2a.types import TaskState

    failed = partial(tool_failure, name, call_id=call_id, session_id=session_id)
    told = _told(parts)
    if task is not None:
        state = task.status.state
        if state in (TaskState.TASK_STATE_INPUT_REQUIRED, TaskState.TASK_STATE_AUTH_REQUIRED):
            what = _text(told) or "it does not say what"
            return failed("error", "tool_error", f"{name} needs input to go on: {what}")
        if state in (TaskState.TASK_STATE_FAILED, TaskState.TASK_STATE_REJECTED):
            return failed(
                "error", "tool_error", f"{name} failed: {_text(told) or 'no reason given'}"
            )
        if state == TaskState.TASK_STATE_CANCELED:
            return failed("error", "tool_error", f"{name} cancelled the task")
        if state != TaskState.TASK_STATE_COMPLETED:
            return failed(
                "error",
                "tool_error",
                f"{name} stopped answering before its task ended ({TaskState.Name(state)})",
            )
    elif not parts:
        return failed("error", "tool_error", f"{name} answered nothing")
    return ToolResult(
        session_id=session_id,
        call_id=call_id,
        tool_name=name,
        status="success",
        content=_content(told),
    )


def _told(parts: Sequence[Part]) -> list[tuple[str, Any]]:
    """Each part as ``("text", str)`` or ``("data", JSON)``."""
    from a2a.helpers import get_data_parts

    told: list[tuple[str, Any]] = []
    for part in parts:
        if part.HasField("text"):
            told.append(("text", part.text))
        elif part.HasField("data"):
            told.append(("data", _plain(get_data_parts([part])[0])))
        else:
            where = part.url if part.HasField("url") else f"{len(part.raw)} bytes"
            told.append(("text", f"[file {part.filename or ''} {part.media_type} {where}]"))
    return told


def _content(told: list[tuple[str, Any]]) -> Any:
    """The answer: text, or data when there is only data."""
    data = [value for kind, value in told if kind == "data"]
    if data and len(data) == len(told):
        return data[0] if len(data) == 1 else data
    return _text(told)


def _text(told: list[tuple[str, Any]]) -> str:
    return "\n".join(
        value if kind == "text" else orjson.dumps(value).decode() for kind, value in told
    )


def _plain(value: Any) -> Any:
    """JSON read from protobuf, whose numbers are all floats: whole ones as ints."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value
