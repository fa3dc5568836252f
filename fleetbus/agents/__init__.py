"""The ReAct agent and what it is made of: models, memory, compression, plan,
permissions, middleware, events and state."""

from fleetbus.agents._reply import FINISH_TOOL
from fleetbus.agents.agent import Agent, ReplyInput
from fleetbus.agents.compression import (
    ApproxTokenCounter,
    CompressionResult,
    ContextConfig,
    Summary,
    TokenCounter,
)
from fleetbus.agents.messages import Msg
from fleetbus.agents.middleware import BudgetLimit, Middleware, ReplyContext, StepLogger, StopReply
from fleetbus.agents.model import (
    ChatModel,
    ModelConfig,
    ModelError,
    ModelRequest,
    ModelResponse,
    TextDelta,
    ThinkingDelta,
)
from fleetbus.agents.offload import DirectoryOffloader, ObjectStoreOffloader, Offloader
from fleetbus.agents.permissions import Decision, PermissionRule, Permissions
from fleetbus.agents.plan import Plan, PlanNotebook, SubTask
from fleetbus.agents.state import AgentState, PendingCall, ReplyState
from fleetbus.agents.tools import ToolSource

__all__ = [
    "FINISH_TOOL",
    "Agent",
    "AgentState",
    "ApproxTokenCounter",
    "BudgetLimit",
    "ChatModel",
    "CompressionResult",
    "ContextConfig",
    "Decision",
    "DirectoryOffloader",
    "Middleware",
    "ModelConfig",
    "ModelError",
    "ModelRequest",
    "ModelResponse",
    "Msg",
    "ObjectStoreOffloader",
    "Offloader",
    "PendingCall",
    "PermissionRule",
    "Permissions",
    "Plan",
    "PlanNotebook",
    "ReplyContext",
    "ReplyInput",
    "ReplyState",
    "StepLogger",
    "StopReply",
    "SubTask",
    "Summary",
    "TextDelta",
    "ThinkingDelta",
    "TokenCounter",
    "ToolSource",
]
