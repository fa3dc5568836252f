"""The gateway's web application: the OpenAI-compatible face, the
fleet-native face, and A2A, over one bus connection.

Every route needs a token but ``/healthz`` and the API's description
(``/openapi.json``, ``/docs``). Request bodies are limited in
size (``max_request_bytes``: a larger one is refused with 413 before it is
read whole); errors of every face have OpenAI's shape (``{"error":
{"message", "type", "code"}}``); ``/openapi.json`` describes the REST routes.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from fleetbus._version import __version__
from fleetbus.bus import Bus
from fleetbus.errors import FleetbusError
from fleetbus.gateway import native, openai_api
from fleetbus.gateway._common import SESSION_HEADER, error_body
from fleetbus.gateway.auth import Tokens
from fleetbus.gateway.fleet import GatewayFleet
from fleetbus.gateway.settings import GatewaySettings

__all__ = ["create_app"]

logger = logging.getLogger(__name__)


class _BodyLimit:
    """Refuses (413) a request whose body is larger than ``limit`` bytes: by
    its ``Content-Length`` before reading (the server holds a body to its
    length), else — a chunked body — as it arrives, reading it whole (it is
    at most ``limit`` bytes) before the application sees it."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None:
            if length.isdigit() and int(length) > self.limit:
                await self._refuse(scope, receive, send)
                return
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        seen = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return
            chunk = message.get("body", b"")
            seen += len(chunk)
            if seen > self.limit:
                await self._refuse(scope, receive, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        whole: Message | None = {"type": "http.request", "body": b"".join(chunks)}

        async def replayed() -> Message:
            nonlocal whole
            if whole is not None:
                message, whole = whole, None
                return message
            return await receive()  # what comes next: the client going away

        await self.app(scope, replayed, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = {
            "error": {
                "message": f"the request body is larger than {self.limit} bytes",
                "type": "invalid_request_error",
                "code": "request_too_large",
                "param": None,
            }
        }
        await JSONResponse(body, status_code=413)(scope, receive, send)


def create_app(
    bus: Bus,
    tokens: Tokens,
    settings: GatewaySettings | None = None,
    *,
    public_url: str | None = None,
    a2a: bool = True,
    cors_origins: Sequence[str] = (),
) -> FastAPI:
    """The gateway application.

    Args:
        bus: the connection (closed by whoever opened it).
        tokens: who may use it.
        settings: limits and timeouts; the environment's by default.
        public_url: the URL clients reach the gateway at, for the links it
            gives (where to confirm, agent cards); the request's own by
            default.
        a2a: serve A2A (needs ``a2a-sdk``, in the gateway extra).
        cors_origins: the web origins whose pages may call the gateway from
            a browser (a chat UI served elsewhere); ``"*"`` for any. None by
            default: browsers refuse other origins' pages.
    """
    settings = settings or GatewaySettings()
    fleet = GatewayFleet(bus, settings)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            await fleet.close()

    app = FastAPI(
        title="fleetbus gateway",
        version=__version__,
        description="Agents of a fleetbus fleet over HTTP: OpenAI-compatible, fleet-native, A2A.",
        lifespan=lifespan,
        redoc_url=None,
    )
    app.state.fleet = fleet
    app.state.tokens = tokens
    app.state.public_url = public_url
    app.add_middleware(_BodyLimit, limit=settings.max_request_bytes)
    if cors_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(cors_origins),
            allow_methods=["GET", "POST"],
            allow_headers=["authorization", "content-type", "x-api-key", SESSION_HEADER],
            expose_headers=[SESSION_HEADER],
        )

    @app.exception_handler(FleetbusError)
    async def fleetbus_error(_request: Request, exc: FleetbusError) -> Response:
        status, body = error_body(exc)
        if status >= 500:
            logger.warning("%s", body["error"]["message"])
        headers = {"www-authenticate": "Bearer"} if status == 401 else None
        return JSONResponse(body, status_code=status, headers=headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: Request, exc: StarletteHTTPException) -> Response:
        # An unknown path (404), a wrong method (405): OpenAI's shape too.
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        body = {"error": {"message": str(exc.detail), "type": kind, "code": kind, "param": None}}
        return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(_request: Request, exc: RequestValidationError) -> Response:
        first: dict[str, Any] = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        message = f"{where}: {first.get('msg', 'invalid')}" if where else str(first.get("msg"))
        body = {
            "error": {
                "message": message,
                "type": "invalid_request_error",
                "code": "invalid",
                "param": where or None,
            }
        }
        return JSONResponse(body, status_code=400)

    @app.get("/healthz", include_in_schema=False)
    async def healthz() -> dict[str, Any]:
        return {"ok": bus.is_connected, "fleet": bus.prefix}

    app.include_router(openai_api.router)
    app.include_router(native.router)
    if a2a:
        from fleetbus.gateway import a2a as a2a_face

        a2a_face.add_a2a_routes(app, fleet, public_url=public_url)
    return app
