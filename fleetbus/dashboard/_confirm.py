"""Sending a person's answer to paused calls, through the code path of
``fleetbus confirm`` and ``fleetbus resume``: the same ``confirm_result``
(allowed, denied, edited, rules accepted) or ``external_result`` to the
agent's inbox, the resumed reply streamed by
:func:`fleetbus.agents.serving.client.stream_reply`."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from fleetbus.agents.serving.client import confirm_result, external_result, stream_reply
from fleetbus.bus import Bus
from fleetbus.errors import FleetbusError, NoRespondersError
from fleetbus.protocol import AnyMessage, ConfirmResult, ErrorMessage, Event, ExternalResult

__all__ = ["ConfirmOutcome", "external", "send_answer", "send_confirmation"]

logger = logging.getLogger(__name__)

SENDER = "dashboard"


@dataclass(frozen=True, slots=True)
class ConfirmOutcome:
    """What became of a confirmation (or an external result), as far as the
    dashboard saw it."""

    accepted: bool
    """Whether the agent took it (``False``: refused, or nobody answered)."""
    state: Literal["resumed", "completed", "refused", "unserved", "failed"]
    message: str
    finished_reason: str | None = None


def confirmation(
    session_id: str,
    *,
    allow: list[str],
    deny: list[str],
    always: bool,
    edits: Sequence[tuple[str, dict[str, Any]]] = (),
    accept_rules: Sequence[str] = (),
) -> ConfirmResult:
    """The ``confirm_result`` of ``fleetbus confirm SESSION --allow … --deny …
    --edit CALL_ID JSON --accept-rules RULE …``.

    Raises:
        ConfigError: no call is named, a call is allowed and denied at once,
            or a rule does not parse.
    """
    return confirm_result(
        session_id,
        allow=allow,
        deny=deny,
        always=always,
        edits=edits,
        accept_rules=accept_rules,
        sender=SENDER,
    )


def external(
    session_id: str,
    *,
    results: Sequence[tuple[str, Any]] = (),
    errors: Sequence[tuple[str, str]] = (),
) -> ExternalResult:
    """The ``external_result`` of ``fleetbus resume SESSION --result CALL_ID
    JSON … --error CALL_ID MESSAGE …``.

    Raises:
        ConfigError: no call is named, or a call is named twice.
    """
    return external_result(session_id, results=results, errors=errors, sender=SENDER)


async def send_confirmation(
    bus: Bus,
    agent: str,
    session_id: str,
    *,
    allow: list[str],
    deny: list[str],
    always: bool,
    timeout: float,
    answered: asyncio.Event,
    edits: Sequence[tuple[str, dict[str, Any]]] = (),
    accept_rules: Sequence[str] = (),
) -> ConfirmOutcome:
    """Send the decisions to ``agent`` and follow the resumed reply to its end.

    ``answered`` is set at the first event of the resumed reply, and when
    this returns (a refusal comes as the answer, without events). ``edits``
    and ``accept_rules`` are those of :func:`confirmation`.

    Raises:
        ConfigError: no call is named, or a rule does not parse.
    """
    message = confirmation(
        session_id,
        allow=allow,
        deny=deny,
        always=always,
        edits=edits,
        accept_rules=accept_rules,
    )
    return await send_answer(bus, agent, session_id, message, timeout=timeout, answered=answered)


async def send_answer(
    bus: Bus,
    agent: str,
    session_id: str,
    message: ConfirmResult | ExternalResult,
    *,
    timeout: float,
    answered: asyncio.Event,
) -> ConfirmOutcome:
    """Send a ``confirm_result`` or ``external_result`` to ``agent`` and
    follow the resumed reply to its end (``answered`` as in
    :func:`send_confirmation`)."""

    def seen(item: AnyMessage) -> None:
        if isinstance(item, Event):
            answered.set()

    try:
        outcome = await stream_reply(bus, agent, session_id, message, on_item=seen, timeout=timeout)
    except NoRespondersError as exc:
        return ConfirmOutcome(accepted=False, state="unserved", message=str(exc))
    except FleetbusError as exc:
        logger.warning(
            "%s for %s/%s: %s",
            "confirmation" if isinstance(message, ConfirmResult) else "external result",
            agent,
            session_id,
            exc,
            extra={"session_id": session_id},
        )
        return ConfirmOutcome(accepted=False, state="failed", message=str(exc))
    finally:
        answered.set()
    if isinstance(outcome, ErrorMessage):
        return ConfirmOutcome(accepted=False, state="refused", message=outcome.message)
    if outcome.finished_reason == "error":
        text = outcome.content if isinstance(outcome.content, str) else "the reply failed"
        return ConfirmOutcome(
            accepted=False, state="refused", message=text, finished_reason="error"
        )
    return ConfirmOutcome(
        accepted=True,
        state="completed",
        message=f"the reply ended {outcome.finished_reason}",
        finished_reason=outcome.finished_reason,
    )
