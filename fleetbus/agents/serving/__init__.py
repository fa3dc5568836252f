"""The agent on the bus: the host that serves many agents' inboxes, the
service that serves one agent's, durable
sessions (journals, leases, recovery), and remote agents (clients of a
served agent)."""

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
    "AgentHost",
    "AgentService",
    "AgentSource",
    "RemoteAgent",
    "SessionFact",
    "SessionJournals",
    "SessionRecord",
    "SessionStore",
]
