"""The gateway's limits and timeouts, from ``FLEETBUS_GATEWAY_<FIELD>``
variables or the ``fleetbus gateway`` options (which win).

=========================================  =====================================
environment variable                       meaning
=========================================  =====================================
``FLEETBUS_GATEWAY_MAX_REQUEST_BYTES``     largest request body accepted (1 MiB)
``FLEETBUS_GATEWAY_MAX_STREAMS_PER_TOKEN`` replies one token may have open at
                                           once on one replica (16)
``FLEETBUS_GATEWAY_REPLY_TIMEOUT``         seconds a whole reply may take (300)
``FLEETBUS_GATEWAY_ON_DISCONNECT``         ``cancel`` (default): a client that
                                           goes away mid-stream interrupts the
                                           reply; ``detach``: it runs to its
                                           end, kept in the session's journal
``FLEETBUS_GATEWAY_DISCOVERY_TTL``         seconds the list of agents is kept
                                           before the bus is asked again (2)
``FLEETBUS_GATEWAY_KEEPALIVE``             seconds between SSE comments that
                                           keep an idle stream open (15)
=========================================  =====================================
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from fleetbus._ranges import settings_from

__all__ = ["GatewaySettings", "gateway_settings"]


class GatewaySettings(BaseSettings):
    """The gateway's settings (see the module docstring)."""

    model_config = SettingsConfigDict(
        env_prefix="FLEETBUS_GATEWAY_", env_ignore_empty=True, extra="ignore", frozen=True
    )

    max_request_bytes: int = Field(default=1024 * 1024, ge=1024)
    max_streams_per_token: int = Field(default=16, ge=1)
    reply_timeout: float = Field(default=300.0, gt=0)
    on_disconnect: Literal["cancel", "detach"] = "cancel"
    discovery_ttl: float = Field(default=2.0, ge=0)
    keepalive: float = Field(default=15.0, gt=0)


def gateway_settings(**given: Any) -> GatewaySettings:
    """The settings: ``given`` (``None``: not given) over the environment,
    over the defaults.

    Raises:
        ConfigError: a value is invalid; the message names its variable (or
            its field, for a value given here).
    """
    return settings_from(GatewaySettings, "FLEETBUS_GATEWAY_", **given)
