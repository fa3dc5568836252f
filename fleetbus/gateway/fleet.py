"""What every face of the gateway (OpenAI, fleet-native REST, A2A) does with
the fleet, for one authenticated caller.

:class:`GatewayFleet` holds nothing a replica would lose: the agents are
discovered on the bus (cached a moment), sessions are read from their
journals, and replies are streamed with :class:`RemoteAgent
<fleetbus.agents.serving.RemoteAgent>`. What it keeps in memory are the
limits of this replica: streams open per token.

Every call checks the caller: an agent the token may not talk to, or a
session that is not the caller's, is :class:`NotFound` — the same answer as
an agent or session that does not exist, so ids reveal nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import AsyncGenerator, Iterator
from dataclasses import dataclass, field
from typing import Any, Final

from fleetbus.agents.serving import RemoteAgent, SessionJournals
from fleetbus.agents.serving.directory import AgentInfo, discover_agents
from fleetbus.agents.serving.facts import SessionFact, SessionRecord
from fleetbus.agents.state import PendingCall
from fleetbus.bus import Bus, check_name
from fleetbus.errors import FleetbusError, SessionNotFoundError
from fleetbus.gateway.auth import Caller
from fleetbus.gateway.settings import GatewaySettings
from fleetbus.protocol import (
    AgentMessage,
    ConfirmResult,
    Event,
    ExternalResult,
    FinalAnswer,
    UserRequest,
    new_id,
)

__all__ = ["Ask", "GatewayFleet", "NotFound", "Reply", "TooManyStreams"]

Ask = UserRequest | AgentMessage | ConfirmResult | ExternalResult
"""What the gateway sends an agent."""

logger = logging.getLogger(__name__)

_DISCOVERY_TIMEOUT: Final = 0.5


class NotFound(FleetbusError):
    """No such agent or session — for this caller."""


class TooManyStreams(FleetbusError):
    """The token has as many replies open on this replica as it may."""


@dataclass(slots=True)
class Reply:
    """A reply the gateway followed to its end."""

    final: FinalAnswer
    events: list[Event] = field(default_factory=list)
    pending: list[PendingCall] = field(default_factory=list)
    """The calls a paused reply waits for (read from the session)."""


class GatewayFleet:
    """The fleet as one gateway replica serves it.

    Args:
        bus: the gateway's connection.
        settings: limits and timeouts.
    """

    def __init__(self, bus: Bus, settings: GatewaySettings) -> None:
        self.bus = bus
        self.settings = settings
        self._journals: SessionJournals | None = None
        self._agents: list[AgentInfo] = []
        self._agents_at = -1e9
        self._agents_lock = asyncio.Lock()
        self._streams: Counter[str] = Counter()
        self._detached: set[asyncio.Task[None]] = set()

    # -- agents --------------------------------------------------------------------------

    async def agents(self, caller: Caller) -> list[AgentInfo]:
        """The agents served now that ``caller`` may talk to, by name."""
        async with self._agents_lock:
            now = time.monotonic()
            if now - self._agents_at > self.settings.discovery_ttl:
                self._agents = await discover_agents(self.bus, timeout=_DISCOVERY_TIMEOUT)
                self._agents_at = time.monotonic()
        return [a for a in self._agents if caller.may_talk_to(a.name)]

    async def agent(self, caller: Caller, name: str) -> AgentInfo:
        """The agent ``name``.

        Raises:
            NotFound: it is not served, or not to this caller.
        """
        if caller.may_talk_to(name):
            for info in await self.agents(caller):
                if info.name == name:
                    return info
            self._agents_at = -1e9  # maybe started a moment ago: look again
            for info in await self.agents(caller):
                if info.name == name:
                    return info
        raise NotFound(f"no agent {name!r} is served")

    def check_agent(self, caller: Caller, name: str) -> str:
        """``name``, if ``caller`` may talk to it.

        Raises:
            NotFound: it may not (or the name cannot be an agent's).
        """
        if not caller.may_talk_to(name) or not _is_name(name):
            raise NotFound(f"no agent {name!r} is served")
        return name

    # -- sessions ------------------------------------------------------------------------

    def session_id(self, caller: Caller, conversation: str | None = None) -> str:
        """The session of ``caller``'s ``conversation`` (a new one when
        ``None``): ``<tag>-<conversation>``. A conversation that is already
        the caller's session id is kept as it is.

        Raises:
            NotFound: the conversation cannot name a session.
        """
        if conversation is None:
            return f"{caller.tag}-{new_id()}"
        if caller.owns(conversation) and _is_name(conversation):
            return conversation
        session = f"{caller.tag}-{conversation}"
        if not _is_name(session):
            raise NotFound(
                f"{conversation!r} cannot name a conversation: use up to 100 letters, "
                "digits, '_' or '-'"
            )
        return session

    def check_session(self, caller: Caller, session_id: str) -> str:
        """``session_id``, if it is ``caller``'s.

        Raises:
            NotFound: it is not (or cannot be a session id).
        """
        if not caller.owns(session_id) or not _is_name(session_id):
            raise NotFound(f"no session {session_id!r}")
        return session_id

    async def journals(self) -> SessionJournals:
        """The session journals, opened once."""
        if self._journals is None:
            self._journals = await SessionJournals.open_journals(self.bus)
        return self._journals

    async def sessions(self, caller: Caller, agent: str | None = None) -> list[SessionRecord]:
        """``caller``'s sessions (of one agent), most recently updated first."""
        if agent is not None:
            self.check_agent(caller, agent)
        journals = await self.journals()
        records = await journals.records(agent, where=lambda _a, s: caller.owns(s))
        return [r for r in records if caller.may_talk_to(r.agent)]

    async def session(self, caller: Caller, agent: str, session_id: str) -> SessionRecord:
        """One of ``caller``'s sessions.

        Raises:
            NotFound: there is none such.
        """
        self.check_agent(caller, agent)
        self.check_session(caller, session_id)
        record = await (await self.journals()).get(agent, session_id)
        if record is None:
            raise NotFound(f"agent {agent!r} has no session {session_id!r}")
        return record

    async def history(self, caller: Caller, agent: str, session_id: str) -> list[SessionFact]:
        """The journal of one of ``caller``'s sessions.

        Raises:
            NotFound: there is none such.
        """
        self.check_agent(caller, agent)
        self.check_session(caller, session_id)
        try:
            return await (await self.journals()).history(agent, session_id)
        except SessionNotFoundError:
            raise NotFound(f"agent {agent!r} has no session {session_id!r}") from None

    async def pending(self, agent: str, session_id: str) -> list[PendingCall]:
        """The calls the session's paused reply waits for (none when it is not paused)."""
        record = await (await self.journals()).get(agent, session_id)
        if record is None or record.state.reply is None:
            return []
        return list(record.state.reply.pending)

    # -- replies -------------------------------------------------------------------------

    def remote(self, caller: Caller, agent: str, session_id: str) -> RemoteAgent:
        """A client of ``agent`` in ``session_id``, speaking as ``caller``."""
        self.check_agent(caller, agent)
        self.check_session(caller, session_id)
        return RemoteAgent(
            self.bus,
            agent,
            session_id=session_id,
            timeout=self.settings.reply_timeout,
            sender=caller.user,
        )

    @contextlib.contextmanager
    def _slot(self, caller: Caller) -> Iterator[None]:
        if self._streams[caller.token_id] >= self.settings.max_streams_per_token:
            raise TooManyStreams(
                f"this token has {self.settings.max_streams_per_token} replies open already; "
                "wait for one to end"
            )
        self._streams[caller.token_id] += 1
        try:
            yield
        finally:
            self._streams[caller.token_id] -= 1
            if not self._streams[caller.token_id]:
                del self._streams[caller.token_id]

    async def stream(
        self,
        caller: Caller,
        agent: str,
        session_id: str,
        message: Ask,
        *,
        schema: dict[str, Any] | None = None,
        detach: bool | None = None,
    ) -> AsyncGenerator[Event | FinalAnswer, None]:
        """Send ``message`` in ``caller``'s session and yield the reply's
        events, the final answer last.

        Left early (the HTTP client went away), the reply is cancelled, or
        with ``detach`` (the settings' ``on_disconnect`` by default) left to
        run to its end in the session, where the journal keeps it.

        Raises:
            NotFound: the agent or the session is not the caller's.
            TooManyStreams: the token's limit of open replies is reached.
            RemoteError, CallTimeoutError, NoRespondersError: as
                :meth:`RemoteAgent.reply_stream
                <fleetbus.agents.serving.RemoteAgent.reply_stream>` raises them.
        """
        remote = self.remote(caller, agent, session_id)
        if detach is None:
            detach = self.settings.on_disconnect == "detach"
        with self._slot(caller):
            if not detach:  # read here: leaving early closes the stream, which cancels
                stream = remote.reply_stream(message, schema=schema)
                async with contextlib.aclosing(stream):
                    async for item in stream:
                        yield item
                return
            # Read by a task of its own, which the reader may leave running.
            items: asyncio.Queue[Event | FinalAnswer | BaseException] = asyncio.Queue()

            async def follow() -> None:
                stream = remote.reply_stream(message, schema=schema)
                try:
                    async with contextlib.aclosing(stream):
                        async for item in stream:
                            items.put_nowait(item)
                except Exception as exc:  # handed to the reader, who raises it
                    items.put_nowait(exc)

            task = asyncio.get_running_loop().create_task(follow())
            done = False
            try:
                while True:
                    got = await items.get()
                    if isinstance(got, BaseException):
                        done = True
                        raise got
                    yield got
                    if isinstance(got, FinalAnswer):
                        done = True
                        return
            finally:
                if not done:
                    self._detached.add(task)
                    task.add_done_callback(self._detached.discard)
                    logger.info(
                        "%s left the reply of %s in session %s running",
                        caller.user,
                        agent,
                        session_id,
                        extra={"session_id": session_id},
                    )
                else:
                    await asyncio.wait([task])

    async def reply(
        self,
        caller: Caller,
        agent: str,
        session_id: str,
        message: Ask,
        *,
        schema: dict[str, Any] | None = None,
    ) -> Reply:
        """Send ``message`` and follow the reply to its end.

        Raises:
            What :meth:`stream` raises.
        """
        events: list[Event] = []
        # Not detached: a request that is not streamed is not left early by
        # its client (the server runs its handler to the end).
        stream = self.stream(caller, agent, session_id, message, schema=schema, detach=False)
        async with contextlib.aclosing(stream):
            async for item in stream:
                if isinstance(item, FinalAnswer):
                    pending: list[PendingCall] = []
                    if item.finished_reason == "paused":
                        pending = await self.pending(agent, session_id)
                    return Reply(final=item, events=events, pending=pending)
                events.append(item)
        raise AssertionError("a reply stream ends with a final answer or raises")

    async def cancel(self, caller: Caller, agent: str, session_id: str) -> None:
        """Interrupt the reply running in one of ``caller``'s sessions."""
        await self.remote(caller, agent, session_id).cancel(f"cancelled by {caller.user}")

    async def close(self) -> None:
        """Stop the replies left running (the gateway is stopping)."""
        for task in list(self._detached):
            task.cancel()
        if self._detached:
            await asyncio.wait(list(self._detached))


def _is_name(name: str) -> bool:
    try:
        check_name(name)
    except FleetbusError:
        return False
    return True
