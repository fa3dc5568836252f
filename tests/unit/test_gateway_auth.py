"""The gateway's tokens: the file's shape and its errors, who a header is,
and the session ids that keep users apart."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from fleetbus.errors import ConfigError
from fleetbus.gateway.auth import (
    TOKENS_VARIABLE,
    Tokens,
    Unauthorized,
    new_token,
    session_tag,
)

SECRET = "sk-a-secret-of-sixteen"


def test_a_token_or_its_digest_names_a_user_and_a_role() -> None:
    digest = hashlib.sha256(b"sk-bob-sixteen-chars").hexdigest()
    tokens = Tokens.parse(
        json.dumps(
            [
                {"user": "alice", "token": SECRET},
                {"user": "bob", "sha256": digest, "role": "admin", "agents": ["writer"]},
            ]
        ),
        source="t.json",
    )
    alice = tokens.caller(f"Bearer {SECRET}", None)
    assert (alice.user, alice.role, alice.agents) == ("alice", "user", None)
    bob = tokens.caller(None, "sk-bob-sixteen-chars")
    assert (bob.user, bob.role, bob.agents) == ("bob", "admin", frozenset({"writer"}))
    assert bob.may_talk_to("writer")
    assert not bob.may_talk_to("reader")
    assert SECRET not in alice.token_id


@pytest.mark.parametrize(
    ("authorization", "api_key", "said"),
    [
        (None, None, "no token"),
        ("Bearer sk-unknown-sixteen-chars", None, "not known"),
        ("Basic YWxpY2U6cHc=", None, "not 'Bearer TOKEN'"),
        ("Bearer ", None, "not 'Bearer TOKEN'"),
    ],
)
def test_no_token_or_an_unknown_one_is_unauthorized(
    authorization: str | None, api_key: str | None, said: str
) -> None:
    tokens = Tokens.parse(json.dumps([{"user": "alice", "token": SECRET}]), source="t")
    with pytest.raises(Unauthorized, match=said):
        tokens.caller(authorization, api_key)


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("{", "malformed"),
        ('[{"user": "a"}]', "one of 'token' or 'sha256'"),
        ('[{"user": "a", "token": "short"}]', "at least 16"),
        ('[{"user": "a", "token": "sk-a-secret-of-sixteen", "role": "root"}]', "role"),
        ('[{"user": "a", "sha256": "xyz"}]', "sha256"),
        ('[{"user": "a", "token": "sk-a-secret-of-sixteen", "agents": ["no.dots"]}]', "agent name"),
        ('[{"user": "a", "token": "sk-a-secret-of-sixteen", "extra": 1}]', "extra"),
        ("[]", "no tokens"),
    ],
)
def test_a_malformed_tokens_file_is_one_clear_error(text: str, said: str) -> None:
    with pytest.raises(ConfigError, match=said):
        Tokens.parse(text, source="t.json")


def test_a_token_given_twice_is_refused() -> None:
    entry = {"user": "a", "token": SECRET}
    with pytest.raises(ConfigError, match="given twice"):
        Tokens.parse(json.dumps([entry, {**entry, "user": "b"}]), source="t")


def test_tokens_load_from_a_file_or_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "tokens.json"
    path.write_text(json.dumps([{"user": "alice", "token": SECRET}]))
    assert Tokens.load(path).caller(f"Bearer {SECRET}", None).user == "alice"
    with pytest.raises(ConfigError, match="cannot read the tokens file"):
        Tokens.load(tmp_path / "missing.json")
    monkeypatch.setenv(TOKENS_VARIABLE, json.dumps([{"user": "env", "token": SECRET}]))
    assert Tokens.load().caller(f"Bearer {SECRET}", None).user == "env"
    monkeypatch.setenv(TOKENS_VARIABLE, "[{")
    with pytest.raises(ConfigError, match=TOKENS_VARIABLE):
        Tokens.load()


def test_a_new_token_comes_with_an_entry_that_holds_only_its_digest() -> None:
    token, entry = new_token("carol", "admin")
    assert token not in entry
    tokens = Tokens.parse(f"[{entry}]", source="new")
    carol = tokens.caller(f"Bearer {token}", None)
    assert (carol.user, carol.role) == ("carol", "admin")


def test_session_ids_keep_users_apart() -> None:
    tokens = Tokens.parse(
        json.dumps(
            [
                {"user": "alice", "token": SECRET},
                {"user": "ops", "token": "sk-ops-sixteen-chars", "role": "admin"},
            ]
        ),
        source="t",
    )
    alice = tokens.caller(f"Bearer {SECRET}", None)
    ops = tokens.caller("Bearer sk-ops-sixteen-chars", None)
    mine = f"{session_tag('alice')}-talk"
    assert alice.owns(mine)
    assert not alice.owns(f"{session_tag('bob')}-talk")
    assert not alice.owns("talk")
    assert ops.owns("talk")
    assert ops.owns(mine)
    assert session_tag("alice") != session_tag("alice ")
