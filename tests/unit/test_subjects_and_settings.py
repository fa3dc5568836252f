"""Subject names, and connection settings from arguments and the environment."""

from __future__ import annotations

import argparse
import ssl
from pathlib import Path

import pytest

from fleetbus.bus import DEFAULT_URL, ConnectEnvironment, ConnectOptions, Subjects
from fleetbus.cli._common import add_connection_options
from fleetbus.errors import ConfigError, InvalidSubjectError


def test_subjects_follow_the_design() -> None:
    s = Subjects()
    assert s.tool("calculator") == "fleet.tool.calculator"
    assert s.tool_queue("calculator") == "tool.calculator"
    assert s.agent_inbox("planner") == "fleet.agent.planner.inbox"
    assert s.agent_queue("planner") == "agent.planner"
    assert s.topic("news") == "fleet.topic.news"
    assert s.model("gpt-4o") == "fleet.model.gpt-4o"
    assert s.events("planner", "s-42", "alice") == "fleet.events.planner.s-42.alice"
    assert s.all_events() == "fleet.events.>"
    assert s.all_events("planner") == "fleet.events.planner.>"
    assert s.tool_control("calculator") == "fleet.tool.calculator.control"


def _matches(pattern: str, subject: str) -> bool:
    """NATS subject matching: ``*`` is one token, ``>`` one or more at the end."""
    want, got = pattern.split("."), subject.split(".")
    for i, token in enumerate(want):
        if token == ">":
            return len(got) > i
        if i >= len(got) or token not in ("*", got[i]):
            return False
    return len(want) == len(got)


def test_the_tool_control_subject_is_outside_the_tool_wildcard() -> None:
    s = Subjects("acme.prod")
    assert _matches(s.all_tools(), s.tool("control"))
    assert _matches(s.all_tools(), s.tool("search"))
    assert not _matches(s.all_tools(), s.tool_control("search"))
    assert s.tool_control("search") != s.tool("control")
    assert not s.tool_control("search").startswith("$SRV")
    with pytest.raises(InvalidSubjectError, match="invalid tool name"):
        s.tool_control("a.b")


def test_the_prefix_separates_fleets() -> None:
    assert Subjects("acme.prod").tool("x") == "acme.prod.tool.x"
    assert Subjects("acme.prod").kv_bucket("sessions") == "acme_prod_sessions"
    assert Subjects("a").tool_queue("x") == Subjects("b").tool_queue("x")


@pytest.mark.parametrize("bad", ["", "a.b", "a b", "*", ">", "a>", "x" * 129, "tab\t"])
def test_names_that_cannot_be_one_token_are_refused(bad: str) -> None:
    with pytest.raises(InvalidSubjectError, match="invalid tool name"):
        Subjects().tool(bad)


@pytest.mark.parametrize("bad", ["", "a..b", ".a", "a.*", "a b"])
def test_bad_prefixes_are_refused(bad: str) -> None:
    with pytest.raises(InvalidSubjectError):
        Subjects(bad)


def test_options_default_to_the_local_server() -> None:
    options = ConnectOptions.from_env(environ={})
    assert options.servers == [DEFAULT_URL]
    assert options.prefix == "fleet"
    assert options.max_reconnect_attempts == -1


def test_options_read_the_process_environment_unless_given_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("FLEETBUS_NATS_URL", "nats://process:4222")
    monkeypatch.setenv("FLEETBUS_NATS_PASSWORD", "s3cret")
    monkeypatch.setenv("FLEETBUS_JS_REPLICAS", "")  # empty: as if unset
    assert "s3cret" not in repr(ConnectEnvironment())
    options = ConnectOptions.from_env()
    assert options.servers == ["nats://process:4222"]
    assert options.password is not None
    assert options.password.get_secret_value() == "s3cret"
    assert options.js_replicas is None
    given = ConnectOptions.from_env(environ={"FLEETBUS_PREFIX": "given"})
    assert (given.servers, given.prefix, given.password) == ([DEFAULT_URL], "given", None)
    monkeypatch.setenv("FLEETBUS_JS_REPLICAS", "6")
    with pytest.raises(ConfigError, match="js_replicas"):
        ConnectOptions.from_env()


def test_options_read_the_environment() -> None:
    env = {
        "FLEETBUS_NATS_URL": "nats://a:4222, nats://b:4222",
        "FLEETBUS_PREFIX": "tenant1",
        "FLEETBUS_NATS_USER": "alice",
        "FLEETBUS_NATS_PASSWORD": "s3cret",
        "FLEETBUS_NATS_TOKEN": "tok",
        "FLEETBUS_NATS_CREDS": "/x.creds",
    }
    options = ConnectOptions.from_env(environ=env)
    assert options.servers == ["nats://a:4222", "nats://b:4222"]
    assert options.prefix == "tenant1"
    kwargs = options.nats_kwargs()
    assert kwargs["user"] == "alice"
    assert kwargs["password"] == "s3cret"
    assert kwargs["token"] == "tok"
    assert kwargs["user_credentials"] == "/x.creds"
    assert "s3cret" not in repr(options)


def test_the_identity_is_the_user_of_the_url_unless_named() -> None:
    def identity(*servers: str, **overrides: str) -> str | None:
        return ConnectOptions.from_env(list(servers), environ={}, **overrides).identity()

    assert identity("nats://alice:s3cret@h:4222") == "alice"
    assert identity("nats://h:4222", "nats://b%40ob:pw@h2:4222") == "b@ob"
    assert identity("nats://alice:pw@h:4222", user="carol") == "carol"
    assert identity("nats://a-token@h:4222") is None  # a name without a password is a token
    assert identity("nats://h:4222") is None
    assert ConnectOptions(servers=["nats://alice:pw@h"], prefix="f").reply_prefix() == (
        "_INBOX_f.alice"
    )


def test_arguments_win_over_the_environment() -> None:
    env = {"FLEETBUS_NATS_URL": "nats://env:4222", "FLEETBUS_PREFIX": "env"}
    options = ConnectOptions.from_env("nats://arg:4222", environ=env, prefix="arg")
    assert (options.servers, options.prefix) == (["nats://arg:4222"], "arg")


@pytest.mark.parametrize(
    "overrides",
    [{"servers": []}, {"servers": ["localhost:4222"]}, {"prefix": "a b"}],
)
def test_invalid_settings_are_a_config_error(overrides: dict[str, object]) -> None:
    servers = overrides.pop("servers", None)
    with pytest.raises(ConfigError, match="invalid NATS connection settings"):
        ConnectOptions.from_env(servers, environ={}, **overrides)  # type: ignore[arg-type]


def test_tls_urls_get_a_context_and_missing_files_are_clear(tmp_path: Path) -> None:
    options = ConnectOptions.from_env("tls://example:4222", environ={})
    assert isinstance(options.nats_kwargs()["tls"], ssl.SSLContext)
    assert "tls" not in ConnectOptions.from_env(environ={}).nats_kwargs()
    missing = ConnectOptions.from_env(environ={}, tls_ca_file=str(tmp_path / "nope.pem"))
    with pytest.raises(ConfigError, match="cannot load TLS files"):
        missing.nats_kwargs()


def test_the_replica_count_follows_the_server_unless_set() -> None:
    assert ConnectOptions.from_env(environ={}).js_replicas is None
    env = {"FLEETBUS_JS_REPLICAS": "3"}
    assert ConnectOptions.from_env(environ=env).js_replicas == 3
    assert ConnectOptions.from_env(environ=env, js_replicas=1).js_replicas == 1


@pytest.mark.parametrize("bad", ["0", "6", "three", "-1"])
def test_a_replica_count_outside_1_to_5_is_a_config_error(bad: str) -> None:
    with pytest.raises(ConfigError, match="js_replicas"):
        ConnectOptions.from_env(environ={"FLEETBUS_JS_REPLICAS": bad})


def test_the_command_line_takes_the_replica_count(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser(prog="fleetbus")
    add_connection_options(parser)
    args = parser.parse_args(["--nats", "nats://a:4222", "--js-replicas", "3"])
    assert (args.nats, args.prefix, args.js_replicas) == ("nats://a:4222", None, 3)
    assert parser.parse_args([]).js_replicas is None
    with pytest.raises(SystemExit):
        parser.parse_args(["--js-replicas", "7"])
    assert "a replica count is 1 to 5, not '7'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("subject", "said"),
    [
        ("team.agent.ann.inbox", "no agent 'ann' is served with prefix 'team'"),
        ("team.tool.calculator", "no worker serves the tool 'calculator' with prefix 'team'"),
        ("team.model.local", "no model worker serves 'local' with prefix 'team'"),
        ("team.topic.news", "nobody serves team.topic.news"),
        ("other.tool.calculator", "nobody serves other.tool.calculator"),
    ],
)
def test_nobody_serves_names_what_is_missing(subject: str, said: str) -> None:
    assert Subjects("team").nobody_serves(subject) == said
