"""The tools of MCP servers as fleetbus tools.

:class:`MCPTools` connects to one MCP server, a command started as a
subprocess and spoken to over stdio or a URL spoken to over streamable HTTP,
lists its tools, and makes each an :class:`MCPTool`: a tool like any other in
a :class:`~fleetbus.tools_workers.toolkit.Toolkit`, whose ``run`` calls the
MCP tool::

    async with MCPTools("npx -y @modelcontextprotocol/server-everything") as server:
        toolkit = Toolkit(server.tools)
        result = await toolkit.run("echo", {"message": "hi"})

``fleetbus worker --mcp "COMMAND ARGS…"`` and ``--mcp-url URL`` serve them on
the bus (see ``docs/mcp.md``).

The MCP session is opened once and shared by every call (MCP multiplexes
requests on it). A call that finds the connection gone (the server process
died, the HTTP server went away) answers an error; the next call connects
again. The tool list is the one read when the session was first opened.

An MCP result becomes the tool's output: its ``structuredContent`` when
there is one; else its text items joined by newlines, when they are all
text; else a list of content blocks: :class:`~fleetbus.protocol.TextBlock`
for text, :class:`~fleetbus.protocol.DataBlock` with a ``data:`` URL for an
image, audio or binary resource, and with the resource's URI for a resource
link. A result flagged ``isError``, an MCP protocol error and a lost
connection are ``error`` results; a call past its deadline is a ``timeout``.

Needs the ``mcp`` SDK (``pip install 'fleetbus[mcp]'``), imported only when an
:class:`MCPTools` is made.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import shlex
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
from pydantic import BaseModel, Field

from fleetbus._opening import Opening
from fleetbus._version import __version__
from fleetbus.bus.subjects import check_name
from fleetbus.errors import ConfigError, InvalidSubjectError, ToolDefinitionError, ToolError
from fleetbus.protocol import DataBlock, ErrorCode, TextBlock, ToolResult, ToolSpec
from fleetbus.tools_workers.settings import check_ranges
from fleetbus.tools_workers.tool import tool_failure

if TYPE_CHECKING:
    from mcp import Client
    from mcp.client.stdio import StdioServerParameters
    from mcp.types import CallToolResult, ContentBlock
    from mcp.types import Tool as ListedTool

__all__ = ["MCPTool", "MCPTools"]

logger = logging.getLogger(__name__)

_INSTALL_HINT = "MCP servers need the mcp SDK 2.x: pip install 'fleetbus[mcp]'"
"""What to tell someone whose environment lacks the SDK."""

_MAX_PAGES = 100
"""Pages of ``tools/list`` read at most: a server that pages forever cannot hang the start."""

_NOT_A_TOKEN = re.compile(r"[^A-Za-z0-9_-]")


class _Limits(BaseModel):
    timeout: float | None = Field(gt=0)
    connect_timeout: float = Field(gt=0)


def _require_sdk() -> None:
    """Make sure the ``mcp`` SDK can be used.

    Raises:
        ConfigError: the ``mcp`` SDK (2.x) is not installed.
    """
    try:
        from mcp import Client  # noqa: F401
    except ImportError as exc:
        raise ConfigError(_INSTALL_HINT) from exc


@dataclass(frozen=True, slots=True)
class _Live:
    """An open MCP session."""

    client: Client
    lost: asyncio.Event = field(default_factory=asyncio.Event)
    """Set when a call finds the session broken, or the server is closed."""


class MCPTool:
    """One tool of an MCP server, used like a local tool.

    Made by :class:`MCPTools`; its :meth:`run` has the contract of a local
    tool's: never raises for what happens to the call.

    Attributes:
        name: the tool's fleetbus name: the MCP name with every character
            that cannot be in a subject token made ``_``, after the server's
            ``name_prefix``.
        mcp_name: the tool's name on the MCP server.
        description: what it does, from the listing.
        parameters: the JSON Schema of its arguments, from the listing.
        timeout: seconds a call may run by default (``None``: the caller's or
            the worker's default).
        concurrency_safe: whether calls may run in parallel within one agent.
        external: always ``False``: the tool runs here.
        group: the toolkit group it joins by default.
    """

    def __init__(
        self,
        server: MCPTools,
        listed: ListedTool,
        *,
        name: str,
        timeout: float | None,
        group: str,
    ) -> None:
        self.server = server
        self.name = name
        self.mcp_name = listed.name
        self.description = listed.description or listed.title or ""
        self.parameters: dict[str, Any] = dict(listed.input_schema)
        self.timeout = timeout
        self.concurrency_safe = True
        self.external = False
        self.group = group

    def __repr__(self) -> str:
        return f"MCPTool({self.name!r}, server={self.server.label!r})"

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
        """Call the MCP tool and say how it ended (a ``tool_result`` nobody
        sent: ``sender`` empty).

        ``call_id`` and ``session_id`` are not sent: MCP has no place for
        them; the result carries them.
        Never raises, except ``CancelledError`` when the caller is cancelled
        (the MCP server is then told the request is cancelled).
        """
        if not isinstance(parameters, dict):
            return tool_failure(
                self.name,
                "error",
                "invalid_parameters",
                "parameters must be a JSON object",
                call_id=call_id,
                session_id=session_id,
            )
        limit = self.timeout if timeout is None else timeout
        return await self.server.call(
            self, parameters, limit, call_id=call_id, session_id=session_id
        )


class MCPTools(Opening):
    """The tools of one MCP server, over one session kept open.

    Use it as an async context manager (or :meth:`open` and :meth:`close`);
    once open, :attr:`tools` holds the server's tools.

    Args:
        command: the server's command line, started as a subprocess and
            spoken to over stdio: a string (split as a shell would, without
            running a shell) or a list of arguments.
        url: the server's streamable HTTP endpoint (``http://host:port/mcp``).
            Give ``command`` or ``url``, not both.
        env: environment variables for the subprocess, over the few the SDK
            passes on (``HOME``, ``PATH``, ``USER``, ...); the rest of this
            process's environment is not passed.
        cwd: the subprocess's working directory (default: this process's).
        name_prefix: put before every tool's name, to keep the tools of two
            servers apart.
        group: the toolkit group the tools join.
        timeout: seconds each call may run (default: the caller's, else
            the worker's default).
        connect_timeout: seconds starting (or reaching) the server and the
            MCP handshake may take, and listing the tools.

    Raises:
        ConfigError: the ``mcp`` SDK is not installed, or the arguments are wrong.
    """

    def __init__(
        self,
        command: str | Sequence[str] | None = None,
        *,
        url: str | None = None,
        env: Mapping[str, str] | None = None,
        cwd: str | Path | None = None,
        name_prefix: str = "",
        group: str = "mcp",
        timeout: float | None = None,
        connect_timeout: float = 30.0,
    ) -> None:
        _require_sdk()
        if (command is None) == (url is None):
            raise ConfigError("give an MCP server's command or its URL (one of them)")
        argv: list[str] = []
        if command is not None:
            try:
                argv = shlex.split(command) if isinstance(command, str) else list(command)
            except ValueError as exc:
                raise ConfigError(
                    f"cannot split the MCP server command {command!r}: {exc}"
                ) from exc
            if not argv:
                raise ConfigError("the MCP server command is empty")
        if url is not None and not url.startswith(("http://", "https://")):
            raise ConfigError(f"an MCP server URL starts with http:// or https://, not {url!r}")
        check_ranges(_Limits, "MCPTools", timeout=timeout, connect_timeout=connect_timeout)
        self.argv = argv
        self.url = url
        self.env = dict(env) if env is not None else None
        self.cwd = cwd
        self.name_prefix = name_prefix
        self.group = group
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.label = url if url is not None else shlex.join(argv)
        """The server, as error messages and logs name it."""
        self.tools: list[MCPTool] = []
        """The server's tools, once open."""
        self.connections = 0
        """How many times a session was opened (more than 1: it was re-established)."""
        self._owner: asyncio.Task[None] | None = None
        self._requests: asyncio.Queue[asyncio.Future[_Live] | None] = asyncio.Queue()
        self._pending: asyncio.Future[_Live] | None = None
        self._live: _Live | None = None
        self._closing = False

    def __repr__(self) -> str:
        return f"MCPTools({self.label!r}, tools={[t.name for t in self.tools]})"

    async def open(self) -> None:
        """Start (or reach) the server, open the session, and list its tools.

        Raises:
            ToolError: the server could not be started or reached, or did not
                list its tools, within ``connect_timeout``.
            ToolDefinitionError: a tool's name cannot be a fleetbus tool name,
                or two tools get the same one.
        """
        if self._owner is not None or self._closing:
            raise ToolError(f"the MCP server {self.label} was opened before")
        # The session's transport runs anyio task groups, which must be left
        # by the task that entered them: one task owns every session.
        self._owner = asyncio.create_task(self._own(), name=f"mcp-session {self.label}")
        try:
            live = await self._connection()
            listed = await self._list(live)
            self.tools = self._make_tools(listed)
        except BaseException:
            await self.close()
            raise
        logger.info("MCP server %s: %d tool(s)", self.label, len(self.tools))

    async def close(self) -> None:
        """End the session (a subprocess is stopped as the MCP spec says:
        stdin closed, then SIGTERM, then SIGKILL); calls after this fail."""
        owner, self._owner = self._owner, None
        if owner is None:
            return
        self._closing = True
        self._requests.put_nowait(None)
        if self._live is not None:
            self._live.lost.set()
        await owner

    async def call(
        self,
        tool: MCPTool,
        arguments: dict[str, Any],
        limit: float | None,
        *,
        call_id: str | None = None,
        session_id: str | None = None,
    ) -> ToolResult:
        """Call ``tool`` with ``arguments`` within ``limit`` seconds (``None``:
        no deadline) and say how it ended, as the ``tool_result`` of the call
        ``call_id`` in ``session_id`` (``sender`` empty); never raises, except
        ``CancelledError``.
        """
        from mcp import MCPError
        from mcp.types import CONNECTION_CLOSED, INVALID_PARAMS

        failed = partial(tool_failure, tool.name, call_id=call_id, session_id=session_id)
        live: _Live | None = None
        deadline = asyncio.timeout(limit)
        try:
            async with deadline:
                live = await self._connection()
                result = await live.client.call_tool(tool.mcp_name, arguments)
        except TimeoutError as exc:
            if deadline.expired():
                return failed("timeout", "timeout", f"{tool.name} did not finish within {limit:g}s")
            self._drop(live, exc)
            return failed("error", "tool_error", self._describe(exc))
        except ToolError as exc:  # no session could be opened
            return failed("error", "tool_error", str(exc))
        except MCPError as exc:
            if exc.code == CONNECTION_CLOSED:
                self._drop(live, exc)
                return failed("error", "tool_error", self._closed())
            code: ErrorCode = "invalid_parameters" if exc.code == INVALID_PARAMS else "tool_error"
            return failed(
                "error", code, f"the MCP server {self.label} answered error {exc.code}: {exc}"
            )
        except (RuntimeError, ValueError) as exc:
            if live is not None and live.lost.is_set():
                # The session was closed under the call (the SDK says so
                # with a RuntimeError).
                return failed("error", "tool_error", self._closed())
            # A result that does not fit its schema or the protocol: the
            # server's fault, the session is fine.
            return failed("error", "tool_error", self._describe(exc))
        except Exception as exc:
            # Anything else is the transport failing: start afresh next time.
            self._drop(live, exc)
            return failed("error", "tool_error", self._describe(exc))
        if result.is_error:
            blocks = [_block(item) for item in result.content]
            message = "\n".join(_describe_block(b) for b in blocks).strip()
            return failed(
                "error", "tool_error", message or "the MCP tool failed without saying why"
            )
        return ToolResult(
            session_id=session_id,
            call_id=call_id,
            tool_name=tool.name,
            status="success",
            content=_content(result),
        )

    def _closed(self) -> str:
        """Why a call found the session closed."""
        if self._closing:
            return f"the MCP server {self.label} is closed"
        return (
            f"the connection to the MCP server {self.label} is closed "
            "(did the server exit?); the next call connects again"
        )

    def _describe(self, exc: BaseException) -> str:
        return f"the MCP server {self.label} failed: {type(exc).__name__}: {exc}"

    def _drop(self, live: _Live | None, exc: BaseException) -> None:
        """Forget the session ``live`` (if still current): the next call opens another."""
        if live is None or self._live is not live:
            return
        logger.warning(
            "MCP server %s: connection lost (%s: %s); the next call connects again",
            self.label,
            type(exc).__name__,
            exc,
        )
        self._live = None
        live.lost.set()

    async def _connection(self) -> _Live:
        """The open session, or one opened for this call.

        Raises:
            ToolError: none could be opened, or the server is closed.
        """
        live = self._live
        if live is not None:
            return live
        if self._owner is None or self._owner.done() or self._closing:
            raise ToolError(f"the MCP server {self.label} is closed")
        if self._pending is None:
            self._pending = asyncio.get_running_loop().create_future()
            self._requests.put_nowait(self._pending)
        # Shielded: a caller that gives up does not fail the others waiting.
        return await asyncio.shield(self._pending)

    async def _own(self) -> None:
        """Open a session when a call asks for one, keep it until it is lost
        or the server is closed; until closed."""
        try:
            while (waiter := await self._requests.get()) is not None:
                # A task of its own for each session: closing one whose
                # transport failed can leave anyio's cancel scopes of that
                # task cancelled, which would cancel the next session at once.
                async with asyncio.TaskGroup() as sessions:
                    sessions.create_task(self._session(waiter))
        finally:
            closed = ToolError(f"the MCP server {self.label} is closed")
            left = [self._pending]
            while not self._requests.empty():
                left.append(self._requests.get_nowait())
            for waiter in left:
                if waiter is not None and not waiter.done():
                    waiter.set_exception(closed)
            self._pending = None
            self._live = None

    async def _session(self, waiter: asyncio.Future[_Live]) -> None:
        """Open a session, hand it to ``waiter``, and hold it until lost or closed."""
        from mcp import Client
        from mcp.client.stdio import stdio_client
        from mcp.types import Implementation

        if self._closing:
            self._pending = None
            waiter.set_exception(ToolError(f"the MCP server {self.label} is closed"))
            return
        live: _Live | None = None
        try:
            async with contextlib.AsyncExitStack() as stack:
                try:
                    async with asyncio.timeout(self.connect_timeout):
                        client = await stack.enter_async_context(
                            Client(
                                self.url
                                if self.url is not None
                                # Given here, not defaulted: the SDK binds
                                # sys.stderr when it is imported.
                                else stdio_client(self._parameters(), errlog=sys.stderr),
                                client_info=Implementation(name="fleetbus", version=__version__),
                            )
                        )
                except Exception as exc:
                    self._pending = None
                    waiter.set_exception(self._connect_error(exc))
                    return
                self.connections += 1
                live = _Live(client)
                self._live = live
                self._pending = None
                waiter.set_result(live)
                if self.connections > 1:
                    logger.info("MCP server %s: connected again", self.label)
                try:
                    if not self._closing:
                        # Ends early (cancelled by anyio) if the transport fails.
                        await live.lost.wait()
                finally:
                    if self._live is live:
                        self._live = None
        except Exception as exc:
            if self._closing or live is None or live.lost.is_set():
                # Closing a session whose server is gone can fail in many
                # ways; none of them matters any more.
                logger.debug("MCP server %s: closing the session: %r", self.label, exc)
            else:
                reasons = "; ".join(f"{type(e).__name__}: {e}" for e in _leaves(exc))
                logger.warning(
                    "MCP server %s: connection lost (%s); the next call connects again",
                    self.label,
                    reasons,
                )

    def _parameters(self) -> StdioServerParameters:
        from mcp.client.stdio import StdioServerParameters

        return StdioServerParameters(
            command=self.argv[0], args=self.argv[1:], env=self.env, cwd=self.cwd
        )

    def _connect_error(self, exc: Exception) -> ToolError:
        from mcp import MCPError
        from mcp.types import CONNECTION_CLOSED

        reasons: list[str] = []
        for leaf in _leaves(exc):
            if isinstance(leaf, TimeoutError):
                reason = f"no MCP handshake within {self.connect_timeout:g}s"
            elif isinstance(leaf, FileNotFoundError) and self.argv:
                reason = f"no such command: {self.argv[0]}"
            elif isinstance(leaf, MCPError) and leaf.code == CONNECTION_CLOSED:
                reason = "it closed the connection (did it exit? its stderr may say why)"
            else:
                reason = f"{type(leaf).__name__}: {leaf}" if str(leaf) else type(leaf).__name__
            if reason not in reasons:
                reasons.append(reason)
        error = ToolError(f"cannot connect to the MCP server {self.label}: {'; '.join(reasons)}")
        error.__cause__ = exc
        return error

    async def _list(self, live: _Live) -> list[ListedTool]:
        """Every tool the server lists, page by page.

        Raises:
            ToolError: the listing failed or took longer than ``connect_timeout``.
        """
        listed: list[ListedTool] = []
        cursor: str | None = None
        try:
            async with asyncio.timeout(self.connect_timeout):
                for _ in range(_MAX_PAGES):
                    page = await live.client.list_tools(cursor=cursor)
                    listed.extend(page.tools)
                    cursor = page.next_cursor
                    if cursor is None:
                        break
        except Exception as exc:
            raise ToolError(
                f"the MCP server {self.label} did not list its tools: {type(exc).__name__}: {exc}"
            ) from exc
        return listed

    def _make_tools(self, listed: list[ListedTool]) -> list[MCPTool]:
        tools: dict[str, MCPTool] = {}
        for item in listed:
            name = self.name_prefix + _NOT_A_TOKEN.sub("_", item.name)
            try:
                check_name(name, what=f"name for the MCP tool {item.name!r}")
            except InvalidSubjectError as exc:
                raise ToolDefinitionError(f"the MCP server {self.label}: {exc}") from exc
            if name in tools:
                raise ToolDefinitionError(
                    f"the MCP server {self.label}: tools {tools[name].mcp_name!r} and "
                    f"{item.name!r} would both be named {name!r}"
                )
            tools[name] = MCPTool(self, item, name=name, timeout=self.timeout, group=self.group)
        return list(tools.values())


def _content(result: CallToolResult) -> Any:
    """What a successful MCP tool result gives: its structured content, its
    text, or its content blocks as JSON."""
    if result.structured_content is not None:
        return result.structured_content
    blocks = [_block(item) for item in result.content]
    if all(isinstance(b, TextBlock) for b in blocks):
        return "\n".join(b.text for b in blocks if isinstance(b, TextBlock))
    content: list[dict[str, Any]] = msgspec.to_builtins(blocks)
    return content


def _block(item: ContentBlock) -> TextBlock | DataBlock:
    """An MCP content item as a fleetbus content block."""
    from mcp.types import (
        AudioContent,
        BlobResourceContents,
        EmbeddedResource,
        ImageContent,
        TextContent,
    )

    if isinstance(item, TextContent):
        return TextBlock(text=item.text)
    if isinstance(item, ImageContent | AudioContent):
        return DataBlock(
            url=f"data:{item.mime_type};base64,{item.data}",
            media_type=item.mime_type,
            size=_decoded_size(item.data),
        )
    if isinstance(item, EmbeddedResource):
        resource = item.resource
        if isinstance(resource, BlobResourceContents):
            media_type = resource.mime_type or "application/octet-stream"
            return DataBlock(
                url=f"data:{media_type};base64,{resource.blob}",
                media_type=media_type,
                name=resource.uri,
                size=_decoded_size(resource.blob),
            )
        return TextBlock(text=resource.text)
    # A resource link: where to read it.
    return DataBlock(
        url=item.uri,
        media_type=item.mime_type or "application/octet-stream",
        name=item.name,
        size=item.size,
    )


def _leaves(exc: BaseException) -> list[BaseException]:
    """The exceptions in ``exc``, out of any (nested) exception groups."""
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for inner in exc.exceptions for leaf in _leaves(inner)]
    return [exc]


def _describe_block(block: TextBlock | DataBlock) -> str:
    if isinstance(block, TextBlock):
        return block.text
    return f"[{block.media_type}{f' {block.name}' if block.name else ''}]"


def _decoded_size(data: str) -> int:
    """The size in bytes of base64 ``data``, without decoding it."""
    stripped = data.rstrip()
    return len(stripped) * 3 // 4 - (len(stripped) - len(stripped.rstrip("=")))
