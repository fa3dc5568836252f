"""What a front end (``fleetbus ask``/``confirm``/``resume``, the dashboard,
the demo) sends a served agent, and how it follows the reply: the
``confirm_result`` and ``external_result`` a person's answers make, and
:func:`stream_reply`, which streams the reply to any of them.

They live here, below every front end, so that the CLI and the dashboard
share one code path without one importing the other."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from typing import Any

from fleetbus.agents.permissions import checked_confirmation
from fleetbus.agents.serving.remote import RemoteAgent
from fleetbus.bus import Bus
from fleetbus.errors import ConfigError, RemoteError
from fleetbus.protocol import (
    AgentMessage,
    AnyMessage,
    Confirmation,
    ConfirmResult,
    ErrorDetail,
    ErrorMessage,
    ExternalOutput,
    ExternalResult,
    FinalAnswer,
    Message,
    UserRequest,
)

__all__ = ["confirm_result", "external_result", "stream_reply"]


async def stream_reply(
    bus: Bus,
    agent: str,
    session: str,
    message: Message,
    *,
    on_item: Callable[[AnyMessage], None],
    timeout: float,
) -> FinalAnswer | ErrorMessage:
    """Send ``message`` to an agent and hand each event of the reply to
    ``on_item`` as it is published, the final answer last (once).

    Streams through :meth:`RemoteAgent.reply_stream
    <fleetbus.agents.serving.remote.RemoteAgent.reply_stream>`, in ``session``;
    a reply left early (the caller cancelled) is interrupted.

    Args:
        bus: the connection.
        agent: the agent's name.
        session: the session to reply in.
        message: a ``user_request``, ``agent_message``, ``confirm_result`` or
            ``external_result``; its ``sender`` (``cli`` when empty) is kept.
        on_item: called with each event, then the final answer.
        timeout: seconds the whole reply may take.

    Returns:
        The final answer, or the ``error`` message the agent answered (its
        ``message`` a full sentence naming who could not handle what).

    Raises:
        CallTimeoutError: no answer within ``timeout`` seconds.
        NoRespondersError: the agent is not served.
        UnexpectedMessageError: the agent answered something else than a
            final answer.
        ConfigError: ``message`` is of another type, or ``session`` cannot be
            a subject token.
    """
    if not isinstance(message, UserRequest | AgentMessage | ConfirmResult | ExternalResult):
        raise ConfigError(
            f"an agent streams the reply to a user_request, agent_message, confirm_result or "
            f"external_result, not to a {type(message).__name__}"
        )
    remote = RemoteAgent(bus, agent, session_id=session, sender=message.sender or "cli")
    stream = remote.reply_stream(message, timeout=timeout)
    try:
        async with contextlib.aclosing(stream):
            async for item in stream:
                on_item(item)
                if isinstance(item, FinalAnswer):
                    return item
    except RemoteError as exc:
        return ErrorMessage(
            sender=exc.source_component,
            session_id=session,
            call_id=exc.call_id,
            code=exc.code,
            message=str(exc),
            source_component=exc.source_component,
        )
    raise AssertionError("a reply stream ends with a final answer or raises")


def external_result(
    session_id: str,
    *,
    results: Iterable[tuple[str, Any]] = (),
    errors: Iterable[tuple[str, str]] = (),
    sender: str = "cli",
) -> ExternalResult:
    """The ``external_result`` of ``fleetbus resume SESSION --result CALL_ID
    JSON … --error CALL_ID MESSAGE …``: each call's output (any JSON value),
    or the error message of a call that failed (the model sees it as a tool
    error).

    Raises:
        ConfigError: no call is named, or a call is named twice.
    """
    outputs: list[ExternalOutput] = []
    seen: set[str] = set()
    given = [(c, v, False) for c, v in results] + [(c, m, True) for c, m in errors]
    for call_id, value, failed in given:
        if not call_id:
            raise ConfigError("a call id is empty")
        if call_id in seen:
            raise ConfigError(f"the call {call_id!r} is given twice")
        seen.add(call_id)
        if failed:
            detail = ErrorDetail(code="tool_error", message=str(value))
            outputs.append(ExternalOutput(call_id=call_id, status="error", error_detail=detail))
        else:
            outputs.append(ExternalOutput(call_id=call_id, content=value))
    if not outputs:
        raise ConfigError(
            "give at least one result (--result CALL_ID JSON or --error CALL_ID TEXT)"
        )
    return ExternalResult(sender=sender, session_id=session_id, results=outputs)


def confirm_result(
    session_id: str,
    *,
    allow: Iterable[str] = (),
    deny: Iterable[str] = (),
    always: bool = False,
    edits: Iterable[tuple[str, dict[str, Any]]] = (),
    accept_rules: Iterable[str] = (),
    sender: str = "cli",
) -> ConfirmResult:
    """The ``confirm_result`` of ``fleetbus confirm SESSION --allow … --deny …
    --edit CALL_ID JSON … --accept-rules RULE …``.

    An edited call is allowed. The accepted rules go with the first allowed
    call (with the first call when all are denied): they are the agent's, for
    any call.

    Raises:
        ConfigError: no call is named, a call is both allowed and denied (or
            edited and denied, or edited twice), or a rule does not parse.
    """
    allowed, denied = list(dict.fromkeys(allow)), list(dict.fromkeys(deny))
    edited: dict[str, dict[str, Any]] = {}
    for call_id, parameters in edits:
        if call_id in edited:
            raise ConfigError(f"the call {call_id!r} is edited twice")
        edited[call_id] = parameters
        if call_id not in allowed:
            allowed.append(call_id)
    both = sorted(set(allowed) & set(denied))
    if both:
        raise ConfigError(f"allowed and denied at once: {', '.join(both)}")
    if not allowed and not denied:
        raise ConfigError("name at least one call to allow, deny or edit")
    rules = list(accept_rules)
    confirmations: list[Confirmation] = []
    for call_id, confirmed in [(c, True) for c in allowed] + [(c, False) for c in denied]:
        confirmations.append(
            checked_confirmation(
                call_id,
                allow=confirmed,
                always=always,
                parameters=edited.get(call_id),
                accept_rules=rules if not confirmations else (),
            )
        )
    return ConfirmResult(sender=sender, session_id=session_id, confirmations=confirmations)
