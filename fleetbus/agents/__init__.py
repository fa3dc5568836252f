"""The ReAct agent and what it is made of — memory, compression, plan,
permissions, middleware, events, state — and agents on the bus: the agent
service, sessions in JetStream, remote agents, group conversations. The
models it reasons with are in :mod:`fleetbus.models`."""

from fleetbus.agents.agent import Agent, ReplyInput
from fleetbus.agents.compression import (
    ApproxTokenCounter,
    CompressionResult,
    ContextConfig,
    Summary,
    TokenCounter,
)
from fleetbus.agents.hub import MsgHub, Participant, fanout_pipeline, sequential_pipeline
from fleetbus.agents.knowledge import (
    BusKnowledgeBase,
    KnowledgeBase,
    KnowledgeConfig,
    KnowledgeHit,
    KnowledgeRetrieval,
    Passage,
)
from fleetbus.agents.long_term_memory import (
    BusMemory,
    LongTermMemory,
    LongTermMemoryConfig,
    LongTermMemoryMode,
    MemoryScope,
)
from fleetbus.agents.messages import Msg
from fleetbus.agents.middleware import BudgetLimit, Middleware, ReplyContext, StepLogger, StopReply
from fleetbus.agents.offload import DirectoryOffloader, ObjectStoreOffloader, Offloader
from fleetbus.agents.permissions import Decision, PermissionRule, Permissions
from fleetbus.agents.plan import Plan, PlanNotebook, SubTask
from fleetbus.agents.sentences import SentenceSplitter
from fleetbus.agents.serving import (
    AgentHost,
    AgentService,
    AgentSource,
    RemoteAgent,
    SessionRecord,
    SessionStore,
)
from fleetbus.agents.speech import SpeakReply, Utterance
from fleetbus.agents.state import AgentState, PendingCall, ReplyState
from fleetbus.agents.talk import talk_tools
from fleetbus.agents.tools import ToolSource

__all__ = [
    "Agent",
    "AgentHost",
    "AgentService",
    "AgentSource",
    "AgentState",
    "ApproxTokenCounter",
    "BudgetLimit",
    "BusKnowledgeBase",
    "BusMemory",
    "CompressionResult",
    "ContextConfig",
    "Decision",
    "DirectoryOffloader",
    "KnowledgeBase",
    "KnowledgeConfig",
    "KnowledgeHit",
    "KnowledgeRetrieval",
    "LongTermMemory",
    "LongTermMemoryConfig",
    "LongTermMemoryMode",
    "MemoryScope",
    "Middleware",
    "Msg",
    "MsgHub",
    "ObjectStoreOffloader",
    "Offloader",
    "Participant",
    "Passage",
    "PendingCall",
    "PermissionRule",
    "Permissions",
    "Plan",
    "PlanNotebook",
    "RemoteAgent",
    "ReplyContext",
    "ReplyInput",
    "ReplyState",
    "SentenceSplitter",
    "SessionRecord",
    "SessionStore",
    "SpeakReply",
    "StepLogger",
    "StopReply",
    "SubTask",
    "Summary",
    "TokenCounter",
    "ToolSource",
    "Utterance",
    "fanout_pipeline",
    "sequential_pipeline",
    "talk_tools",
]
