"""The authorization block of ``fleetbus auth`` and the inbox scheme it
relies on, without a server: who may do what, and how refusals read."""

from __future__ import annotations

import pytest

from fleetbus.bus import ConnectOptions, inbox_prefix, inbox_wildcard
from fleetbus.bus._replies import Denials, permission_denied
from fleetbus.cli.auth_cmd import ROLES, User, authorization, role_permissions
from fleetbus.errors import ConfigError, PermissionDeniedError


def test_inboxes_are_per_fleet_and_per_identity() -> None:
    assert inbox_prefix("acme.prod") == "_INBOX_acme_prod"
    assert inbox_prefix("acme.prod", "alice@example.com") == "_INBOX_acme_prod.alice_example_com"
    assert inbox_wildcard("fleet", "bob") == "_INBOX_fleet.bob.>"
    options = ConnectOptions(prefix="acme", user="alice", password="pw")
    assert options.nats_kwargs()["inbox_prefix"] == "_INBOX_acme.alice"
    assert ConnectOptions(prefix="acme").nats_kwargs()["inbox_prefix"] == "_INBOX_acme"
    custom = ConnectOptions.from_env(environ={"FLEETBUS_INBOX_PREFIX": "_INBOX_mine.x"})
    assert custom.nats_kwargs()["inbox_prefix"] == "_INBOX_mine.x"
    with pytest.raises(ConfigError):
        ConnectOptions.from_env(environ={"FLEETBUS_INBOX_PREFIX": "_INBOX.>"})


def test_each_role_gets_only_what_it_uses() -> None:
    worker = role_permissions("f", "tool-worker", identity="w")
    assert "f.tool.*" in worker.subscribe
    assert not any(s.startswith("f.tool") for s in worker.publish)  # serves, calls no tool
    assert not any("session" in s for s in worker.publish + worker.subscribe)
    assert "$O.f_tool_results.>" in worker.publish
    assert worker.responses == (1, None)
    assert "_INBOX_f.w.>" in worker.subscribe

    agent = role_permissions("f", "agent", identity="a", name="a1")
    assert agent.subscribe[:2] == ("f.agent.a1.inbox", "f.agent.a1.control")
    assert "f.session.a1.*" in agent.publish  # its own sessions' journals
    assert "f.session.*.*" not in agent.publish
    assert "$JS.API.DIRECT.GET.f_session" in agent.publish
    assert "$KV.f_session_leases.>" in agent.publish
    assert "_INBOX_f.>" in agent.publish  # a replica answers a request another took
    assert "$O.f_tool_results.>" not in agent.publish  # reads results, writes none

    client = role_permissions("f", "client", identity="alice")
    assert "_INBOX_f.alice.>" in client.subscribe
    assert not any(s.startswith("_INBOX_f.>") for s in client.subscribe)
    assert not any("f_session" in s or "f.session" in s for s in client.publish)

    watcher = role_permissions("f", "watcher", identity="w")
    assert watcher.publish == ()
    assert set(watcher.subscribe) == {"f.>", "_INBOX_f.>"}

    models = role_permissions("f", "model-worker", identity="m")
    assert models.publish == ()
    assert models.responses is not None
    assert models.responses[0] > 1  # deltas, then the answer

    with pytest.raises(ConfigError, match="unknown role"):
        role_permissions("f", "admin", identity="x")


def test_the_block_is_nats_server_syntax() -> None:
    block = authorization(
        "f",
        [
            User(role="watcher", user="w", password="$FLEETBUS_PASSWORD_W"),
            User(role="model-worker", nkey="UABC"),
            User(role="tool-worker", user="t", password='p"w'),
        ],
        topics=["news"],
    )
    assert block.count("{") == block.count("}")
    assert "password: $FLEETBUS_PASSWORD_W" in block  # read by the server from its environment
    assert 'password: "p\\"w"' in block
    assert 'nkey: "UABC"' in block
    assert 'publish: { deny: [">"] }' in block  # the watcher publishes nothing
    assert "allow_responses: { max: 1 }" in block
    assert len(ROLES) == 6
    with pytest.raises(ConfigError):
        authorization("f", [User(role="client")])


def test_a_permission_violation_becomes_one_line() -> None:
    denial = permission_denied(
        Exception('nats: permissions violation for publish to "fleet.tool.search"')
    )
    assert isinstance(denial, PermissionDeniedError)
    assert str(denial) == "permission denied: publish to fleet.tool.search"
    assert (denial.operation, denial.subject) == ("publish", "fleet.tool.search")
    queued = permission_denied(
        Exception('nats: permissions violation for subscription to "a.b" using queue "q"')
    )
    assert queued is not None
    assert str(queued) == "permission denied: subscription to a.b"
    assert permission_denied(Exception("nats: timeout")) is None

    denials = Denials()
    mark = denials.count
    denials.add(queued)
    # The server lower-cases its text; the caller's spelling is kept.
    found = denials.since(mark, "subscription", "A.B")
    assert found is not None
    assert str(found) == "permission denied: subscription to A.B"
    assert denials.since(denials.count) is None
    assert denials.since(mark, "publish") is None


def test_the_agents_service_name_is_the_one_hosts_register() -> None:
    from fleetbus.agents.serving import AGENT_SERVICE_NAME
    from fleetbus.cli.auth_cmd import AGENT_SERVICE

    assert AGENT_SERVICE == AGENT_SERVICE_NAME
