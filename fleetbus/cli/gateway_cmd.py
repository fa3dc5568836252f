"""``fleetbus gateway``: the fleet's agents over HTTP — OpenAI-compatible,
fleet-native REST with Server-Sent Events, and A2A (docs/gateway.md).

FastAPI, uvicorn and a2a-sdk come with the ``fleetbus[gateway]`` extra and
are imported only when the command runs: without them it says, in one line,
what to install.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fleetbus.cli._common import (
    Subcommands,
    add_connection_options,
    connect,
    console,
    count,
    err_console,
    on_stop_signals,
    run,
    seconds,
)
from fleetbus.cli._web import ANY_HOST, listen, server_class
from fleetbus.errors import ConfigError

__all__ = ["DEFAULT_PORT", "add_parser", "cmd"]

DEFAULT_PORT = 8710
_EXTRA = "pip install 'fleetbus[gateway]'"


def add_parser(
    sub: Subcommands,
    bus_options: Callable[[argparse.ArgumentParser], None] = add_connection_options,
) -> None:
    """Add the ``gateway`` command to ``sub``."""
    p = sub.add_parser(
        "gateway", help="serve the fleet's agents over HTTP (OpenAI-compatible, REST, A2A)"
    )
    p.add_argument(
        "--port",
        type=count("a port is 0 to 65535", le=65535),
        default=DEFAULT_PORT,
        help=f"HTTP port (0: any free one; default {DEFAULT_PORT})",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument(
        "--tokens",
        type=Path,
        metavar="FILE",
        help="JSON file of the tokens (default: FLEETBUS_GATEWAY_TOKENS); see docs/gateway.md",
    )
    p.add_argument(
        "--public-url",
        metavar="URL",
        help="the URL clients reach the gateway at, for the links it gives (behind a proxy)",
    )
    p.add_argument(
        "--max-request-bytes",
        type=count("a size in bytes, 1024 or more", ge=1024),
        help="largest request body (default 1 MiB, or FLEETBUS_GATEWAY_MAX_REQUEST_BYTES)",
    )
    p.add_argument(
        "--max-streams-per-token",
        type=count("1 or more", ge=1),
        help="replies one token may have open at once (default 16)",
    )
    p.add_argument(
        "--reply-timeout",
        type=seconds("a positive number of seconds", gt=0),
        help="seconds a whole reply may take (default 300)",
    )
    p.add_argument(
        "--on-disconnect",
        choices=("cancel", "detach"),
        help="a client gone mid-reply: interrupt the reply (cancel, the default) or let it "
        "finish in its session (detach)",
    )
    p.add_argument(
        "--cors-origin",
        action="append",
        default=[],
        metavar="ORIGIN",
        help="let pages of this web origin call the gateway from a browser (a chat UI: "
        "https://chat.example.com; * for any); repeatable",
    )
    p.add_argument("--no-a2a", action="store_true", help="do not serve A2A")
    p.add_argument(
        "--new-token",
        metavar="USER",
        help="print a new token for USER and its entry for the tokens file, then exit",
    )
    p.add_argument(
        "--role",
        choices=("user", "admin"),
        default="user",
        help="with --new-token: the token's role (admin: every session)",
    )
    bus_options(p)


def _load() -> tuple[Any, Any]:
    """``(uvicorn, fleetbus.gateway)``, or one line saying what to install.

    Raises:
        ConfigError: fastapi, uvicorn or a2a-sdk is missing.
    """
    try:
        import uvicorn

        import fleetbus.gateway as gateway
    except ImportError as exc:
        missing = (exc.name or "fastapi").split(".")[0]
        raise ConfigError(
            f"fleetbus gateway needs {missing}, from the gateway extra: {_EXTRA}"
        ) from exc
    return uvicorn, gateway


def cmd(args: argparse.Namespace) -> int:
    """Serve the gateway until SIGTERM/SIGINT (or print a new token)."""
    uvicorn, gateway = _load()
    if args.new_token:
        token, entry = gateway.new_token(args.new_token, args.role)
        console.print(f"token: {token}", highlight=False, soft_wrap=True)
        console.print(f"entry: {entry}", highlight=False, soft_wrap=True)
        return 0
    tokens = gateway.Tokens.load(args.tokens)
    if not len(tokens):
        gateway.Tokens([])  # raises the one line saying how to give tokens
    settings = gateway.gateway_settings(
        max_request_bytes=args.max_request_bytes,
        max_streams_per_token=args.max_streams_per_token,
        reply_timeout=args.reply_timeout,
        on_disconnect=args.on_disconnect,
    )
    if not args.no_a2a:
        try:
            import a2a  # noqa: F401
        except ImportError as exc:
            raise ConfigError(
                f"fleetbus gateway serves A2A with a2a-sdk, from the gateway extra: {_EXTRA} "
                "(or give --no-a2a)"
            ) from exc
    Server = server_class(uvicorn)

    async def serve() -> int:
        sock = listen(args.host, args.port, "the gateway")
        bus = await connect(args.nats, args.prefix, "gateway")
        try:
            app = gateway.create_app(
                bus,
                tokens,
                settings,
                public_url=args.public_url,
                a2a=not args.no_a2a,
                cors_origins=args.cors_origin,
            )
            config = uvicorn.Config(
                app,
                log_config=None,
                access_log=False,
                lifespan="on",
                timeout_graceful_shutdown=5,
                # Longer than the idle timeout of the load balancers in front
                # (60 s is common), so that they, not the gateway, close an
                # idle connection: a request is never sent on one just closed.
                timeout_keep_alive=75,
            )
            server = Server(config)

            def stop() -> None:
                server.should_exit = True

            on_stop_signals(stop)
            # The socket listens already: a client that connects now waits for the app.
            _announce(sock, args.host, bus, len(tokens))
            await server.serve(sockets=[sock])
        finally:
            await bus.close()
        console.print("gateway stopped")
        return 0

    return run(serve())


def _announce(sock: Any, host: str, bus: Any, tokens: int) -> None:
    port = sock.getsockname()[1]
    shown = "127.0.0.1" if host in ANY_HOST else host
    console.print(
        f"gateway on http://{shown}:{port}/v1 (fleet {bus.prefix} at {bus.connected_url}, "
        f"{tokens} token{'s' if tokens != 1 else ''})",
        highlight=False,
    )
    if host in ANY_HOST:
        err_console.print(
            "[yellow]note:[/] listening on every interface: put TLS in front of it "
            "(a reverse proxy) before it leaves this machine",
            highlight=False,
        )
