"""Model strings (``openai:NAME``, ``bus:NAME``, ``offline``, ``module:attr``,
a bare name) and model settings (command line over TOML over environment)."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from fleetbus.cli.fleet_file import load_agents
from fleetbus.errors import ConfigError
from fleetbus.models import (
    BusModelRef,
    ModelConfig,
    ModelError,
    ModelRequest,
    ModelSettings,
    OfflineModel,
    OpenAIChatModel,
    default_model,
    default_model_config,
    describe_default_model,
    load_model_settings,
    model_config_from_settings,
    model_from_string,
    strings,
)
from fleetbus.models.strings import ModelString, check_model, parse_model_string
from fleetbus.protocol import ChatMessage

ENDPOINT = "http://127.0.0.1:9/v1"


def offline_factory() -> OfflineModel:
    """A ``module:attr`` factory, for the tests."""
    return OfflineModel()


OFFLINE_INSTANCE = OfflineModel()
NOT_A_MODEL = "just text"


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("OPENAI_API_KEY", "OPENAI_BASE_URL", "FLEETBUS_MODEL"):
        monkeypatch.delenv(name, raising=False)
    for field in ModelSettings.model_fields:
        monkeypatch.delenv(f"FLEETBUS_MODEL_{field.upper()}", raising=False)


# -- the syntax ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("offline", ModelString("offline", "offline")),
        ("openai:gpt-4o-mini", ModelString("openai", "gpt-4o-mini")),
        ("openai:qwen2.5:7b", ModelString("openai", "qwen2.5:7b")),
        ("bus:gpt-4-1", ModelString("bus", "gpt-4-1")),
        (
            "tests.unit.test_model_strings:offline_factory",
            ModelString("python", "tests.unit.test_model_strings:offline_factory"),
        ),
        ("pkg.mod:Class.attr", ModelString("python", "pkg.mod:Class.attr")),
        # Bare names: an OpenAI-compatible model, colons (Ollama tags) included.
        (
            "qwen2.5-coder-1.5b-instruct",
            ModelString("openai", "qwen2.5-coder-1.5b-instruct", explicit=False),
        ),
        ("llama3.1:8b", ModelString("openai", "llama3.1:8b", explicit=False)),
        ("  gpt-4o  ", ModelString("openai", "gpt-4o", explicit=False)),
    ],
)
def test_model_strings_are_read_by_kind(text: str, expected: ModelString) -> None:
    assert parse_model_string(text) == expected


def test_the_reserved_prefixes_are_never_python() -> None:
    # ``openai`` is an importable module with attributes: the prefix still wins.
    assert parse_model_string("openai:OpenAI").kind == "openai"
    assert parse_model_string("bus:offline").kind == "bus"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "empty model string"),
        ("openai:", "names no model"),
        ("bus:", "names no model"),
        ("bus:" + "x" * 200, "invalid model name"),
    ],
)
def test_malformed_strings_are_config_errors(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_model_string(text)


# -- building models -----------------------------------------------------------------------


def test_offline_and_python_models() -> None:
    assert isinstance(model_from_string("offline"), OfflineModel)
    made = model_from_string("tests.unit.test_model_strings:offline_factory")
    assert isinstance(made, OfflineModel)
    assert model_from_string("tests.unit.test_model_strings:OFFLINE_INSTANCE") is OFFLINE_INSTANCE
    assert isinstance(model_from_string("fleetbus.models:OfflineModel"), OfflineModel)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("tests.unit.test_model_strings:NOT_A_MODEL", "is not a ChatModel"),
        ("no.such.module:factory", "cannot load the model 'no.such.module:factory'"),
        # Looks like module:attr; the message says how to mean a model name.
        ("mistral:latest", "openai:mistral:latest"),
    ],
)
def test_python_models_that_do_not_load_say_so(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        model_from_string(text)


def test_openai_models_get_their_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENAI_BASE_URL", ENDPOINT)
    settings = ModelSettings(timeout=300, retries=1, temperature=0.2, max_tokens=64, tools="off")
    model = model_from_string("openai:qwen2.5:7b", settings)
    assert isinstance(model, OpenAIChatModel)
    assert (model.name, model.base_url) == ("qwen2.5:7b", ENDPOINT)
    config = model.config
    assert (config.read_timeout, config.max_retries) == (300, 1)
    assert (config.temperature, config.max_tokens, config.native_tools) == (0.2, 64, "off")
    # Unset settings keep the adapter's defaults (the tool mode auto).
    assert model_from_string("openai:m").config.native_tools == "auto"  # type: ignore[attr-defined]


def test_a_base_url_setting_is_an_endpoint_too() -> None:
    model = model_from_string("openai:m", ModelSettings(base_url="http://127.0.0.1:8/v1"))
    assert isinstance(model, OpenAIChatModel)
    assert model.base_url == "http://127.0.0.1:8/v1"
    # A bare name counts it as a configured endpoint as well.
    bare = model_from_string("m", ModelSettings(base_url="http://127.0.0.1:8/v1"))
    assert isinstance(bare, OpenAIChatModel)


def _refused_port() -> int:
    """A port on 127.0.0.1 that takes no connection (bound, then closed)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    return port


@pytest.mark.parametrize("in_container", [True, False], ids=["in-a-container", "on-the-host"])
async def test_a_loopback_endpoint_refused_in_a_container_says_what_loopback_is_there(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, in_container: bool
) -> None:
    marker = tmp_path / ".dockerenv"
    if in_container:
        marker.touch()
    monkeypatch.setattr(strings, "_CONTAINER_MARKERS", (marker,))
    url = f"http://127.0.0.1:{_refused_port()}/v1"
    model = model_from_string("openai:m", ModelSettings(base_url=url))
    with pytest.raises(ConfigError) as raised:
        await check_model(model)
    message = str(raised.value)
    assert message.startswith(f"model openai:m: cannot reach {url}: ")
    assert ("host.docker.internal" in message) is in_container


@pytest.mark.parametrize(
    ("host", "hinted"),
    [
        ("localhost", True),
        ("127.0.0.1", True),
        ("127.1.2.3", True),
        ("::1", True),
        ("10.0.0.5", False),
        ("host.docker.internal", False),
        ("nats", False),
        (None, False),
    ],
)
def test_only_loopback_hosts_get_the_container_hint(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, host: str | None, hinted: bool
) -> None:
    marker = tmp_path / ".dockerenv"
    marker.touch()
    monkeypatch.setattr(strings, "_CONTAINER_MARKERS", (marker,))
    assert bool(strings._loopback_in_container_hint(host)) is hinted


def test_openai_without_an_endpoint_or_a_key_is_a_config_error() -> None:
    with pytest.raises(
        ConfigError, match=r"model 'openai:gpt-4o-mini': no API key.*OPENAI_BASE_URL"
    ):
        model_from_string("openai:gpt-4o-mini")


def test_a_bare_name_needs_an_endpoint_or_a_key(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match=r"a bare name .* openai:NAME, bus:NAME, offline"):
        model_from_string("qwen2.5-coder-1.5b-instruct")
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test")
    model = model_from_string("gpt-4o-mini")
    assert isinstance(model, OpenAIChatModel)
    assert model.name == "gpt-4o-mini"


async def test_a_bus_model_is_bound_later_and_carries_its_options() -> None:
    model = model_from_string("bus:gpt-4-1", ModelSettings(timeout=30, temperature=0.5))
    assert isinstance(model, BusModelRef)
    assert (model.name, model.timeout, model.options) == ("gpt-4-1", 30, {"temperature": 0.5})
    assert model.bus is None
    request = ModelRequest(messages=[ChatMessage(role="user", content=[])])
    with pytest.raises(ModelError, match="not bound to a bus"):
        async for _ in model.stream(request):
            pass


# -- settings and their precedence ----------------------------------------------------------


def test_settings_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLEETBUS_MODEL_TIMEOUT", "300")
    monkeypatch.setenv("FLEETBUS_MODEL_RETRIES", "0")
    monkeypatch.setenv("FLEETBUS_MODEL_TEMPERATURE", "0.1")
    monkeypatch.setenv("FLEETBUS_MODEL_MAX_TOKENS", "512")
    monkeypatch.setenv("FLEETBUS_MODEL_TOOLS", "off")
    monkeypatch.setenv("FLEETBUS_MODEL_FALLBACK", "offline")
    assert load_model_settings() == ModelSettings(
        timeout=300, retries=0, temperature=0.1, max_tokens=512, tools="off", fallback="offline"
    )


def test_command_line_over_toml_over_environment_over_defaults(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("FLEETBUS_MODEL_TIMEOUT", "10")
    monkeypatch.setenv("FLEETBUS_MODEL_RETRIES", "5")
    monkeypatch.setenv("FLEETBUS_MODEL_TEMPERATURE", "0.1")
    settings = load_model_settings(
        toml={"timeout": 20, "retries": 4},
        cli={"timeout": 30.0, "tools": "on", "max_tokens": None},  # None: not given
    )
    assert settings.timeout == 30  # command line
    assert settings.retries == 4  # TOML
    assert settings.temperature == 0.1  # environment
    assert settings.tools == "on"
    assert settings.max_tokens is None  # nobody: the default
    assert settings.fallback is None


@pytest.mark.parametrize(
    ("env", "toml", "cli", "message"),
    [
        (
            {"FLEETBUS_MODEL_TIMEOUT": "slow"},
            {},
            {},
            "FLEETBUS_MODEL_TIMEOUT: Input should be a valid number",
        ),
        (
            {"FLEETBUS_MODEL_TOOLS": "sometimes"},
            {},
            {},
            "FLEETBUS_MODEL_TOOLS: Input should be 'auto', 'on' or 'off'",
        ),
        (
            {},
            {"timeout": 0},
            {},
            r"a.toml: agent.x.model_settings.timeout: Input should be greater than 0",
        ),
        ({}, {"temprature": 1}, {}, "unknown key.*temprature; known: timeout, retries"),
        (
            {},
            {"retries": 1},
            {"retries": -1},
            "--model-retries: Input should be greater than or equal to 0",
        ),
    ],
)
def test_bad_settings_name_where_they_come_from(
    monkeypatch: pytest.MonkeyPatch,
    env: dict[str, str],
    toml: dict[str, object],
    cli: dict[str, object],
    message: str,
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=message):
        load_model_settings(toml=toml, cli=cli, where="a.toml: agent.x.model_settings")


def test_timeout_retries_and_fallback_go_to_the_model_config() -> None:
    config = model_config_from_settings(ModelSettings(timeout=300, retries=0, fallback="offline"))
    assert (config.timeout, config.max_retries) == (300, 0)
    assert isinstance(config.fallback, OfflineModel)
    # Unset settings keep what the base had.
    base = ModelConfig(timeout=5, backoff=0.0)
    kept = model_config_from_settings(ModelSettings(retries=1), base=base)
    assert (kept.timeout, kept.max_retries, kept.backoff) == (5, 1, 0.0)
    assert model_config_from_settings(ModelSettings()) == ModelConfig()
    with pytest.raises(ConfigError, match=r"the fallback model: .*a bare name"):
        model_config_from_settings(ModelSettings(fallback="gpt-4o"))


# -- the default model -------------------------------------------------------------------


def test_nothing_configured_is_the_offline_model_announced_as_such() -> None:
    assert isinstance(default_model(), OfflineModel)
    assert default_model_config() == ModelConfig()
    assert describe_default_model().startswith("built-in offline model (")
    assert "set FLEETBUS_MODEL" in describe_default_model()


def test_fleetbus_model_takes_any_model_string(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLEETBUS_MODEL", "bus:local-qwen")
    assert isinstance(default_model(), BusModelRef)
    assert describe_default_model() == "bus:local-qwen (model workers on the bus)"
    monkeypatch.setenv("FLEETBUS_MODEL", "qwen2.5-coder-1.5b-instruct")  # the README's bare name
    monkeypatch.setenv("OPENAI_BASE_URL", ENDPOINT)
    model = default_model(ModelSettings(timeout=600))
    assert isinstance(model, OpenAIChatModel)
    assert (model.name, model.config.read_timeout) == ("qwen2.5-coder-1.5b-instruct", 600)
    assert describe_default_model() == f"openai:qwen2.5-coder-1.5b-instruct at {ENDPOINT}"


def test_a_configured_model_that_cannot_be_made_stops_with_one_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("FLEETBUS_MODEL", "openai:gpt-4o-mini")
    with pytest.raises(ConfigError, match=r"^FLEETBUS_MODEL: model 'openai:gpt-4o-mini'") as info:
        default_model()
    assert "\n" not in str(info.value)
    assert describe_default_model().startswith("FLEETBUS_MODEL=openai:gpt-4o-mini, which is not")
    # Never the offline model instead.
    monkeypatch.setenv("FLEETBUS_MODEL", "gpt-4o-mini")
    with pytest.raises(ConfigError, match="neither OPENAI_BASE_URL nor OPENAI_API_KEY"):
        default_model()


# -- agents of a spec --------------------------------------------------------------------


def test_a_toml_agent_gets_its_model_and_settings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OPENAI_BASE_URL", ENDPOINT)
    monkeypatch.setenv("FLEETBUS_MODEL_TEMPERATURE", "0.9")
    monkeypatch.setenv("FLEETBUS_MODEL_RETRIES", "7")
    spec = tmp_path / "agents.toml"
    spec.write_text(
        """
[agent.coder]
model = "openai:qwen2.5-coder"

[agent.coder.model_settings]
timeout = 300
max_tokens = 256
tools = "off"
fallback = "offline"

[agent.other]
"""
    )
    coder, other = load_agents(str(spec), settings={"timeout": 400.0})
    assert isinstance(coder.model, OpenAIChatModel)
    config = coder.model.config
    assert (config.read_timeout, config.max_tokens, config.native_tools) == (400, 256, "off")
    assert (config.temperature, config.max_retries) == (0.9, 7)  # from the environment
    assert (coder.model_config.timeout, coder.model_config.max_retries) == (400, 7)
    assert isinstance(coder.model_config.fallback, OfflineModel)
    assert isinstance(other.model, OfflineModel)  # nothing configured
    assert other.model_config.timeout == 400  # the command line is for every agent

    # --model replaces every agent's model; without it FLEETBUS_MODEL is the default.
    monkeypatch.setenv("FLEETBUS_MODEL", "bus:shared")
    coder, other = load_agents(str(spec))
    assert isinstance(coder.model, OpenAIChatModel)
    assert isinstance(other.model, BusModelRef)
    both = load_agents(str(spec), model="offline")
    assert all(isinstance(a.model, OfflineModel) for a in both)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[agent.a]\nmodel = "openai:x"\n', r"agents.toml: agent.a: model 'openai:x': no API key"),
        ("[agent.a]\nmodel = 3\n", r"agent.a.model is not a string"),
        ("[agent.a]\nmodel_settings = 3\n", r"agent.a.model_settings is not a table"),
        ("[agent.a.model_settings]\ntimeout = -1\n", r"agent.a.model_settings.timeout: Input"),
    ],
)
def test_bad_toml_models_name_the_agent(tmp_path: Path, text: str, message: str) -> None:
    spec = tmp_path / "agents.toml"
    spec.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_agents(str(spec))


def test_a_factory_sees_the_command_line_and_model_overrides_its_agents(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("OPENAI_BASE_URL", ENDPOINT)
    monkeypatch.setenv("FLEETBUS_MODEL_TIMEOUT", "200")
    (agent,) = load_agents("fleetbus.cli.demo_fleet:agents")
    assert isinstance(agent.model, OfflineModel)
    assert agent.model_config.timeout == 200  # the demo reads FLEETBUS_MODEL_* itself

    (agent,) = load_agents(
        "fleetbus.cli.demo_fleet:agents",
        model="openai:small",
        settings={"timeout": 900.0, "tools": "off"},
    )
    assert isinstance(agent.model, OpenAIChatModel)
    assert (agent.model.name, agent.model.config.native_tools) == ("small", "off")
    assert (agent.model.config.read_timeout, agent.model_config.timeout) == (900, 900)
    # The environment is as it was.
    assert "FLEETBUS_MODEL" not in os.environ
    assert os.environ["FLEETBUS_MODEL_TIMEOUT"] == "200"


def test_a_bus_model_is_found_under_the_name_its_workers_serve_it_as() -> None:
    """``fleetbus model-worker --model openai:qwen2.5-coder`` serves it as
    ``qwen2-5-coder``; ``bus:qwen2.5-coder`` finds it there."""
    from fleetbus.models.strings import served_name

    assert served_name("qwen2.5-coder-1.5b-instruct") == "qwen2-5-coder-1-5b-instruct"
    with_dots = model_from_string("bus:qwen2.5-coder")
    without = model_from_string("bus:qwen2-5-coder")
    assert with_dots.name == without.name
