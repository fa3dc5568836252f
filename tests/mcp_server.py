"""A small MCP server for the tests, written with the MCP SDK's ``MCPServer``.

Run it over stdio (``python tests/mcp_server.py``) or over streamable HTTP
(``python tests/mcp_server.py --http PORT``, endpoint ``/mcp``). Its tools:
one answering text, one answering several text blocks, one with structured
output, one answering an image and an embedded resource, one that raises, a
slow one, one that tells which process served the call (also listed as
``util.pid``), and one that reads its environment. ``--name-prefix P`` puts
``P`` before every tool's name.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import os
from collections.abc import Callable
from typing import Any, TypedDict

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.types import EmbeddedResource, ImageContent, TextContent, TextResourceContents

# A 1x1 PNG: the bytes do not matter to the tests, only that they arrive intact.
PNG = base64.b64decode(
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg=="
)


class Stats(TypedDict):
    """Summary statistics of a list of numbers."""

    count: int
    total: float
    mean: float


def echo(text: str) -> str:
    """Answer the text it is given."""
    return text


def count(n: int) -> list[str]:
    """Answer the numbers 1 to n, one text block each."""
    return [str(i) for i in range(1, n + 1)]


def stats(values: list[float]) -> Stats:
    """The count, total and mean of some numbers."""
    total = sum(values)
    return Stats(count=len(values), total=total, mean=total / len(values) if values else 0.0)


def picture() -> list[TextContent | ImageContent | EmbeddedResource]:
    """A caption, a PNG image and an embedded text resource."""
    return [
        TextContent(type="text", text="a red dot"),
        ImageContent(type="image", data=base64.b64encode(PNG).decode(), mime_type="image/png"),
        EmbeddedResource(
            type="resource",
            resource=TextResourceContents(uri="memo://dot", mime_type="text/plain", text="dot"),
        ),
    ]


def fail(message: str) -> str:
    """Fail with the message, as a tool reports an error."""
    raise ToolError(message)


async def sleep(seconds: float) -> str:
    """Sleep, then say how long."""
    await asyncio.sleep(seconds)
    return f"slept {seconds:g}s"


def whoami() -> str:
    """The process id of this server."""
    return str(os.getpid())


def getenv(name: str) -> str:
    """The value of an environment variable of this server ("" when unset)."""
    return os.environ.get(name, "")


def build(name_prefix: str = "") -> MCPServer:
    """The server, its tools' names after ``name_prefix``."""
    server = MCPServer("fleetbus-test", log_level="WARNING")
    unstructured: list[Callable[..., Any]] = [echo, count, fail, sleep, whoami, getenv]
    for fn in unstructured:
        server.add_tool(fn, name=name_prefix + fn.__name__, structured_output=False)
    server.add_tool(stats, name=f"{name_prefix}stats")
    server.add_tool(picture, name=f"{name_prefix}picture")
    # A name with a dot, which a fleetbus tool name cannot have.
    server.add_tool(whoami, name=f"{name_prefix}util.pid", structured_output=False)
    return server


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--http", type=int, metavar="PORT", help="serve streamable HTTP on PORT")
    parser.add_argument("--name-prefix", default="", help="put before every tool's name")
    args = parser.parse_args()
    server = build(args.name_prefix)
    if args.http is None:
        server.run()
    else:
        server.run("streamable-http", host="127.0.0.1", port=args.http)


if __name__ == "__main__":
    main()
