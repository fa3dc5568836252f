"""The agent on the bus: the service that serves an agent's inbox, durable
sessions with leases and recovery, and remote agents (clients of a served
agent)."""

from fleetbus.agents.serving.remote import RemoteAgent
from fleetbus.agents.serving.service import AgentService
from fleetbus.agents.serving.sessions import SessionRecord, SessionStore

__all__ = ["AgentService", "RemoteAgent", "SessionRecord", "SessionStore"]
