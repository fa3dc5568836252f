"""The commands' settings come from ``FLEETBUS_*`` variables through one
pydantic-settings model; a bad value stops a command with one line naming
its variable, and a bad number on the command line is refused by argparse."""

from __future__ import annotations

import pytest

from fleetbus.cli import build_parser
from fleetbus.cli.settings import cli_settings
from fleetbus.errors import ConfigError


def test_the_variables_are_read_and_the_command_line_wins(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("FLEETBUS_LOG_FORMAT", " JSON ")
    monkeypatch.setenv("FLEETBUS_UVLOOP", "0")
    monkeypatch.setenv("FLEETBUS_MODEL_WAIT", "2.5")
    monkeypatch.setenv("FLEETBUS_DEMO_TIMEOUT", "")  # empty: as if unset
    settings = cli_settings()
    assert (settings.log_format, settings.uvloop, settings.model_wait) == ("json", False, 2.5)
    assert settings.demo_timeout == 900.0
    assert cli_settings(log_format="text").log_format == "text"


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("FLEETBUS_MODEL_WAIT", "0"),
        ("FLEETBUS_DEMO_TIMEOUT", "soon"),
        ("FLEETBUS_LOG_FORMAT", "xml"),
        ("FLEETBUS_UVLOOP", "maybe"),
    ],
)
def test_a_bad_variable_is_named(monkeypatch: pytest.MonkeyPatch, name: str, value: str) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=f"^{name}: "):
        cli_settings()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["agent", "m:agents", "--replicas", "0"], "a count of 1 or more, not '0'"),
        (["worker", "m", "--concurrency", "0"], "a count of 1 or more, not '0'"),
        (["demo", "--calls", "x"], "a count of 1 or more, not 'x'"),
        (["dashboard", "--port", "70000"], "a port is 0 to 65535, not '70000'"),
        (["dashboard", "--poll", "0"], "a positive number of seconds, not '0'"),
        (["dashboard", "--store-wait", "-1"], "seconds of 0 or more, not '-1'"),
        (["sim", "run", "p:s", "--deadline", "nan"], "a positive number of seconds, not 'nan'"),
        (["sim", "run", "p:s", "--rounds", "-1"], "a count of 0 or more, not '-1'"),
    ],
)
def test_a_number_out_of_range_is_a_usage_error(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(argv)
    assert exited.value.code == 2
    assert message in capsys.readouterr().err
