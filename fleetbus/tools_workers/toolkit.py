"""The Toolkit: tools by name and group, local or served on the bus.

Anything with the :class:`ToolLike` shape can be in a toolkit: a local
:class:`~fleetbus.tools_workers.tool.Tool`, or a
:class:`~fleetbus.tools_workers.remote.RemoteToolProxy` that calls a tool
served by workers. An agent uses both the same way.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Collection, Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from fleetbus._imports import import_named
from fleetbus.bus import ToolClient
from fleetbus.errors import ToolDefinitionError, UnknownToolError
from fleetbus.protocol import ToolResult, ToolSpec
from fleetbus.tools_workers.remote import RemoteToolProxy
from fleetbus.tools_workers.skills import SKILL_TOOL_NAME, SkillTool, load_skills
from fleetbus.tools_workers.tool import DEFAULT_GROUP, Tool, tool_failure

if TYPE_CHECKING:
    from fleetbus.tools_workers.mcp import MCPTools

__all__ = ["ToolLike", "Toolkit", "load_toolkit"]


@runtime_checkable
class ToolLike(Protocol):
    """What a toolkit holds: a tool's description and a way to run it."""

    name: str
    description: str
    parameters: dict[str, Any]
    timeout: float | None
    concurrency_safe: bool
    external: bool
    group: str

    def spec(self) -> ToolSpec:
        """The tool as offered to a model."""
        ...

    async def run(
        self,
        parameters: Any,
        *,
        timeout: float | None = None,
        call_id: str | None = None,
        session_id: str | None = None,
    ) -> ToolResult:
        """Run it and say how it ended, as a ``tool_result``: ``tool_name``
        the tool's, ``call_id`` and ``session_id`` those of the call (as
        given; a call sent on the bus without a ``call_id`` gets one),
        ``sender`` the worker that answered, empty when nobody sent it (a
        local run). Never raises for what the tool does."""
        ...


class Toolkit:
    """Tools by name, in groups: local functions and tools served on the bus,
    used the same way.

    Groups the model switches on and off itself: a group given a description
    (``groups=``, :meth:`add_group`) or marked inactive (``active_groups=``,
    :meth:`set_active`) is *switchable*. An agent offers its model the tools
    of the groups that are not switchable, those of the switchable groups
    that are active, and the meta-tool ``switch_tool_groups`` listing every
    switchable group with its description; the model calls it to switch
    groups on and off, and a call of a tool whose group is off tells the
    model to switch the group on first. What is set here is where each
    session of the agent starts; what the model switches is kept in the
    session's state (``AgentState.active_groups``).

    Args:
        tools: tools (plain functions are made tools; remote tools are added
            as they are) to add.
        skills: skill folders, or folders of them, offered through one
            ``load_skill`` tool (see :meth:`add_skills`).
        groups: switchable groups, by name, with the description the model
            is shown to choose them by.
        active_groups: the groups active at the start of a session. Given,
            every group of ``groups`` and of the tools given here (but the
            ``default`` group) is switchable, and those not listed start
            inactive. ``None``: the groups of ``groups`` start active.

    Raises:
        ConfigError: ``skills`` names a folder without skills or an invalid ``SKILL.md``.
    """

    def __init__(
        self,
        tools: Iterable[ToolLike | Callable[..., Any]] = (),
        *,
        skills: str | Path | Iterable[str | Path] | None = None,
        groups: Mapping[str, str] | None = None,
        active_groups: Iterable[str] | None = None,
    ) -> None:
        self._tools: dict[str, ToolLike] = {}
        self._groups: dict[str, str] = {}
        self._switchable: dict[str, str] = {}
        """Switchable group -> its description."""
        self._inactive: set[str] = set()
        """The switchable groups a session starts without."""
        for t in tools:
            self.add(t)
        if skills is not None:
            self.add_skills(skills)
        described = dict(groups or {})
        if active_groups is None:
            for group, description in described.items():
                self.add_group(group, description)
        else:
            active = list(active_groups)
            named = [g for g in self._groups.values() if g != DEFAULT_GROUP]
            for group in dict.fromkeys([*described, *named, *active]):
                self.add_group(group, described.get(group, ""), active=group in active)

    def add_skills(
        self, skills: str | Path | Iterable[str | Path], *, name: str | None = None
    ) -> SkillTool:
        """Offer the skills in ``skills`` (skill folders, or folders of them:
        :func:`~fleetbus.tools_workers.skills.load_skills`) through the tool
        ``name`` (``load_skill``), made if absent, else given these skills too.

        Raises:
            ConfigError: a folder holds no skill, a ``SKILL.md`` is invalid,
                or two skills have the same name.
            ToolDefinitionError: ``name`` is taken by a tool that is not a skill tool.
        """
        tool_name = name or SKILL_TOOL_NAME
        loaded = load_skills(skills)
        found = self._tools.get(tool_name)
        if found is None:
            made = SkillTool(loaded, name=tool_name)
            self.add(made)
            return made
        if not isinstance(found, SkillTool):
            raise ToolDefinitionError(f"a tool named {tool_name!r} is already in the toolkit")
        made = found.with_skills(loaded)
        self._tools[tool_name] = made
        return made

    def add_mcp(self, server: MCPTools, *, group: str | None = None) -> list[str]:
        """Add every tool of an open MCP server (:class:`~fleetbus.tools_workers.MCPTools`);
        their names.

        Raises:
            ToolDefinitionError: a name is taken.
        """
        return [self.add(t, group=group).name for t in server.tools]

    async def add_a2a(
        self,
        url: str,
        *,
        name: str | None = None,
        headers: Mapping[str, str] | None = None,
        group: str | None = None,
    ) -> str:
        """Add the agent of an A2A server whose card is at ``url`` (the
        agent's URL, or its card's) as a tool
        (:class:`~fleetbus.tools_workers.a2a.A2AAgentTool`: named after the
        agent unless ``name`` is given, ``headers`` sent with every request);
        its name.

        Raises:
            ConfigError: a2a-sdk is not installed, or ``url`` is not HTTP(S).
            ToolError: the card could not be read.
            ToolDefinitionError: the name cannot be a tool's, or is taken.
        """
        from fleetbus.tools_workers.a2a import A2AAgentTool

        made = await A2AAgentTool.from_url(url, name=name, headers=headers)
        return self.add(made, group=group).name

    def add(self, item: ToolLike | Callable[..., Any], *, group: str | None = None) -> ToolLike:
        """Add a tool (a plain function is made one first).

        Raises:
            ToolDefinitionError: the function cannot be a tool, or the name is taken.
        """
        added: ToolLike = item if isinstance(item, ToolLike) else Tool(item)
        if added.name in self._tools and self._tools[added.name] is not added:
            raise ToolDefinitionError(f"a tool named {added.name!r} is already in the toolkit")
        self._tools[added.name] = added
        self._groups[added.name] = group or added.group
        return added

    def remove(self, name: str) -> None:
        """Remove a tool.

        Raises:
            UnknownToolError: no such tool.
        """
        self.get(name)
        del self._tools[name]
        del self._groups[name]

    def get(self, name: str) -> ToolLike:
        """The tool called ``name``.

        Raises:
            UnknownToolError: no such tool; the error lists those that exist.
        """
        try:
            return self._tools[name]
        except KeyError:
            raise UnknownToolError(name, list(self._tools)) from None

    def __contains__(self, name: object) -> bool:
        return name in self._tools

    def __iter__(self) -> Iterator[ToolLike]:
        return iter(self._tools.values())

    def __len__(self) -> int:
        return len(self._tools)

    @property
    def names(self) -> list[str]:
        """The tools' names, in the order they were added."""
        return list(self._tools)

    @property
    def groups(self) -> dict[str, list[str]]:
        """Tool names by group."""
        result: dict[str, list[str]] = {}
        for tool_name, group in self._groups.items():
            result.setdefault(group, []).append(tool_name)
        return result

    def add_group(self, name: str, description: str = "", *, active: bool = True) -> None:
        """Make the group ``name`` switchable by the model, with the
        ``description`` it chooses by, active at the start of a session or not.

        Raises:
            ToolDefinitionError: ``name`` is empty.
        """
        if not name:
            raise ToolDefinitionError("a tool group needs a name")
        self._switchable[name] = description or self._switchable.get(name, "")
        self.set_active(name, active)

    def set_active(self, group: str, active: bool) -> None:
        """Whether the tools of ``group`` are offered at the start of a
        session (the group becomes switchable by the model if it was not).

        Raises:
            ToolDefinitionError: ``group`` is empty.
        """
        if not group:
            raise ToolDefinitionError("a tool group needs a name")
        self._switchable.setdefault(group, "")
        if active:
            self._inactive.discard(group)
        else:
            self._inactive.add(group)

    @property
    def group_descriptions(self) -> dict[str, str]:
        """The switchable groups with their descriptions (empty: the model is
        offered every tool, and no meta-tool)."""
        return dict(self._switchable)

    @property
    def active_groups(self) -> list[str]:
        """The switchable groups active at the start of a session."""
        return [g for g in self._switchable if g not in self._inactive]

    def group_of(self, name: str) -> str | None:
        """The group of the tool ``name`` (``None``: no such tool)."""
        return self._groups.get(name)

    def active_specs(self, active: Collection[str]) -> list[ToolSpec]:
        """The specs of the tools offered when the switchable groups in
        ``active`` are on: those of the groups that are not switchable, and
        those of the active ones."""
        switchable = self._switchable
        groups = self._groups
        return [
            t.spec()
            for t in self._tools.values()
            if groups[t.name] not in switchable or groups[t.name] in active
        ]

    def in_groups(self, *groups: str) -> list[ToolLike]:
        """The tools of the given groups (all tools when none is given)."""
        return [t for t in self._tools.values() if not groups or self._groups[t.name] in groups]

    def specs(self, *groups: str) -> list[ToolSpec]:
        """The specs of the tools of the given groups (all when none given)."""
        return [t.spec() for t in self.in_groups(*groups)]

    def is_concurrency_safe(self, name: str) -> bool:
        """Whether calls of the tool may run in parallel (``False`` if unknown)."""
        found = self._tools.get(name)
        return found is not None and found.concurrency_safe

    def is_streaming(self, name: str) -> bool:
        """Whether the tool yields its result in chunks (``False`` if unknown):
        a local generator tool, or one served on the bus whose workers say
        it streams."""
        found = self._tools.get(name)
        return isinstance(found, Tool | RemoteToolProxy) and found.streams

    def is_external(self, name: str) -> bool:
        """Whether the tool is run outside the agent (``False`` if unknown)."""
        found = self._tools.get(name)
        return found is not None and found.external

    async def run(
        self,
        name: str,
        parameters: Any,
        *,
        timeout: float | None = None,
        call_id: str | None = None,
        session_id: str | None = None,
        on_chunk: Callable[[Any], Awaitable[None]] | None = None,
    ) -> ToolResult:
        """Run a tool by name and answer its ``tool_result`` (see
        :meth:`ToolLike.run`); an unknown name is an ``unknown_tool`` error.

        A streaming tool (:meth:`is_streaming`) hands each chunk to ``on_chunk``.
        Never raises for what the tool does, except ``CancelledError``.
        """
        found = self._tools.get(name)
        if found is None:
            message = str(UnknownToolError(name, list(self._tools)))
            return tool_failure(
                name, "error", "unknown_tool", message, call_id=call_id, session_id=session_id
            )
        if on_chunk is not None and isinstance(found, Tool | RemoteToolProxy) and found.streams:
            return await found.run(
                parameters,
                timeout=timeout,
                call_id=call_id,
                session_id=session_id,
                on_chunk=on_chunk,
            )
        return await found.run(parameters, timeout=timeout, call_id=call_id, session_id=session_id)

    async def add_remote(
        self,
        client: ToolClient,
        names: Iterable[str] | None = None,
        *,
        group: str = "remote",
        timeout: float = 0.5,
        exclude: Collection[str] = (),
    ) -> list[str]:
        """Add the tools served on the bus (all, or those named), discovered
        through ``client``; returns the names added. A name already in the
        toolkit is kept as it is (local tools win); a name in ``exclude`` is
        not added (with ``names=None``).

        Raises:
            UnknownToolError: a named tool is not served by any worker.
            BusError: discovery failed.
        """
        found = await client.discover(timeout=timeout)
        wanted = [n for n in found if n not in exclude] if names is None else list(names)
        missing = [n for n in wanted if n not in found]
        if missing:
            raise UnknownToolError(missing[0], list(found))
        added = []
        for tool_name in wanted:
            if tool_name not in self._tools:
                self.add(RemoteToolProxy(found[tool_name], client), group=group)
                added.append(tool_name)
        return added


def load_toolkit(spec: str) -> Toolkit:
    """The toolkit named by ``MODULE[:ATTR]``.

    ``ATTR`` may be a :class:`Toolkit`, a :class:`Tool`, a list of tools, or a
    function returning one of these. Without ``ATTR``: the module's
    ``toolkit`` attribute if it has one (a Toolkit, or a function returning
    one of these), else every ``Tool`` defined at its top level.

    Raises:
        ToolDefinitionError: the module or attribute cannot be loaded, or
            holds no tools.
        ConfigError: a factory refused its settings (``skills.toolkit``
            without ``FLEETBUS_SKILLS``).
    """
    module_name, _, attr = spec.partition(":")
    try:
        module = import_named(module_name)
    except ImportError as exc:
        raise ToolDefinitionError(f"cannot import {module_name!r}: {exc}") from exc
    if attr:
        try:
            target: Any = module
            for part in attr.split("."):
                target = getattr(target, part)
        except AttributeError:
            raise ToolDefinitionError(f"module {module_name!r} has no attribute {attr!r}") from None
    elif isinstance(getattr(module, "toolkit", None), Toolkit) or inspect.isfunction(
        getattr(module, "toolkit", None)
    ):
        target = module.toolkit
    else:
        target = [v for v in vars(module).values() if isinstance(v, Tool)]
    if callable(target) and not isinstance(target, Tool | Toolkit | RemoteToolProxy):
        target = target()
    if isinstance(target, Awaitable):
        raise ToolDefinitionError(f"{spec} is an async factory; give a sync one")
    if isinstance(target, Toolkit):
        kit = target
    elif isinstance(target, ToolLike):
        kit = Toolkit([target])
    elif isinstance(target, list | tuple) and all(isinstance(t, ToolLike) for t in target):
        kit = Toolkit(target)
    else:
        raise ToolDefinitionError(f"{spec} is not a Toolkit, a Tool or a list of tools")
    if not len(kit):
        raise ToolDefinitionError(f"{spec} holds no tools")
    return kit
