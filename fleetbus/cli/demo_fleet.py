"""The demo fleet's agent, for ``fleetbus agent fleetbus.cli.demo_fleet:agents``
(``make demo`` and ``docker compose`` serve it).

Its model is an OpenAI-compatible endpoint when one is configured
(``FLEETBUS_MODEL`` with ``OPENAI_API_KEY`` and/or ``OPENAI_BASE_URL``),
otherwise the built-in offline one: deterministic, no network, announced as
such. Its tools come from the bus (the built-in tool workers); writing a
file needs a person's confirmation.
"""

from __future__ import annotations

import os

from fleetbus.agents import Agent, ChatModel, Permissions
from fleetbus.agents.offline import OfflineModel
from fleetbus.tools_workers import Toolkit

__all__ = ["agents", "default_model", "describe_model"]


def _endpoint_configured() -> bool:
    return bool(os.environ.get("FLEETBUS_MODEL")) and bool(
        os.environ.get("OPENAI_API_KEY") or os.environ.get("OPENAI_BASE_URL")
    )


def default_model() -> ChatModel:
    """The configured OpenAI-compatible model, else the offline one.

    Raises:
        ConfigError: the endpoint settings are incomplete.
    """
    if _endpoint_configured():
        from fleetbus.agents.openai_model import OpenAIChatModel

        return OpenAIChatModel()
    return OfflineModel()


def describe_model() -> str:
    """One line for people: which model the demo agent uses."""
    if _endpoint_configured():
        where = os.environ.get("OPENAI_BASE_URL") or "the OpenAI API"
        return f"{os.environ['FLEETBUS_MODEL']} at {where}"
    return (
        "built-in offline model (deterministic, no network; set FLEETBUS_MODEL and "
        "OPENAI_API_KEY or OPENAI_BASE_URL for a real one)"
    )


SYSTEM_PROMPT = (
    "You are the fleet's assistant. Use the calculator for arithmetic, current_time for "
    "the time, and the file tools for notes. Answer briefly."
)


def agents() -> list[Agent]:
    """The demo fleet's agents: one assistant."""
    return [
        Agent(
            "assistant",
            SYSTEM_PROMPT,
            default_model(),
            toolkit=Toolkit(),
            max_iters=8,
            permissions=Permissions.from_strings(ask=["write_file"]),
        )
    ]
