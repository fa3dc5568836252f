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
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any, Literal

from pydantic import BaseModel, field_validator, model_validator

from fleetbus.errors import ConfigError

__all__ = ["Action", "Decision", "PermissionRule", "Permissions", "coding_permissions"]

Action = Literal["allow", "deny", "ask"]
"""What to do with a tool call: run it, refuse it, or ask a person first."""

_PRECEDENCE: tuple[Action, ...] = ("deny", "ask", "allow")

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

    rules: list[PermissionRule] = []
    default: Action = "allow"

    @field_validator("rules")
    @classmethod
    def _unique(cls, rules: list[PermissionRule]) -> list[PermissionRule]:
        return [rule for i, rule in enumerate(rules) if rule not in rules[:i]]

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
        """Decide a tool call: any matching deny wins, then ask, then allow, then the default.

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
        for action in _PRECEDENCE:
            if action in matched:
                return Decision(action, matched[action])
        return Decision(self.default, None)

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
