"""``fleetbus cancel SESSION``: interrupt the reply running in a session."""

from __future__ import annotations

import argparse

from fleetbus.cli._common import connect, console, run
from fleetbus.cli._store import find_agent
from fleetbus.protocol import Cancel

__all__ = ["cmd"]


def cmd(args: argparse.Namespace) -> int:
    """Send a cancel to every replica of the session's agent."""

    async def main() -> int:
        bus = await connect(args.nats, args.prefix)
        try:
            agent = await find_agent(bus, args.session, args.agent, args.store_wait)
            cancel = Cancel(sender="cli", session_id=args.session, reason=args.reason)
            await bus.publish(bus.subjects.agent_control(agent), cancel)
            await bus.flush()
        finally:
            await bus.close()
        console.print(f"cancel sent to {agent} for session {args.session}")
        return 0

    return run(main())
