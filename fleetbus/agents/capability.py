"""The capability seam: what an agent is given beyond the loop.

A capability — a long-term memory, knowledge bases, a plan notebook, an
offloader of long tool results, speech, talk — hooks into a reply only
through the seams every middleware has (:mod:`fleetbus.agents.middleware`):
the hooks around the reply, the model calls and the tool calls, hints added
to a model call's messages, and the tools a layer offers and answers itself
(:meth:`~fleetbus.agents.middleware.Middleware.tools`). The loop knows none
of them by name. The built-in ones are in :mod:`fleetbus.capabilities`::

    agent = Agent("helper", "You help.", model, capabilities=[Planning(), Knowledge([docs])])
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from fleetbus.agents.settings import AgentSettings
from fleetbus.models.model import ChatModel

if TYPE_CHECKING:
    from fleetbus.agents.middleware import Middleware
    from fleetbus.agents.state import AgentState

__all__ = ["AgentView", "Capability"]


class AgentView(Protocol):
    """What a capability sees of the agent it is given to
    (:class:`fleetbus.agents.Agent` is one)."""

    @property
    def name(self) -> str:
        """The agent's name."""
        ...

    @property
    def model(self) -> ChatModel:
        """The model it reasons with."""
        ...

    @property
    def settings(self) -> AgentSettings:
        """The loop's settings (its context's ``tool_result_limit`` among them)."""
        ...


@runtime_checkable
class Capability(Protocol):
    """What an agent can be given beyond the loop, as a plug-in.

    An agent asks each of its capabilities for its layers when a reply
    starts, and lets it set up the state of each new session.
    """

    def middlewares(self, agent: AgentView) -> Sequence[Middleware]:
        """The layers this capability adds to a reply of ``agent``.

        They wrap the agent's own middleware, in the order of the agent's
        ``capabilities`` (the first outermost), so every layer of the agent
        sees the hints they add. Called as each reply starts: what the agent
        has then (its model, its settings) holds for that reply.
        """
        ...

    def prepare_state(self, state: AgentState) -> None:
        """Set up ``state``: the agent's when it is built, and each new
        session's (:meth:`fleetbus.agents.Agent.initial_state`); a restored
        state is left as it was saved."""
        ...
