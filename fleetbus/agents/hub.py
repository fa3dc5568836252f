"""Multi-agent conversations: a hub where the others hear what one says, and
pipelines that chain or fan out replies.

Participants are anything with a ``name``, ``reply`` and ``observe``: a local
:class:`~fleetbus.agents.Agent` or a :class:`~fleetbus.agents.serving.remote.RemoteAgent`
alike::

    async with MsgHub([alice, bob, carol], announcement="Plan the offsite.") as hub:
        await hub.speak(alice)          # bob and carol hear alice's answer
        await hub.speak(bob)            # alice and carol hear bob's
    summary = await sequential_pipeline([drafter, editor], "Write the invite.")
    votes = await fanout_pipeline([alice, bob, carol], "Friday or Monday?")

What a participant answers reaches the others as an ``agent_message`` named
after it (:func:`to_agent_message`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Sequence
from types import TracebackType
from typing import Protocol, Self

from fleetbus.errors import ConfigError
from fleetbus.protocol import AgentMessage, ContentBlock, FinalAnswer, TextBlock

__all__ = [
    "MsgHub",
    "Participant",
    "fanout_pipeline",
    "sequential_pipeline",
    "to_agent_message",
]

logger = logging.getLogger(__name__)

# A reply that ends so is not something to hand on: the pipeline stops there.
_STOPPING = frozenset({"error", "paused", "interrupted", "guardrail_tripped"})


class Participant(Protocol):
    """An agent that can take part in a conversation, local or remote."""

    @property
    def name(self) -> str:
        """Its name: how the others see it speak."""
        ...

    async def reply(self, inputs: str | AgentMessage | None = None, /) -> FinalAnswer:
        """Reply to ``inputs`` (``None``: to its memory as it is)."""
        ...

    async def observe(self, messages: str | AgentMessage | Sequence[str | AgentMessage], /) -> None:
        """Add messages to its memory without replying."""
        ...


def to_agent_message(answer: FinalAnswer, speaker: str) -> AgentMessage:
    """An answer as the message the next participant gets from ``speaker``.

    Text becomes one text block; ``name`` and ``sender`` are the speaker's
    name, and ``reply`` is set (a participant that only observes it ignores
    that).
    """
    content: list[ContentBlock] = (
        [TextBlock(text=answer.content)]
        if isinstance(answer.content, str)
        else list(answer.content)
    )
    return AgentMessage(sender=speaker, name=speaker, content=content, reply=True)


class MsgHub:
    """A conversation in which what one participant says, the others hear.

    On entering (``async with``), every participant observes the
    announcement. :meth:`speak` runs one participant's reply and, with
    broadcast enabled, every other participant observes the answer.
    Observations run concurrently; a participant that fails to observe
    raises in an ``ExceptionGroup``.

    Args:
        participants: who takes part (each once; order is kept).
        announcement: what everyone hears on entering.
        enable_broadcast: let the others hear what a speaker answers.

    Attributes:
        transcript: ``(speaker name, text)`` of the announcement, each
            broadcast and each answer, in order (``""`` as the speaker of
            plain text).
    """

    def __init__(
        self,
        participants: Iterable[Participant],
        *,
        announcement: str | AgentMessage | None = None,
        enable_broadcast: bool = True,
    ) -> None:
        self._participants: list[Participant] = []
        for participant in participants:
            self.add(participant)
        self.announcement = announcement
        self.enable_broadcast = enable_broadcast
        self.transcript: list[tuple[str, str]] = []

    @property
    def participants(self) -> list[Participant]:
        """Who takes part now (a copy)."""
        return list(self._participants)

    async def __aenter__(self) -> Self:
        if self.announcement is not None:
            await self.broadcast(self.announcement)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        return None

    def add(self, participant: Participant) -> None:
        """Let a participant join (it hears what is said from now on)."""
        if not any(p is participant for p in self._participants):
            self._participants.append(participant)

    def remove(self, participant: Participant) -> None:
        """Let a participant leave (it hears nothing more).

        Raises:
            ConfigError: it is not a participant.
        """
        for index, member in enumerate(self._participants):
            if member is participant:
                del self._participants[index]
                return
        raise ConfigError(f"{participant.name!r} is not a participant of this hub")

    async def broadcast(self, message: str | AgentMessage) -> None:
        """Every participant observes ``message`` (broadcast enabled or not)."""
        if isinstance(message, AgentMessage):
            self.transcript.append((message.name or message.sender, _text(message.content)))
        else:
            self.transcript.append(("", message))
        await _observe_all(self._participants, message)

    async def speak(
        self, participant: Participant, inputs: str | AgentMessage | None = None
    ) -> FinalAnswer:
        """Run ``participant``'s reply; the others hear its answer.

        Args:
            participant: who speaks (usually a participant; one from outside
                is heard by all).
            inputs: what it replies to; ``None``: to what it has heard.

        Returns:
            Its final answer.
        """
        answer = await participant.reply(inputs)
        self.transcript.append((participant.name, _text(answer.content)))
        if self.enable_broadcast:
            others = [p for p in self._participants if p is not participant]
            await _observe_all(others, to_agent_message(answer, participant.name))
        return answer


async def sequential_pipeline(
    participants: Sequence[Participant], inputs: str | AgentMessage | None
) -> FinalAnswer:
    """Each participant replies to the previous one's answer.

    The first replies to ``inputs``. A reply that ends ``error``, ``paused``,
    ``interrupted`` or ``guardrail_tripped`` stops the pipeline: that answer
    is returned (its ``sender`` says whose it is).

    Returns:
        The last answer.

    Raises:
        ConfigError: there is no participant.
    """
    if not participants:
        raise ConfigError("a sequential pipeline needs at least one participant")
    message = inputs
    answer: FinalAnswer | None = None
    for participant in participants:
        answer = await participant.reply(message)
        if answer.finished_reason in _STOPPING:
            logger.info(
                "pipeline stopped at %s: its reply ended %s",
                participant.name,
                answer.finished_reason,
                extra={"session_id": answer.session_id},
            )
            return answer
        message = to_agent_message(answer, participant.name)
    assert answer is not None
    return answer


async def fanout_pipeline(
    participants: Sequence[Participant],
    inputs: str | AgentMessage | None,
    *,
    concurrent: bool = True,
) -> list[FinalAnswer]:
    """Every participant replies to the same ``inputs``.

    Args:
        participants: who replies.
        inputs: what they reply to.
        concurrent: reply all at once (a failure cancels the others and is
            raised in an ``ExceptionGroup``), else one after another.

    Returns:
        The answers, in the order of ``participants``.
    """
    if not concurrent:
        return [await participant.reply(inputs) for participant in participants]
    async with asyncio.TaskGroup() as group:
        tasks = [group.create_task(participant.reply(inputs)) for participant in participants]
    return [task.result() for task in tasks]


async def _observe_all(participants: Sequence[Participant], message: str | AgentMessage) -> None:
    async with asyncio.TaskGroup() as group:
        for participant in list(participants):
            group.create_task(participant.observe(message))


def _text(content: str | list[ContentBlock]) -> str:
    if isinstance(content, str):
        return content
    return "\n".join(block.text for block in content if isinstance(block, TextBlock))
