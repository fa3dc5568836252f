"""The ReAct agent and what it is made of — memory, compression, plan,
permissions, middleware, events, state, the capability seam — and agents on
the bus: the agent service, sessions in JetStream, remote agents, group
conversations. The models it reasons with are in :mod:`fleetbus.models`; the
capabilities it can be given (long-term memory, knowledge, planning,
offloading, speech, talk) in :mod:`fleetbus.capabilities`."""

from fleetbus.agents.agent import Agent, ReplyInput
from fleetbus.agents.capability import AgentView, Capability
from fleetbus.agents.compression import (
    ApproxTokenCounter,
    CompressionResult,
    ContextConfig,
    Summary,
    TokenCounter,
)
from fleetbus.agents.hub import MsgHub, Participant, fanout_pipeline, sequential_pipeline
from fleetbus.agents.messages import Msg
from fleetbus.agents.middleware import (
    BudgetLimit,
    Middleware,
    ReplyContext,
    StepLogger,
    StopReply,
    ToolLayer,
)
from fleetbus.agents.offload import DirectoryOffloader, ObjectStoreOffloader, Offloader
from fleetbus.agents.permissions import Decision, PermissionRule, Permissions
from fleetbus.agents.plan import Plan, PlanNotebook, SubTask
from fleetbus.agents.serving import (
    AgentHost,
    AgentService,
    AgentSource,
    RemoteAgent,
    SessionRecord,
    SessionStore,
)
from fleetbus.agents.settings import AgentSettings
from fleetbus.agents.state import AgentState, PendingCall, ReplyState
from fleetbus.agents.tools import ToolSource

__all__ = [
    "Agent",
    "AgentHost",
    "AgentService",
    "AgentSettings",
    "AgentSource",
    "AgentState",
    "AgentView",
    "ApproxTokenCounter",
    "BudgetLimit",
    "Capability",
    "CompressionResult",
    "ContextConfig",
    "Decision",
    "DirectoryOffloader",
    "Middleware",
    "Msg",
    "MsgHub",
    "ObjectStoreOffloader",
    "Offloader",
    "Participant",
    "PendingCall",
    "PermissionRule",
    "Permissions",
    "Plan",
    "PlanNotebook",
    "RemoteAgent",
    "ReplyContext",
    "ReplyInput",
    "ReplyState",
    "SessionRecord",
    "SessionStore",
    "StepLogger",
    "StopReply",
    "SubTask",
    "Summary",
    "TokenCounter",
    "ToolLayer",
    "ToolSource",
    "fanout_pipeline",
    "sequential_pipeline",
]
