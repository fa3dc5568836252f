"""The agent replicas ``fleetbus agent --replicas N`` starts log as the
command does: ``-v`` and ``--log-format`` reach them through
``FLEETBUS_LOG_LEVEL`` and ``FLEETBUS_LOG_FORMAT``; this process's own
environment is left as it was."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator

import pytest

from fleetbus.cli._common import child_environment, setup_logging


@pytest.fixture
def restored(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv("FLEETBUS_LOG_LEVEL", raising=False)
    monkeypatch.delenv("FLEETBUS_LOG_FORMAT", raising=False)
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.mark.usefixtures("restored")
@pytest.mark.parametrize(
    ("verbose", "log_format", "level", "chosen"),
    [(1, "json", "info", "json"), (2, None, "debug", "text"), (0, None, "warning", "text")],
)
def test_children_inherit_the_level_and_format(
    verbose: int, log_format: str | None, level: str, chosen: str
) -> None:
    setup_logging(verbose, log_format)
    child = child_environment()
    assert (child["FLEETBUS_LOG_LEVEL"], child["FLEETBUS_LOG_FORMAT"]) == (level, chosen)
    assert "FLEETBUS_LOG_LEVEL" not in os.environ


@pytest.mark.usefixtures("restored")
def test_the_environment_is_kept_when_nothing_is_given(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLEETBUS_LOG_LEVEL", "error")
    monkeypatch.setenv("FLEETBUS_LOG_FORMAT", "json")
    setup_logging(0, None)
    assert (os.environ["FLEETBUS_LOG_LEVEL"], os.environ["FLEETBUS_LOG_FORMAT"]) == (
        "error",
        "json",
    )


@pytest.mark.usefixtures("restored")
def test_text_logs_off_a_terminal_are_whole_lines(capsys: pytest.CaptureFixture[str]) -> None:
    """A container's log or a pipe gets one line a record, not a console's
    80 columns with the message wrapped and padded."""
    setup_logging(0, "text")
    long = "word " * 60
    logging.getLogger("fleetbus.test").warning("%s: the end", long.strip())
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    assert lines[0].endswith(f"{long.strip()}: the end")
    assert "WARNING" in lines[0]
