"""Tool permission rules an agent checks before a tool call leaves it.

A rule is an action (``allow``, ``deny`` or ``ask``) and a pattern written as
text::

    *                                   every tool
    read_*                              every tool whose name starts with read_
    write_file(path=notes/*)            write_file, when path matches notes/*
    shell(cmd=rm *, cwd=/tmp/*)         every parameter glob must match
    write_file(path="a,b/*")            quote (' or ") values with , ( ) or quotes

Globs are :func:`fnmatch.fnmatchcase` patterns: case-sensitive, and ``*``
matches ``/`` too, so ``notes/*`` matches ``notes/a/b``. :class:`Permissions`
decides deny before ask before allow, whatever the order of the rules, and
falls back to its ``default``.

Rules compare text, nothing more. ``notes/*`` also matches ``notes/../secret``:
paths are not normalised, links are not resolved, and ``shell(cmd=rm *)`` does
not see ``/bin/rm`` or ``rm  -rf``. They are a policy for the model's requests,
not a sandbox: tool workers must still check the paths and commands they are
given. Prefer ``default="deny"`` with narrow allow rules over broad denials.

When a call asks, :func:`suggest_rules` proposes allow rules that would let
calls like it through (the same value of its key parameter, its folder, the
tool with any input); a person may *accept* rules (:meth:`Permissions.accept`).
An accepted rule outranks ``ask`` rules — it answers them — but never a
``deny``. An agent keeps the rules accepted in any of its sessions in a
:class:`RuleBook` (:class:`AcceptedRules` in memory; in JetStream for an agent
served on the bus, :mod:`fleetbus.agents.serving.rules`), and each reply loads
them as it starts.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any, Literal, Protocol

from pydantic import BaseModel, Field, field_validator, model_validator

from fleetbus.errors import ConfigError
from fleetbus.protocol import Confirmation

__all__ = [
    "MAX_RULE_TEXT",
    "AcceptedRules",
    "Action",
    "Decision",
    "PermissionRule",
    "Permissions",
    "RuleBook",
    "checked_confirmation",
    "coding_permissions",
    "parse_accepted",
    "suggest_rules",
]

Action = Literal["allow", "deny", "ask"]
"""What to do with a tool call: run it, refuse it, or ask a person first."""

_PRECEDENCE: tuple[Action, ...] = ("deny", "ask", "allow")

MAX_RULE_TEXT = 1000
"""Characters an accepted rule's text may have (rules are stored and shown)."""

_QUOTES = "'\""
# Characters the rule syntax gives a meaning to; a value holding one is quoted.
_SPECIAL = frozenset("(),=" + _QUOTES)
_NEEDS_QUOTES = _SPECIAL - {"="}


def _check_name(kind: str, name: str) -> str:
    """Return ``name`` if it can stand as a tool glob or parameter name, else say why."""
    if not name:
        return f"empty {kind}"
    bad = sorted({c for c in name if c in _SPECIAL or c.isspace()})
    if bad:
        return f"{kind} {name!r} contains {', '.join(map(repr, bad))}"
    return ""


def _quote(value: str) -> str:
    """Write a parameter glob so that :func:`_parse` reads it back unchanged."""
    if value and value == value.strip() and _NEEDS_QUOTES.isdisjoint(value):
        return value
    quote = "'" if '"' in value and "'" not in value else '"'
    escaped = value.replace("\\", "\\\\").replace(quote, "\\" + quote)
    return f"{quote}{escaped}{quote}"


def _parse(text: str) -> tuple[str, dict[str, str]]:
    """Split rule text into its tool glob and parameter globs.

    Raises:
        ConfigError: the text is malformed; the message says where and why.
    """

    def fail(problem: str) -> ConfigError:
        return ConfigError(f"invalid permission rule {text!r}: {problem}")

    head, paren, body = text.partition("(")
    tool = head.strip()
    if problem := _check_name("tool name", tool):
        if ")" in tool:
            problem = "')' without a matching '('"
        raise fail(problem)
    params: dict[str, str] = {}
    if not paren:
        return tool, params
    pos, end = 0, len(body)
    while True:
        stop = pos
        while stop < end and body[stop] not in "=,()":
            stop += 1
        name = body[pos:stop].strip()
        if stop == end:
            raise fail(f"missing '=' after {name!r}" if name else "missing ')'")
        if body[stop] != "=":
            if not name and not params and body[stop] == ")":
                raise fail(f"empty parameter list; write {tool!r} to match any parameters")
            if not name:
                raise fail(f"empty parameter before {body[stop]!r}")
            raise fail(f"missing '=' after parameter {name!r} (expected name=glob)")
        if problem := _check_name("parameter name", name):
            raise fail(problem)
        if name in params:
            raise fail(f"duplicate parameter {name!r}")
        pos = end - len(body[stop + 1 :].lstrip())
        if pos < end and body[pos] in _QUOTES:
            quote, chars = body[pos], []
            pos += 1
            while pos < end and body[pos] != quote:
                if body[pos] == "\\" and pos + 1 < end:
                    pos += 1
                chars.append(body[pos])
                pos += 1
            if pos == end:
                raise fail(f"unterminated {quote} in the value of {name!r}")
            value = "".join(chars)
            pos = end - len(body[pos + 1 :].lstrip())
        else:
            stop = pos
            while stop < end and body[stop] not in ",)":
                if body[stop] in "(" + _QUOTES:
                    raise fail(f"{body[stop]!r} in the value of {name!r}; quote the value")
                stop += 1
            value = body[pos:stop].strip()
            if not value:
                raise fail(f"empty value for {name!r}; write {name}=\"\" to match ''")
            pos = stop
        params[name] = value
        if pos == end:
            raise fail("missing ')'")
        if body[pos] == ")":
            if rest := body[pos + 1 :].strip():
                raise fail(f"unexpected {rest!r} after ')'")
            return tool, params
        if body[pos] != ",":
            raise fail(f"unexpected {body[pos]!r} after the value of {name!r}")
        pos += 1


class PermissionRule(BaseModel, frozen=True):
    """One rule: an action for the tool calls a pattern matches.

    Attributes:
        action: what to do with a matching call.
        tool: glob on the tool name (``write_file``, ``read_*``, ``*``).
        params: parameter name -> glob on that parameter's value. Every glob
            must match, and a parameter the call lacks does not match.
    """

    action: Action
    tool: str
    params: dict[str, str] = {}

    @model_validator(mode="after")
    def _writable(self) -> PermissionRule:
        # A rule that str() could not write would break parse(str(rule)) == rule.
        for kind, name in [("tool name", self.tool)] + [("parameter name", p) for p in self.params]:
            if problem := _check_name(kind, name):
                raise ValueError(problem)
        return self

    @classmethod
    def parse(cls, action: Action, text: str) -> PermissionRule:
        """Read a rule from its text form, e.g. ``shell(cmd=rm *, cwd=/tmp/*)``.

        Whitespace around names, values and punctuation is ignored; inside an
        unquoted value it is kept (``cmd=rm *`` is the glob ``rm *``). A value
        quoted with ``'`` or ``"`` may hold commas, parentheses, ``=`` and
        leading or trailing spaces; a backslash in it escapes the next character.

        Args:
            action: what the rule does with the calls it matches.
            text: the pattern.

        Returns:
            The rule.

        Raises:
            ConfigError: the text is malformed (unbalanced parentheses, a
                parameter without ``=``, an empty tool name or value, a duplicate
                parameter, an unterminated quote).
        """
        tool, params = _parse(text)
        return cls(action=action, tool=tool, params=params)

    def matches(self, tool_name: str, parameters: Mapping[str, Any]) -> bool:
        """Tell whether a call of ``tool_name`` with ``parameters`` matches this rule.

        String values are matched as they are. Any other value is matched
        against its JSON text, ``json.dumps(value, sort_keys=True)``: ``3`` is
        ``"3"``, ``True`` is ``"true"``, ``None`` is ``"null"``, ``["a", "b"]``
        is ``'["a", "b"]'`` (note the space after commas and colons).

        Args:
            tool_name: the tool called.
            parameters: its arguments, decoded JSON.

        Returns:
            Whether the tool glob and every parameter glob match.
        """
        if not fnmatchcase(tool_name, self.tool):
            return False
        for name, glob in self.params.items():
            if name not in parameters:
                return False
            value = parameters[name]
            text = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
            if not fnmatchcase(text, glob):
                return False
        return True

    def __str__(self) -> str:
        """The text form of the pattern; ``parse(rule.action, str(rule)) == rule``."""
        if not self.params:
            return self.tool
        inner = ", ".join(f"{name}={_quote(glob)}" for name, glob in self.params.items())
        return f"{self.tool}({inner})"


@dataclass(frozen=True)
class Decision:
    """The outcome of :meth:`Permissions.check`.

    Attributes:
        action: what to do with the call.
        rule: the rule that decided, or ``None`` when the default did.
    """

    action: Action
    rule: PermissionRule | None


class Permissions(BaseModel):
    """An agent's tool permission rules.

    Attributes:
        rules: the rules, without duplicates. Their order does not change the
            action, only which of several matching rules a decision reports.
        default: the action when no rule matches.
    """

    # default_factory, not a [] default, which pydantic deep-copies for every
    # new state (a new session's).
    rules: list[PermissionRule] = Field(default_factory=list)
    default: Action = "allow"
    accepted: list[PermissionRule] = Field(default_factory=list)
    """Allow rules a person accepted in this session (:meth:`accept`): they
    outrank ``ask`` rules, not ``deny`` ones."""
    agent_accepted: list[PermissionRule] = Field(default_factory=list, exclude=True)
    """The agent's accepted rules (its :class:`RuleBook`), as loaded when the
    reply started; the same rank as ``accepted``. Not saved with the session:
    each reply loads them anew, so a rule removed from the agent stops
    applying to the sessions that did not accept it themselves."""

    @field_validator("rules")
    @classmethod
    def _unique(cls, rules: list[PermissionRule]) -> list[PermissionRule]:
        return [rule for i, rule in enumerate(rules) if rule not in rules[:i]]

    @field_validator("accepted", "agent_accepted")
    @classmethod
    def _allowing(cls, rules: list[PermissionRule]) -> list[PermissionRule]:
        if any(rule.action != "allow" for rule in rules):
            raise ValueError("accepted rules are allow rules")
        return [rule for i, rule in enumerate(rules) if rule not in rules[:i]]

    @property
    def asks(self) -> bool:
        """Whether any call can be asked about (an ``ask`` rule, or the default):
        only then can accepted rules change a decision."""
        return self.default == "ask" or any(rule.action == "ask" for rule in self.rules)

    @classmethod
    def from_strings(
        cls,
        *,
        allow: Iterable[str] = (),
        deny: Iterable[str] = (),
        ask: Iterable[str] = (),
        default: Action = "allow",
    ) -> Permissions:
        """Build permissions from rule texts, grouped by action.

        Raises:
            ConfigError: a text is malformed.
        """
        permissions = cls(default=default)
        for text in allow:
            permissions.allow(text)
        for text in deny:
            permissions.deny(text)
        for text in ask:
            permissions.ask(text)
        return permissions

    def check(self, tool_name: str, parameters: Mapping[str, Any]) -> Decision:
        """Decide a tool call: any matching deny wins, then an accepted rule,
        then ask, then allow, then the default.

        Args:
            tool_name: the tool called.
            parameters: its arguments, decoded JSON.

        Returns:
            The action, and the first rule of that action that matched.
        """
        matched: dict[Action, PermissionRule] = {}
        for rule in self.rules:
            if rule.action not in matched and rule.matches(tool_name, parameters):
                matched[rule.action] = rule
        if "deny" not in matched:
            for rule in (*self.accepted, *self.agent_accepted):
                if rule.matches(tool_name, parameters):
                    return Decision("allow", rule)
        for action in _PRECEDENCE:
            if action in matched:
                return Decision(action, matched[action])
        return Decision(self.default, None)

    def accept(self, *rules: PermissionRule | str) -> list[PermissionRule]:
        """Add accepted allow rules (rule objects or their text); the ones new here.

        Raises:
            ConfigError: a text is malformed, or a rule is not an allow rule.
        """
        added: list[PermissionRule] = []
        for rule in parse_accepted(rules):
            if rule not in self.accepted:
                self.accepted.append(rule)
                added.append(rule)
        return added

    def add(self, rule: PermissionRule) -> None:
        """Append ``rule`` unless an equal rule is already there."""
        if rule not in self.rules:
            self.rules.append(rule)

    def allow(self, text: str) -> PermissionRule:
        """Parse an allow rule (see :meth:`PermissionRule.parse`), add it and return it.

        Raises:
            ConfigError: the text is malformed.
        """
        return self._add_text("allow", text)

    def deny(self, text: str) -> PermissionRule:
        """Parse a deny rule (see :meth:`PermissionRule.parse`), add it and return it.

        Raises:
            ConfigError: the text is malformed.
        """
        return self._add_text("deny", text)

    def ask(self, text: str) -> PermissionRule:
        """Parse an ask rule (see :meth:`PermissionRule.parse`), add it and return it.

        Raises:
            ConfigError: the text is malformed.
        """
        return self._add_text("ask", text)

    def _add_text(self, action: Action, text: str) -> PermissionRule:
        self.add(rule := PermissionRule.parse(action, text))
        return rule


def coding_permissions() -> Permissions:
    """New permissions for an agent given the coding tools
    (:mod:`fleetbus.tools_workers.coding`): ``Read`` and ``Grep`` run,
    ``Bash``, ``Write`` and ``Edit`` ask a person first. New on each call: a
    confirmation with ``always=True`` adds a rule to the agent's own."""
    return Permissions.from_strings(allow=["Read", "Grep"], ask=["Bash", "Write", "Edit"])


def parse_accepted(rules: Iterable[PermissionRule | str]) -> list[PermissionRule]:
    """Rules a person accepts, read from their text (``write_file(path=notes/*)``).

    Raises:
        ConfigError: a text is not a string, is longer than
            :data:`MAX_RULE_TEXT`, or is malformed; a rule is not an allow rule.
    """
    parsed: list[PermissionRule] = []
    for rule in [rules] if isinstance(rules, str) else rules:
        if isinstance(rule, PermissionRule):
            if rule.action != "allow":
                raise ConfigError(f"an accepted rule allows; {rule.action} {rule} does not")
        elif not isinstance(rule, str):
            raise ConfigError(f"an accepted rule is text, not {type(rule).__name__}")
        elif len(rule) > MAX_RULE_TEXT:
            raise ConfigError(
                f"an accepted rule has at most {MAX_RULE_TEXT} characters, not {len(rule)}"
            )
        else:
            rule = PermissionRule.parse("allow", rule)
        if rule not in parsed:
            parsed.append(rule)
    return parsed


def checked_confirmation(
    call_id: str,
    *,
    allow: bool,
    always: bool = False,
    parameters: Mapping[str, Any] | None = None,
    accept_rules: Iterable[str] = (),
) -> Confirmation:
    """A person's decision on one paused call, checked before it is sent.

    Raises:
        ConfigError: ``parameters`` is not a mapping or goes with a denial,
            or a rule does not parse (the agent refuses those too).
    """
    if parameters is not None:
        if not isinstance(parameters, Mapping):
            raise ConfigError(
                f"the edited parameters of {call_id!r} must be an object (a dict), "
                f"not {type(parameters).__name__}"
            )
        if not allow:
            raise ConfigError(f"the call {call_id!r} is denied: only an allowed call is edited")
    rules = [str(rule) for rule in parse_accepted(accept_rules)]
    return Confirmation(
        call_id=call_id,
        confirmed=allow,
        always=always,
        parameters=None if parameters is None else dict(parameters),
        accept_rules=rules,
    )


class RuleBook(Protocol):
    """Where an agent keeps the rules accepted in its sessions, so that its
    later sessions start with them. :class:`AcceptedRules` keeps them in
    memory; an agent served on the bus keeps them in JetStream
    (:func:`fleetbus.agents.serving.rules.stored_rules`)."""

    async def load(self) -> list[PermissionRule]:
        """The accepted rules now (a reply loads them as it starts)."""
        ...

    async def add(self, rules: Sequence[PermissionRule]) -> None:
        """Keep more accepted rules (before the call they were accepted with runs).

        Raises:
            FleetbusError: they could not be kept (then nothing of the
                confirmation is applied).
        """
        ...


class AcceptedRules:
    """A :class:`RuleBook` in memory: an agent's definition and its clones
    share one, so a rule accepted in one session holds in the next.

    Args:
        rules: rules accepted from the start (texts or rules).

    Raises:
        ConfigError: a text is malformed, or a rule does not allow.
    """

    def __init__(self, rules: Iterable[PermissionRule | str] = ()) -> None:
        self._rules = parse_accepted(rules)

    @property
    def rules(self) -> list[PermissionRule]:
        """The accepted rules, oldest first (a copy)."""
        return list(self._rules)

    async def load(self) -> list[PermissionRule]:
        """The accepted rules."""
        return list(self._rules)

    async def add(self, rules: Sequence[PermissionRule]) -> None:
        """Keep ``rules`` (those not already kept)."""
        self._rules += [rule for rule in parse_accepted(rules) if rule not in self._rules]

    def remove(self, *rules: PermissionRule | str) -> None:
        """Forget accepted rules (sessions that accepted one themselves keep it).

        Raises:
            ConfigError: a text is malformed.
        """
        gone = parse_accepted(rules)
        self._rules = [rule for rule in self._rules if rule not in gone]


# -- suggestions --------------------------------------------------------------------

_KEY_PARAMETERS = (
    "file_path",
    "path",
    "filepath",
    "filename",
    "file",
    "command",
    "cmd",
    "url",
    "uri",
    "directory",
    "dir",
    "cwd",
    "query",
    "pattern",
    "name",
    "key",
    "target",
)
"""Parameter names that say what a call acts on, the likeliest first."""
_COMMAND_PARAMETERS = frozenset({"command", "cmd", "script", "shell"})
_PATH_PARAMETERS = frozenset(
    {"file_path", "path", "filepath", "filename", "file", "directory", "dir", "cwd", "url", "uri"}
)
_SUGGESTED_VALUE = 200
"""Longest value (characters) a suggestion repeats."""


def suggest_rules(tool_name: str, parameters: Mapping[str, Any]) -> list[str]:
    """Allow rules (their text) that would let calls like this one through,
    most specific first.

    The call's key parameter (``file_path``, ``path``, ``command``, ``url``…,
    else its first short text parameter) with the same value; for a path or a
    URL, the same folder and the top folder (``notes/2024/*``, ``notes/*``);
    for a command, the same first words (``git commit *``, ``git *``); last,
    the tool with any input. Every suggestion matches the call and reads back
    with :meth:`PermissionRule.parse`; globs in the values are escaped.

    Args:
        tool_name: the tool called.
        parameters: its arguments.

    Returns:
        Rule texts, without duplicates.
    """
    tool = _escape(tool_name)
    candidates: list[dict[str, str]] = []
    key = _key_parameter(parameters)
    if key is not None:
        value = parameters[key]
        text = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
        candidates.append({key: _escape(text)})
        if isinstance(value, str):
            candidates += [{key: _escape(prefix) + "*"} for prefix in _prefixes(key, value)]
    candidates.append({})
    suggestions: list[str] = []
    for params in candidates:
        try:
            rule = PermissionRule(action="allow", tool=tool, params=params)
        except ValueError:  # a name the rule syntax cannot hold
            continue
        text = str(rule)
        if text not in suggestions and rule.matches(tool_name, parameters):
            suggestions.append(text)
    return suggestions


def _key_parameter(parameters: Mapping[str, Any]) -> str | None:
    """The parameter that says what the call acts on, if one is short enough to repeat."""

    def fits(value: Any) -> bool:
        if isinstance(value, str):
            return 0 < len(value) <= _SUGGESTED_VALUE and "\n" not in value
        return isinstance(value, int | float | bool)

    for name in _KEY_PARAMETERS:
        if name in parameters and fits(parameters[name]):
            return name
    for name, value in parameters.items():
        if isinstance(value, str) and fits(value):
            return name
    return None


def _prefixes(key: str, value: str) -> list[str]:
    """Broader values than ``value``, narrowest first, each to be followed by ``*``."""
    if key in _COMMAND_PARAMETERS:
        words = value.split()
        return [" ".join(words[:n]) + " " for n in (2, 1) if len(words) > n]
    scheme, sep, rest = value.partition("://")
    if sep:  # a URL: its folders, then its host, never broader
        host, slash, path = rest.partition("/")
        if not slash:
            return []
        base = f"{scheme}://{host}/"
    elif value.startswith("/"):
        base, path = "/", value.lstrip("/")
    else:
        base, path = "", value
    folders = path.rstrip("/").split("/")[:-1]
    prefixes = [base + "/".join(folders) + "/"] if folders else []
    if len(folders) > 1:
        prefixes.append(base + folders[0] + "/")
    if sep:
        prefixes.append(base)
    return prefixes


def _escape(text: str) -> str:
    """``text`` as a glob that matches only itself."""
    return "".join(f"[{c}]" if c in "*?[" else c for c in text)
