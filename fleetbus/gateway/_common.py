"""What the gateway's faces share: the caller of a request, answers as
Server-Sent Events, the text of an answer, a paused reply told in words."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Sequence
from typing import Annotated, Any, Final, TypeVar

import anyio
import orjson
from fastapi import Depends, Request
from fastapi.responses import StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from fleetbus.agents.events import MODEL_CALL_END
from fleetbus.agents.state import PendingCall
from fleetbus.errors import (
    CallTimeoutError,
    ConfigError,
    NoRespondersError,
    RemoteError,
)
from fleetbus.gateway.auth import Caller, Forbidden, Tokens, Unauthorized
from fleetbus.gateway.fleet import GatewayFleet, NotFound, TooManyStreams
from fleetbus.protocol import (
    ContentBlock,
    Event,
    FinalAnswer,
    TextBlock,
    Usage,
)

__all__ = [
    "SESSION_HEADER",
    "Who",
    "answer_text",
    "authenticated",
    "call_list",
    "caller",
    "error_body",
    "fleet",
    "paused_note",
    "sse",
    "sse_response",
    "started",
    "usage",
    "yes_or_no",
]

SESSION_HEADER: Final = "x-fleetbus-session"
"""The header naming a conversation (requests) or the session (answers)."""

T = TypeVar("T")

_YES: Final = re.compile(r"^\s*(yes|y|allow|approve|ok|go ahead)\s*[.!]*\s*$", re.I)
_NO: Final = re.compile(r"^\s*(no|n|deny|reject|stop)\s*[.!]*\s*$", re.I)


def fleet(request: Request) -> GatewayFleet:
    """The fleet the application serves."""
    found: GatewayFleet = request.app.state.fleet
    return found


_BEARER: Final = HTTPBearer(auto_error=False, description="a token of the gateway's tokens file")


def authenticated(request: Request) -> Caller:
    """Who sends ``request`` (``Authorization: Bearer`` or ``x-api-key``).

    Raises:
        Unauthorized: no token, or an unknown one.
    """
    tokens: Tokens = request.app.state.tokens
    return tokens.caller(request.headers.get("authorization"), request.headers.get("x-api-key"))


async def caller(
    request: Request,
    _shown: Annotated[HTTPAuthorizationCredentials | None, Depends(_BEARER)] = None,
) -> Caller:
    """:func:`authenticated`, as the routes' dependency (a coroutine, though
    it waits for nothing: FastAPI runs a plain function in its thread pool,
    a hop per request).

    Raises:
        Unauthorized: no token, or an unknown one.
    """
    return authenticated(request)


Who = Annotated[Caller, Depends(caller)]
"""A route's parameter for the caller (authenticated first)."""


def answer_text(final: FinalAnswer) -> str:
    """The text of an answer: its structured object as JSON when it has one,
    else its text blocks joined."""
    if final.structured is not None:
        return orjson.dumps(final.structured).decode()
    return content_text(final.content)


def content_text(content: str | Sequence[ContentBlock]) -> str:
    """The text of content blocks, joined by blank lines."""
    if isinstance(content, str):
        return content
    return "\n\n".join(b.text for b in content if isinstance(b, TextBlock))


def usage(events: Sequence[Event]) -> Usage:
    """The tokens the reply's model calls used, summed from their events."""
    used_in = used_out = 0
    for event in events:
        if event.event == MODEL_CALL_END:
            used_in += int(event.data.get("input_tokens") or 0)
            used_out += int(event.data.get("output_tokens") or 0)
    return Usage(input_tokens=used_in, output_tokens=used_out)


def paused_note(base_url: str, agent: str, session: str, pending: Sequence[PendingCall]) -> str:
    """What a paused reply waits for, in words, with where to answer."""
    confirm = [p for p in pending if p.kind == "confirm"]
    external = [p for p in pending if p.kind == "external"]
    lines = []
    where = f"{base_url.rstrip('/')}/v1/fleet/agents/{agent}/sessions/{session}"
    if confirm:
        calls = call_list(confirm)
        lines.append(
            f"The agent waits for your confirmation to run {calls}. Answer 'yes' or 'no' in "
            f'this conversation, or POST {where}/confirm {{"allow": ["{confirm[0].call_id}"]}} '
            f"(or run: fleetbus confirm {session} --agent {agent} --allow {confirm[0].call_id})."
        )
    if external:
        calls = call_list(external)
        lines.append(
            f"The agent waits for the result of {calls}, run outside the fleet: POST "
            f'{where}/results {{"results": {{"{external[0].call_id}": …}}}}.'
        )
    return "\n\n".join(lines) or "The agent's reply is paused."


def call_list(calls: Sequence[PendingCall]) -> str:
    """Calls as a person reads them: ``name(arg=value, …) [call id], …``."""
    return ", ".join(f"{p.tool_name}({_args(p.parameters)}) [{p.call_id}]" for p in calls)


def _args(parameters: dict[str, Any]) -> str:
    text = ", ".join(f"{k}={orjson.dumps(v).decode()}" for k, v in parameters.items())
    return text if len(text) <= 200 else text[:199] + "…"


def yes_or_no(text: str) -> bool | None:
    """``True`` for a yes (``yes``, ``allow``, ``ok``…), ``False`` for a no,
    ``None`` for anything else."""
    if _YES.match(text):
        return True
    if _NO.match(text):
        return False
    return None


def sse(data: Any, event: str | None = None) -> bytes:
    """One Server-Sent Event: ``data`` as JSON (a str as it is)."""
    body = data if isinstance(data, str) else orjson.dumps(data).decode()
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {body}\n\n".encode()


async def _with_keepalive(body: AsyncIterator[bytes], every: float) -> AsyncIterator[bytes]:
    """``body``, with an SSE comment after each ``every`` seconds of silence
    (proxies close streams they think idle)."""
    iterator = aiter(body)
    pending: asyncio.Future[bytes] | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(anext(iterator))
            done, _ = await asyncio.wait([pending], timeout=every)
            if not done:
                yield b": keepalive\n\n"
                continue
            step, pending = pending, None
            try:
                chunk = step.result()
            except StopAsyncIteration:
                return
            yield chunk
    finally:
        # The server cancels a response whose client went away, and under
        # its (anyio) cancellation every await fails at once: shielded, the
        # body's own clean-up (a reply's cancel) runs to its end.
        with anyio.CancelScope(shield=True):
            if pending is not None:
                pending.cancel()
                await asyncio.wait([pending])
                if not pending.cancelled():
                    pending.exception()  # retrieved: the stream ended or failed already
            await _close(iterator)


def sse_response(
    body: AsyncIterator[bytes], *, keepalive: float, headers: dict[str, str] | None = None
) -> StreamingResponse:
    """A ``text/event-stream`` response of ``body``, kept alive."""
    return StreamingResponse(
        _with_keepalive(body, keepalive),
        media_type="text/event-stream",
        headers={"cache-control": "no-cache", "x-accel-buffering": "no", **(headers or {})},
    )


async def started(items: AsyncIterator[T]) -> AsyncIterator[T]:
    """``items``, its first one awaited now: a reply that cannot start (no
    such agent, too many streams) raises here, to be an HTTP error rather
    than a stream that breaks at once.

    Raises:
        What the first step of ``items`` raises (``items`` is closed).
    """
    try:
        first = await anext(items)
    except BaseException:
        await _close(items)
        raise

    async def replay() -> AsyncIterator[T]:
        try:
            yield first
            async for item in items:
                yield item
        finally:
            await _close(items)

    return replay()


async def _close(items: AsyncIterator[Any]) -> None:
    closing = getattr(items, "aclose", None)
    if closing is not None:
        await closing()


_STATUS: Final[tuple[tuple[type[BaseException], int, str], ...]] = (
    (Unauthorized, 401, "authentication_error"),
    (Forbidden, 403, "permission_error"),
    (NotFound, 404, "not_found_error"),
    (TooManyStreams, 429, "rate_limit_error"),
    (NoRespondersError, 404, "model_not_found"),
    (CallTimeoutError, 504, "timeout"),
    (RemoteError, 502, "agent_error"),
    (ConfigError, 400, "invalid_request_error"),
)


def error_body(exc: BaseException) -> tuple[int, dict[str, Any]]:
    """The HTTP status and the body (OpenAI's error shape, which every face
    uses) of an error."""
    for kind, status, name in _STATUS:
        if isinstance(exc, kind):
            code = getattr(exc, "code", None) if isinstance(exc, RemoteError) else None
            return status, {
                "error": {"message": str(exc), "type": name, "code": code or name, "param": None}
            }
    return 500, {
        "error": {
            "message": f"the gateway failed: {type(exc).__name__}",
            "type": "server_error",
            "code": "server_error",
            "param": None,
        }
    }
