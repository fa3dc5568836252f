"""The ReAct agent and what it is made of — models, memory, compression, plan,
permissions, middleware, events, state — and agents on the bus: the agent
service, sessions in JetStream, remote agents, group conversations."""

from typing import TYPE_CHECKING, Any

from fleetbus.agents._reply_scope import FINISH_TOOL
from fleetbus.agents.agent import Agent, ReplyInput
from fleetbus.agents.bus_model import BusChatModel
from fleetbus.agents.compression import (
    ApproxTokenCounter,
    CompressionResult,
    ContextConfig,
    Summary,
    TokenCounter,
)
from fleetbus.agents.defaults import default_model, describe_default_model
from fleetbus.agents.hub import MsgHub, Participant, fanout_pipeline, sequential_pipeline
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
from fleetbus.agents.model_worker import ModelWorker
from fleetbus.agents.offline import OfflineModel
from fleetbus.agents.offload import DirectoryOffloader, ObjectStoreOffloader, Offloader
from fleetbus.agents.permissions import Decision, PermissionRule, Permissions
from fleetbus.agents.plan import Plan, PlanNotebook, SubTask
from fleetbus.agents.serving import AgentService, RemoteAgent, SessionRecord, SessionStore
from fleetbus.agents.state import AgentState, PendingCall, ReplyState
from fleetbus.agents.tools import ToolSource

if TYPE_CHECKING:
    from fleetbus.agents.openai_model import OpenAIChatModel, OpenAIConfig


def __getattr__(name: str) -> Any:
    # The OpenAI adapter imports the openai SDK (~0.7 s): only when asked for.
    if name in ("OpenAIChatModel", "OpenAIConfig"):
        from fleetbus.agents import openai_model

        return getattr(openai_model, name)
    raise AttributeError(f"module 'fleetbus.agents' has no attribute {name!r}")


__all__ = [
    "FINISH_TOOL",
    "Agent",
    "AgentService",
    "AgentState",
    "ApproxTokenCounter",
    "BudgetLimit",
    "BusChatModel",
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
    "ModelWorker",
    "Msg",
    "MsgHub",
    "ObjectStoreOffloader",
    "OfflineModel",
    "Offloader",
    "OpenAIChatModel",
    "OpenAIConfig",
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
    "TextDelta",
    "ThinkingDelta",
    "TokenCounter",
    "ToolSource",
    "default_model",
    "describe_default_model",
    "fanout_pipeline",
    "sequential_pipeline",
]
