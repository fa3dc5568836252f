"""Messages an agent only takes in: an ``agent_message`` with ``reply=False``,
and the broadcasts of the topics a host observes — the part of
:class:`AgentHost <fleetbus.agents.serving.host.AgentHost>` that records them
in a session's memory (under its lease, finishing first whatever reply a dead
owner left in it).

A broadcast on a topic the host observes is recorded by one replica in the
memory of every agent it serves, in the session the sender names, else in
the session named after the topic. A durable topic is kept in a JetStream
stream, read through one durable consumer per host group: a host that was
down catches up on what it missed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Sized
from typing import Any

from fleetbus.agents.serving._replies import ReplyRunning, Run, decode_final
from fleetbus.agents.serving.sessions import SessionStatus, session_key
from fleetbus.bus import Request
from fleetbus.bus.subjects import check_name
from fleetbus.bus.topics import DurableTopic
from fleetbus.errors import InvalidSubjectError, SessionLost
from fleetbus.protocol import (
    AgentMessage,
    AnyMessage,
    ErrorMessage,
    Event,
    FinalAnswer,
    Message,
    UserRequest,
)

__all__ = ["Observing"]

logger = logging.getLogger(__name__)


class Observing(ReplyRunning):
    """Recording observed messages and broadcasts (mixed into ``AgentHost``,
    which sets these attributes)."""

    concurrency: int
    durable_topics: bool
    drain_timeout: float
    _stop: asyncio.Event

    def _observe_on(
        self,
        tg: asyncio.TaskGroup,
        ready: list[asyncio.Event],
        topic: str,
        queue: str,
        names: Iterable[str],
    ) -> None:
        """Record the broadcasts of ``topic`` in the memory of ``names``."""
        event = asyncio.Event()
        ready.append(event)

        async def observe(request: Request) -> None:
            await self._observe_topic(topic, request.message, names)
            return None

        if self.durable_topics:
            reader = DurableTopic(self.bus, topic, consumer=queue.replace(".", "-"))
            tg.create_task(reader.run(observe, stop=self._stop, ready=event))
            return
        tg.create_task(
            self.bus.serve(
                self.bus.subjects.topic(topic),
                observe,
                stop=self._stop,
                queue=queue,
                limiter=self._limiter,
                drain_timeout=self.drain_timeout,
                ready=event,
                component=self.replica_id,
            )
        )

    async def _observe(self, name: str, message: AgentMessage, session: str = "main") -> Message:
        session = message.session_id or session
        try:
            check_name(session, what="session id")
        except InvalidSubjectError as exc:
            return self._error(message, "malformed", str(exc))
        assert self.store is not None
        async with self._session_lock(session_key(name, session)):
            while True:
                lease = await self._acquire(name, message, session, None)
                if isinstance(lease, ErrorMessage | FinalAnswer):
                    return lease
                assert lease is not None  # (None only for a copy of a request with a receipt)
                state = lease.record.state
                stored = decode_final(lease.orphan_final)
                if stored is not None and lease.orphan_reply_to:
                    await self._publish(lease.orphan_reply_to, stored)  # a dead owner's answer
                if lease.orphan_input is None and (state.reply is None or state.paused):
                    break
                # A dead owner left work in this session: finish it, then observe.
                lease.record = lease.record.model_copy(
                    update={
                        "pending_input": lease.orphan_input,
                        "reply_to": lease.orphan_reply_to,
                    }
                )
                # (an observation does not always hold a place of the limiter)
                if await self._run_reply(lease, None, Run(), holds_slot=False) is None:
                    return self._error(message, "internal", f"session {session} was lost")
            agent = self.definition(name).clone(state=lease.record.state)
            await agent.observe(message)
            previous = lease.previous
            status: SessionStatus = (
                "paused" if agent.state.paused else "idle" if previous == "running" else previous
            )
            try:
                await self._save(
                    lease, self.lease_ttl, state=agent.state, status=status, release=True
                )
            except SessionLost as exc:
                return self._error(message, "internal", str(exc))
        return Event(
            sender=self.replica_id,
            session_id=session,
            call_id=message.call_id,
            event="observed",
            data={"agent": name},
        )

    async def _observe_topic(self, topic: str, message: AnyMessage, names: Iterable[str]) -> None:
        """Record a broadcast in the memory of each of ``names`` (not its
        sender's), in the session it names or the topic's; ``concurrency``
        at a time. ``names`` is gone over once, as the broadcast is recorded."""
        if isinstance(message, AgentMessage):
            observed = message
        elif isinstance(message, UserRequest | FinalAnswer):
            content = message.content
            observed = AgentMessage(
                sender=message.sender,
                session_id=message.session_id,
                name=message.sender,
                content=content if isinstance(content, list) else _text_blocks(content),
                reply=False,
            )
        else:
            logger.info("%s: topic message %s not observed", topic, type(message).__name__)
            return
        pending = (name for name in names if name != observed.name)

        async def record() -> None:
            for name in pending:
                answer = await self._observe(name, observed, topic)
                if isinstance(answer, ErrorMessage):
                    logger.warning(
                        "%s: broadcast on %s not recorded: %s", name, topic, answer.message
                    )

        async with asyncio.TaskGroup() as tg:
            width = (
                min(self.concurrency, len(names)) if isinstance(names, Sized) else self.concurrency
            )
            for _ in range(width):
                tg.create_task(record())


def _text_blocks(text: str) -> list[Any]:
    from fleetbus.protocol import TextBlock

    return [TextBlock(text=text)]
