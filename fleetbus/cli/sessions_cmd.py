"""``fleetbus sessions``: list agent sessions; with ``history``, ``fork`` or
``migrate``, list a session's journal, fork a session, or carry the sessions
of the layout before journals into the journal."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from typing import Any

from rich.table import Table
from rich.text import Text

from fleetbus.agents.permissions import suggest_rules
from fleetbus.agents.serving.sessions import SessionRecord, SessionStore
from fleetbus.bus.subjects import check_name
from fleetbus.cli._common import connect, console, err_console, run
from fleetbus.cli._parsers import SESSION_SUBCOMMANDS
from fleetbus.cli._store import from_store, open_store, session_records
from fleetbus.errors import ConfigError

__all__ = ["cmd"]


def cmd(args: argparse.Namespace) -> int:
    """List sessions; or (``history``, ``fork``, ``migrate``) list a
    session's journal, fork it, or carry over the sessions of the old layout."""
    words: list[str] = args.words
    action = words[0] if words and words[0] in SESSION_SUBCOMMANDS else None
    problem = _sessions_misuse(args, action)
    if problem is not None:
        # As argparse tells a misuse: the usage, the problem, exit code 2.
        sys.stderr.write(f"{args.sessions_usage}fleetbus sessions: error: {problem}\n")
        return 2
    if action in ("history", "fork"):
        agent = check_name(words[1], what="agent name")
        session = check_name(words[2], what="session id")
        return run((_history if action == "history" else _fork)(args, agent, session))
    if action == "migrate":
        return run(_migrate(args))
    return run(_list_sessions(args, args.agent_option or (words[0] if words else None)))


def _sessions_misuse(args: argparse.Namespace, action: str | None) -> str | None:
    """What is wrong with the words and options of ``fleetbus sessions``, if anything."""
    words: list[str] = args.words
    wanted = {"history": 3, "fork": 3, "migrate": 1}.get(action or "", 1)
    if action is None and (len(words) > 1 or (words and args.agent_option)):
        return "give one AGENT (or --agent AGENT)"
    if action in ("history", "fork") and len(words) != wanted:
        return f"{action} takes AGENT SESSION"
    if action == "migrate" and len(words) != wanted:
        return "migrate takes no AGENT or SESSION"
    if action is not None and args.agent_option:
        return f"--agent is for the listing; {action} takes AGENT SESSION"
    if action == "fork" and args.at is None:
        return "fork needs --at N (the facts as history numbers them)"
    if action != "fork" and (args.at is not None or args.new_session is not None):
        return "--at and --as go with fork"
    if action != "migrate" and args.drop:
        return "--drop goes with migrate"
    return None


async def _list_sessions(args: argparse.Namespace, agent: str | None) -> int:
    bus = await connect(args.nats, args.prefix)
    try:
        records = await from_store(lambda: session_records(bus, agent), args.store_wait)
    finally:
        await bus.close()
    if args.json:
        print(json.dumps([_summary(r) for r in records], indent=2))
        return 0
    if not records:
        console.print("no sessions")
        return 0
    table = Table(title="sessions")
    for column in ("agent", "session", "status", "step", "age", "owner", "last answer"):
        table.add_column(column)
    now = time.time()
    for r in records:
        summary = _summary(r)
        table.add_row(
            r.agent,
            r.session_id,
            _status_style(r.status),
            str(r.step),
            _age(now - r.updated_at.timestamp()),
            r.owner or "",
            str(summary["last_answer"] or "")[:60],
        )
    console.print(table)
    return 0


async def _history(args: argparse.Namespace, agent: str, session: str) -> int:
    """Print the facts of a session's journal (``SessionNotFoundError``: none)."""
    bus = await connect(args.nats, args.prefix)
    try:
        facts = await from_store(
            lambda: open_store(bus, lambda store: store.history(agent, session)), args.store_wait
        )
    finally:
        await bus.close()
    if args.json:
        for fact in facts:
            print(json.dumps(fact.model_dump(mode="json"), ensure_ascii=False))
        return 0
    table = Table(title=f"session {session} of {agent}")
    for column in ("n", "time", "kind", "status", "added", "changed", "final answer"):
        table.add_column(column, overflow="fold")
    for fact in facts:
        status = Text.from_markup(_status_style(fact.status or ""))
        if fact.owner:
            status.append(f" {fact.owner}" if fact.status else fact.owner)
        table.add_row(
            str(fact.n),
            f"{fact.time.astimezone():%Y-%m-%d %H:%M:%S}" if fact.time is not None else "",
            fact.kind,
            status,
            Text(_describe_added(fact.added)),
            ", ".join(fact.changed),
            Text(_answer_text(fact.final)[:80]),
        )
    console.print(table)
    return 0


def _describe_added(messages: list[dict[str, Any]]) -> str:
    """The messages a fact added, in one short line."""
    parts = []
    for message in messages[:3]:
        blocks = []
        for block in message.get("content") or []:
            kind = block.get("type")
            if kind == "text":
                blocks.append(repr(_cut(str(block.get("text", "")), 40)))
            elif kind == "tool_use":
                arguments = json.dumps(block.get("input"), ensure_ascii=False)
                blocks.append(f"→ {block.get('name')}({_cut(arguments, 30)})")
            elif kind == "tool_result":
                blocks.append(f"← {block.get('name')}: {block.get('state', 'success')}")
            elif kind:
                blocks.append(f"[{kind}]")
        parts.append(f"{message.get('role')}: {' '.join(blocks)}")
    if len(messages) > 3:
        parts.append(f"+{len(messages) - 3} more")
    return "; ".join(parts)


def _cut(text: str, width: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 1] + "…"


def _answer_text(final: dict[str, Any] | None) -> str:
    """The text of a stored final answer."""
    content = (final or {}).get("content")
    if isinstance(content, list):
        return " ".join(str(b.get("text", "")) for b in content if isinstance(b, dict))
    return "" if content is None else str(content)


async def _fork(args: argparse.Namespace, agent: str, session: str) -> int:
    """Fork a session at fact ``--at`` into ``--as`` (or a new id); print its id."""
    new = check_name(args.new_session, what="session id") if args.new_session else None
    bus = await connect(args.nats, args.prefix)
    try:
        store = await from_store(lambda: SessionStore.open(bus, owner="cli"), args.store_wait)
        facts = await from_store(lambda: store.history(agent, session), args.store_wait)
        if not 1 <= args.at <= len(facts):
            raise ConfigError(
                f"--at {args.at}: session {session} of {agent} has facts 1 to {len(facts)} "
                f"(fleetbus sessions history {agent} {session} lists them)"
            )
        # Not retried: a fork that landed unacknowledged would be made twice.
        record = await store.fork(agent, session, at=args.at, new_session=new)
    finally:
        await bus.close()
    if args.json:
        print(json.dumps(_summary(record)))
    else:
        console.print(
            f"session {record.session_id}: {session} of {agent} up to fact {args.at} "
            f"({record.messages} messages, {record.status})",
            highlight=False,
        )
    return 0


async def _migrate(args: argparse.Namespace) -> int:
    """Carry the sessions of the layout before journals into the journal."""
    from fleetbus.agents.serving.legacy import migrate

    bus = await connect(args.nats, args.prefix)
    try:
        done = await from_store(
            lambda: open_store(bus, lambda store: migrate(bus, store, drop=args.drop)),
            args.store_wait,
        )
    finally:
        await bus.close()
    if args.json:
        print(json.dumps(dataclasses.asdict(done), indent=2))
    else:
        for key in done.carried:
            console.print(f"carried over {key}", highlight=False)
        for key in done.kept:
            console.print(f"kept {key}: its journal has facts already", highlight=False)
        for key, why in done.failed.items():
            err_console.print(Text(f"not carried over: {key}: {why}", style="red"))
        if not (done.carried or done.kept or done.failed):
            console.print("no sessions of the layout before journals")
        for bucket in done.dropped:
            console.print(f"removed {bucket}", highlight=False)
        if args.drop and done.failed:
            err_console.print("the old buckets are kept: some sessions could not be read")
    return 1 if done.failed else 0


def _summary(record: SessionRecord) -> dict[str, Any]:
    final = record.final or {}
    pending = record.state.reply.pending if record.state.reply else []
    return {
        "agent": record.agent,
        "session": record.session_id,
        "status": record.status,
        "step": record.step,
        "updated_at": record.updated_at.isoformat(),
        "owner": record.owner,
        "pending": [
            {**p.model_dump(), "suggested_rules": suggest_rules(p.tool_name, p.parameters)}
            if p.kind == "confirm"
            else p.model_dump()
            for p in pending
        ],
        "last_answer": final.get("content"),
    }


def _status_style(status: str) -> str:
    colour = {"running": "cyan", "paused": "yellow", "done": "green", "error": "red"}.get(status)
    return f"[{colour}]{status}[/]" if colour else status


def _age(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f}s"
    if seconds < 5400:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.1f}h"
