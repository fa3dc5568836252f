"""Handoffs: an agent hands the conversation to another agent of the fleet.

The model gets one tool per handoff, ``transfer_to_<agent>`` (a triage agent
passing a question to a specialist, as the OpenAI Agents SDK's handoffs and
AutoGen's Swarm do). Calling it ends the reply ``handed_off`` once the step's
calls are answered; the final answer carries the conversation, through the
handoff's input filter, and names the agent (:class:`fleetbus.protocol.Handoff`).

Served on the bus, the agent's host sends the request on to that agent —
which may run in another process or on another host — carrying the
conversation, with the requester's call id and reply subject: the requester
gets its answer from whoever ends the reply. A later request in the same
session goes on to the agent that holds the conversation now. In one process,
:func:`follow_handoffs` does the same with local agents::

    triage = Agent("triage", "Route billing questions to billing.", model,
                   capabilities=[Handoffs(["billing"])])
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import msgspec

from fleetbus.agents.middleware import Middleware, ReplyContext, ToolLayer
from fleetbus.errors import ConfigError
from fleetbus.protocol import (
    ChatMessage,
    FinalAnswer,
    ToolResultBlock,
    ToolSpec,
    ToolUseBlock,
    UserRequest,
)

if TYPE_CHECKING:
    from fleetbus.agents.agent import Agent, ReplyInput
    from fleetbus.agents.capability import AgentView
    from fleetbus.agents.state import AgentState

__all__ = ["FILTERS", "HandoffTo", "Handoffs", "InputFilter", "follow_handoffs"]

InputFilter = Callable[[list[ChatMessage]], list[ChatMessage]]
"""What the agent taking a conversation over gets of it: the conversation
(without the system prompt) in, the messages to hand over out."""

FilterName = Literal["all", "no_tools", "last_user"]

_TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def _all(messages: list[ChatMessage]) -> list[ChatMessage]:
    return messages


def _no_tools(messages: list[ChatMessage]) -> list[ChatMessage]:
    out = []
    for message in messages:
        if message.role == "tool":
            continue
        content = [b for b in message.content if not isinstance(b, ToolUseBlock | ToolResultBlock)]
        if content:
            out.append(msgspec.structs.replace(message, content=content))
    return out


def _last_user(messages: list[ChatMessage]) -> list[ChatMessage]:
    for message in reversed(messages):
        if message.role == "user":
            return [message]
    return []


FILTERS: dict[str, InputFilter] = {"all": _all, "no_tools": _no_tools, "last_user": _last_user}
"""The input filters by name: ``all`` (the whole conversation, the default),
``no_tools`` (without tool calls and their results), ``last_user`` (the last
user message alone). Each is given the conversation without the hand-over's
own ``transfer_to_…`` calls and their results."""


@dataclass(frozen=True)
class HandoffTo:
    """One agent the conversation may be handed to.

    Args:
        agent: its name in the fleet.
        description: when to hand over, for the model (the tool's description).
        input_filter: what the agent gets of the conversation: a name of
            :data:`FILTERS` or a function.
        tool_name: the tool the model calls; ``transfer_to_<agent>`` (its
            characters other than letters, digits, ``_`` and ``-`` made ``_``).

    Raises:
        ConfigError: an empty agent name, an unknown filter, or a tool name
            a model cannot call.
    """

    agent: str
    description: str = ""
    input_filter: FilterName | InputFilter = "all"
    tool_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.agent, str) or not self.agent:
            raise ConfigError(f"a handoff names an agent, not {self.agent!r}")
        if isinstance(self.input_filter, str) and self.input_filter not in FILTERS:
            raise ConfigError(
                f"handoff to {self.agent}: unknown input filter {self.input_filter!r} "
                f"(one of {', '.join(FILTERS)}, or a function)"
            )
        if not isinstance(self.input_filter, str) and not callable(self.input_filter):
            raise ConfigError(f"handoff to {self.agent}: the input filter is not a function")
        if self.tool_name is not None and not isinstance(self.tool_name, str):
            raise ConfigError(f"handoff to {self.agent}: the tool name is not a string")
        if not _TOOL_NAME.match(self.tool):
            raise ConfigError(
                f"handoff to {self.agent}: {self.tool!r} is not a tool name "
                "(1-64 letters, digits, _ or -)"
            )

    @property
    def tool(self) -> str:
        """The name of the tool the model calls."""
        if self.tool_name is not None:
            return self.tool_name
        return "transfer_to_" + re.sub(r"[^A-Za-z0-9_-]", "_", self.agent)[:52]

    def filtered(self, messages: list[ChatMessage]) -> list[ChatMessage]:
        """``messages`` through the input filter.

        Raises:
            ConfigError: a filter function returned something else than a
                list of ``ChatMessage``.
        """
        chosen = self.input_filter
        function = FILTERS[chosen] if isinstance(chosen, str) else chosen
        out = function(list(messages))
        if not isinstance(out, list) or not all(isinstance(m, ChatMessage) for m in out):
            raise ConfigError(
                f"the input filter of the handoff to {self.agent} must return a list of "
                f"ChatMessage, not {type(out).__name__}"
            )
        return out

    def spec(self) -> ToolSpec:
        """The tool the model is offered."""
        when = f" {self.description.strip()}" if self.description.strip() else ""
        return ToolSpec(
            name=self.tool,
            description=(
                f"Hand the conversation over to the agent {self.agent}, which answers "
                f"from here on.{when}"
            ),
            parameters={
                "type": "object",
                "properties": {"reason": {"type": "string", "description": "Why, in a few words."}},
                "additionalProperties": False,
            },
        )


class Handoffs:
    """Let the agent hand the conversation to other agents.

    Args:
        targets: the agents, by name or as :class:`HandoffTo`.

    Raises:
        ConfigError: no target, a target named twice, or two with one tool name.
    """

    def __init__(self, targets: Sequence[str | HandoffTo]) -> None:
        if isinstance(targets, str):
            targets = [targets]
        made = [t if isinstance(t, HandoffTo) else HandoffTo(t) for t in targets]
        if not made:
            raise ConfigError("Handoffs needs at least one agent to hand over to")
        by_agent = {t.agent: t for t in made}
        by_tool = {t.tool: t for t in made}
        if len(by_agent) != len(made) or len(by_tool) != len(made):
            raise ConfigError("Handoffs: each agent, and each tool name, once")
        self.targets: tuple[HandoffTo, ...] = tuple(made)

    def middlewares(self, agent: AgentView) -> Sequence[Middleware]:
        """The layer offering the ``transfer_to_…`` tools.

        Raises:
            ConfigError: the agent would hand over to itself.
        """
        for target in self.targets:
            if target.agent == agent.name:
                raise ConfigError(f"agent {agent.name} cannot hand the conversation to itself")
        return (_HandoffLayer(self.targets),)

    def prepare_state(self, state: AgentState) -> None:
        """Nothing: handoffs keep no state of their own."""


class _HandoffLayer(ToolLayer):
    def __init__(self, targets: tuple[HandoffTo, ...]) -> None:
        super().__init__([t.spec() for t in targets])
        self._by_tool = {t.tool: t for t in targets}
        self._by_agent = {t.agent: t for t in targets}

    async def answer(self, ctx: ReplyContext, call: ToolUseBlock) -> ToolResultBlock:
        target = self._by_tool[call.name]
        reason = call.input.get("reason") if isinstance(call.input, dict) else None
        reason = reason.strip() if isinstance(reason, str) else ""
        said = f"Handed over to {target.agent}" + (f": {reason}" if reason else ".")
        if not ctx.end_after_step(
            "handed_off", said, handoff_to=target.agent, handoff_reason=reason
        ):
            return ToolResultBlock(
                id=call.id,
                name=call.name,
                output="Not handed over: this step already ends the reply.",
                state="error",
            )
        return ToolResultBlock(
            id=call.id,
            name=call.name,
            output=f"Handing the conversation over to {target.agent}.",
            state="success",
        )

    async def on_reply(
        self, ctx: ReplyContext, call_next: Callable[[], Awaitable[FinalAnswer]]
    ) -> FinalAnswer:
        final = await call_next()
        handoff = final.handoff
        target = self._by_agent.get(handoff.agent) if handoff is not None else None
        if handoff is None or target is None:
            return final
        messages = target.filtered(_without(handoff.messages, self._by_tool))
        return msgspec.structs.replace(
            final, handoff=msgspec.structs.replace(handoff, messages=messages)
        )


def _without(messages: list[ChatMessage], tools: Mapping[str, object]) -> list[ChatMessage]:
    """``messages`` without the calls of ``tools`` and their results (the
    hand-over itself: a model given it tends to call a tool it does not
    have), and without the messages left empty."""
    out = []
    for message in messages:
        content = [
            b
            for b in message.content
            if not (isinstance(b, ToolUseBlock | ToolResultBlock) and b.name in tools)
        ]
        if content:
            out.append(
                message
                if len(content) == len(message.content)
                else msgspec.structs.replace(message, content=content)
            )
    return out


async def follow_handoffs(
    agents: Mapping[str, Agent] | Sequence[Agent],
    first: str,
    inputs: ReplyInput,
    *,
    session_id: str | None = None,
    max_handoffs: int = 10,
    **reply_options: Any,
) -> FinalAnswer:
    """Reply with agent ``first`` in this process, and follow its handoffs:
    each agent handed the conversation replies to it in turn, until one
    ends the reply otherwise. The last answer is returned (its ``sender``
    is the agent that gave it).

    Args:
        agents: the agents, by name (or a list of them).
        first: the agent asked first.
        inputs: what ``Agent.reply`` takes.
        session_id: the conversation's session.
        max_handoffs: hand-overs at most; past them the reply ends ``error``.
        reply_options: more arguments for each ``Agent.reply``.

    Raises:
        ConfigError: an agent named that is not in ``agents``.
    """
    by_name = dict(agents) if isinstance(agents, Mapping) else {a.name: a for a in agents}

    def named(name: str) -> Agent:
        agent = by_name.get(name)
        if agent is None:
            raise ConfigError(f"no agent {name!r} to hand the conversation to")
        return agent

    final = await named(first).reply(inputs, session_id=session_id, **reply_options)
    for _ in range(max_handoffs):
        if final.handoff is None:
            return final
        request = UserRequest(
            content="",
            session_id=final.session_id,
            call_id=final.call_id,
            handoff=final.handoff,
        )
        final = await named(final.handoff.agent).reply(
            request, session_id=session_id, **reply_options
        )
    if final.handoff is None:
        return final
    return msgspec.structs.replace(
        final,
        content=f"Stopped after {max_handoffs} hand-overs: {final.content}",
        finished_reason="error",
        handoff=None,
    )
