"""Guardrails: checks beside the agent that stop a reply when they trip.

As the OpenAI Agents SDK defines them, in fleetbus's terms::

    from fleetbus.capabilities import (
        AgentGuardrail, GuardrailResult, Guardrails, PatternGuardrail, guardrail,
    )

    @guardrail
    def no_homework(checked, ctx):
        if "homework" in checked.text.lower():
            return GuardrailResult.trip("homework is not what this agent is for")
        return GuardrailResult.passed()

    agent = Agent("helper", "You help.", model, capabilities=[Guardrails(
        input=[no_homework, AgentGuardrail("moderator", bus=bus)],
        output=[PatternGuardrail([r"(?i)password\\s*[:=]"], name="no-secrets")],
        tools=[PatternGuardrail([r"rm -rf"], name="no-rm")],
    )])

The stages:

- ``input``: the reply's new input (the user messages memory got since the
  model last spoke), checked beside the reply's first model call — or before
  it, for a guardrail made with ``run_in_parallel=False``. The model's first
  message is used only once every input guardrail has passed: a trip stops
  the reply before any tool call of that step runs and before any answer.
- ``output``: the answer (text, or a structured answer with its JSON as
  text), before it is given.
- ``tool_input`` / ``tool_output``: each tool call before it runs, and its
  result before the model sees it; ``tools`` guardrails run at both. There a
  guardrail may also reject the call (it is not run; the model is told why)
  or replace the result the model sees.

A trip ends the reply with ``finished_reason`` ``guardrail_tripped``, the
final answer's ``guardrail`` naming the guardrail, the stage and the reason;
memory keeps an assistant message saying so (its ``metadata["guardrail"]``:
the trip), so the session's journal records it. The answer a trip refused is
neither given nor kept. Each check is a ``guardrail`` event of the reply.

A guardrail that fails (raises, times out, returns something else than a
:class:`GuardrailResult`) trips the reply with the failure as its reason —
it fails closed — unless it is declared ``fail_open``: then the check passes,
and its event says it failed.

The loop knows none of this: the capability's layer
(:mod:`~fleetbus.capabilities._guardrail_layer`) works through the
middleware seams — ``on_reasoning`` around the first step for the input,
``on_answer`` for the answer, ``on_tool_call`` for the tools, ``on_reply``
for the trip's record, ``ReplyContext.event`` for the events.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final, TypeAlias, overload

from fleetbus._imports import import_named
from fleetbus.agents.middleware import Middleware
from fleetbus.agents.serving.remote import MessageBus, RemoteAgent
from fleetbus.bus.subjects import check_name
from fleetbus.capabilities._guardrail_layer import CheckFailedError, GuardrailLayer, text_of
from fleetbus.capabilities._guardrail_types import (
    GUARDRAIL_STAGES,
    VERDICT_SCHEMA,
    Checked,
    Guardrail,
    GuardrailContext,
    GuardrailResult,
    GuardrailStage,
)
from fleetbus.errors import ConfigError
from fleetbus.protocol import new_id

if TYPE_CHECKING:
    from fleetbus.agents.capability import AgentView
    from fleetbus.agents.state import AgentState

__all__ = [
    "GUARDRAIL_STAGES",
    "VERDICT_SCHEMA",
    "AgentGuardrail",
    "Checked",
    "FunctionGuardrail",
    "Guardrail",
    "GuardrailContext",
    "GuardrailFunction",
    "GuardrailResult",
    "GuardrailStage",
    "Guardrails",
    "PatternGuardrail",
    "guardrail",
]

GuardrailFunction: TypeAlias = Callable[
    [Checked, GuardrailContext], GuardrailResult | Awaitable[GuardrailResult]
]
"""A function a :class:`FunctionGuardrail` runs: sync or async."""


class FunctionGuardrail(Guardrail):
    """A guardrail that is a function of what is checked and its context,
    sync or async, returning a :class:`GuardrailResult`.

    Args:
        function: the check.
        name: its name (the function's by default).
        run_in_parallel, fail_open, timeout: as :class:`Guardrail`.

    Raises:
        ConfigError: ``function`` is not callable, or a setting is out of range.
    """

    def __init__(
        self,
        function: GuardrailFunction,
        *,
        name: str | None = None,
        run_in_parallel: bool = True,
        fail_open: bool = False,
        timeout: float | None = None,
    ) -> None:
        if not callable(function):
            raise ConfigError(f"a function guardrail needs a function, not {function!r}")
        super().__init__(
            name or str(getattr(function, "__name__", "function")),
            run_in_parallel=run_in_parallel,
            fail_open=fail_open,
            timeout=timeout,
        )
        self.function = function

    async def check(self, checked: Checked, ctx: GuardrailContext) -> GuardrailResult:
        result = self.function(checked, ctx)
        if inspect.isawaitable(result):
            return await result
        return result  # (its type is checked by the layer that runs it)


@overload
def guardrail(function: GuardrailFunction, /) -> FunctionGuardrail: ...


@overload
def guardrail(
    *,
    name: str | None = None,
    run_in_parallel: bool = True,
    fail_open: bool = False,
    timeout: float | None = None,
) -> Callable[[GuardrailFunction], FunctionGuardrail]: ...


def guardrail(
    function: GuardrailFunction | None = None,
    /,
    *,
    name: str | None = None,
    run_in_parallel: bool = True,
    fail_open: bool = False,
    timeout: float | None = None,
) -> FunctionGuardrail | Callable[[GuardrailFunction], FunctionGuardrail]:
    """Make a function a :class:`FunctionGuardrail`: ``@guardrail`` or
    ``@guardrail(name=…, run_in_parallel=False, …)``."""

    def make(fn: GuardrailFunction) -> FunctionGuardrail:
        return FunctionGuardrail(
            fn, name=name, run_in_parallel=run_in_parallel, fail_open=fail_open, timeout=timeout
        )

    return make(function) if function is not None else make


class PatternGuardrail(Guardrail):
    """Trips when the checked text matches one of ``patterns`` (regular
    expressions, searched anywhere in it; ``(?i)`` for any case), naming it.

    Args:
        patterns: the expressions.
        name: its name.
        run_in_parallel, fail_open, timeout: as :class:`Guardrail`.

    Raises:
        ConfigError: no pattern, or one that is not a valid expression.
    """

    def __init__(
        self,
        patterns: Iterable[str | re.Pattern[str]],
        *,
        name: str = "patterns",
        run_in_parallel: bool = True,
        fail_open: bool = False,
        timeout: float | None = None,
    ) -> None:
        super().__init__(
            name, run_in_parallel=run_in_parallel, fail_open=fail_open, timeout=timeout
        )
        if isinstance(patterns, str | re.Pattern):
            patterns = [patterns]
        compiled: list[re.Pattern[str]] = []
        for pattern in patterns:
            if isinstance(pattern, re.Pattern):
                compiled.append(pattern)
                continue
            if not isinstance(pattern, str):
                raise ConfigError(f"guardrail {name!r}: a pattern is a string, not {pattern!r}")
            try:
                compiled.append(re.compile(pattern))
            except re.error as exc:
                raise ConfigError(f"guardrail {name!r}: bad pattern {pattern!r}: {exc}") from None
        if not compiled:
            raise ConfigError(f"guardrail {name!r} has no pattern")
        self.patterns = compiled

    async def check(self, checked: Checked, ctx: GuardrailContext) -> GuardrailResult:
        for pattern in self.patterns:
            if pattern.search(checked.text):
                return GuardrailResult.trip(
                    f"it matches the pattern '{pattern.pattern}'", info={"pattern": pattern.pattern}
                )
        return GuardrailResult.passed()


class AgentGuardrail(Guardrail):
    """Asks another agent of the fleet — a small, cheap model with a system
    prompt that says what to stop — whether to trip, through
    :class:`~fleetbus.agents.serving.RemoteAgent`: one request per check, in
    a session of its own, asking for a structured answer
    (:data:`VERDICT_SCHEMA`: ``tripped`` and ``reason``).

    An answer that is not a verdict (an ``error``, no structured answer), no
    answer within ``timeout``, or nobody serving the agent is a failure: the
    reply trips, unless ``fail_open``.

    Args:
        agent: the agent's name, or a :class:`RemoteAgent` of it.
        bus: the connection to ask it on (with a name); ``None`` until
            :meth:`bind` (``fleetbus agent`` binds the guardrails of the
            agents it serves to its own).
        name: the guardrail's name (the agent's by default).
        run_in_parallel, fail_open: as :class:`Guardrail`.
        timeout: seconds the agent has to answer.

    Raises:
        ConfigError: a name that cannot be an agent's, or a setting out of range.
    """

    def __init__(
        self,
        agent: str | RemoteAgent,
        *,
        bus: MessageBus | None = None,
        name: str | None = None,
        run_in_parallel: bool = True,
        fail_open: bool = False,
        timeout: float = 30.0,
    ) -> None:
        if isinstance(agent, RemoteAgent):
            self.agent_name = agent.name
            self._remote: RemoteAgent | None = agent
        else:
            self.agent_name = check_name(agent, what="guardrail agent name")
            self._remote = None
        super().__init__(
            name or self.agent_name,
            run_in_parallel=run_in_parallel,
            fail_open=fail_open,
            timeout=timeout,
        )
        self._bus = bus

    @property
    def bound(self) -> bool:
        """Whether it can ask its agent (it has a bus, or a :class:`RemoteAgent`)."""
        return self._remote is not None or self._bus is not None

    def bind(self, bus: MessageBus) -> None:
        """Ask the agent on ``bus`` from now on, unless it has a bus or a
        :class:`RemoteAgent` already."""
        if not self.bound:
            self._bus = bus

    async def check(self, checked: Checked, ctx: GuardrailContext) -> GuardrailResult:
        remote = self._remote
        if remote is None:
            if self._bus is None:
                raise CheckFailedError(
                    f"it is not bound to a bus (AgentGuardrail({self.agent_name!r}, bus=...))"
                )
            remote = self._remote = RemoteAgent(self._bus, self.agent_name)
        session = f"guardrail-{new_id()}"
        answer = await remote.reply(
            _question(checked, ctx),
            session_id=session,
            timeout=self.timeout,
            schema=VERDICT_SCHEMA,
        )
        verdict = answer.structured
        tripped = verdict.get("tripped") if verdict is not None else None
        reason = verdict.get("reason") if verdict is not None else None
        if (
            answer.finished_reason != "completed"
            or not isinstance(tripped, bool)
            or not isinstance(reason, str)
        ):
            said = text_of(answer.content)
            raise CheckFailedError(
                f"the agent {self.agent_name!r} gave no verdict "
                f"({answer.finished_reason}: {said[:200]})"
            )
        info = {"agent": self.agent_name, "session_id": session}
        if tripped:
            return GuardrailResult.trip(reason or "the agent said so", info=info)
        return GuardrailResult(reason=reason, info=info)


def _question(checked: Checked, ctx: GuardrailContext) -> str:
    """What an :class:`AgentGuardrail` asks its agent."""
    tool = checked.call.name if checked.call is not None else "?"
    what = {
        "input": f"the request made to the agent {ctx.agent_name!r}",
        "output": f"the answer of the agent {ctx.agent_name!r}",
        "tool_input": f"the arguments of a call of the tool {tool!r} by the agent "
        f"{ctx.agent_name!r}",
        "tool_output": f"the result of the tool {tool!r} called by the agent {ctx.agent_name!r}",
    }[ctx.stage]
    return (
        f"Check {what}, between the lines <<< and >>> below. Answer with tripped: true "
        "if it must be stopped, false if it may pass, and the reason in one sentence.\n"
        f"<<<\n{checked.text}\n>>>"
    )


class Guardrails:
    """The guardrails capability: checks of an agent's input, output and
    tool calls, each a :class:`Guardrail`.

    Args:
        input: run on the reply's new input, beside (or before) its first
            model call.
        output: run on the answer before it is given.
        tools: run before every tool call and on every result.
        tool_input: run before every tool call only.
        tool_output: run on every result only.

    Input and output guardrails of a stage run at once, the first trip
    stopping the others; tool guardrails run one after another, in order (a
    rejection stops the checks of that call, a replacement is what the next
    one checks).

    Raises:
        ConfigError: an item that is not a :class:`Guardrail`.
    """

    def __init__(
        self,
        *,
        input: Iterable[Guardrail] = (),
        output: Iterable[Guardrail] = (),
        tools: Iterable[Guardrail] = (),
        tool_input: Iterable[Guardrail] = (),
        tool_output: Iterable[Guardrail] = (),
    ) -> None:
        given = {
            "input": input,
            "output": output,
            "tools": tools,
            "tool_input": tool_input,
            "tool_output": tool_output,
        }
        lists: dict[str, tuple[Guardrail, ...]] = {}
        for stage, items in given.items():
            if isinstance(items, Guardrail):
                items = [items]
            checked = tuple(items)
            for item in checked:
                if not isinstance(item, Guardrail):
                    raise ConfigError(
                        f"Guardrails({stage}=...): {item!r} is not a guardrail "
                        "(a Guardrail: @guardrail, PatternGuardrail, AgentGuardrail…)"
                    )
            lists[stage] = checked
        self.input = lists["input"]
        self.output = lists["output"]
        self.tool_input = (*lists["tools"], *lists["tool_input"])
        self.tool_output = (*lists["tools"], *lists["tool_output"])

    def __repr__(self) -> str:
        def names(items: tuple[Guardrail, ...]) -> list[str]:
            return [g.name for g in items]

        return (
            f"Guardrails(input={names(self.input)}, output={names(self.output)}, "
            f"tool_input={names(self.tool_input)}, tool_output={names(self.tool_output)})"
        )

    @property
    def guardrails(self) -> list[Guardrail]:
        """Every guardrail, each once."""
        seen: dict[int, Guardrail] = {}
        for g in (*self.input, *self.output, *self.tool_input, *self.tool_output):
            seen.setdefault(id(g), g)
        return list(seen.values())

    def bind(self, bus: MessageBus) -> None:
        """Bind the agent guardrails without a bus to ``bus``."""
        for g in self.guardrails:
            if isinstance(g, AgentGuardrail):
                g.bind(bus)

    @classmethod
    def from_table(cls, table: Mapping[str, Any], *, where: str = "guardrails") -> Guardrails:
        """The guardrails a fleet file's ``[agent.NAME.guardrails]`` table
        declares: the keys ``input``, ``output``, ``tools``, ``tool_input``
        and ``tool_output``, each a list of entries, an entry one of::

            { patterns = ["(?i)password"], name = "no-secrets" }
            { agent = "moderator", timeout = 10.0, fail_open = false }
            { function = "mychecks:no_homework", run_in_parallel = false }

        ``name``, ``run_in_parallel``, ``fail_open`` and ``timeout`` are
        optional in each; a ``function`` is ``module:attr``, a function of
        ``(checked, ctx)`` or a :class:`Guardrail` (whose settings the entry
        cannot change). An agent guardrail is bound to a bus later
        (:meth:`bind`).

        Raises:
            ConfigError: an unknown key, an entry that is not one of these, a
                value of the wrong type, a function that cannot be imported;
                the message names ``where`` and the entry.
        """
        if not isinstance(table, Mapping):
            raise ConfigError(f"{where} is not a table")
        unknown = set(table) - {"input", "output", "tools", "tool_input", "tool_output"}
        if unknown:
            raise ConfigError(
                f"{where}: unknown key(s) {', '.join(sorted(unknown))} "
                "(input, output, tools, tool_input, tool_output)"
            )
        lists: dict[str, list[Guardrail]] = {}
        for stage, entries in table.items():
            if not isinstance(entries, list):
                raise ConfigError(f"{where}.{stage} is a list of guardrails")
            lists[stage] = [
                _from_entry(entry, f"{where}.{stage}[{index}]")
                for index, entry in enumerate(entries)
            ]
        return cls(**lists)

    def middlewares(self, agent: AgentView) -> Sequence[Middleware]:
        """The layer that runs the checks, one for each reply."""
        return (GuardrailLayer(self.input, self.output, self.tool_input, self.tool_output),)

    def prepare_state(self, state: AgentState) -> None:
        """Nothing: a trip is kept in memory, where the reply ends."""


_ENTRY_KEYS: Final = frozenset(
    {"patterns", "agent", "function", "name", "run_in_parallel", "fail_open", "timeout"}
)


def _from_entry(entry: Any, where: str) -> Guardrail:
    """One guardrail of a fleet file (see :meth:`Guardrails.from_table`)."""
    if not isinstance(entry, Mapping):
        raise ConfigError(f"{where} is not a table ({{ patterns = [...] }}, {{ agent = ... }}…)")
    unknown = set(entry) - _ENTRY_KEYS
    if unknown:
        raise ConfigError(
            f"{where}: unknown key(s) {', '.join(sorted(unknown))} "
            f"({', '.join(sorted(_ENTRY_KEYS))})"
        )
    kinds = [k for k in ("patterns", "agent", "function") if k in entry]
    if len(kinds) != 1:
        raise ConfigError(f"{where}: give one of patterns, agent or function")
    options: dict[str, Any] = {}
    for key, expected in (("name", str), ("run_in_parallel", bool), ("fail_open", bool)):
        if key in entry:
            if not isinstance(entry[key], expected):
                raise ConfigError(f"{where}.{key} is a {expected.__name__}, not {entry[key]!r}")
            options[key] = entry[key]
    if "timeout" in entry:
        options["timeout"] = entry["timeout"]
    kind = kinds[0]
    value = entry[kind]
    try:
        if kind == "patterns":
            if not isinstance(value, list) or not all(isinstance(p, str) for p in value):
                raise ConfigError("patterns is a list of regular expressions (strings)")
            return PatternGuardrail(value, **options)
        if kind == "agent":
            if not isinstance(value, str):
                raise ConfigError(f"agent is the name of an agent, not {value!r}")
            return AgentGuardrail(value, **options)
        return _function_guardrail(value, options)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None


def _function_guardrail(spec: Any, options: dict[str, Any]) -> Guardrail:
    """The guardrail ``module:attr`` names: a :class:`Guardrail`, or a function made one."""
    if not isinstance(spec, str) or ":" not in spec:
        raise ConfigError(f"function is 'module:attr', not {spec!r}")
    module_name, _, attr = spec.partition(":")
    try:
        target = getattr(import_named(module_name), attr)
    except ImportError as exc:
        raise ConfigError(f"cannot import {module_name!r}: {exc}") from None
    except AttributeError:
        raise ConfigError(f"module {module_name!r} has no attribute {attr!r}") from None
    if isinstance(target, Guardrail):
        if options:
            raise ConfigError(
                f"{spec} is a guardrail already: its settings are its own "
                f"({', '.join(sorted(options))} cannot be given here)"
            )
        return target
    if not callable(target):
        raise ConfigError(f"{spec} is neither a guardrail nor a function")
    return FunctionGuardrail(target, **options)
