"""The settings of the ``fleetbus`` commands read from the environment.

=============================  ==========================================
environment variable           meaning
=============================  ==========================================
``FLEETBUS_LOG_FORMAT``        log lines as ``text`` (default) or ``json``
                               lines, unless ``--log-format`` says
``FLEETBUS_UVLOOP``            ``0``: run commands on the standard asyncio
                               event loop, not uvloop (default ``1``)
``FLEETBUS_MODEL_WAIT``        seconds ``fleetbus agent`` waits at start for
                               a model worker of a ``bus:NAME`` model
                               (default 10)
``FLEETBUS_DEMO_TIMEOUT``      seconds each reply of ``fleetbus demo`` may
                               take (default 900)
=============================  ==========================================

The commands also read the variables of the layers below them, each
documented where it is read: the bus layer's (``FLEETBUS_NATS_URL``,
``FLEETBUS_PREFIX``, ``FLEETBUS_GC_THRESHOLD`` … in
:mod:`fleetbus.bus.settings`), the model's
(``FLEETBUS_MODEL``, ``FLEETBUS_MODEL_*`` … in :mod:`fleetbus.models.settings`),
and the log level's (``FLEETBUS_LOG_LEVEL`` in :mod:`fleetbus.logs`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from fleetbus._ranges import settings_from

__all__ = ["CliSettings", "cli_settings"]


class CliSettings(BaseSettings):
    """The commands' settings, from ``FLEETBUS_<FIELD>`` variables (an empty
    variable is as if unset)."""

    model_config = SettingsConfigDict(
        env_prefix="FLEETBUS_", env_ignore_empty=True, extra="ignore", frozen=True
    )

    log_format: Literal["text", "json"] = "text"
    """``FLEETBUS_LOG_FORMAT``: log lines as text or as JSON lines."""
    uvloop: bool = True
    """``FLEETBUS_UVLOOP``: run commands on uvloop when it is installed."""
    model_wait: float = Field(default=10.0, gt=0)
    """``FLEETBUS_MODEL_WAIT``: seconds ``fleetbus agent`` waits at start for a
    model worker of a ``bus:NAME`` model."""
    demo_timeout: float = Field(default=900.0, gt=0)
    """``FLEETBUS_DEMO_TIMEOUT``: seconds each reply of ``fleetbus demo`` may
    take (a local model can be slow)."""

    @field_validator("log_format", mode="before")
    @classmethod
    def _lower(cls, value: Any) -> Any:
        return value.strip().lower() if isinstance(value, str) else value


def cli_settings(**given: Any) -> CliSettings:
    """The settings: ``given`` (field names; ``None``: not given) over the
    environment, over the defaults. Read anew at each call, so that a
    variable set since (a test's, a parent command's) counts.

    Raises:
        ConfigError: a value is invalid; the message names its variable (or
            its field, for a value given here).
    """
    return settings_from(CliSettings, "FLEETBUS_", **given)
