"""Whose a reply's events are: the owner token the serving side derives from
the request's reply subject, and the one a client derives from its own inbox
prefix, name the same subject; and what the roles' permissions grant of it."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fleetbus.bus import ConnectOptions, Subjects, inbox_prefix
from fleetbus.bus.subjects import ANY_OWNER, NO_OWNER
from fleetbus.cli.auth_cmd import role_permissions
from fleetbus.errors import ConfigError, InvalidSubjectError


def _matches(pattern: str, subject: str) -> bool:
    """NATS subject matching: ``*`` is one token, ``>`` one or more at the end."""
    want, got = pattern.split("."), subject.split(".")
    for i, token in enumerate(want):
        if token == ">":
            return len(got) > i
        if i >= len(got) or token not in ("*", got[i]):
            return False
    return len(want) == len(got)


def test_the_owner_of_a_reply_is_the_identity_in_its_reply_subject() -> None:
    s = Subjects("acme.prod")
    assert s.inbox_root() == inbox_prefix("acme.prod") == "_INBOX_acme_prod"
    # nats-py's inboxes: <prefix>.<unique>, and its request mux's <prefix>.<unique>.<token>.
    assert s.reply_owner("_INBOX_acme_prod.alice.Xyz123") == "alice"
    assert s.reply_owner("_INBOX_acme_prod.alice.Xyz123.7") == "alice"
    assert s.reply_owner("_INBOX_acme_prod.UABCDEF.Xyz123") == "UABCDEF"  # an NKEY user
    # Without credentials the unique token stands first: a subject of its own.
    assert s.reply_owner("_INBOX_acme_prod.Xyz123") == "Xyz123"
    # Nobody of the fleet's inboxes waits: no reply subject, another root,
    # another fleet (a root that only starts the same), a token that is no name.
    for nobody in (None, "", "_INBOX.Xyz123", "mine.x.y", "_INBOX_acme_prodx.alice.y"):
        assert s.reply_owner(nobody) == NO_OWNER, nobody
    assert s.reply_owner("_INBOX_acme_prod.a*b.y") == NO_OWNER
    assert s.reply_owner("_INBOX_acme_prod." + "a" * 129 + ".y") == NO_OWNER


def test_a_client_reads_the_events_of_its_own_identity() -> None:
    s = Subjects("acme.prod")
    assert s.inbox_owner("_INBOX_acme_prod.alice") == "alice"
    assert s.inbox_owner(inbox_prefix("acme.prod", "alice@example.com")) == "alice_example_com"
    assert s.inbox_owner("_INBOX_acme_prod") == ANY_OWNER  # no credentials: every owner
    assert s.inbox_owner("_INBOX_mine.x") == NO_OWNER  # a custom inbox prefix
    options = ConnectOptions(prefix="acme.prod", user="bob", password="pw")
    assert s.inbox_owner(options.reply_prefix()) == "bob"


@given(
    identity=st.one_of(st.none(), st.text(min_size=1, max_size=40)),
    unique=st.from_regex(r"[A-Za-z0-9]{1,22}", fullmatch=True),
    token=st.one_of(st.none(), st.from_regex(r"[0-9]{1,6}", fullmatch=True)),
)
def test_the_client_subscribes_where_the_host_publishes(
    identity: str | None, unique: str, token: str | None
) -> None:
    s = Subjects("acme.prod")
    prefix = inbox_prefix("acme.prod", identity)
    reply_to = f"{prefix}.{unique}" + (f".{token}" if token else "")
    published = s.events("a1", "s1", s.reply_owner(reply_to))
    subscribed = s.events("a1", "s1", s.inbox_owner(prefix))
    assert _matches(subscribed, published)
    assert _matches(s.all_events("a1"), published)
    assert _matches(s.all_events(), published)
    if identity:
        # Another identity's subscription does not see it.
        other = s.events("a1", "s1", s.inbox_owner(inbox_prefix("acme.prod", identity + "x")))
        assert not _matches(other, published)


def test_an_events_subject_names_one_owner_or_any() -> None:
    s = Subjects()
    assert s.events("a1", "s1", "_") == "fleet.events.a1.s1._"
    assert s.events("a1", "s1", ANY_OWNER) == "fleet.events.a1.s1.*"
    for bad in ("", ">", "a.b", "a b"):
        with pytest.raises(InvalidSubjectError):
            s.events("a1", "s1", bad)


def test_roles_read_the_events_of_their_own_identity_only() -> None:
    client = role_permissions("f", "client", identity="alice")
    assert "f.events.*.*.alice" in client.subscribe
    assert not any(s.startswith("f.events.>") for s in client.subscribe)
    agent = role_permissions("f", "agent", identity="agent-a1", name="a1")
    assert "f.events.a1.*.*" in agent.publish  # its own agent's events, whoever asked
    assert "f.events.*.*.agent-a1" in agent.subscribe  # the replies it asks other agents for
    assert "$SRV.*.fleetbus-agents" in agent.subscribe  # it answers agent discovery
    everyone = role_permissions("f", "agent", identity="agents")
    assert "f.events.*.*.*" in everyone.publish
    # An identity that reads as '_' or '*' would read events nobody (or anybody) owns.
    for odd in ("_", "*", "x" * 129):
        with pytest.raises(ConfigError, match="cannot own events"):
            role_permissions("f", "client", identity=odd)


def test_the_gateway_reads_sessions_and_writes_none() -> None:
    gateway = role_permissions("f", "gateway", identity="gw")
    assert set(gateway.subscribe) == {"f.events.*.*.gw", "f.session.*.*", "_INBOX_f.gw.>"}
    assert "f.agent.*.inbox" in gateway.publish
    assert "f.agent.*.control" in gateway.publish
    for verb in ("PING", "INFO", "STATS"):
        assert f"$SRV.{verb}.fleetbus-agents" in gateway.publish
    assert "$JS.API.DIRECT.GET.f_session.>" in gateway.publish
    assert "$JS.API.STREAM.INFO.f_session" in gateway.publish
    assert "$JS.API.DIRECT.GET.KV_f_session_leases.>" in gateway.publish
    assert "$JS.API.STREAM.INFO.OBJ_f_session_blobs" in gateway.publish
    # Nothing that writes: no journal subject, no KV or object write, no
    # stream made or changed, no consumer on the journal, no tool, no event.
    written = ("f.session.", "$KV.", "$O.", "f.tool.", "f.events.")
    changed = ("STREAM.CREATE", "STREAM.UPDATE", "STREAM.PURGE", "MSG.DELETE")
    for subject in gateway.publish:
        assert not subject.startswith(written), subject
        assert not any(verb in subject for verb in changed), subject
        assert not subject.startswith("$JS.API.CONSUMER.CREATE.f_session."), subject
        assert subject != "$JS.API.CONSUMER.CREATE.f_session", subject
