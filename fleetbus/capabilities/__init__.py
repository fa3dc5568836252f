"""What an agent can be given beyond the loop, each a plug-in
(:class:`fleetbus.agents.Capability`) that hooks in through the middleware
and hint seams::

    from fleetbus.capabilities import Knowledge, Memory, Planning

    agent = Agent(
        "helper", "You help.", model,
        capabilities=[Knowledge([docs]), Memory(BusMemory()), Planning()],
    )

- :class:`Memory`: a long-term memory kept across conversations
  (:mod:`fleetbus.capabilities.memory`);
- :class:`Knowledge`: knowledge bases searched before the model reasons
  (:mod:`fleetbus.capabilities.knowledge`);
- :class:`Planning`: a plan notebook (:mod:`fleetbus.capabilities.plan`);
- :class:`Offloading`: long tool results kept whole and readable
  (:mod:`fleetbus.capabilities.offload`);
- :class:`SpeakReply`: the reply spoken (:mod:`fleetbus.capabilities.speech`);
- :class:`Talk`: ``send_message`` and ``publish`` to the fleet
  (:mod:`fleetbus.capabilities.talk`);
- :class:`Handoffs`: hand the conversation to another agent of the fleet
  (:mod:`fleetbus.capabilities.handoffs`);
- :class:`Guardrails`: checks of the input, the answer and the tool calls
  that stop a reply when they trip (:mod:`fleetbus.capabilities.guardrails`).
"""

from fleetbus.capabilities.guardrails import (
    GUARDRAIL_STAGES,
    VERDICT_SCHEMA,
    AgentGuardrail,
    Checked,
    FunctionGuardrail,
    Guardrail,
    GuardrailContext,
    GuardrailFunction,
    GuardrailResult,
    Guardrails,
    GuardrailStage,
    PatternGuardrail,
    guardrail,
)
from fleetbus.capabilities.handoffs import Handoffs, HandoffTo, follow_handoffs
from fleetbus.capabilities.knowledge import (
    BusKnowledgeBase,
    Knowledge,
    KnowledgeBase,
    KnowledgeConfig,
    KnowledgeHit,
    KnowledgeRetrieval,
    Passage,
)
from fleetbus.capabilities.memory import (
    BusMemory,
    LongTermMemory,
    LongTermMemoryConfig,
    LongTermMemoryMode,
    Memory,
    MemoryScope,
)
from fleetbus.capabilities.offload import Offloading
from fleetbus.capabilities.plan import Planning
from fleetbus.capabilities.sentences import SentenceSplitter
from fleetbus.capabilities.speech import SpeakReply, Utterance
from fleetbus.capabilities.talk import Talk, talk_tools

__all__ = [
    "GUARDRAIL_STAGES",
    "VERDICT_SCHEMA",
    "AgentGuardrail",
    "BusKnowledgeBase",
    "BusMemory",
    "Checked",
    "FunctionGuardrail",
    "Guardrail",
    "GuardrailContext",
    "GuardrailFunction",
    "GuardrailResult",
    "GuardrailStage",
    "Guardrails",
    "HandoffTo",
    "Handoffs",
    "Knowledge",
    "KnowledgeBase",
    "KnowledgeConfig",
    "KnowledgeHit",
    "KnowledgeRetrieval",
    "LongTermMemory",
    "LongTermMemoryConfig",
    "LongTermMemoryMode",
    "Memory",
    "MemoryScope",
    "Offloading",
    "Passage",
    "PatternGuardrail",
    "Planning",
    "SentenceSplitter",
    "SpeakReply",
    "Talk",
    "Utterance",
    "follow_handoffs",
    "guardrail",
    "talk_tools",
]
