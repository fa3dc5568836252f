"""The demo fleet's agent, for ``fleetbus agent fleetbus.cli.demo_fleet:agents``
(``make demo`` and ``docker compose`` serve it).

Its model is the built-in offline one: deterministic, no network, announced
as such in its first answer. Its tools come from the bus (the built-in tool
workers); writing a file needs a person's confirmation.
"""

from __future__ import annotations

from fleetbus.agents import Agent, Permissions
from fleetbus.agents.offline import OfflineModel
from fleetbus.tools_workers import Toolkit

__all__ = ["agents"]

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
            OfflineModel(),
            toolkit=Toolkit(),
            max_iters=8,
            permissions=Permissions.from_strings(ask=["write_file"]),
        )
    ]
