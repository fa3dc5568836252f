"""Everything needed to continue an agent: its :class:`AgentState`.

The state is one pydantic model that round-trips through JSON: memory with
its marks, the compressed summary, the plan, the permission rules, and the
reply in progress — its step, its usage so far, and the tool calls it waits
for. An agent built from a restored state continues exactly where the other
stopped, in this process or another.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from fleetbus.agents.compression import Summary
from fleetbus.agents.messages import Msg
from fleetbus.agents.permissions import Permissions
from fleetbus.agents.plan import PlanNotebook

__all__ = ["STATE_VERSION", "AgentState", "PendingCall", "RecentCall", "ReplyState"]

STATE_VERSION = 1
"""Bumped when a saved state can no longer be read by this code."""


class PendingCall(BaseModel):
    """A tool call the reply waits for: a person's confirmation, or a result
    computed outside the agent."""

    call_id: str
    tool_name: str
    parameters: dict[str, Any]
    kind: Literal["confirm", "external"]
    rule: str | None = None
    """For ``confirm``: the rule that asked."""


class RecentCall(BaseModel):
    """One tool call of the reply, as loop detection remembers it."""

    signature: str
    """The tool's name and a digest of its canonical arguments (``name:digest``)."""
    ok: bool
    """Whether it succeeded."""


class ReplyState(BaseModel):
    """The reply in progress (``None`` in :class:`AgentState` between replies)."""

    reply_id: str
    session_id: str | None = None
    iteration: int = 0
    """The reasoning step to run next."""
    pending: list[PendingCall] = Field(default_factory=list)
    """Non-empty while paused."""
    structured_name: str | None = None
    structured_schema: dict[str, Any] | None = None
    structured_failures: int = 0
    last_failure: str | None = None
    """The last failing call (tool name and canonical arguments)."""
    repeat_count: int = 0
    """How many times in a row that call failed."""
    recent_calls: list[RecentCall] = Field(default_factory=list)
    """The reply's last tool calls, oldest first: only as many as loop
    detection looks at (a call repeated after it succeeded, a short cycle),
    so the saved state stays bounded and a take-over goes on detecting."""
    loops_shown: list[str] = Field(default_factory=list)
    """The loops the model was already shown (a few keys): seen again, they
    end the reply."""
    input_tokens: int = 0
    output_tokens: int = 0
    tool_calls: int = 0
    answered: list[str] = Field(default_factory=list)
    """The ``call_id`` of every tool call of the current step already answered
    (cleared at each step, so the saved state does not grow with the reply)."""
    arrived: list[Msg] = Field(default_factory=list)
    """Results of the current step's tool calls that arrived and are not yet in
    memory (memory gets them in the model's order once the step's calls are
    done); saved as each arrives, so no call is run again after its result."""


class AgentState(BaseModel):
    """All an agent needs to continue; JSON in, JSON out."""

    format_version: int = STATE_VERSION
    agent_name: str
    memory: list[Msg] = Field(default_factory=list)
    summary: Summary | None = None
    """The structured summary standing for compressed older messages."""
    plan: PlanNotebook | None = None
    permissions: Permissions = Field(default_factory=Permissions)
    reply: ReplyState | None = None

    @property
    def paused(self) -> bool:
        """Whether a reply waits for confirmations or external results."""
        return self.reply is not None and bool(self.reply.pending)
