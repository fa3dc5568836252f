"""fleetbus: fleets of cooperating LLM agents, tool workers and model workers
over NATS.

The names a user types are here; everything else is reached through its
subpackage (``fleetbus.protocol``, ``fleetbus.bus``, ``fleetbus.tools_workers``,
``fleetbus.models``, ``fleetbus.agents``, ``fleetbus.testing``).

They are imported when first used (PEP 562): a process that needs only the
bus and the tools — a tool worker, ``fleetbus call`` — starts without
importing the agent and the model adapters.
"""

import importlib as _importlib
import typing as _typing

from fleetbus._version import __version__

if _typing.TYPE_CHECKING:
    from fleetbus.agents import (
        Agent,
        AgentHost,
        AgentService,
        AgentState,
        BudgetLimit,
        ContextConfig,
        MsgHub,
        Permissions,
        RemoteAgent,
        StepLogger,
    )
    from fleetbus.bus import Bus, ConnectOptions, EmbeddedServer, RemoteTool, ToolClient
    from fleetbus.errors import FleetbusError
    from fleetbus.models import ModelConfig
    from fleetbus.tools_workers import Tool, Toolkit, ToolWorker
    from fleetbus.tools_workers.tool import tool

_HOMES = {
    "fleetbus.agents": (
        "Agent", "AgentHost", "AgentService", "AgentState", "BudgetLimit", "ContextConfig",
        "MsgHub", "Permissions", "RemoteAgent", "StepLogger",
    ),
    "fleetbus.bus": ("Bus", "ConnectOptions", "EmbeddedServer", "RemoteTool", "ToolClient"),
    "fleetbus.errors": ("FleetbusError",),
    "fleetbus.models": ("ModelConfig",),
    "fleetbus.tools_workers": ("Tool", "Toolkit", "ToolWorker", "tool"),
}  # fmt: skip
_HOME_OF = {name: module for module, names in _HOMES.items() for name in names}

__all__ = [
    "Agent",
    "AgentHost",
    "AgentService",
    "AgentState",
    "BudgetLimit",
    "Bus",
    "ConnectOptions",
    "ContextConfig",
    "EmbeddedServer",
    "FleetbusError",
    "ModelConfig",
    "MsgHub",
    "Permissions",
    "RemoteAgent",
    "RemoteTool",
    "StepLogger",
    "Tool",
    "ToolClient",
    "ToolWorker",
    "Toolkit",
    "__version__",
    "tool",
]


def __getattr__(name: str) -> _typing.Any:
    home = _HOME_OF.get(name)
    if home is None:
        raise AttributeError(f"module 'fleetbus' has no attribute {name!r}")
    value = getattr(_importlib.import_module(home), name)
    globals()[name] = value  # found once
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
