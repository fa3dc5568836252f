"""fleetbus: fleets of cooperating LLM agents, tool workers and model workers
over NATS.

The names a user types are here; everything else is reached through its
subpackage (``fleetbus.protocol``, ``fleetbus.bus``, ``fleetbus.tools_workers``,
``fleetbus.models``, ``fleetbus.agents``, ``fleetbus.testing``).
"""

from fleetbus._version import __version__
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
from fleetbus.tools_workers import Tool, Toolkit, ToolWorker, tool

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
