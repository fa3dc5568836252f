"""The dashboard's web application: one page, JSON, and Server-Sent Events.

Routes:

``GET /``
    the page (HTML, plain JavaScript and CSS from ``static/``).
``GET /api/fleet``
    the view's snapshot: bus status, agents, sessions, tool workers.
``GET /api/fleet/stream``
    the snapshot again (event ``fleet``) each time it changes, at most four
    times a second.
``GET /api/sessions/{agent}/{session}/events``
    the events kept of one session.
``GET /api/sessions/{agent}/{session}/stream``
    those events, then each new one (event ``message``) as it is published.
``POST /api/sessions/{agent}/{session}/confirm``
    ``{"allow": [call ids], "deny": [call ids], "always": false,
    "edits": {call id: {input}}, "accept_rules": [rules]}`` (all but one of
    ``allow``, ``deny`` and ``edits`` optional): the decision sent as
    ``fleetbus confirm`` sends it; an edited call is allowed with the input
    given instead of the model's.
``POST /api/sessions/{agent}/{session}/resume``
    ``{"results": {call id: output}, "errors": {call id: message}}``: the
    results of calls run outside the agent, sent as ``fleetbus resume``
    sends them.

The page can send confirmations, so the application defends itself against
other web pages a browser has open: it answers only the host names it was
given (no DNS rebinding), and a POST needs the token embedded in the page
(which another origin cannot read) and, when the browser sends one, an
``Origin`` of its own. Every response forbids inline scripts and framing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import orjson
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from fleetbus.bus import Bus
from fleetbus.bus.subjects import ANY_OWNER
from fleetbus.dashboard._confirm import ConfirmOutcome
from fleetbus.dashboard.view import FleetView
from fleetbus.errors import ConfigError

__all__ = ["DEFAULT_HOSTS", "STATIC_DIR", "TOKEN_HEADER", "create_app"]

logger = logging.getLogger(__name__)

STATIC_DIR: Final = Path(__file__).resolve().parent / "static"
"""The page, its script and its style sheet, shipped in the package."""
TOKEN_HEADER: Final = "x-fleetbus-token"
"""The header a POST carries the page's token in."""
DEFAULT_HOSTS: Final = ("127.0.0.1", "localhost")
"""Host names answered when none are given."""
_MAX_BODY: Final = 64 * 1024
_MAX_CALLS: Final = 100
_MAX_RULES: Final = 20
_MIN_INTERVAL: Final = 0.25
_KEEPALIVE: Final = 15.0
_SECURITY_HEADERS: Final = [
    (
        b"content-security-policy",
        b"default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
        b"img-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    ),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
    (b"x-frame-options", b"DENY"),
]


class _SecurityHeaders:
    """Adds :data:`_SECURITY_HEADERS` to every HTTP response (a plain ASGI
    middleware: it leaves streamed responses alone)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), *_SECURITY_HEADERS]
            await send(message)

        await self.app(scope, receive, with_headers)


def _json(data: Any, status: int = 200) -> Response:
    return Response(
        orjson.dumps(data, default=str),
        status_code=status,
        media_type="application/json",
        headers={"cache-control": "no-store"},
    )


def _sse(event: str, data: Any) -> bytes:
    # orjson writes no newline, so the data is one "data:" line.
    return b"event: " + event.encode() + b"\ndata: " + orjson.dumps(data, default=str) + b"\n\n"


def _stream(body: AsyncIterator[bytes]) -> StreamingResponse:
    return StreamingResponse(
        body,
        media_type="text/event-stream",
        headers={"cache-control": "no-store", "x-accel-buffering": "no"},
    )


def create_app(
    bus: Bus,
    *,
    view: FleetView | None = None,
    allowed_hosts: Sequence[str] = DEFAULT_HOSTS,
    token: str | None = None,
) -> Starlette:
    """The dashboard of the fleet on ``bus``.

    The application runs its :class:`FleetView` while it is served (in its
    lifespan), and stops it at shutdown.

    Args:
        bus: the connection; its prefix is the fleet shown.
        view: the view to show (one with the default limits and intervals
            when omitted).
        allowed_hosts: the host names (``Host`` header, without port) the
            application answers; ``"*"`` answers any.
        token: the secret a POST must carry (a random one when omitted);
            the page embeds it.

    Returns:
        A Starlette application (``app.state.view``, ``app.state.token``).
    """
    fleet = view or FleetView(bus)
    secret = token or secrets.token_urlsafe(24)
    page = (STATIC_DIR / "index.html").read_text(encoding="utf-8").replace("{{token}}", secret)

    @contextlib.asynccontextmanager
    async def lifespan(_app: Starlette) -> AsyncIterator[None]:
        stop = asyncio.Event()
        async with asyncio.TaskGroup() as tg:
            tg.create_task(fleet.run(stop))
            await fleet.ready.wait()
            try:
                yield
            finally:
                stop.set()
                fleet.close()

    async def index(_request: Request) -> Response:
        return HTMLResponse(page, headers={"cache-control": "no-store"})

    async def snapshot(_request: Request) -> Response:
        return _json(fleet.snapshot())

    async def fleet_stream(_request: Request) -> Response:
        async def body() -> AsyncIterator[bytes]:
            yield b"retry: 2000\n\n"
            version = -1
            while not fleet.stopping.is_set():
                if fleet.version != version:
                    version = fleet.version
                    yield _sse("fleet", fleet.snapshot())
                    await asyncio.sleep(_MIN_INTERVAL)  # changes in a burst: one snapshot
                    continue
                if not await fleet.changed(version, _KEEPALIVE):
                    yield b": keep-alive\n\n"

        return _stream(body())

    def _names(request: Request) -> tuple[str, str]:
        return str(request.path_params["agent"]), str(request.path_params["session"])

    async def session_events(request: Request) -> Response:
        agent, session = _names(request)
        return _json(fleet.events(agent, session))

    async def session_stream(request: Request) -> Response:
        agent, session = _names(request)
        try:
            fleet.bus.subjects.events(agent, session, ANY_OWNER)
        except ConfigError as exc:
            return _json({"error": str(exc)}, 400)

        async def body() -> AsyncIterator[bytes]:
            yield b"retry: 2000\n\n"
            async with contextlib.aclosing(fleet.follow(agent, session)) as items:
                async for item in items:
                    yield b": keep-alive\n\n" if item is None else _sse("message", item)

        return _stream(body())

    async def _resuming(
        request: Request, send: Callable[[str, str, bytes], Awaitable[ConfirmOutcome]]
    ) -> Response:
        """A paused session's resume input, from the request's body: refused
        without the page's secret, 413 past the size, 400 when it cannot be
        read, else the outcome of ``send(agent, session, body)``."""
        refused = _refuse(request, secret)
        if refused is not None:
            return refused
        agent, session = _names(request)
        body = await request.body()
        if len(body) > _MAX_BODY:
            return _json({"error": "the request is too large"}, 413)
        try:
            outcome = await send(agent, session, body)
        except ConfigError as exc:
            return _json({"error": str(exc)}, 400)
        return _outcome(outcome)

    async def send_confirm(agent: str, session: str, body: bytes) -> ConfirmOutcome:
        decision = _decisions(body)
        return await fleet.confirm(
            agent,
            session,
            allow=decision.allow,
            deny=decision.deny,
            always=decision.always,
            edits=decision.edits,
            accept_rules=decision.accept_rules,
        )

    async def send_resume(agent: str, session: str, body: bytes) -> ConfirmOutcome:
        results, errors = _external_results(body)
        return await fleet.resume(agent, session, results=results, errors=errors)

    async def confirm(request: Request) -> Response:
        return await _resuming(request, send_confirm)

    async def resume(request: Request) -> Response:
        return await _resuming(request, send_resume)

    def _outcome(outcome: ConfirmOutcome) -> Response:
        status = {"refused": 409, "unserved": 503, "failed": 502}.get(outcome.state, 200)
        return _json(
            {
                "accepted": outcome.accepted,
                "state": outcome.state,
                "message": outcome.message,
                "finished_reason": outcome.finished_reason,
            },
            status,
        )

    app = Starlette(
        routes=[
            Route("/", index),
            Route("/api/fleet", snapshot),
            Route("/api/fleet/stream", fleet_stream),
            Route("/api/sessions/{agent}/{session}/events", session_events),
            Route("/api/sessions/{agent}/{session}/stream", session_stream),
            Route("/api/sessions/{agent}/{session}/confirm", confirm, methods=["POST"]),
            Route("/api/sessions/{agent}/{session}/resume", resume, methods=["POST"]),
            Mount("/static", StaticFiles(directory=STATIC_DIR), name="static"),
        ],
        middleware=[
            Middleware(_SecurityHeaders),
            Middleware(TrustedHostMiddleware, allowed_hosts=list(allowed_hosts)),
        ],
        lifespan=lifespan,
    )
    app.state.view = fleet
    app.state.token = secret
    return app


def _refuse(request: Request, secret: str) -> Response | None:
    """Why a POST is refused (``None``: it is not): a missing or wrong token,
    another page's ``Origin``, or a body that is not JSON."""
    given = request.headers.get(TOKEN_HEADER, "")
    if not secrets.compare_digest(given.encode(), secret.encode()):
        return _json({"error": "missing or wrong dashboard token"}, 403)
    origin = request.headers.get("origin")
    if origin is not None and origin.split("://", 1)[-1] != request.headers.get("host"):
        return _json({"error": f"requests from {origin} are not accepted"}, 403)
    if request.headers.get("content-type", "").split(";")[0].strip() != "application/json":
        return _json({"error": "send the decision as application/json"}, 415)
    return None


@dataclass(frozen=True, slots=True)
class _Decision:
    """What a confirmation POST asks for."""

    allow: list[str]
    deny: list[str]
    always: bool
    edits: list[tuple[str, dict[str, Any]]]
    accept_rules: list[str]


def _body_object(body: bytes, shape: str) -> dict[str, Any]:
    """The JSON object a POST body holds.

    Raises:
        ConfigError: not JSON, or not an object (``shape`` says what to send).
    """
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise ConfigError(f"the body is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"send {shape}")
    return data


def _call_map(data: dict[str, Any], key: str) -> dict[str, Any]:
    """``data[key]``, an object keyed by call id (empty when missing).

    Raises:
        ConfigError: not such an object, or too many calls.
    """
    calls = data.get(key, {})
    if not isinstance(calls, dict) or not all(isinstance(c, str) and c for c in calls):
        raise ConfigError(f"{key} must be an object keyed by call id")
    if len(calls) > _MAX_CALLS:
        raise ConfigError(f"at most {_MAX_CALLS} calls in {key}")
    return calls


def _decisions(body: bytes) -> _Decision:
    """``allow``, ``deny``, ``always``, ``edits`` and ``accept_rules`` from a POST body.

    Raises:
        ConfigError: not such a JSON object.
    """
    data = _body_object(
        body,
        '{"allow": [call ids], "deny": [call ids], "always": false, '
        '"edits": {call id: {input}}, "accept_rules": [rules]}',
    )
    lists = []
    for key in ("allow", "deny"):
        calls = data.get(key, [])
        if not isinstance(calls, list) or not all(isinstance(c, str) and c for c in calls):
            raise ConfigError(f"{key} must be a list of call ids")
        if len(calls) > _MAX_CALLS:
            raise ConfigError(f"at most {_MAX_CALLS} call ids in {key}")
        lists.append(calls)
    always = data.get("always", False)
    if not isinstance(always, bool):
        raise ConfigError("always must be true or false")
    edits = _call_map(data, "edits")
    for call_id, parameters in edits.items():
        if not isinstance(parameters, dict):
            raise ConfigError(f"the edited input of {call_id} must be a JSON object")
    rules = data.get("accept_rules", [])
    if not isinstance(rules, list) or not all(isinstance(r, str) and r for r in rules):
        raise ConfigError("accept_rules must be a list of rules")
    if len(rules) > _MAX_RULES:
        raise ConfigError(f"at most {_MAX_RULES} rules in accept_rules")
    return _Decision(lists[0], lists[1], always, list(edits.items()), rules)


def _external_results(body: bytes) -> tuple[list[tuple[str, Any]], list[tuple[str, str]]]:
    """``results`` and ``errors`` from a POST body.

    Raises:
        ConfigError: not such a JSON object.
    """
    data = _body_object(body, '{"results": {call id: output}, "errors": {call id: message}}')
    results = _call_map(data, "results")
    errors = _call_map(data, "errors")
    if not all(isinstance(m, str) for m in errors.values()):
        raise ConfigError("errors must map each call id to its message")
    return list(results.items()), list(errors.items())
