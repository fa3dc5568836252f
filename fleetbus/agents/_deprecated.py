"""The keywords ``Agent`` took before capabilities and :class:`AgentSettings`,
kept for one release: each still works, with a ``DeprecationWarning`` naming
what replaces it.

The capabilities the old keywords stand for live in the layer above
(:mod:`fleetbus.capabilities`), which :mod:`fleetbus.agents` does not
import but here: :func:`_capabilities` imports it when an old keyword needs
it. The layering contract (``pyproject.toml``, ``[tool.importlinter]``)
names that import as its one exception, which goes with the old keywords.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, Final, TypedDict

import pydantic

from fleetbus.agents.compression import ContextConfig, TokenCounter
from fleetbus.agents.offload import Offloader
from fleetbus.agents.plan import PlanNotebook
from fleetbus.agents.settings import AgentSettings
from fleetbus.agents.tools import error_text
from fleetbus.errors import ConfigError
from fleetbus.models.model import ModelConfig

if TYPE_CHECKING:
    from fleetbus.agents.capability import Capability

__all__ = ["OLD_KEYWORDS", "OldKeywords", "from_old_keywords"]

_SETTINGS: Final = {
    "max_iters": "max_iters",
    "parallel_tool_calls": "parallel_tool_calls",
    "tool_timeout": "tool_timeout",
    "max_repeated_failures": "max_repeated_failures",
    "max_repeated_calls": "max_repeated_calls",
    "structured_retries": "structured_retries",
    "token_counter": "token_counter",
    "context": "context",
    "model_config": "model_calls",
}
"""Old keyword → the :class:`AgentSettings` field that replaces it."""

_CAPABILITIES: Final = {
    "knowledge": "Knowledge(bases, config)",
    "knowledge_config": "Knowledge(bases, config)",
    "long_term_memory": "Memory(store, mode=…, config=…)",
    "long_term_memory_mode": "Memory(store, mode=…, config=…)",
    "long_term_memory_config": "Memory(store, mode=…, config=…)",
    "plan": "Planning()",
    "offloader": "Offloading(offloader)",
}
"""Old keyword → the capability (``fleetbus.capabilities``) that replaces it."""

OLD_KEYWORDS: Final = frozenset(_SETTINGS) | frozenset(_CAPABILITIES)
"""Every keyword still taken with a warning."""


class OldKeywords(TypedDict, total=False):
    """The old keywords and their types, as ``Agent`` took them."""

    max_iters: int
    parallel_tool_calls: bool
    tool_timeout: float | None
    max_repeated_failures: int
    max_repeated_calls: int | None
    structured_retries: int
    token_counter: TokenCounter | None
    context: ContextConfig | None
    model_config: ModelConfig | None
    plan: bool | PlanNotebook
    offloader: Offloader | None
    long_term_memory: Any
    long_term_memory_mode: str
    long_term_memory_config: Any
    knowledge: Iterable[Any]
    knowledge_config: Any


def from_old_keywords(
    old: Mapping[str, Any], settings: AgentSettings | None
) -> tuple[AgentSettings | None, list[Capability], PlanNotebook | None]:
    """The settings, the capabilities (in the order the agent used to layer
    them: knowledge, memory, plan, offloading) and the plan notebook to start
    from that the old keywords ``old`` ask for; warns once.

    Raises:
        TypeError: a keyword ``Agent`` never took.
        ConfigError: a setting given both ways, or a value out of range.
    """
    unknown = sorted(set(old) - OLD_KEYWORDS)
    if unknown:
        raise TypeError(f"Agent() got an unexpected keyword argument {unknown[0]!r}")
    instead = sorted(
        {f"settings=AgentSettings({_SETTINGS[k]}=…)" for k in old if k in _SETTINGS}
        | {f"capabilities=[{_CAPABILITIES[k]}]" for k in old if k in _CAPABILITIES}
    )
    where = " (fleetbus.capabilities)" if any(k in _CAPABILITIES for k in old) else ""
    warnings.warn(
        f"Agent({', '.join(f'{k}=' for k in sorted(old))}) is deprecated: "
        f"use {', '.join(instead)}{where}",
        DeprecationWarning,
        stacklevel=3,
    )
    fields = {_SETTINGS[k]: v for k, v in old.items() if k in _SETTINGS}
    if fields:
        if settings is not None:
            raise ConfigError("give settings=AgentSettings(…) or the old keywords, not both")
        fields = {k: v for k, v in fields.items() if v is not None or k in _NULLABLE}
        try:
            settings = AgentSettings(**fields)
        except pydantic.ValidationError as exc:
            raise ConfigError(f"agent settings: {error_text(exc)}") from exc
    return settings, *_capabilities(old)


_NULLABLE: Final = frozenset({"tool_timeout", "max_repeated_calls", "token_counter"})
"""Settings for which ``None`` is a value (the others took ``None`` as "the default")."""


def _capabilities(old: Mapping[str, Any]) -> tuple[list[Capability], PlanNotebook | None]:
    from fleetbus import capabilities as above  # the one import upwards (see above)

    found: list[Capability] = []
    knowledge = list(old.get("knowledge") or ())
    if knowledge:
        found.append(above.Knowledge(knowledge, old.get("knowledge_config")))
    memory = old.get("long_term_memory")
    if memory is not None:
        found.append(
            above.Memory(
                memory,
                mode=old.get("long_term_memory_mode", "static"),
                config=old.get("long_term_memory_config"),
            )
        )
    plan = old.get("plan", False)
    if plan is not False:
        found.append(above.Planning())
    offloader = old.get("offloader")
    if offloader is not None:
        found.append(above.Offloading(offloader))
    return found, plan if isinstance(plan, PlanNotebook) else None
