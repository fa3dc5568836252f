"""``fleetbus dashboard``: serve a live web page of the fleet (docs/dashboard.md).

Starlette and uvicorn come with the ``fleetbus[dashboard]`` extra and are
imported only when the command runs: without them it says, in one line, what
to install. Also runs on its own as ``python -m fleetbus.cli.dashboard_cmd``.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import sys
from collections.abc import Callable, Sequence
from typing import Any

from fleetbus.bus.store import STORE_WAIT
from fleetbus.cli._common import (
    Subcommands,
    add_connection_options,
    connect,
    console,
    count,
    err_console,
    guarded,
    on_stop_signals,
    run,
    seconds,
    setup_logging,
)
from fleetbus.cli._web import ANY_HOST, listen, server_class
from fleetbus.errors import ConfigError

__all__ = ["DEFAULT_PORT", "add_parser", "cmd", "main"]

DEFAULT_PORT = 8700
_EXTRA = "pip install 'fleetbus[dashboard]'"
"""How to install the extra (the backslash keeps rich from reading a style tag)."""


def add_parser(
    sub: Subcommands,
    bus_options: Callable[[argparse.ArgumentParser], None] = add_connection_options,
) -> None:
    """Add the ``dashboard`` command to ``sub``."""
    p = sub.add_parser("dashboard", help="serve a live web page of the fleet (read from the bus)")
    p.add_argument(
        "--port",
        type=count("a port is 0 to 65535", le=65535),
        default=DEFAULT_PORT,
        help=f"HTTP port (0: any free one; default {DEFAULT_PORT})",
    )
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (default 127.0.0.1: the page can allow tool calls)",
    )
    p.add_argument(
        "--allow-host",
        action="append",
        default=[],
        metavar="NAME",
        help="also answer requests for this host name (behind a proxy); repeatable",
    )
    p.add_argument(
        "--poll",
        type=seconds("a positive number of seconds", gt=0),
        default=2.0,
        help="seconds between reads of sessions and stats",
    )
    p.add_argument(
        "--store-wait",
        type=seconds("seconds of 0 or more", ge=0),
        default=STORE_WAIT,
        metavar="SECONDS",
        help="seconds a reading of the session store waits out a failure that may pass (a "
        f"cluster electing a new leader after a node died) before the page shows an error; "
        f"default {STORE_WAIT:g}",
    )
    bus_options(p)


def _load() -> tuple[Any, Any]:
    """``(uvicorn, fleetbus.dashboard)``, or one line saying what to install.

    Raises:
        ConfigError: starlette or uvicorn is missing.
    """
    try:
        import uvicorn

        import fleetbus.dashboard as dashboard
    except ImportError as exc:
        missing = exc.name or "starlette/uvicorn"
        raise ConfigError(
            f"fleetbus dashboard needs {missing.split('.')[0]}, from the dashboard extra: {_EXTRA}"
        ) from exc
    return uvicorn, dashboard


def _allowed_hosts(host: str, extra: Sequence[str]) -> list[str]:
    if host in ANY_HOST:
        return ["*"]
    return sorted({"127.0.0.1", "localhost", host, *extra})


def cmd(args: argparse.Namespace) -> int:
    """Serve the dashboard until SIGTERM/SIGINT."""
    uvicorn, dashboard = _load()

    Server = server_class(uvicorn)

    async def serve() -> int:
        bus = await connect(args.nats, args.prefix, "dashboard")
        try:
            view = dashboard.FleetView(
                bus, session_poll=args.poll, stats_poll=args.poll, store_wait=args.store_wait
            )
            app = dashboard.create_app(
                bus, view=view, allowed_hosts=_allowed_hosts(args.host, args.allow_host)
            )
            config = uvicorn.Config(
                app,
                host=args.host,
                port=args.port,
                log_config=None,
                access_log=False,
                lifespan="on",
                timeout_graceful_shutdown=3,
            )
            server = Server(config)
            sock = listen(args.host, args.port, "the dashboard")

            def stop() -> None:
                view.close()
                server.should_exit = True

            on_stop_signals(stop)
            async with asyncio.TaskGroup() as tg:
                serving = tg.create_task(server.serve(sockets=[sock]))
                ready = tg.create_task(view.ready.wait())
                await asyncio.wait([serving, ready], return_when=asyncio.FIRST_COMPLETED)
                if ready.done():
                    _announce(sock, args.host, bus)
                ready.cancel()
        finally:
            await bus.close()
        console.print("dashboard stopped")
        return 0

    return run(serve())


def _announce(sock: socket.socket, host: str, bus: Any) -> None:
    port = sock.getsockname()[1]
    shown = "127.0.0.1" if host in ANY_HOST else host
    console.print(
        f"dashboard on http://{shown}:{port}/ (fleet {bus.prefix} at {bus.connected_url})",
        highlight=False,
    )
    if host not in ("127.0.0.1", "localhost", "::1"):
        err_console.print(
            f"[yellow]warning:[/] listening on {host}: whoever reaches this port can allow "
            "or deny the tool calls of paused sessions",
            highlight=False,
        )


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m fleetbus.cli.dashboard_cmd``: the command on its own."""
    parser = argparse.ArgumentParser(prog="fleetbus", description="A live web page of the fleet.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def bus_options(p: argparse.ArgumentParser) -> None:
        add_connection_options(p)
        p.add_argument("-v", "--verbose", action="count", default=0, help="more logs")

    add_parser(sub, bus_options)
    args = parser.parse_args(["dashboard", *(sys.argv[1:] if argv is None else argv)])
    setup_logging(args.verbose)
    return guarded(lambda: cmd(args))


if __name__ == "__main__":
    raise SystemExit(main())
