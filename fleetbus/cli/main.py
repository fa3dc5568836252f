"""``fleetbus …`` commands: argument parsing and the small commands.

Every command prints one clear line on error (never a traceback) and exits
non-zero; ``-v`` shows logs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from rich.table import Table

from fleetbus import logs, tracing
from fleetbus._version import __version__
from fleetbus.bus import EmbeddedServer, ToolClient
from fleetbus.cli import auth_cmd, dashboard_cmd, gateway_cmd
from fleetbus.cli._common import (
    POSITIVE,
    Parser,
    add_connection_options,
    connect,
    console,
    fail,
    guarded,
    on_stop_signals,
    run,
    setup_logging,
)
from fleetbus.cli._parsers import (
    FLEET_COMMANDS,
    add_eval_parser,
    add_fleet_commands,
    add_model_worker_parser,
    add_sim_parser,
    fleet_command,
)
from fleetbus.errors import ConfigError
from fleetbus.protocol import PROTOCOL_VERSION, render_schemas, to_builtins

if TYPE_CHECKING:
    from fleetbus.tools_workers.a2a import A2ATools
    from fleetbus.tools_workers.mcp import MCPTools

DEFAULT_SCHEMA_DIR = Path("docs/protocol")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every command."""
    parser = Parser(
        prog="fleetbus",
        description="Fleets of LLM agents, tool workers and model workers over NATS.",
    )
    parser.add_argument(
        "--version",
        action="version",
        version=f"fleetbus {__version__} (protocol version {PROTOCOL_VERSION})",
    )
    _logging_options(parser, "")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def bus_options(p: argparse.ArgumentParser) -> None:
        add_connection_options(p)

    p = sub.add_parser(
        "server", help="run an embedded nats-server with JetStream in the foreground"
    )
    p.add_argument(
        "--port", type=int, default=4222, help="client port (0: pick a free one; default 4222)"
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument(
        "--state-dir", type=Path, help="JetStream storage (default: a temporary directory)"
    )

    p = sub.add_parser(
        "worker",
        help="serve the tools of a Python module, of MCP servers or of A2A agents, on the bus",
    )
    p.add_argument(
        "spec",
        metavar="MODULE[:ATTR]",
        nargs="?",
        help="e.g. fleetbus.tools_workers.builtin (optional with --mcp, --mcp-url or --a2a)",
    )
    p.add_argument(
        "--mcp",
        action="append",
        default=[],
        metavar='"COMMAND ARGS…"',
        help="serve the tools of an MCP server started as a subprocess (stdio); repeatable",
    )
    p.add_argument(
        "--mcp-url",
        action="append",
        default=[],
        metavar="URL",
        help="serve the tools of an MCP server over streamable HTTP; repeatable",
    )
    p.add_argument(
        "--mcp-env",
        action="append",
        default=[],
        metavar="NAME[=VALUE]",
        help="pass this variable (from this environment, or VALUE) to --mcp servers; repeatable",
    )
    p.add_argument(
        "--a2a",
        action="append",
        default=[],
        metavar="URL",
        help="serve a remote A2A agent as a tool (its URL or its card's); repeatable",
    )
    p.add_argument(
        "--a2a-header",
        action="append",
        default=[],
        metavar='"NAME: VALUE"',
        help="an HTTP header of every --a2a request (Authorization: Bearer …); repeatable",
    )
    p.add_argument(
        "--concurrency", type=POSITIVE, default=64, help="calls run at once (default 64)"
    )
    p.add_argument("--worker-id", help="this worker's id (default: worker.<host>-<pid>)")
    p.add_argument(
        "--timeout", type=float, default=30.0, help="default seconds per call (default 30)"
    )
    p.add_argument(
        "--drain-timeout", type=float, default=30.0, help="seconds to finish calls on stop"
    )
    p.add_argument(
        "--max-request-bytes",
        type=int,
        help="refuse larger calls with invalid_parameters (default: the server's max_payload)",
    )
    bus_options(p)

    p = sub.add_parser("tools", help="list the tools served on the bus, with their workers")
    p.add_argument(
        "--wait", type=float, default=0.5, help="seconds to collect answers (default 0.5)"
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    bus_options(p)

    p = sub.add_parser("call", help="call a tool and print its tool_result")
    p.add_argument("tool_name", metavar="TOOL_NAME")
    p.add_argument("parameters", metavar="JSON", nargs="?", default="{}", help="parameters object")
    p.add_argument(
        "--timeout",
        type=float,
        help="seconds the tool may run (default: the tool's own, else the worker's)",
    )
    p.add_argument("--session", help="session_id to send")
    bus_options(p)

    p = sub.add_parser("schema", help="write the JSON Schema of every message to docs/protocol/")
    p.add_argument(
        "--out", type=Path, default=DEFAULT_SCHEMA_DIR, help="directory (default docs/protocol)"
    )
    p.add_argument("--check", action="store_true", help="exit 1 if the files differ from the code")

    add_fleet_commands(sub, bus_options)
    add_model_worker_parser(sub, bus_options)
    add_sim_parser(sub, bus_options)
    add_eval_parser(sub, bus_options)
    dashboard_cmd.add_parser(sub, bus_options)
    gateway_cmd.add_parser(sub, bus_options)
    auth_cmd.add_parser(sub)

    p = sub.add_parser(
        "demo", help="embedded server, tool workers, 2,000 calculator calls, then an agent fleet"
    )
    p.add_argument("--calls", type=POSITIVE, default=2000, help="how many calls (default 2000)")
    p.add_argument("--workers", type=POSITIVE, default=2, help="worker processes (default 2)")
    p.add_argument("--in-flight", type=POSITIVE, default=64, help="calls in flight (default 64)")
    p.add_argument("--no-agents", action="store_true", help="only the tool-call part")
    _everywhere(parser)
    return parser


def _logging_options(parser: argparse.ArgumentParser, suffix: str) -> None:
    """``-v`` and ``--log-format`` (kept apart per level: argparse lets a
    subcommand's defaults overwrite what was given before it)."""
    parser.add_argument(
        "-v",
        "--verbose",
        action="count",
        default=0,
        dest=f"verbose{suffix}",
        help="more logs (-vv: debug; else FLEETBUS_LOG_LEVEL)",
    )
    parser.add_argument(
        "--log-format",
        choices=("text", "json"),
        dest=f"log_format{suffix}",
        help="log lines as text or JSON lines (default: FLEETBUS_LOG_FORMAT, else text)",
    )


def _everywhere(parser: Parser) -> None:
    """Give every subcommand (at every depth) the logging options, so that
    ``fleetbus -v worker`` and ``fleetbus worker -v`` both work."""
    for child in parser.subcommands:
        _logging_options(child, f"_{child.depth}")
        _everywhere(child)


def _logging_of(args: argparse.Namespace) -> tuple[int, str | None]:
    """The ``-v`` count and the ``--log-format`` given at any level."""
    values = vars(args)
    verbose = sum(v for k, v in values.items() if k.startswith("verbose") and isinstance(v, int))
    formats = [v for k, v in sorted(values.items()) if k.startswith("log_format") and v]
    return verbose, (formats[-1] if formats else None)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``fleetbus`` command; returns the exit code."""
    args = build_parser().parse_args(argv)
    verbose, log_format = _logging_of(args)
    try:
        setup_logging(verbose, log_format)
    except ConfigError as exc:
        return fail(str(exc))
    args.verbose = verbose
    tracing.setup_from_env()
    replicas = getattr(args, "js_replicas", None)
    if replicas is not None:
        # The option wins over the environment, here and in the processes the
        # command starts (agent replicas), which inherit it.
        os.environ["FLEETBUS_JS_REPLICAS"] = str(replicas)
    command = (
        _heavy_command(args.command)
        or {
            "dashboard": dashboard_cmd.cmd,
            "gateway": gateway_cmd.cmd,
            "auth": auth_cmd.cmd,
            "server": cmd_server,
            "worker": cmd_worker,
            "tools": cmd_tools,
            "call": cmd_call,
            "schema": cmd_schema,
            "demo": cmd_demo,
        }[args.command]
    )
    return guarded(lambda: command(args))


def _heavy_command(name: str) -> Callable[[argparse.Namespace], int] | None:
    """The command ``name`` when its code is imported only to run it (see
    :mod:`fleetbus.cli._parsers`); ``None`` for the others."""
    if name in FLEET_COMMANDS:
        return fleet_command(name)
    if name == "sim":
        from fleetbus.cli import sim_cmd

        return sim_cmd.cmd
    if name == "eval":
        from fleetbus.cli import eval_cmd

        return eval_cmd.cmd
    if name == "model-worker":
        from fleetbus.cli import model_worker_cmd

        return model_worker_cmd.cmd
    return None


def cmd_server(args: argparse.Namespace) -> int:
    """Run an embedded server until Ctrl-C or SIGTERM."""
    server = EmbeddedServer(port=args.port or None, host=args.host, state_dir=args.state_dir)

    async def serve() -> int:
        stop = asyncio.Event()
        on_stop_signals(stop.set)
        with server:
            console.print(
                f"nats-server listening on [bold]{server.url}[/] (JetStream in {server.state_dir})"
            )
            console.print(f"export FLEETBUS_NATS_URL={server.url}", highlight=False)
            while not stop.is_set() and server.running:
                try:
                    await asyncio.wait_for(stop.wait(), 0.5)
                except TimeoutError:
                    pass
            if not server.running:
                return fail("nats-server exited unexpectedly")
        console.print("nats-server stopped")
        return 0

    return run(serve())


def cmd_worker(args: argparse.Namespace) -> int:
    """Serve a toolkit until SIGTERM/SIGINT, then drain and exit 0."""
    from fleetbus.tools_workers import Toolkit, ToolWorker, load_toolkit

    if not (args.spec or args.mcp or args.mcp_url or args.a2a):
        raise ConfigError("give the tools to serve: MODULE[:ATTR], --mcp, --mcp-url or --a2a")
    servers: list[MCPTools | A2ATools] = [*_mcp_servers(args), *_a2a_agents(args)]
    toolkit = load_toolkit(args.spec) if args.spec else Toolkit()

    async def serve() -> int:
        async with contextlib.AsyncExitStack() as stack:
            # Each MCP session (and A2A connection pool) stays open while the worker serves.
            for server in servers:
                await stack.enter_async_context(server)
                for served in server.tools:
                    toolkit.add(served)
            return await serve_toolkit()

    async def serve_toolkit() -> int:
        bus = await connect(args.nats, args.prefix, args.worker_id)
        try:
            worker = ToolWorker(
                bus,
                toolkit,
                worker_id=args.worker_id,
                concurrency=args.concurrency,
                default_timeout=args.timeout,
                drain_timeout=args.drain_timeout,
                max_request_bytes=args.max_request_bytes,
            )
            on_stop_signals(worker.stop)
            logs.bind_process(worker=worker.worker_id)
            console.print(
                f"worker [bold]{worker.worker_id}[/] serving {', '.join(toolkit.names)} "
                f"on {bus.connected_url} (prefix {bus.prefix})",
                highlight=False,
            )
            await worker.run()
            console.print(f"worker {worker.worker_id} drained and stopped", highlight=False)
        finally:
            await bus.close()
        return 0

    return run(serve())


def _a2a_agents(args: argparse.Namespace) -> list[A2ATools]:
    """The remote A2A agents named by ``--a2a`` (not yet open).

    Raises:
        ConfigError: a2a-sdk is missing, or a header is not ``NAME: VALUE``.
    """
    if not args.a2a:
        if args.a2a_header:
            raise ConfigError("--a2a-header goes with --a2a")
        return []
    from fleetbus.tools_workers.a2a import A2ATools

    headers: dict[str, str] = {}
    for item in args.a2a_header:
        name, colon, value = item.partition(":")
        if not colon or not name.strip():
            raise ConfigError(f"--a2a-header takes 'NAME: VALUE', not {item!r}")
        headers[name.strip()] = value.strip()
    return [A2ATools(args.a2a, headers=headers)]


def _mcp_servers(args: argparse.Namespace) -> list[MCPTools]:
    """The MCP servers named by ``--mcp`` and ``--mcp-url`` (not yet open).

    Raises:
        ConfigError: the ``mcp`` SDK is missing, or an option is wrong.
    """
    from fleetbus.tools_workers.mcp import MCPTools

    env: dict[str, str] = {}
    for item in args.mcp_env:
        name, has_value, value = item.partition("=")
        if not name:
            raise ConfigError(f"--mcp-env takes NAME or NAME=VALUE, not {item!r}")
        if not has_value:
            if name not in os.environ:
                raise ConfigError(f"--mcp-env {name}: no such variable in this environment")
            value = os.environ[name]
        env[name] = value
    return [
        *(MCPTools(command, env=env or None) for command in args.mcp),
        *(MCPTools(url=url) for url in args.mcp_url),
    ]


def cmd_tools(args: argparse.Namespace) -> int:
    """Print the tools discovered on the bus."""

    async def list_tools() -> int:
        bus = await connect(args.nats, args.prefix)
        try:
            tools = await ToolClient(bus).discover(timeout=args.wait)
        finally:
            await bus.close()
        if args.json:
            print(
                json.dumps(
                    {
                        t.name: {
                            "description": t.description,
                            "parameters": t.parameters,
                            "workers": t.workers,
                            "worker_ids": list(t.worker_ids),
                        }
                        for t in tools.values()
                    },
                    indent=2,
                )
            )
            return 0
        if not tools:
            console.print(f"no tool workers answered on prefix {bus.prefix!r}")
            return 0
        table = Table(title=f"tools on {bus.prefix}")
        table.add_column("tool", style="bold")
        table.add_column("workers", justify="right")
        table.add_column("parameters")
        table.add_column("description")
        for t in tools.values():
            params = ", ".join(t.parameters.get("properties", {}))
            summary = t.description.splitlines()[0] if t.description else ""
            table.add_row(t.name, str(t.workers), params, summary)
        console.print(table)
        return 0

    return run(list_tools())


def cmd_call(args: argparse.Namespace) -> int:
    """Call one tool; exit 0 when it succeeded, 1 otherwise."""
    try:
        parameters = json.loads(args.parameters)
    except ValueError as exc:
        raise ConfigError(f"parameters are not JSON: {exc}") from exc
    if not isinstance(parameters, dict):
        raise ConfigError('parameters must be a JSON object, e.g. \'{"expr": "1 + 2"}\'')

    async def call() -> int:
        bus = await connect(args.nats, args.prefix)
        try:
            result = await ToolClient(bus).call(
                args.tool_name, parameters, session_id=args.session, timeout=args.timeout
            )
        finally:
            await bus.close()
        text = json.dumps(to_builtins(result), indent=2, ensure_ascii=False)
        if sys.stdout.isatty():
            console.print_json(text)
        else:
            print(text)
        return 0 if result.ok else 1

    return run(call())


def cmd_schema(args: argparse.Namespace) -> int:
    """Write (or check) the JSON Schema files."""
    rendered = render_schemas()
    out: Path = args.out
    if args.check:
        stale = [
            name
            for name, text in rendered.items()
            if not (out / name).is_file() or (out / name).read_text() != text
        ]
        extra = sorted(p.name for p in out.glob("*.json") if p.name not in rendered)
        if stale or extra:
            return fail(
                f"schemas in {out} differ from the code: {', '.join(stale + extra)}; "
                "run 'fleetbus schema'"
            )
        console.print(f"{len(rendered)} schemas in {out} match the code")
        return 0
    out.mkdir(parents=True, exist_ok=True)
    for name, text in rendered.items():
        (out / name).write_text(text)
    console.print(f"wrote {len(rendered)} schemas to {out}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    """The tool fleet demo."""
    from fleetbus.cli.demo import run_demo

    return run(
        run_demo(
            calls=args.calls,
            workers=args.workers,
            in_flight=args.in_flight,
            agents=not args.no_agents,
        )
    )
