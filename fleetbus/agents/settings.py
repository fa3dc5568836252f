"""How an agent's loop is tuned: :class:`AgentSettings`, one value."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from fleetbus.agents.compression import ContextConfig
from fleetbus.models.model import ModelConfig

__all__ = ["AgentSettings"]


class AgentSettings(BaseModel):
    """The tuning knobs of an agent's loop.

    ``Agent(..., settings=AgentSettings(max_iters=20))``; a value out of range
    fails as the settings are made (``pydantic.ValidationError``).
    """

    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True)

    max_iters: int = Field(default=10, ge=1)
    """Reasoning steps per reply before the agent must answer."""
    parallel_tool_calls: bool = False
    """Run a step's calls at once when every tool of the step is concurrency-safe."""
    tool_timeout: float | None = Field(default=None, gt=0)
    """Seconds each tool call may run (the tool's own, else the worker's, when ``None``)."""
    max_repeated_failures: int = Field(default=3, ge=1)
    """The same failing call this many times in a row ends the reply (``repeated_action``)."""
    max_repeated_calls: int | None = Field(default=3, ge=2)
    """Loop detection. The same call (tool and arguments) made this many times
    in a reply after it succeeded, or a short cycle of calls gone round twice
    (A, B, A, B), is shown to the model in the call's result; going on ends
    the reply (``repeated_action``). ``None`` turns it off."""
    structured_retries: int = Field(default=2, ge=0)
    """Invalid or missing structured answers tolerated."""
    context: ContextConfig = Field(default_factory=ContextConfig)
    """Context length and compression."""
    model_calls: ModelConfig = Field(default_factory=ModelConfig)
    """Retries, backoff, timeout and fallback of model calls."""
    token_counter: Any = None
    """Estimates tokens (a :class:`~fleetbus.agents.TokenCounter` with
    ``count_text`` too); ``None``: a tokenizer-free one."""
