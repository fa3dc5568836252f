"""Which model an agent gets when none is named: the configured
OpenAI-compatible endpoint, else the built-in offline model."""

from __future__ import annotations

import os

from fleetbus.models.model import ChatModel
from fleetbus.models.offline import OfflineModel

__all__ = ["default_model", "describe_default_model"]


def _endpoint_configured() -> bool:
    return bool(os.environ.get("FLEETBUS_MODEL")) and bool(
        os.environ.get("OPENAI_API_KEY") or os.environ.get("OPENAI_BASE_URL")
    )


def default_model() -> ChatModel:
    """``OpenAIChatModel()`` when ``FLEETBUS_MODEL`` and ``OPENAI_API_KEY`` or
    ``OPENAI_BASE_URL`` are set, else :class:`OfflineModel`.

    Raises:
        ConfigError: the endpoint settings are incomplete.
    """
    if _endpoint_configured():
        from fleetbus.models.openai_model import OpenAIChatModel

        return OpenAIChatModel()
    return OfflineModel()


def describe_default_model() -> str:
    """One line for people: which model :func:`default_model` gives."""
    if _endpoint_configured():
        where = os.environ.get("OPENAI_BASE_URL") or "the OpenAI API"
        return f"{os.environ['FLEETBUS_MODEL']} at {where}"
    return (
        "built-in offline model (deterministic, no network; set FLEETBUS_MODEL and "
        "OPENAI_API_KEY or OPENAI_BASE_URL for a real one)"
    )
