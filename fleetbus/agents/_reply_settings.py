"""What a reply reads of its agent: :class:`ReplySettings`, one frozen value.

The parts of the loop (:mod:`fleetbus.agents._reply` and its collaborators)
take it instead of the :class:`fleetbus.agents.Agent`, so none of them imports
the agent module.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fleetbus.agents.compression import ContextConfig
from fleetbus.agents.middleware import Middleware
from fleetbus.agents.permissions import RuleBook
from fleetbus.agents.tools import ToolSource
from fleetbus.models.model import ChatModel, ModelConfig

__all__ = ["ReplySettings"]


@dataclass(frozen=True, slots=True)
class ReplySettings:
    """The agent's settings, as one reply runs with them.

    The fields are the :class:`fleetbus.agents.Agent` arguments and the
    :class:`fleetbus.agents.AgentSettings` fields of the same names;
    ``middlewares`` are the capabilities' layers around the agent's own. The
    agent takes them when a reply starts: its attributes stay plain and
    assignable (``fleetbus fleet`` gives an agent a toolkit after building
    it), and a new value holds from the next reply.
    """

    name: str
    system_prompt: str
    model: ChatModel
    toolkit: ToolSource | None
    max_iters: int
    parallel_tool_calls: bool
    middlewares: tuple[Middleware, ...]
    context: ContextConfig
    model_config: ModelConfig
    # Any, as on the agent: the loop calls count_text, which TokenCounter
    # (the protocol) does not declare.
    token_counter: Any
    tool_timeout: float | None
    max_repeated_failures: int
    max_repeated_calls: int | None
    structured_retries: int
    accepted_rules: RuleBook | None = None
