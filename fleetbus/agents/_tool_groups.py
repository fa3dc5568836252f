"""Tool groups the model switches on and off: the ``switch_tool_groups``
meta-tool, which tools are on offer, and what a call of a switched-off
group's tool is told.

Which groups are on is the session's: ``AgentState.active_groups`` (``None``
until the model first switches: the toolkit's defaults), saved with the rest
of the state, so a take-over or a later reply of the session goes on with the
groups the model chose.
"""

from __future__ import annotations

import json
from typing import Any

from fleetbus.agents.state import AgentState
from fleetbus.agents.tools import SwitchableToolSource
from fleetbus.protocol import ToolSpec

__all__ = ["SWITCH_TOOL", "active_groups", "inactive_group", "switch", "switch_spec"]

SWITCH_TOOL = "switch_tool_groups"
"""The meta-tool's name."""


def active_groups(tools: SwitchableToolSource, state: AgentState) -> list[str]:
    """The switchable groups on in this session."""
    if state.active_groups is None:
        return tools.active_groups
    known = tools.group_descriptions
    return [g for g in state.active_groups if g in known]


def switch_spec(tools: SwitchableToolSource) -> ToolSpec:
    """The meta-tool: one optional boolean per switchable group; its
    description lists the groups with their descriptions."""
    described = tools.group_descriptions
    lines = [f"- {name}: {text}" if text else f"- {name}" for name, text in described.items()]
    properties = {
        name: {
            "type": "boolean",
            "description": (f"{text} " if text else "")
            + f"true: switch the group {name!r} on; false: off; omitted: unchanged.",
        }
        for name, text in described.items()
    }
    return ToolSpec(
        name=SWITCH_TOOL,
        description="Switch groups of tools on or off. Only the tools of the groups that are "
        "on are offered to you; switch on a group whose tools you need, and off one you no "
        "longer need. The groups:\n" + "\n".join(lines),
        parameters={"type": "object", "properties": properties, "additionalProperties": False},
    )


def switch(tools: SwitchableToolSource, state: AgentState, arguments: Any) -> tuple[bool, str]:
    """Run the meta-tool: switch the groups named in ``arguments`` in ``state``.

    Returns:
        whether it succeeded, and the text the model is shown.
    """
    described = tools.group_descriptions
    if not isinstance(arguments, dict):
        return False, "invalid_parameters: give a JSON object of group names to true or false."
    unknown = [k for k in arguments if k not in described]
    wrong = [k for k, v in arguments.items() if k in described and not isinstance(v, bool)]
    if unknown or wrong:
        problems = []
        if unknown:
            problems.append(f"no tool group {', '.join(map(repr, unknown))}")
        if wrong:
            problems.append(f"not true or false: {', '.join(map(repr, wrong))}")
        return False, (
            f"invalid_parameters: {'; '.join(problems)}. The groups: {', '.join(described)}."
        )
    on = set(active_groups(tools, state))
    for name, value in arguments.items():
        if value:
            on.add(name)
        else:
            on.discard(name)
    state.active_groups = [g for g in described if g in on]
    offered = [s.name for s in tools.active_specs(state.active_groups)]
    return True, (
        f"Tool groups on: {', '.join(state.active_groups) or 'none'}. "
        f"Tools offered from now on: {', '.join(offered) or 'none'}."
    )


def inactive_group(tools: SwitchableToolSource, state: AgentState, name: str) -> str | None:
    """What a call of the tool ``name`` is told when its group is off
    (``None``: it may run)."""
    group = tools.group_of(name)
    if group is None or group not in tools.group_descriptions:
        return None
    if group in active_groups(tools, state):
        return None
    arguments = json.dumps({group: True})
    return (
        f"inactive_group: the tool {name!r} is in the tool group {group!r}, which is off. "
        f"Switch it on first: call {SWITCH_TOOL} with {arguments}, then call {name} again."
    )
