"""The demo fleet's agent, for ``fleetbus agent fleetbus.cli.demo_fleet:agents``
(``make demo`` and ``docker compose`` serve it).

Its model is the model string in ``FLEETBUS_MODEL`` (``openai:NAME`` with
``OPENAI_BASE_URL`` or ``OPENAI_API_KEY``, ``bus:NAME``, or a bare
OpenAI-compatible name), with the ``FLEETBUS_MODEL_*`` settings (timeout,
retries, fallback…); otherwise the built-in offline one: deterministic, no
network, announced as such. Its tools come from the bus (the built-in tool workers); writing a
file needs a person's confirmation.
"""

from __future__ import annotations

from fleetbus.agents import Agent, AgentSettings, Permissions
from fleetbus.models.defaults import default_model, default_model_config, describe_default_model
from fleetbus.models.strings import load_model_settings
from fleetbus.tools_workers import Toolkit

__all__ = ["agents", "describe_model"]

describe_model = describe_default_model

SYSTEM_PROMPT = (
    "You are the fleet's assistant. Use the calculator for arithmetic, current_time for "
    "the time, and the file tools for notes. Answer briefly."
)


def agents() -> list[Agent]:
    """The demo fleet's agents: one assistant.

    Raises:
        ConfigError: ``FLEETBUS_MODEL`` or a ``FLEETBUS_MODEL_*`` setting is not usable.
    """
    settings = load_model_settings()
    return [
        Agent(
            "assistant",
            SYSTEM_PROMPT,
            default_model(settings),
            description="The fleet's assistant: arithmetic, the time, and notes in files.",
            toolkit=Toolkit(),
            settings=AgentSettings(max_iters=8, model_calls=default_model_config(settings)),
            permissions=Permissions.from_strings(ask=["write_file"]),
        )
    ]
