"""``fleetbus watch``: every message of a fleet, one line each, as it travels.

Its options are in :mod:`fleetbus.cli._parsers`, its command in
:mod:`fleetbus.cli.watch_cmd`.

:func:`watch` listens on ``<prefix>.>`` (calls, agent inboxes, topics, event
streams whoever they are for) and on the fleet's inboxes, ``_INBOX_<prefix>.>``
(:func:`~fleetbus.bus.inbox_wildcard`), where its replies travel; no
server-wide ``_INBOX.>`` permission is needed. An inbox is shown only when it
is the reply subject of a request seen on the fleet's prefix, so JetStream
and discovery answers stay out (replies to requests sent before the watch
began are not shown either). ``$SRV`` discovery traffic is not watched.

Session journals (``<prefix>.session.<agent>.<session>``) are shown fact by
fact as they are appended; watching one session (``--session``), the facts
its journals already hold are shown first (catch up, then follow), so a
watch begun late sees the same facts in the same order.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import OrderedDict
from datetime import datetime
from typing import Final, Protocol, TypeVar

from rich.console import Console
from rich.text import Text

from fleetbus.agents.serving.sessions import SessionFact, SessionStore, read_fact
from fleetbus.bus import INBOX_ROOT, Bus, Listener, Subjects, inbox_wildcard
from fleetbus.cli.render import STATUS_STYLES, describe
from fleetbus.errors import ConnectionClosedError, FleetbusError, ProtocolError, StoreError
from fleetbus.protocol import (
    AgentMessage,
    ErrorMessage,
    Event,
    FinalAnswer,
    LlmPrompt,
    LlmResponse,
    Message,
    ToolCall,
    ToolResult,
    UserRequest,
    decode,
    to_builtins,
)

__all__ = ["watch"]

logger = logging.getLogger(__name__)

_INBOXES: Final = (INBOX_ROOT, "_INBOX.")
"""How reply subjects start: fleetbus's own, and nats-py's default."""
_REPLY: Final = "_INBOX.reply"
"""The subject a reply is described with (``@ reply``, see ``describe``)."""
_EARLY_REPLY_WINDOW: Final = 2.0
"""Seconds a reply read before its request is held for it."""
_REMEMBERED: Final = 10_000
"""How many pending calls and reply subjects are remembered, the oldest forgotten first."""
_FLUSH_TIMEOUT: Final = 5.0
_PENDING_EVENTS: Final = frozenset({"require_user_confirm", "require_external_execution"})


class _Msg(Protocol):
    """What is read of a nats-py message."""

    subject: str
    reply: str
    data: bytes


K = TypeVar("K")
V = TypeVar("V")


class _Bounded(OrderedDict[K, V]):
    """An ordered dict that forgets its oldest entries beyond ``limit``."""

    def __init__(self, limit: int = _REMEMBERED) -> None:
        super().__init__()
        self.limit = limit

    def remember(self, key: K, value: V) -> None:
        self[key] = value
        self.move_to_end(key)
        while len(self) > self.limit:
            self.popitem(last=False)


def _fleet_wildcard(subjects: Subjects) -> str:
    # Subjects has no "everything" method; all_events() is "<prefix>.events.>",
    # so the prefix is the part before "events.>".
    return subjects.all_events().removesuffix("events.>") + ">"


def _matches(pattern: str, subject: str) -> bool:
    """Whether a NATS subject matches a pattern with ``*`` / ``>`` wildcards."""
    want, got = pattern.split("."), subject.split(".")
    for i, token in enumerate(want):
        if token == ">":
            return len(got) > i
        if i >= len(got) or (token != "*" and token != got[i]):
            return False
    return len(want) == len(got)


class _Watcher:
    """The state of one watch: filters, pending calls and reply subjects, counts."""

    def __init__(
        self,
        subjects: Subjects,
        *,
        session: str | None,
        agent: str | None,
        json_output: bool,
        console: Console,
    ) -> None:
        self.session = session
        self.agent = agent
        self.json_output = json_output
        self.console = console
        self.store_writes = subjects.kv_writes("x", "").removesuffix("x.")
        """The stem of the stores' repeated writes (not protocol messages)."""
        self.journals = f"{subjects.prefix}.session."
        """The stem of the session journals' subjects."""
        self.facts_shown: _Bounded[tuple[str, tuple[int, int]], bool] = _Bounded()
        """Facts already shown (a catch-up and the live appends overlap)."""
        self.agent_subjects = (
            ()
            if agent is None
            else (
                subjects.agent_inbox(agent),
                subjects.agent_control(agent),
                subjects.all_events(agent),
            )
        )
        self.calls: _Bounded[tuple[str, str], float] = _Bounded()
        """When each pending tool call was seen, by (kind, call_id)."""
        self.replies: _Bounded[str, bool] = _Bounded()
        """Reply subjects of the fleet's requests: whether the request was shown."""
        self.early: _Bounded[str, tuple[float, _Msg]] = _Bounded()
        """Replies read before their request: the two subscriptions are read by
        two tasks, so a reply can come first; held until its request, briefly."""
        self.shown = 0
        self.skipped = 0
        """Payloads that could not be decoded."""

    def wanted(self, message: Message, subject: str) -> bool:
        if self.session is not None and message.session_id != self.session:
            return False
        if self.agent is not None:
            return message.sender == self.agent or any(
                _matches(p, subject) for p in self.agent_subjects
            )
        return True

    def receive(self, msg: _Msg) -> None:
        if msg.subject.startswith(("$", self.store_writes)):
            return  # JetStream or service traffic ($KV.…, $JS.…, <prefix>.kv.…)
        if msg.subject.startswith(self.journals):
            try:
                fact = read_fact(msg.data)
            except StoreError as exc:
                self.skipped += 1
                logger.debug("skipped an unreadable fact on %s: %s", msg.subject, exc)
                return
            self.show_fact(msg.subject.removeprefix(self.journals), fact)
            return
        inbox = msg.subject.startswith(_INBOXES)
        if inbox and msg.subject not in self.replies:
            # Someone else's reply (another fleet, discovery, JetStream), or
            # one whose request this watcher has not read yet.
            self.early.remember(msg.subject, (time.monotonic(), msg))
            return
        try:
            message = decode(msg.data)
        except ProtocolError as exc:
            self.skipped += 1
            logger.debug("skipped an undecodable message on %s: %s", msg.subject, exc)
            return
        wanted = self.wanted(message, msg.subject) or (inbox and self.replies[msg.subject])
        if msg.reply and not inbox:
            self.replies.remember(msg.reply, wanted)
            held = self.early.pop(msg.reply, None)
        else:
            held = None
        latency = self.pair(message)
        if wanted:
            self.shown += 1
            self.print(message, _REPLY if inbox else msg.subject, latency)
        if held is not None and time.monotonic() - held[0] < _EARLY_REPLY_WINDOW:
            self.receive(held[1])  # its request is known now

    def show_fact(self, key: str, fact: SessionFact) -> None:
        """Print a fact of journal ``key`` (``<agent>.<session>``), once."""
        agent, _, session = key.partition(".")
        if self.session is not None and session != self.session:
            return
        if self.agent is not None and agent != self.agent:
            return
        if (key, fact.writer) in self.facts_shown:
            return
        self.facts_shown.remember((key, fact.writer), True)
        self.shown += 1
        if self.json_output:
            line = json.dumps({"journal": key, **fact.model_dump(mode="json")}, ensure_ascii=False)
            self.console.out(line, highlight=False)
            return
        clock = (fact.time or datetime.now()).strftime("%H:%M:%S.%f")[:-3]
        self.console.print(
            Text.assemble((clock, "dim"), " ", (_describe_fact(key, fact), "italic")),
            soft_wrap=True,
            highlight=False,
        )

    def pair(self, message: Message) -> float | None:
        """Milliseconds since the call a result answers, when that call was seen."""
        if isinstance(message, ToolCall | ToolResult):
            kind, call_id, is_call = "call", message.call_id, isinstance(message, ToolCall)
        elif isinstance(message, Event) and message.event in ("tool_call", "tool_result"):
            kind, call_id = "event", message.data.get("call_id")
            is_call = message.event == "tool_call"
        else:
            return None
        if not isinstance(call_id, str):
            return None
        key = (kind, call_id)
        if is_call:
            if key not in self.calls:  # a retry keeps the first attempt's time
                self.calls.remember(key, time.monotonic())
            return None
        started = self.calls.pop(key, None)
        return None if started is None else (time.monotonic() - started) * 1000.0

    def print(self, message: Message, subject: str, latency: float | None) -> None:
        if self.json_output:
            line = json.dumps(to_builtins(message), ensure_ascii=False, default=str)
            self.console.out(line, highlight=False)
            return
        clock = datetime.now().strftime("%H:%M:%S.%f")[:-3]
        text = Text.assemble((clock, "dim"), " ", (describe(message, subject), _style(message)))
        if latency is not None:
            text.append(f"  [{latency:.1f} ms]", style="bold")
        self.console.print(text, soft_wrap=True, highlight=False)


def _describe_fact(key: str, fact: SessionFact) -> str:
    """One line about a session fact."""
    agent, _, session = key.partition(".")
    parts = [f"{'fact ' + fact.kind:<13} {agent} session={session}"]
    if fact.owner:
        parts.append(f"by {fact.owner}")
    if fact.status:
        parts.append(f"-> {fact.status}")
    for added in fact.added[-3:]:
        blocks = added.get("content") or []
        said = " ".join(
            str(b.get("text") or b.get("name") or b.get("type", "")) for b in blocks[:3]
        )
        parts.append(f"+{added.get('role', '?')}: {said[:80]}")
    if fact.final is not None:
        parts.append(f"final: {str(fact.final.get('content', ''))[:80]}")
    return " ".join(parts)


async def _catch_up(bus: Bus, watcher: _Watcher, session: str, agent: str | None) -> None:
    """Show the facts the journals of ``session`` already hold."""
    try:
        store = await SessionStore.open(bus, owner="watch")
        for key in await store.journal.keys(f"{agent or '*'}.{session}"):
            name = key.partition(".")[0]
            for fact in await store.history(name, session):
                watcher.show_fact(key, fact)
    except FleetbusError as exc:  # (a watcher may not read JetStream: it follows)
        logger.info("the journal of %s was not read: %s", session, exc)


def _style(message: Message) -> str:
    match message:
        case ToolCall():
            return "cyan"
        case ToolResult():
            return STATUS_STYLES.get(message.status, "")
        case ErrorMessage():
            return "red"
        case FinalAnswer():
            return "bold green"
        case UserRequest():
            return "bold"
        case AgentMessage():
            return "magenta"
        case LlmPrompt() | LlmResponse():
            return "blue"
        case Event() if message.event in _PENDING_EVENTS:
            return "bold yellow"
        case Event():
            return "dim"
        case _:
            return ""


async def watch(
    bus: Bus,
    *,
    session: str | None,
    agent: str | None,
    json_output: bool,
    console: Console,
    stop: asyncio.Event,
    ready: asyncio.Event | None = None,
) -> None:
    """Print every message of the fleet as it travels, until ``stop`` is set.

    One line per message (:func:`~fleetbus.cli.render.describe`), a
    ``tool_result`` with the milliseconds since its ``tool_call``; or, with
    ``json_output``, each message as one JSON object per line. Payloads that
    do not decode are skipped and counted (the count is printed at the end,
    unless ``json_output``).

    Args:
        bus: the connection (its prefix is the fleet watched).
        session: only messages of this ``session_id``.
        agent: only messages this agent sends, those on its inbox, control
            and event subjects, and the replies to its requests.
        json_output: print JSON lines instead of descriptions.
        console: where to print.
        stop: set it to return.
        ready: set once the subscriptions are live on the server.

    Raises:
        ConnectionClosedError: the bus is closed.
        CallTimeoutError: the server did not confirm the subscriptions in time.
    """
    if bus.is_closed:
        raise ConnectionClosedError("the bus connection is closed")
    watcher = _Watcher(
        bus.subjects, session=session, agent=agent, json_output=json_output, console=console
    )

    async def consume(listener: Listener) -> None:
        async for msg in listener:
            watcher.receive(msg)

    subs = [
        await bus.listen(_fleet_wildcard(bus.subjects)),
        await bus.listen(inbox_wildcard(bus.prefix)),
    ]
    try:
        await bus.flush(_FLUSH_TIMEOUT)
        if session is not None:  # subscribed first: nothing falls between the two
            await _catch_up(bus, watcher, session, agent)
        if ready is not None:
            ready.set()
        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(consume(sub)) for sub in subs]
            stopped = tg.create_task(stop.wait())
            # The consumers end on their own only when the connection closes.
            await asyncio.wait([stopped, *tasks], return_when=asyncio.FIRST_COMPLETED)
            for task in (stopped, *tasks):
                task.cancel()
    finally:
        for sub in subs:
            await sub.unsubscribe()
    if not json_output and watcher.skipped:
        console.print(
            Text(f"skipped {watcher.skipped} undecodable message(s)", style="dim"),
            highlight=False,
        )
