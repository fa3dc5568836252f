"""``fleetbus ask AGENT TEXT``: ask an agent, streaming its reply as it
happens; and :func:`converse`, which ``confirm`` and ``resume`` stream
their resumed replies with."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from fleetbus.agents.serving.client import stream_reply
from fleetbus.bus.subjects import check_name
from fleetbus.cli._common import connect, console, fail, run
from fleetbus.cli.render import ReplyPrinter
from fleetbus.errors import ConfigError
from fleetbus.protocol import (
    AnyMessage,
    ConfirmResult,
    ErrorMessage,
    ExternalResult,
    UserRequest,
    new_id,
    to_builtins,
)

__all__ = ["cmd", "converse"]


def cmd(args: argparse.Namespace) -> int:
    """Ask an agent, streaming its reply; exit 1 when it ends in error.

    With ``--schema FILE`` the request carries that JSON Schema as its
    ``output_schema`` and the answer's ``structured`` object is printed;
    with ``--user ID``, ``metadata.user_id`` names who asks.

    Raises:
        ConfigError: an invalid session id, or a schema file that cannot be
            read or is not the JSON Schema of an object.
    """
    session = args.session or f"s-{new_id()[:12]}"
    check_name(session, what="session id")
    schema = None if args.schema is None else _read_output_schema(args.schema)
    request = UserRequest(
        sender="cli",
        session_id=session,
        content=args.text,
        output_schema=schema,
        metadata={"user_id": args.user} if args.user else {},
    )
    return run(converse(args, args.agent, session, request))


def _read_output_schema(path: Path) -> dict[str, Any]:
    """The JSON Schema in ``path``, checked to describe an object (the answer
    is given as the arguments of a tool).

    Raises:
        ConfigError: the file cannot be read, is not JSON, or is not the
            schema of an object.
    """
    try:
        schema = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"cannot read the schema {path}: {exc.strerror or exc}") from exc
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError
        raise ConfigError(f"the schema {path} is not JSON: {exc}") from exc
    if not isinstance(schema, dict) or schema.get("type", "object") != "object":
        raise ConfigError(
            f'the schema {path} is not the JSON Schema of an object ("type": "object"): '
            "the answer is given as the arguments of a tool"
        )
    return schema


async def converse(
    args: argparse.Namespace,
    agent: str,
    session: str,
    message: UserRequest | ConfirmResult | ExternalResult,
) -> int:
    """Stream the reply to ``message``: exit 1 when it ends in error (or is refused)."""
    bus = await connect(args.nats, args.prefix)
    printer = ReplyPrinter(console, session_id=session)
    try:
        if not args.json:
            console.print(f"[dim]session {session}[/]")
        outcome = await stream_reply(
            bus,
            agent,
            session,
            message,
            on_item=lambda item: _show(item, printer, args.json),
            timeout=args.timeout,
        )
    finally:
        if not args.json:
            printer.close()  # a line left open by a reply cut short
        await bus.close()
    if isinstance(outcome, ErrorMessage):
        return fail(outcome.message)
    return 1 if outcome.finished_reason in ("error", "guardrail_tripped") else 0


def _show(message: AnyMessage, printer: ReplyPrinter, as_json: bool) -> None:
    if as_json:
        print(json.dumps(to_builtins(message), ensure_ascii=False), flush=True)
    else:
        printer.handle(message)
