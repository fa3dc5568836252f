"""``fleetbus watch``: live traffic on the bus, one message a line, until
Ctrl-C (the watcher itself is :mod:`fleetbus.cli.watch`)."""

from __future__ import annotations

import argparse
import asyncio

from fleetbus.cli._common import connect, console, on_stop_signals, run
from fleetbus.cli.watch import watch

__all__ = ["cmd"]


def cmd(args: argparse.Namespace) -> int:
    """Print live traffic until Ctrl-C."""

    async def main() -> int:
        bus = await connect(args.nats, args.prefix)
        stop = asyncio.Event()
        on_stop_signals(stop.set)
        try:
            await watch(
                bus,
                session=args.session,
                agent=args.agent,
                json_output=args.json,
                console=console,
                stop=stop,
            )
        finally:
            await bus.close()
        return 0

    return run(main())
