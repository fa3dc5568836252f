"""Which model an agent gets when none is named: the model string in
``FLEETBUS_MODEL`` (see :mod:`fleetbus.models.strings`), else the built-in
offline model, which is always announced as such."""

from __future__ import annotations

from fleetbus.bus import Bus
from fleetbus.errors import ConfigError
from fleetbus.models.model import ChatModel, ModelConfig
from fleetbus.models.offline import OfflineModel
from fleetbus.models.settings import ModelEnvironment
from fleetbus.models.strings import (
    OFFLINE_DESCRIPTION,
    ModelSettings,
    load_model_settings,
    model_config_from_settings,
    model_from_string,
    parse_model_string,
)

__all__ = ["default_model", "default_model_config", "describe_default_model"]


def _configured() -> str:
    return ModelEnvironment().model or ""


def default_model(
    settings: ModelSettings | None = None,
    *,
    bus: Bus | None = None,
    otherwise: ChatModel | None = None,
) -> ChatModel:
    """The model ``FLEETBUS_MODEL`` names (a model string), else ``otherwise``
    (default: :class:`OfflineModel`).

    A bare name in ``FLEETBUS_MODEL`` (``gpt-4o-mini``) is an OpenAI-compatible
    model when ``OPENAI_BASE_URL`` or ``OPENAI_API_KEY`` is set.

    Args:
        settings: the model's settings (default: ``FLEETBUS_MODEL_*``).
        bus: the bus of a ``bus:NAME`` model (else bound later).
        otherwise: the model when ``FLEETBUS_MODEL`` is not set (an example's
            scripted stand-in, say).

    Raises:
        ConfigError: ``FLEETBUS_MODEL`` names a model that cannot be configured
            (e.g. ``openai:NAME`` with neither ``OPENAI_BASE_URL`` nor
            ``OPENAI_API_KEY``); the message names the variable.
    """
    text = _configured()
    if not text:
        return otherwise if otherwise is not None else OfflineModel()
    try:
        return model_from_string(text, settings, bus=bus)
    except ConfigError as exc:
        raise ConfigError(f"FLEETBUS_MODEL: {exc}") from exc


def default_model_config(
    settings: ModelSettings | None = None, *, bus: Bus | None = None
) -> ModelConfig:
    """``ModelConfig`` with the timeout, retries and fallback of ``settings``
    (default: ``FLEETBUS_MODEL_TIMEOUT``, ``FLEETBUS_MODEL_RETRIES``,
    ``FLEETBUS_MODEL_FALLBACK``).

    Raises:
        ConfigError: a bad value, or a fallback that is not a usable model string.
    """
    return model_config_from_settings(
        settings if settings is not None else load_model_settings(), bus=bus
    )


def describe_default_model() -> str:
    """One line for people: which model :func:`default_model` gives (or why
    it cannot)."""
    text = _configured()
    if not text:
        return OFFLINE_DESCRIPTION
    env = ModelEnvironment()
    try:
        spec = parse_model_string(text)
        url = load_model_settings().base_url or env.openai_base_url
    except ConfigError as exc:
        return f"FLEETBUS_MODEL={text}, which is not usable: {exc}"
    if spec.kind == "offline":
        return OFFLINE_DESCRIPTION
    if spec.kind == "bus":
        return f"bus:{spec.name} (model workers on the bus)"
    if spec.kind == "python":
        return f"{spec.name} (a model made in Python)"
    if not url and not env.openai_api_key:
        return f"FLEETBUS_MODEL={text}, which is not usable: set OPENAI_BASE_URL or OPENAI_API_KEY"
    return f"openai:{spec.name} at {url or 'the OpenAI API'}"
