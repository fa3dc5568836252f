"""Who may use the gateway: bearer tokens, each naming a user and a role.

The tokens come from a JSON file (``--tokens FILE``) or from the
``FLEETBUS_GATEWAY_TOKENS`` variable, in one shape::

    [
      {"user": "alice", "token": "sk-alice-…"},
      {"user": "bob", "sha256": "9f86d08…", "agents": ["writer"]},
      {"user": "ops", "token": "sk-ops-…", "role": "admin"}
    ]

``token`` is the secret itself; ``sha256`` its SHA-256 in hex, so that the
file holds no secret (``fleetbus gateway --new-token USER`` makes a token and
its entry). A ``user`` reads and continues only its own sessions; an
``admin`` reads and continues every session. ``agents``, when given, are the
only agents the token may talk to.

A request carries its token as ``Authorization: Bearer TOKEN`` (what every
OpenAI client sends from its API key) or ``x-api-key: TOKEN``; no token, no
access.

Sessions are kept apart by their ids: a user's sessions are named
``<tag>-<conversation>``, where the tag is a digest of the user name, so a
user can name its conversations freely and never reach another user's.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Final, Literal

import pydantic
from pydantic import BaseModel, ConfigDict, StringConstraints, model_validator

from fleetbus.bus import check_name
from fleetbus.errors import ConfigError, FleetbusError

__all__ = [
    "TOKENS_VARIABLE",
    "Caller",
    "Forbidden",
    "TokenEntry",
    "Tokens",
    "Unauthorized",
    "new_token",
    "session_tag",
]

TOKENS_VARIABLE: Final = "FLEETBUS_GATEWAY_TOKENS"
"""The environment variable that holds the tokens (JSON) when no file is given."""

Role = Literal["user", "admin"]
_TAG_LENGTH: Final = 12


class Unauthorized(FleetbusError):
    """The request carries no token, or one the gateway does not know."""


class Forbidden(FleetbusError):
    """The token is known but may not do what the request asks."""


def session_tag(user: str) -> str:
    """The prefix of every session id of ``user``: ``u`` and 12 hex digits of
    the SHA-256 of the user name."""
    return "u" + hashlib.sha256(user.encode()).hexdigest()[:_TAG_LENGTH]


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class TokenEntry(BaseModel):
    """One token of the tokens file."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    user: Annotated[str, StringConstraints(min_length=1, max_length=128)]
    role: Role = "user"
    token: Annotated[str, StringConstraints(min_length=16, max_length=512)] | None = None
    sha256: Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")] | None = None
    agents: list[str] | None = None
    """The agents the token may talk to (all when not given)."""

    @model_validator(mode="after")
    def _one_secret(self) -> TokenEntry:
        if (self.token is None) == (self.sha256 is None):
            raise ValueError(f"give the user {self.user!r} one of 'token' or 'sha256'")
        for agent in self.agents or ():
            check_name(agent, what="agent name")
        return self

    @property
    def digest(self) -> str:
        """The SHA-256 of the token, in hex."""
        return self.sha256 if self.sha256 is not None else _digest(self.token or "")


@dataclass(frozen=True, slots=True)
class Caller:
    """Who a request comes from."""

    user: str
    role: Role
    token_id: str
    """A short, non-secret name of the token (the start of its digest), for
    limits and logs."""
    agents: frozenset[str] | None = None

    @property
    def tag(self) -> str:
        """The prefix of this user's session ids."""
        return session_tag(self.user)

    def may_talk_to(self, agent: str) -> bool:
        """Whether the token may talk to ``agent``."""
        return self.agents is None or agent in self.agents

    def owns(self, session_id: str) -> bool:
        """Whether ``session_id`` is one of this caller's (an admin's: any)."""
        return self.role == "admin" or session_id.startswith(self.tag + "-")


class Tokens:
    """The tokens the gateway accepts.

    Raises:
        ConfigError: no tokens, a malformed entry, or one token given twice.
    """

    def __init__(self, entries: Sequence[TokenEntry]) -> None:
        if not entries:
            raise ConfigError(
                f"the gateway has no tokens: give --tokens FILE or set {TOKENS_VARIABLE} "
                '(JSON: [{"user": "me", "token": "a secret of 16+ characters"}])'
            )
        self._by_digest: dict[str, TokenEntry] = {}
        for entry in entries:
            if entry.digest in self._by_digest:
                raise ConfigError(f"a token of user {entry.user!r} is given twice")
            self._by_digest[entry.digest] = entry

    def __len__(self) -> int:
        return len(self._by_digest)

    @classmethod
    def parse(cls, text: str, *, source: str) -> Tokens:
        """Tokens from JSON text (a list of entries).

        Raises:
            ConfigError: the text is not such a list (the error names ``source``).
        """
        try:
            entries = pydantic.TypeAdapter(list[TokenEntry]).validate_json(text)
        except pydantic.ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in e['loc']) or 'the list'}: {e['msg']}"
                for e in exc.errors()[:5]
            )
            raise ConfigError(f"the tokens in {source} are malformed: {problems}") from None
        return cls(entries)

    @classmethod
    def load(cls, path: str | Path | None = None) -> Tokens:
        """The tokens of the file ``path``, else of :data:`TOKENS_VARIABLE`.

        Raises:
            ConfigError: the file cannot be read, neither is given, or the
                tokens are malformed.
        """
        if path is not None:
            try:
                text = Path(path).read_text(encoding="utf-8")
            except OSError as exc:
                raise ConfigError(
                    f"cannot read the tokens file {path}: {exc.strerror or exc}"
                ) from exc
            return cls.parse(text, source=str(path))
        text = os.environ.get(TOKENS_VARIABLE, "")
        if not text.strip():
            return cls([])
        return cls.parse(text, source=TOKENS_VARIABLE)

    def caller(self, authorization: str | None, api_key: str | None) -> Caller:
        """Who presents ``Authorization: Bearer TOKEN`` (or ``x-api-key``).

        Raises:
            Unauthorized: no token, or an unknown one.
        """
        token = api_key
        if authorization:
            scheme, _, value = authorization.partition(" ")
            if scheme.lower() != "bearer" or not value.strip():
                raise Unauthorized("the Authorization header is not 'Bearer TOKEN'")
            token = value.strip()
        if not token:
            raise Unauthorized("no token: send 'Authorization: Bearer TOKEN'")
        digest = _digest(token)
        entry = self._by_digest.get(digest)
        # A lookup by digest answers in the same time whichever byte differs;
        # the comparison below keeps it so for the hit too.
        if entry is None or not hmac.compare_digest(entry.digest, digest):
            raise Unauthorized("the token is not known to this gateway")
        agents = frozenset(entry.agents) if entry.agents is not None else None
        return Caller(user=entry.user, role=entry.role, token_id=digest[:12], agents=agents)


def new_token(user: str, role: Role = "user") -> tuple[str, str]:
    """A new random token for ``user`` and its entry for the tokens file
    (holding only the token's SHA-256), as JSON."""
    token = "fb-" + secrets.token_urlsafe(32)
    entry = TokenEntry(user=user, role=role, sha256=_digest(token))
    return token, entry.model_dump_json(exclude_none=True)
