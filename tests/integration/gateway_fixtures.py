"""A gateway served for tests: the real application on uvicorn, on a free
port of this machine, over a connection of its own to the test server."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import uvicorn

from fleetbus.bus import Bus, ConnectOptions
from fleetbus.cli._web import server_class
from fleetbus.gateway import GatewaySettings, Tokens, create_app
from fleetbus.gateway.auth import TokenEntry

ALICE = "sk-alice-0123456789abcdef"
BOB = "sk-bob-0123456789abcdef"
ADMIN = "sk-admin-0123456789abcdef"
TOKENS = Tokens(
    [
        TokenEntry(user="alice", token=ALICE),
        TokenEntry(user="bob", token=BOB),
        TokenEntry(user="ops", token=ADMIN, role="admin"),
    ]
)


@dataclass(frozen=True)
class Gateway:
    url: str
    """The base URL (``http://127.0.0.1:PORT``)."""
    bus: Bus


@contextlib.asynccontextmanager
async def gateway(
    nats_url: str,
    prefix: str,
    *,
    tokens: Tokens = TOKENS,
    a2a: bool = False,
    options: ConnectOptions | None = None,
    cors_origins: tuple[str, ...] = (),
    **settings: Any,
) -> AsyncIterator[Gateway]:
    """A gateway until the block ends (settings: :class:`GatewaySettings`
    fields), connected with ``options`` when given (a user of its own)."""
    if options is not None:
        bus = await Bus.connect(options=options, timeout=5.0)
    else:
        bus = await Bus.connect(nats_url, prefix=prefix, name="gateway")
    sock = socket.create_server(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    app = create_app(bus, tokens, GatewaySettings(**settings), a2a=a2a, cors_origins=cors_origins)
    config = uvicorn.Config(
        app, log_config=None, access_log=False, lifespan="on", timeout_graceful_shutdown=2
    )
    server = server_class(uvicorn)(config)
    serving = asyncio.ensure_future(server.serve(sockets=[sock]))
    try:
        while not server.started:
            if serving.done():
                serving.result()
            await asyncio.sleep(0.01)
        yield Gateway(url=f"http://127.0.0.1:{port}", bus=bus)
    finally:
        server.should_exit = True
        with contextlib.suppress(Exception):
            await asyncio.wait_for(serving, 10)
        sock.close()
        await bus.close()
