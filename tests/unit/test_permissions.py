"""Tool permission rules: the text form, matching, and deny > ask > allow > default."""

from __future__ import annotations

from typing import Any

import pydantic
import pytest
from hypothesis import given
from hypothesis import strategies as st

from fleetbus.agents.permissions import Decision, PermissionRule, Permissions
from fleetbus.errors import ConfigError


@pytest.mark.parametrize(
    ("text", "tool", "params"),
    [
        ("write_file(path=notes/*)", "write_file", {"path": "notes/*"}),
        ("shell(cmd=rm *, cwd=/tmp/*)", "shell", {"cmd": "rm *", "cwd": "/tmp/*"}),
        ("read_*", "read_*", {}),
        ("*", "*", {}),
        ("fetch(url=https://example.com/*)", "fetch", {"url": "https://example.com/*"}),
        ("  shell (  cmd = rm *  ,cwd=/tmp/*  )  ", "shell", {"cmd": "rm *", "cwd": "/tmp/*"}),
        ('write_file(path="a,b/*")', "write_file", {"path": "a,b/*"}),
        ("write_file(path='f(x), g'  )", "write_file", {"path": "f(x), g"}),
        ("say(text='he said \"hi\"')", "say", {"text": 'he said "hi"'}),
        (r'say(text="a\"b\\c")', "say", {"text": 'a"b\\c'}),
        ("say(text=' padded ')", "say", {"text": " padded "}),
        ('say(text="")', "say", {"text": ""}),
        ("env(set=A=1)", "env", {"set": "A=1"}),
        (r"read_file(path=C:\data\*)", "read_file", {"path": r"C:\data\*"}),
    ],
)
def test_parse_examples(text: str, tool: str, params: dict[str, str]) -> None:
    rule = PermissionRule.parse("ask", text)
    assert rule == PermissionRule(action="ask", tool=tool, params=params)
    assert PermissionRule.parse("ask", str(rule)) == rule


def test_str_is_the_canonical_text_form() -> None:
    assert str(PermissionRule.parse("deny", " shell( cmd=rm * ,cwd = /tmp/* )")) == (
        "shell(cmd=rm *, cwd=/tmp/*)"
    )
    assert str(PermissionRule(action="allow", tool="w", params={"p": "a,b"})) == 'w(p="a,b")'
    assert str(PermissionRule(action="allow", tool="w", params={"p": 'say "x"'})) == (
        "w(p='say \"x\"')"
    )


_SAFE = st.text(alphabet="abcXYZ019_-./:*?", min_size=1, max_size=12)
_NAMES = st.from_regex(r"[a-z_][a-z0-9_]{0,8}", fullmatch=True)
_ACTIONS = st.sampled_from(["allow", "deny", "ask"])


@given(action=_ACTIONS, tool=_SAFE, params=st.dictionaries(_NAMES, _SAFE, max_size=4))
def test_round_trip_safe_characters(action: Any, tool: str, params: dict[str, str]) -> None:
    rule = PermissionRule(action=action, tool=tool, params=params)
    assert PermissionRule.parse(action, str(rule)) == rule


@given(
    tool=_SAFE,
    params=st.dictionaries(
        _NAMES, st.text(alphabet="ab *,()'\"\\= \t/", max_size=12), min_size=1, max_size=4
    ),
)
def test_round_trip_values_that_need_quotes(tool: str, params: dict[str, str]) -> None:
    rule = PermissionRule(action="deny", tool=tool, params=params)
    text = str(rule)
    assert PermissionRule.parse("deny", text) == rule
    for value in params.values():
        if any(c in value for c in ",()"):
            assert '"' in text or "'" in text


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("write_file(path=notes/*", "missing ')'"),
        ("write_file path=notes/*)", "')' without a matching '('"),
        ("f(a=1))", "unexpected ')' after ')'"),
        ("f(a=1) extra", "unexpected 'extra' after ')'"),
        ("f(a=(x))", "'(' in the value of 'a'; quote the value"),
        ("f(path)", "missing '=' after parameter 'path'"),
        ("f(path", "missing '=' after 'path'"),
        ("", "empty tool name"),
        ("   ", "empty tool name"),
        ("(path=x)", "empty tool name"),
        ("write file", "tool name 'write file' contains ' '"),
        ("f(a=1, a=2)", "duplicate parameter 'a'"),
        ("f()", "empty parameter list; write 'f' to match any parameters"),
        ("f(a=1,)", "empty parameter before ')'"),
        ("f(a=1,,b=2)", "empty parameter before ','"),
        ("f(=1)", "empty parameter name"),
        ("f(a b=1)", "parameter name 'a b' contains ' '"),
        ("f(a=)", "empty value for 'a'"),
        ("f(a='x)", "unterminated ' in the value of 'a'"),
        ("f(a='x' y)", "unexpected 'y' after the value of 'a'"),
        ("f(a=it's)", "\"'\" in the value of 'a'; quote the value"),
    ],
)
def test_malformed_text_raises_config_error(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match="invalid permission rule") as caught:
        PermissionRule.parse("allow", text)
    assert message in str(caught.value)
    assert repr(text) in str(caught.value)
    assert isinstance(caught.value, ValueError)


def test_constructing_an_unwritable_rule_is_refused() -> None:
    with pytest.raises(pydantic.ValidationError, match="empty tool name"):
        PermissionRule(action="allow", tool="")
    with pytest.raises(pydantic.ValidationError, match="contains"):
        PermissionRule(action="allow", tool="f", params={"a=b": "x"})


@pytest.mark.parametrize(
    ("text", "tool_name", "parameters", "expected"),
    [
        ("*", "anything", {}, True),
        ("read_*", "read_file", {"path": "x"}, True),
        ("read_*", "write_file", {}, False),
        ("read_*", "READ_FILE", {}, False),
        ("write_file", "write_file", {"path": "x", "mode": "w"}, True),
        ("write_file(path=notes/*)", "write_file", {"path": "notes/a.md"}, True),
        ("write_file(path=notes/*)", "write_file", {"path": "notes/a/b/c.md"}, True),
        ("write_file(path=notes/*)", "write_file", {"path": "notes/../secret"}, True),
        ("write_file(path=notes/*)", "write_file", {"path": "other/a.md"}, False),
        ("write_file(path=notes/*)", "write_file", {}, False),
        ("write_file(path=notes/*)", "read_file", {"path": "notes/a"}, False),
        ("write_file(path=*)", "write_file", {"content": "x"}, False),
        ("shell(cmd=rm *, cwd=/tmp/*)", "shell", {"cmd": "rm -rf x", "cwd": "/tmp/a"}, True),
        ("shell(cmd=rm *, cwd=/tmp/*)", "shell", {"cmd": "rm -rf x", "cwd": "/home"}, False),
        ("shell(cmd=rm *, cwd=/tmp/*)", "shell", {"cmd": "rm -rf x"}, False),
        ("f(n=4?)", "f", {"n": 42}, True),
        ("f(n=42)", "f", {"n": "42"}, True),
        ("f(n=4[0-9])", "f", {"n": 42.5}, False),
        ("f(flag=true)", "f", {"flag": True}, True),
        ("f(flag=True)", "f", {"flag": True}, False),
        ("f(x=null)", "f", {"x": None}, True),
        ("f(x=null)", "f", {"x": "null"}, True),
        ("f(tags='?\"a\", *')", "f", {"tags": ["a", "b"]}, True),
        ('f(tags=\'?"a","b"]\')', "f", {"tags": ["a", "b"]}, False),
        ('f(opts=\'{"a": 1, "b": 2}\')', "f", {"opts": {"b": 2, "a": 1}}, True),
        ("f(s=[[]*)", "f", {"s": "[x"}, True),
    ],
)
def test_matches(text: str, tool_name: str, parameters: dict[str, Any], expected: bool) -> None:
    assert PermissionRule.parse("allow", text).matches(tool_name, parameters) is expected


@pytest.fixture
def overlapping() -> Permissions:
    return Permissions.from_strings(
        allow=["*", "write_file(path=notes/*)", "shell(cwd=/tmp/*)"],
        ask=["write_file", "shell(cmd=git *)"],
        deny=["write_file(path=notes/secret/*)", "shell(cmd=rm *)"],
        default="deny",
    )


@pytest.mark.parametrize(
    ("tool_name", "parameters", "action", "rule_text"),
    [
        ("read_file", {"path": "a"}, "allow", "*"),
        ("write_file", {"path": "notes/a.md"}, "ask", "write_file"),
        ("write_file", {"path": "notes/secret/k"}, "deny", "write_file(path=notes/secret/*)"),
        ("shell", {"cmd": "rm -rf /", "cwd": "/tmp/x"}, "deny", "shell(cmd=rm *)"),
        ("shell", {"cmd": "git status", "cwd": "/tmp/x"}, "ask", "shell(cmd=git *)"),
        ("shell", {"cmd": "ls", "cwd": "/tmp/x"}, "allow", "*"),
    ],
)
def test_precedence_deny_then_ask_then_allow(
    overlapping: Permissions,
    tool_name: str,
    parameters: dict[str, Any],
    action: str,
    rule_text: str,
) -> None:
    decision = overlapping.check(tool_name, parameters)
    assert decision.action == action
    assert decision.rule is not None
    assert (decision.rule.action, str(decision.rule)) == (action, rule_text)


def test_precedence_does_not_depend_on_rule_order() -> None:
    rules = [
        PermissionRule.parse("allow", "f"),
        PermissionRule.parse("ask", "f"),
        PermissionRule.parse("deny", "f(x=1)"),
    ]
    for ordered in (rules, rules[::-1]):
        permissions = Permissions(rules=ordered)
        assert permissions.check("f", {"x": 1}) == Decision("deny", rules[2])
        assert permissions.check("f", {"x": 2}) == Decision("ask", rules[1])


@pytest.mark.parametrize("default", ["allow", "deny", "ask"])
def test_default_decides_when_nothing_matches(default: Any) -> None:
    permissions = Permissions.from_strings(allow=["read_*"], deny=["shell"], default=default)
    assert permissions.check("write_file", {"path": "x"}) == Decision(default, None)


def test_allow_deny_ask_append_and_add_skips_duplicates() -> None:
    permissions = Permissions()
    assert permissions.check("shell", {}) == Decision("allow", None)
    denied = permissions.deny("shell")
    asked = permissions.ask("write_file(path=*)")
    allowed = permissions.allow("read_*")
    assert permissions.rules == [denied, asked, allowed]
    assert denied == PermissionRule(action="deny", tool="shell")
    assert permissions.deny(" shell ") == denied
    permissions.add(PermissionRule(action="ask", tool="write_file", params={"path": "*"}))
    assert permissions.rules == [denied, asked, allowed]
    permissions.add(PermissionRule(action="allow", tool="shell"))
    assert len(permissions.rules) == 4
    assert permissions.check("shell", {}).action == "deny"
    with pytest.raises(ConfigError):
        permissions.allow("f(")
    assert len(permissions.rules) == 4
    assert Permissions(rules=[denied, denied, asked]).rules == [denied, asked]


def test_json_round_trip(overlapping: Permissions) -> None:
    restored = Permissions.model_validate_json(overlapping.model_dump_json())
    assert restored == overlapping
    assert restored.default == "deny"
    quoted = Permissions.from_strings(deny=['f(p="a,(b)", q=\'"\')'])
    assert Permissions.model_validate_json(quoted.model_dump_json()) == quoted
