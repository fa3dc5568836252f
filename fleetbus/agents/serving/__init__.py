"""The agent on the bus: the host that serves many agents' inboxes, the
service that serves one agent's, durable
sessions (journals, leases, recovery), remote agents (clients of a
served agent), and the agents' directory (which agents are served)."""

from fleetbus.agents.serving.directory import (
    AGENT_SERVICE_NAME,
    AgentInfo,
    ToolInfo,
    discover_agents,
)
from fleetbus.agents.serving.host import AgentHost, AgentSource
from fleetbus.agents.serving.remote import RemoteAgent
from fleetbus.agents.serving.service import AgentService
from fleetbus.agents.serving.sessions import (
    SessionFact,
    SessionJournals,
    SessionRecord,
    SessionStore,
)

__all__ = [
    "AGENT_SERVICE_NAME",
    "AgentHost",
    "AgentInfo",
    "AgentService",
    "AgentSource",
    "RemoteAgent",
    "SessionFact",
    "SessionJournals",
    "SessionRecord",
    "SessionStore",
    "ToolInfo",
    "discover_agents",
]
