"""What guardrails are made of: the stages, what a check is given and
what it finds, and the :class:`Guardrail` base class (see
:mod:`fleetbus.capabilities.guardrails`)."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Final, Literal, TypeAlias, get_args

from fleetbus.agents.messages import Msg
from fleetbus.errors import ConfigError
from fleetbus.protocol import ToolResultBlock, ToolUseBlock

__all__ = [
    "GUARDRAIL_STAGES",
    "VERDICT_SCHEMA",
    "Checked",
    "Guardrail",
    "GuardrailContext",
    "GuardrailResult",
    "GuardrailStage",
]

GuardrailStage: TypeAlias = Literal["input", "output", "tool_input", "tool_output"]
GUARDRAIL_STAGES: Final[tuple[str, ...]] = get_args(GuardrailStage)

VERDICT_SCHEMA: Final[dict[str, Any]] = {
    "type": "object",
    "properties": {
        "tripped": {
            "type": "boolean",
            "description": "true if what was checked must be stopped, false if it may pass",
        },
        "reason": {"type": "string", "description": "why, in one sentence"},
    },
    "required": ["tripped", "reason"],
    "additionalProperties": False,
}
"""The structured answer an :class:`~fleetbus.capabilities.AgentGuardrail`
asks its agent for."""


@dataclass(frozen=True, slots=True)
class GuardrailContext:
    """Where a check runs.

    Attributes:
        agent_name: the agent replying.
        session_id: its session, if any.
        reply_id: the reply (the ``call_id`` of its events).
        stage: what is checked: ``input``, ``output``, ``tool_input`` or
            ``tool_output``.
    """

    agent_name: str
    session_id: str | None
    reply_id: str
    stage: GuardrailStage


@dataclass(frozen=True, slots=True)
class Checked:
    """What a guardrail checks.

    Attributes:
        text: it as text, at every stage: the input's text, the answer (a
            structured one as JSON), a call's arguments as JSON, a result's
            output (as JSON unless it is text).
        messages: at ``input``, the new input messages.
        structured: at ``output``, a structured answer.
        call: at ``tool_input`` and ``tool_output``, the tool call.
        result: at ``tool_output``, its result.
    """

    text: str
    messages: tuple[Msg, ...] = ()
    structured: dict[str, Any] | None = None
    call: ToolUseBlock | None = None
    result: ToolResultBlock | None = None


@dataclass(frozen=True, slots=True)
class GuardrailResult:
    """What a check found: made with :meth:`passed`, :meth:`trip`,
    :meth:`reject` or :meth:`replace`.

    Attributes:
        tripped: stop the reply.
        reason: why, in a sentence (said to the caller on a trip, to the
            model on a rejection).
        info: anything else worth showing, as JSON values (in the check's
            event).
        rejected: at ``tool_input``: do not run the call; the model gets a
            result saying it was rejected, and why.
        replaced: at ``tool_output``: the model sees ``output`` instead of
            the tool's result.
        output: the replacement, with ``replaced``.

    Raises:
        ConfigError: more than one of ``tripped``, ``rejected`` and
            ``replaced``, or a reason that is not a string.
    """

    tripped: bool = False
    reason: str = ""
    info: dict[str, Any] | None = None
    rejected: bool = False
    replaced: bool = False
    output: Any = None

    def __post_init__(self) -> None:
        if self.tripped + self.rejected + self.replaced > 1:
            raise ConfigError("a guardrail result trips, rejects or replaces: one of them")
        if not isinstance(self.reason, str):
            raise ConfigError(f"a guardrail's reason is a string, not {type(self.reason).__name__}")

    @classmethod
    def passed(cls, *, info: dict[str, Any] | None = None) -> GuardrailResult:
        """Nothing to stop."""
        return cls(info=info)

    @classmethod
    def trip(cls, reason: str, *, info: dict[str, Any] | None = None) -> GuardrailResult:
        """Stop the reply, for ``reason``."""
        return cls(tripped=True, reason=reason, info=info)

    @classmethod
    def reject(cls, reason: str, *, info: dict[str, Any] | None = None) -> GuardrailResult:
        """At ``tool_input``: do not run the call, and tell the model ``reason``
        (at another stage, it trips the reply)."""
        return cls(rejected=True, reason=reason, info=info)

    @classmethod
    def replace(
        cls, output: Any, reason: str = "", *, info: dict[str, Any] | None = None
    ) -> GuardrailResult:
        """At ``tool_output``: the model sees ``output`` instead of the result
        (at another stage, it trips the reply)."""
        return cls(replaced=True, output=output, reason=reason, info=info)

    @property
    def action(self) -> str:
        """``pass``, ``trip``, ``reject`` or ``replace``."""
        if self.tripped:
            return "trip"
        if self.rejected:
            return "reject"
        return "replace" if self.replaced else "pass"


class Guardrail(ABC):
    """A check of what goes in and out of an agent.

    Args:
        name: how it is named in events and in the trip.
        run_in_parallel: as an input guardrail, run beside the reply's first
            model call (``True``) or before it (``False``: a trip spends no
            model call). Without effect at the other stages.
        fail_open: when the check fails (raises, times out, gives no
            result), let it pass instead of tripping.
        timeout: seconds a check may take (``None``: no limit of its own).

    Raises:
        ConfigError: an empty name, or a timeout that is not a positive number.
    """

    def __init__(
        self,
        name: str,
        *,
        run_in_parallel: bool = True,
        fail_open: bool = False,
        timeout: float | None = None,
    ) -> None:
        if not isinstance(name, str) or not name.strip():
            raise ConfigError(f"a guardrail's name is a non-empty string, not {name!r}")
        if timeout is not None and not (
            isinstance(timeout, int | float)
            and not isinstance(timeout, bool)
            and math.isfinite(timeout)
            and timeout > 0
        ):
            raise ConfigError(f"guardrail {name!r}: timeout is a positive number, not {timeout!r}")
        self.name = name
        self.run_in_parallel = bool(run_in_parallel)
        self.fail_open = bool(fail_open)
        self.timeout = float(timeout) if timeout is not None else None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"

    @abstractmethod
    async def check(self, checked: Checked, ctx: GuardrailContext) -> GuardrailResult:
        """Check ``checked`` at the stage ``ctx.stage``.

        What it raises is its failure (a trip, or a pass with ``fail_open``);
        a :class:`~fleetbus.agents.StopReply` it raises trips with its reason.
        """
