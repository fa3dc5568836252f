"""How to reach NATS: URLs, credentials, TLS and reconnection, from code or
the environment.

The environment variables are those of :class:`ConnectEnvironment`
(``FLEETBUS_NATS_URL``, ``FLEETBUS_PREFIX``, credentials, TLS …), read by
:meth:`ConnectOptions.from_env`, and those of :class:`BusSettings`
(``FLEETBUS_GC_THRESHOLD``, ``FLEETBUS_PRIVATE_OFF``, ``FLEETBUS_NATS_SERVER``).

Replies travel on inboxes of the fleet and of the client's identity,
``_INBOX_<prefix with . as _>.<identity>.<unique>…``: the identity is the
user name (``FLEETBUS_NATS_USER``, or the user of a URL
``nats://user:password@host``), else the public key of the NKEY (or of the
credentials file's user), and is left out without credentials. The authorization block of
``fleetbus auth`` lets each user subscribe to its own inboxes only, so no role
needs the server-wide ``_INBOX.>``. The identity is also whose events a
reply's are (:meth:`Subjects.reply_owner
<fleetbus.bus.subjects.Subjects.reply_owner>`).
"""

from __future__ import annotations

import re
import ssl
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import nkeys  # type: ignore[import-untyped]
from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from fleetbus.bus.subjects import DEFAULT_PREFIX, INBOX_ROOT, Subjects, check_prefix
from fleetbus.errors import ConfigError

__all__ = [
    "DEFAULT_URL",
    "INBOX_ROOT",
    "BusSettings",
    "ConnectEnvironment",
    "ConnectOptions",
    "inbox_prefix",
    "inbox_wildcard",
]

DEFAULT_URL = "nats://127.0.0.1:4222"
"""Where fleetbus connects when no URL is given anywhere."""

_NOT_TOKEN = re.compile(r"[^A-Za-z0-9_-]")


class BusSettings(BaseSettings):
    """The bus layer's settings from the environment, apart from how to reach
    NATS (:class:`ConnectOptions`). Each field is read from ``FLEETBUS_`` and
    its name in capitals."""

    model_config = SettingsConfigDict(env_prefix="FLEETBUS_", extra="ignore", frozen=True)

    gc_threshold: int | None = Field(default=None, ge=0)
    """``FLEETBUS_GC_THRESHOLD``: the first-generation threshold of Python's
    collector that :func:`~fleetbus.bus.tune_gc` sets (a whole number, at
    least 0; ``0`` leaves Python's settings alone); unset:
    :data:`~fleetbus.bus.GC_THRESHOLD`."""
    private_off: str = ""
    """``FLEETBUS_PRIVATE_OFF``: the private paths of ``fleetbus.bus._seam``
    not to take, comma-separated (``route``, ``publish_now``, ``headers``,
    ``places``, ``unsubscribe``, ``server_info``), or ``all``: those then go
    through nats-py's and asyncio's public API. For measuring what each buys,
    and for a nats-py release whose internals changed in a way the start-up
    check cannot see."""

    nats_server: str = ""
    """``FLEETBUS_NATS_SERVER``: the ``nats-server`` executable
    :class:`~fleetbus.bus.EmbeddedServer` runs (and the test suite's
    servers), instead of the one next to the interpreter or on ``PATH``: to
    run fleetbus, or its tests, on another release
    (``scripts/test-server-versions.sh``)."""

    def private_paths_off(self) -> frozenset[str]:
        """The names :attr:`private_off` lists."""
        return frozenset(name.strip() for name in self.private_off.split(",") if name.strip())


def inbox_prefix(prefix: str, identity: str | None = None) -> str:
    """The inbox prefix of a fleet's client: ``_INBOX_<prefix with . as
    _>[.<identity>]``; nats-py adds a unique token per inbox.

    Args:
        prefix: the fleet's subject prefix.
        identity: who connects (a user name or an NKEY public key); any
            character that cannot be in a subject token becomes ``_``.

    Raises:
        InvalidSubjectError: ``prefix`` is not a valid prefix.
    """
    fleet = Subjects(prefix).inbox_root()
    if not identity:
        return fleet
    return f"{fleet}.{_NOT_TOKEN.sub('_', identity)}"


def inbox_wildcard(prefix: str, identity: str | None = None) -> str:
    """Every inbox of a fleet (or of one identity in it): ``<inbox prefix>.>``.

    Raises:
        InvalidSubjectError: ``prefix`` is not a valid prefix.
    """
    return f"{inbox_prefix(prefix, identity)}.>"


class ConnectEnvironment(BaseSettings):
    """How to reach NATS, as the environment says (an empty variable is as if
    unset): what :meth:`ConnectOptions.from_env` reads, under the name of the
    option each variable gives; the options check the values."""

    model_config = SettingsConfigDict(env_ignore_empty=True, extra="ignore", frozen=True)

    servers: str | None = Field(default=None, validation_alias="FLEETBUS_NATS_URL")
    """``FLEETBUS_NATS_URL``: one or more server URLs, comma-separated."""
    prefix: str | None = Field(default=None, validation_alias="FLEETBUS_PREFIX")
    """``FLEETBUS_PREFIX``: the subject prefix (default ``fleet``)."""
    user: str | None = Field(default=None, validation_alias="FLEETBUS_NATS_USER")
    """``FLEETBUS_NATS_USER``: the user name (with ``FLEETBUS_NATS_PASSWORD``)."""
    password: SecretStr | None = Field(default=None, validation_alias="FLEETBUS_NATS_PASSWORD")
    """``FLEETBUS_NATS_PASSWORD``: the password."""
    token: SecretStr | None = Field(default=None, validation_alias="FLEETBUS_NATS_TOKEN")
    """``FLEETBUS_NATS_TOKEN``: an auth token."""
    creds_file: str | None = Field(default=None, validation_alias="FLEETBUS_NATS_CREDS")
    """``FLEETBUS_NATS_CREDS``: the path of a ``.creds`` file (JWT + NKey)."""
    nkey_file: str | None = Field(default=None, validation_alias="FLEETBUS_NATS_NKEY")
    """``FLEETBUS_NATS_NKEY``: the path of an NKEY user seed file (``SU…``)."""
    inbox_prefix: str | None = Field(default=None, validation_alias="FLEETBUS_INBOX_PREFIX")
    """``FLEETBUS_INBOX_PREFIX``: the reply inbox prefix (default: see the module)."""
    tls_ca_file: str | None = Field(default=None, validation_alias="FLEETBUS_NATS_TLS_CA")
    """``FLEETBUS_NATS_TLS_CA``: a CA bundle to verify the server."""
    tls_cert_file: str | None = Field(default=None, validation_alias="FLEETBUS_NATS_TLS_CERT")
    """``FLEETBUS_NATS_TLS_CERT``: the client certificate (mutual TLS)."""
    tls_key_file: str | None = Field(default=None, validation_alias="FLEETBUS_NATS_TLS_KEY")
    """``FLEETBUS_NATS_TLS_KEY``: the client key (mutual TLS)."""
    tls_hostname: str | None = Field(default=None, validation_alias="FLEETBUS_NATS_TLS_HOSTNAME")
    """``FLEETBUS_NATS_TLS_HOSTNAME``: the name the server's certificate must carry."""
    initial_connect_timeout: str | None = Field(
        default=None, validation_alias="FLEETBUS_CONNECT_TIMEOUT"
    )
    """``FLEETBUS_CONNECT_TIMEOUT``: seconds to keep trying the first connection."""
    js_replicas: str | None = Field(default=None, validation_alias="FLEETBUS_JS_REPLICAS")
    """``FLEETBUS_JS_REPLICAS``: copies of each KV bucket and object store
    (1-5); by default 3 on a JetStream cluster, 1 on a single server."""


class _GivenEnvironment(ConnectEnvironment):
    """:class:`ConnectEnvironment` from the variables given to it only, not
    from the process's environment."""

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings,)


class ConnectOptions(BaseModel):
    """Connection settings for :meth:`fleetbus.Bus.connect`.

    Durations are seconds. Reconnection is on by default and unbounded, so a
    server restart or a cluster fail-over is survived without code.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    servers: list[str] = Field(default_factory=lambda: [DEFAULT_URL])
    """NATS URLs; several for a cluster."""
    prefix: str = DEFAULT_PREFIX
    """Subject prefix of the fleet."""
    name: str | None = None
    """Client name shown by the server's monitoring."""
    user: str | None = None
    password: SecretStr | None = None
    token: SecretStr | None = None
    creds_file: str | None = None
    """A ``.creds`` file: the user's JWT and NKEY seed (decentralized auth)."""
    nkey_file: str | None = None
    """A file holding an NKEY user seed (``SU…``), for users the server
    lists by public key."""
    inbox_prefix: str | None = None
    """Where replies to this client travel; by default
    :func:`inbox_prefix` of the fleet and this client's identity."""
    tls_ca_file: str | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    tls_hostname: str | None = None
    connect_timeout: float = 2.0
    """Seconds to wait for each connection attempt."""
    initial_connect_timeout: float = Field(default=10.0, gt=0)
    """Seconds to keep trying before the first connection is given up; later
    disconnects are retried as ``max_reconnect_attempts`` says."""
    allow_reconnect: bool = True
    max_reconnect_attempts: int = -1
    """-1: try for ever."""
    reconnect_time_wait: float = 0.5
    ping_interval: float = 5.0
    """Seconds between this client's pings to its server."""
    max_outstanding_pings: int = 3
    """Pings unanswered after which the connection is taken for dead and
    another server of the list is tried: a server cut off by the network
    (no connection reset comes) is left in about 20 s (measured 70 s at the
    20 s this was)."""
    drain_timeout: float = 5.0
    """Seconds :meth:`Bus.close` waits for pending work to drain."""
    js_replicas: int | None = Field(default=None, ge=1, le=5)
    """Copies JetStream keeps of each KV bucket and object store fleetbus
    creates (1-5, JetStream's limit). ``None``: follow the server, 3 on a
    cluster and 1 on a single server. An existing bucket with fewer copies is
    raised to this count when opened."""

    @field_validator("servers")
    @classmethod
    def _check_servers(cls, servers: list[str]) -> list[str]:
        cleaned = [s.strip() for s in servers if s.strip()]
        if not cleaned:
            raise ValueError("at least one NATS server URL is needed")
        for url in cleaned:
            if "://" not in url:
                raise ValueError(f"{url!r} is not a URL (expected nats://host:port)")
        return cleaned

    @field_validator("prefix")
    @classmethod
    def _check_prefix(cls, prefix: str) -> str:
        return check_prefix(prefix)

    @field_validator("inbox_prefix")
    @classmethod
    def _check_inbox_prefix(cls, value: str | None) -> str | None:
        if value is not None and (
            any(not token for token in value.split(".")) or any(c in value for c in "*> \t\r\n")
        ):
            raise ValueError(f"{value!r} is not an inbox prefix (tokens joined by dots)")
        return value

    @classmethod
    def from_env(
        cls,
        servers: str | Sequence[str] | None = None,
        environ: Mapping[str, str] | None = None,
        **overrides: Any,
    ) -> ConnectOptions:
        """Options from arguments, then the variables of
        :class:`ConnectEnvironment` (of ``environ``, else of the process),
        then defaults.

        Raises:
            ConfigError: a value is invalid.
        """
        if environ is None:
            env = ConnectEnvironment()
        else:
            given = {name: value for name, value in environ.items() if value}
            env = _GivenEnvironment.model_validate(given)
        values: dict[str, Any] = env.model_dump(exclude_none=True)
        from_environment = values.pop("servers", None)
        if servers is None:
            servers = from_environment
        if isinstance(servers, str):
            servers = servers.split(",")
        if servers is not None:
            values["servers"] = list(servers)
        values.update({k: v for k, v in overrides.items() if v is not None})
        try:
            return cls(**values)
        except ValueError as exc:  # pydantic.ValidationError is a ValueError
            raise ConfigError(f"invalid NATS connection settings: {exc}") from exc

    def ssl_context(self) -> ssl.SSLContext | None:
        """The TLS context the options ask for, or ``None`` for plain TCP
        (``tls://`` URLs still get the system's default context).

        Raises:
            ConfigError: a certificate or key file cannot be loaded.
        """
        wants_tls = any(s.startswith("tls://") for s in self.servers)
        if not (self.tls_ca_file or self.tls_cert_file or wants_tls):
            return None
        try:
            context = ssl.create_default_context(cafile=self.tls_ca_file)
            if self.tls_cert_file:
                context.load_cert_chain(self.tls_cert_file, self.tls_key_file)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"cannot load TLS files: {exc}") from exc
        return context

    def identity(self) -> str | None:
        """Who this client is to the server: the user name (given as
        ``user``, else in a server URL as ``nats://user:password@host``),
        else the public key of the NKEY seed (of the credentials file, or of
        the seed file); ``None`` without either.

        Raises:
            ConfigError: the credentials or seed file is missing or malformed.
        """
        if self.user:
            return self.user
        url_user = _url_user(self.servers)
        if url_user:
            return url_user
        if self.creds_file:
            return _public_key(_creds_seed(self.creds_file), self.creds_file)
        if self.nkey_file:
            return _public_key(_seed_file(self.nkey_file), self.nkey_file)
        return None

    def reply_prefix(self) -> str:
        """The inbox prefix this client's replies travel on: ``inbox_prefix``
        if set, else :func:`inbox_prefix` of the fleet and :meth:`identity`.

        Raises:
            ConfigError: the credentials or seed file is missing or malformed.
        """
        return self.inbox_prefix or inbox_prefix(self.prefix, self.identity())

    def nats_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``nats.connect``.

        Raises:
            ConfigError: a TLS, credentials or seed file is missing or malformed.
        """
        kwargs: dict[str, Any] = {
            "servers": self.servers,
            "connect_timeout": self.connect_timeout,
            "allow_reconnect": self.allow_reconnect,
            "max_reconnect_attempts": self.max_reconnect_attempts,
            "reconnect_time_wait": self.reconnect_time_wait,
            "ping_interval": self.ping_interval,
            "max_outstanding_pings": self.max_outstanding_pings,
            "drain_timeout": self.drain_timeout,
        }
        if self.name:
            kwargs["name"] = self.name
        if self.user:
            kwargs["user"] = self.user
        if self.password:
            kwargs["password"] = self.password.get_secret_value()
        if self.token:
            kwargs["token"] = self.token.get_secret_value()
        if self.creds_file:
            kwargs["user_credentials"] = self.creds_file
        elif self.nkey_file:
            # The seed line, not the file: nats-py before 2.15 takes a seed
            # file's every byte, its line break too, for the seed.
            kwargs["nkeys_seed_str"] = _seed_file(self.nkey_file)
        # Read (and checked) here: nats-py loops for ever on a credentials
        # file without a JWT, and reports a bad seed only once connected.
        kwargs["inbox_prefix"] = self.reply_prefix()
        context = self.ssl_context()
        if context is not None:
            kwargs["tls"] = context
            if self.tls_hostname:
                kwargs["tls_hostname"] = self.tls_hostname
        return kwargs


def _read_secret(path: str, what: str) -> list[str]:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read the {what} {path}: {exc.strerror or exc}") from exc
    except UnicodeDecodeError:
        raise ConfigError(f"the {what} {path} is not text") from None
    return [line.strip() for line in text.splitlines()]


def _creds_seed(path: str) -> str:
    """The user seed of a ``.creds`` file, checked to hold a JWT too.

    Raises:
        ConfigError: the file cannot be read or lacks the JWT or the seed.
    """
    lines = _read_secret(path, "credentials file")
    parts = {}
    for marker, part in (("BEGIN NATS USER JWT", "jwt"), ("BEGIN USER NKEY SEED", "seed")):
        found = [i for i, line in enumerate(lines) if marker in line]
        value = lines[found[0] + 1] if found and found[0] + 1 < len(lines) else ""
        if not value or value.startswith("-"):
            raise ConfigError(
                f"the credentials file {path} is malformed: no {part.upper()} block "
                "(make it with nsc, e.g. 'nsc generate creds')"
            )
        parts[part] = value
    if parts["jwt"].count(".") != 2:
        raise ConfigError(f"the credentials file {path} is malformed: its JWT is not a JWT")
    return parts["seed"]


def _seed_file(path: str) -> str:
    """The NKEY user seed in ``path`` (the first line that is one).

    Raises:
        ConfigError: the file cannot be read or holds no user seed.
    """
    for line in _read_secret(path, "NKEY seed file"):
        if line.startswith("SU"):
            return line
    raise ConfigError(f"the NKEY seed file {path} holds no user seed (a line starting with SU)")


def _public_key(seed: str, path: str) -> str:
    try:
        pair = nkeys.from_seed(bytearray(seed.encode()))
    except (nkeys.NkeysError, ValueError) as exc:
        raise ConfigError(f"the NKEY seed in {path} is not valid") from exc
    try:
        return str(pair.public_key.decode())
    finally:
        pair.wipe()


def _url_user(servers: Sequence[str]) -> str | None:
    """The user name of the first server URL that carries ``user:password@``
    (as NATS reads it: a URL with a name and no password carries a token)."""
    for url in servers:
        parts = urlsplit(url)
        if parts.username and parts.password is not None:
            return unquote(parts.username)
    return None
