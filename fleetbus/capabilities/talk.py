"""The talk capability: tools with which an agent on the bus talks from its
own loop.

- ``send_message(to, message, wait_for_reply=False)``: a direct message to
  another agent's inbox, recorded in the recipient's memory in this reply's
  session; with ``wait_for_reply`` the recipient answers and the answer is
  the tool's result.
- ``publish(topic, message)``: a broadcast on ``<prefix>.topic.<topic>``,
  recorded by every agent observing the topic.

Opt in per agent with the capability, or by adding the tools to its toolkit::

    agent = Agent("alice", "...", model, capabilities=[Talk()])
    agent = Agent("alice", "...", model, toolkit=Toolkit(talk_tools()))

They work while the agent is served by an
:class:`~fleetbus.agents.serving.AgentHost` (or ``AgentService``), which
tells them the bus, the agent's name and the session
(:mod:`fleetbus.agents.talk`); elsewhere they answer with an error the model
sees.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Final

from fleetbus.agents.middleware import Middleware, ReplyContext, ToolLayer
from fleetbus.agents.talk import Speaker, speaker
from fleetbus.bus import RESEND_AFTER
from fleetbus.bus.subjects import check_name
from fleetbus.errors import BusError, FleetbusError, ToolError
from fleetbus.protocol import (
    AgentMessage,
    ErrorMessage,
    Event,
    FinalAnswer,
    TextBlock,
    ToolResultBlock,
    ToolUseBlock,
    new_id,
)
from fleetbus.tools_workers.tool import Tool, tool

if TYPE_CHECKING:
    from fleetbus.agents.capability import AgentView
    from fleetbus.agents.state import AgentState

__all__ = ["MAX_TALK_CHARS", "REPLY_TIMEOUT", "Talk", "publish", "send_message", "talk_tools"]

MAX_TALK_CHARS: Final = 8000
"""Longest message the talk tools send, in characters."""

REPLY_TIMEOUT: Final = 120.0
"""Seconds ``send_message(wait_for_reply=True)`` waits for the answer."""

_DELIVERY_TIMEOUT: Final = 30.0


def _who() -> Speaker:
    me = speaker()
    if me is None:
        raise ToolError("this agent is not served on the bus: it cannot send messages")
    return me


def _note(me: Speaker, message: str, *, reply: bool) -> AgentMessage:
    """The message ``me`` sends, in its reply's session.

    Raises:
        ToolError: the text is empty or too long.
    """
    if not message.strip():
        raise ToolError("the message is empty")
    if len(message) > MAX_TALK_CHARS:
        raise ToolError(f"the message is {len(message)} characters; the limit is {MAX_TALK_CHARS}")
    return AgentMessage(
        sender=me.name,
        session_id=me.session,
        name=me.name,
        content=[TextBlock(text=message)],
        reply=reply,
        call_id=new_id(),
        receipt=reply,
    )


async def _send_message(to: str, message: str, wait_for_reply: bool = False) -> str:
    """Send a direct message to another agent of the fleet.

    Args:
        to: the other agent's name.
        message: what to tell it.
        wait_for_reply: wait for its answer and return it (it replies in
            this conversation); otherwise it only hears the message.
    """
    me = _who()
    try:
        check_name(to, what="agent name")
    except FleetbusError as exc:
        raise ToolError(str(exc)) from exc
    if to == me.name:
        raise ToolError("that is yourself; name another agent")
    note = _note(me, message, reply=wait_for_reply)
    timeout = REPLY_TIMEOUT if wait_for_reply else _DELIVERY_TIMEOUT
    # A question asks for a receipt: sent again until a replica has taken it.
    resend = RESEND_AFTER if wait_for_reply else None
    subject = me.bus.subjects.agent_inbox(to)
    try:
        if wait_for_reply and me.slot is not None:
            me.slot.release()  # a full host must still serve the agent asked
            try:
                answer = await me.bus.request(subject, note, timeout=timeout, resend=resend)
            finally:
                await me.slot.acquire()
        else:
            answer = await me.bus.request(subject, note, timeout=timeout, resend=resend)
    except BusError as exc:
        raise ToolError(f"the message to {to} was not delivered: {exc}") from exc
    if isinstance(answer, ErrorMessage):
        raise ToolError(f"{to} could not take the message: {answer.message}")
    if isinstance(answer, FinalAnswer):
        return str(answer.content)
    if isinstance(answer, Event):
        return f"delivered to {to}"
    raise ToolError(f"{to} answered with an unexpected {type(answer).__name__}")


async def _publish(topic: str, message: str) -> str:
    """Publish a message on a topic: every agent observing the topic hears it.

    Args:
        topic: the topic's name.
        message: what to announce.
    """
    me = _who()
    try:
        subject = me.bus.subjects.topic(topic)
    except FleetbusError as exc:
        raise ToolError(str(exc)) from exc
    note = _note(me, message, reply=False)
    try:
        await me.bus.publish(subject, note)
    except BusError as exc:
        raise ToolError(f"the message was not published on {topic}: {exc}") from exc
    return f"published on {topic}"


send_message: Tool = tool(name="send_message", concurrency_safe=True)(_send_message)
"""The tool ``send_message``."""

publish: Tool = tool(name="publish", concurrency_safe=True)(_publish)
"""The tool ``publish``."""


def talk_tools() -> list[Tool]:
    """``send_message`` and ``publish``, to add to an agent's toolkit."""
    return [send_message, publish]


class Talk:
    """Give the agent ``send_message`` and ``publish`` (see the module docstring)."""

    def middlewares(self, agent: AgentView) -> Sequence[Middleware]:
        """The layer offering and running the two tools."""
        return (_TalkLayer(talk_tools()),)

    def prepare_state(self, state: AgentState) -> None:
        """Nothing: talking keeps no state."""


class _TalkLayer(ToolLayer):
    def __init__(self, tools: list[Tool]) -> None:
        super().__init__([t.spec() for t in tools])
        self.by_name = {t.name: t for t in tools}

    async def answer(self, ctx: ReplyContext, call: ToolUseBlock) -> ToolResultBlock:
        ran = await self.by_name[call.name].run(call.input, session_id=ctx.session_id)
        if ran.status == "success":
            return ToolResultBlock(id=call.id, name=call.name, output=ran.content, state="success")
        detail = ran.error_detail
        text = f"{detail.code}: {detail.message}" if detail else ran.status
        return ToolResultBlock(id=call.id, name=call.name, output=text, state=ran.status)
