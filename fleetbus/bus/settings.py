"""How to reach NATS: URLs, credentials, TLS and reconnection, from code or
the environment.

=============================  ==========================================
environment variable           meaning
=============================  ==========================================
``FLEETBUS_NATS_URL``          one or more server URLs, comma-separated
``FLEETBUS_PREFIX``            the subject prefix (default ``fleet``)
``FLEETBUS_NATS_USER``         user name (with ``FLEETBUS_NATS_PASSWORD``)
``FLEETBUS_NATS_PASSWORD``     password
``FLEETBUS_NATS_TOKEN``        an auth token
``FLEETBUS_NATS_CREDS``        path of a ``.creds`` file (JWT + NKey)
``FLEETBUS_NATS_TLS_CA``       CA bundle to verify the server
``FLEETBUS_NATS_TLS_CERT``     client certificate (mutual TLS)
``FLEETBUS_NATS_TLS_KEY``      client key (mutual TLS)
``FLEETBUS_CONNECT_TIMEOUT``   seconds to keep trying the first connection
``FLEETBUS_JS_REPLICAS``       copies of each KV bucket and object store
                               (1-5); by default 3 on a JetStream cluster,
                               1 on a single server
=============================  ==========================================
"""

from __future__ import annotations

import os
import ssl
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator

from fleetbus.bus.subjects import DEFAULT_PREFIX, check_prefix
from fleetbus.errors import ConfigError

__all__ = ["DEFAULT_URL", "ConnectOptions"]

DEFAULT_URL = "nats://127.0.0.1:4222"
"""Where fleetbus connects when no URL is given anywhere."""


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
    ping_interval: float = 20.0
    max_outstanding_pings: int = 3
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

    @classmethod
    def from_env(
        cls,
        servers: str | Sequence[str] | None = None,
        environ: Mapping[str, str] | None = None,
        **overrides: Any,
    ) -> ConnectOptions:
        """Options from arguments, then ``FLEETBUS_*`` variables, then defaults.

        Raises:
            ConfigError: a value is invalid.
        """
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        if servers is None:
            servers = env.get("FLEETBUS_NATS_URL") or None
        if isinstance(servers, str):
            servers = servers.split(",")
        if servers is not None:
            values["servers"] = list(servers)
        for key, var in _ENV.items():
            if env.get(var):
                values[key] = env[var]
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

    def nats_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``nats.connect``."""
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
        context = self.ssl_context()
        if context is not None:
            kwargs["tls"] = context
            if self.tls_hostname:
                kwargs["tls_hostname"] = self.tls_hostname
        return kwargs


_ENV = {
    "prefix": "FLEETBUS_PREFIX",
    "user": "FLEETBUS_NATS_USER",
    "password": "FLEETBUS_NATS_PASSWORD",
    "token": "FLEETBUS_NATS_TOKEN",
    "creds_file": "FLEETBUS_NATS_CREDS",
    "tls_ca_file": "FLEETBUS_NATS_TLS_CA",
    "tls_cert_file": "FLEETBUS_NATS_TLS_CERT",
    "tls_key_file": "FLEETBUS_NATS_TLS_KEY",
    "initial_connect_timeout": "FLEETBUS_CONNECT_TIMEOUT",
    "js_replicas": "FLEETBUS_JS_REPLICAS",
}
