"""The events of a reply, as protocol ``event`` messages.

A reply streams, in order: ``reply_start``; per reasoning step
``model_call_start``, ``thinking_delta``/``text_delta`` pieces,
``model_call_end`` (with token usage); per tool call ``tool_call``, the
``tool_result_delta`` chunks of a streaming tool as it yields them
(``call_id``, ``tool_name``, ``content``), and ``tool_result``; when it
pauses ``require_user_confirm`` or ``require_external_execution``; last
``reply_end`` with the ``finished_reason``. A layer adds events of its own
(a guardrail's ``guardrail`` per check: ``name``, ``stage``, ``tripped``,
``reason``, ``action``). Every event carries the reply's id as ``call_id``
and a ``seq`` from 0, so they can travel on the bus and be put back in
order.
"""

from __future__ import annotations

from typing import Any, Final

from fleetbus.protocol import Event

__all__ = [
    "EVENT_NAMES",
    "GUARDRAIL",
    "MODEL_CALL_END",
    "MODEL_CALL_START",
    "REPLY_END",
    "REPLY_START",
    "REQUIRE_EXTERNAL_EXECUTION",
    "REQUIRE_USER_CONFIRM",
    "TEXT_DELTA",
    "THINKING_DELTA",
    "TOOL_CALL",
    "TOOL_RESULT",
    "TOOL_RESULT_DELTA",
    "EventFactory",
]

REPLY_START: Final = "reply_start"
MODEL_CALL_START: Final = "model_call_start"
MODEL_CALL_END: Final = "model_call_end"
TEXT_DELTA: Final = "text_delta"
THINKING_DELTA: Final = "thinking_delta"
TOOL_CALL: Final = "tool_call"
TOOL_RESULT: Final = "tool_result"
TOOL_RESULT_DELTA: Final = "tool_result_delta"
REQUIRE_USER_CONFIRM: Final = "require_user_confirm"
REQUIRE_EXTERNAL_EXECUTION: Final = "require_external_execution"
REPLY_END: Final = "reply_end"
GUARDRAIL: Final = "guardrail"

EVENT_NAMES: Final = (
    REPLY_START,
    MODEL_CALL_START,
    MODEL_CALL_END,
    TEXT_DELTA,
    THINKING_DELTA,
    TOOL_CALL,
    TOOL_RESULT_DELTA,
    TOOL_RESULT,
    REQUIRE_USER_CONFIRM,
    REQUIRE_EXTERNAL_EXECUTION,
    GUARDRAIL,
    REPLY_END,
)
"""Every event a reply can stream."""


class EventFactory:
    """Makes the numbered events of one reply.

    Args:
        agent_name: the ``sender``.
        reply_id: the ``call_id`` every event of the reply carries.
        session_id: the session, if any.
    """

    def __init__(self, agent_name: str, reply_id: str, session_id: str | None) -> None:
        self.agent_name = agent_name
        self.reply_id = reply_id
        self.session_id = session_id
        self._seq = 0

    def __call__(self, name: str, /, **data: Any) -> Event:
        """The next event of the reply."""
        event = Event(
            sender=self.agent_name,
            session_id=self.session_id,
            call_id=self.reply_id,
            event=name,
            data=data,
            seq=self._seq,
        )
        self._seq += 1
        return event
