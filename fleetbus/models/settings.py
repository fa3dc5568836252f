"""What the models layer reads from the environment, each variable documented
once: on its field of :class:`ModelEnvironment` or :class:`ModelSettings`.

:class:`ModelEnvironment` says which model a fleet runs and where its
endpoint is (``FLEETBUS_MODEL``, ``OPENAI_BASE_URL``, ``OPENAI_API_KEY``,
``FLEETBUS_ESPEAK``); :class:`ModelSettings` tunes a model made from a model
string (``FLEETBUS_MODEL_<FIELD>``: ``FLEETBUS_MODEL_TIMEOUT``…). Both are
read when a model is made, not at import, and a value given in code wins.

:func:`check_ranges` checks the numbers a model, a model worker or a speech
synthesizer is made with against pydantic constraints.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

from fleetbus._ranges import check_ranges

__all__ = ["ModelEnvironment", "ModelSettings", "check_ranges"]


class ModelEnvironment(BaseSettings):
    """Which model, which endpoint, which key; an empty variable counts as
    unset. Read from the environment only (each field from the variable its
    docstring names)."""

    model_config = SettingsConfigDict(
        env_ignore_empty=True,
        str_strip_whitespace=True,
        extra="forbid",
        frozen=True,
    )

    model: str | None = Field(default=None, validation_alias="FLEETBUS_MODEL")
    """``FLEETBUS_MODEL``: the model string of an agent that names none
    (:func:`fleetbus.models.default_model`), and the model name of an
    ``OpenAIChatModel`` made without one; the built-in offline model when unset."""
    openai_base_url: str | None = Field(default=None, validation_alias="OPENAI_BASE_URL")
    """``OPENAI_BASE_URL``: the OpenAI-compatible endpoint of ``openai:`` models
    (e.g. a local server's ``http://localhost:8000/v1``); OpenAI's own when
    unset. ``FLEETBUS_MODEL_BASE_URL`` wins over it."""
    openai_api_key: SecretStr | None = Field(default=None, validation_alias="OPENAI_API_KEY")
    """``OPENAI_API_KEY``: the key of that endpoint; needed for OpenAI's own,
    not for a local server."""
    espeak: str | None = Field(default=None, validation_alias="FLEETBUS_ESPEAK")
    """``FLEETBUS_ESPEAK``: the espeak-ng program :class:`~fleetbus.models.EspeakSpeech`
    runs; ``espeak-ng`` on ``PATH`` when unset."""

    @property
    def api_key(self) -> str | None:
        """:attr:`openai_api_key` in clear, for the client that sends it."""
        return None if self.openai_api_key is None else self.openai_api_key.get_secret_value()


class ModelSettings(BaseSettings):
    """The settings of a model built from a string; ``None`` keeps the default.

    Read from ``FLEETBUS_MODEL_<FIELD>`` environment variables; values passed
    to the constructor win over the environment.
    """

    model_config = SettingsConfigDict(env_prefix="FLEETBUS_MODEL_", extra="forbid", frozen=True)

    timeout: float | None = Field(default=None, gt=0)
    """Seconds one model call may take (``ModelConfig.timeout``, the OpenAI
    adapter's read timeout, ``BusChatModel``'s and a model worker's deadline);
    120 s by default, 300 s for a model worker's calls."""
    retries: int | None = Field(default=None, ge=0)
    """Retries of a failed call (``ModelConfig.max_retries``, and the OpenAI
    adapter's ``max_retries``)."""
    temperature: float | None = Field(default=None, ge=0)
    max_tokens: int | None = Field(default=None, gt=0)
    tools: Literal["auto", "on", "off"] | None = None
    """How an OpenAI-compatible model calls tools (``OpenAIConfig.native_tools``)."""
    fallback: str | None = None
    """A model string: the model that takes over when this one keeps failing."""
    base_url: str | None = None
    """The OpenAI-compatible endpoint (default: ``OPENAI_BASE_URL``)."""
