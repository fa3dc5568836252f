"""The ``external_result`` that ``fleetbus resume`` (and the dashboard) sends."""

from __future__ import annotations

import pytest

from fleetbus.agents.serving.client import external_result
from fleetbus.errors import ConfigError


def test_results_and_errors_become_one_external_result() -> None:
    message = external_result(
        "s-1", results=[("t0", {"rows": 3}), ("t1", "text")], errors=[("t2", "disk full")]
    )
    assert message.session_id == "s-1"
    assert message.sender == "cli"
    ok, text, failed = message.results
    assert (ok.call_id, ok.status, ok.content) == ("t0", "success", {"rows": 3})
    assert (text.call_id, text.content) == ("t1", "text")
    assert (failed.call_id, failed.status) == ("t2", "error")
    assert failed.error_detail is not None
    assert (failed.error_detail.code, failed.error_detail.message) == ("tool_error", "disk full")


@pytest.mark.parametrize(
    ("results", "errors", "said"),
    [
        ([], [], "at least one result"),
        ([("t0", 1)], [("t0", "no")], "given twice"),
        ([("", 1)], [], "empty"),
    ],
)
def test_a_resume_that_names_no_call_or_one_twice_is_refused(
    results: list[tuple[str, object]], errors: list[tuple[str, str]], said: str
) -> None:
    with pytest.raises(ConfigError, match=said):
        external_result("s-1", results=results, errors=errors)
