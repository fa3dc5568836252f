"""A trivial nats-py responder: the floor fleetbus is measured against.

Usage: python bench/_raw_responder.py URL SUBJECT
"""

from __future__ import annotations

import asyncio
import signal
import sys

import nats
from nats.aio.msg import Msg

REPLY = b'{"type":"tool_result","status":"success","content":null}'


async def main(url: str, subject: str) -> None:
    nc = await nats.connect(url)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)

    async def respond(msg: Msg) -> None:
        await msg.respond(REPLY)

    await nc.subscribe(subject, queue="raw", cb=respond)
    await nc.flush()
    print("ready", flush=True)
    await stop.wait()
    await nc.drain()


if __name__ == "__main__":
    if sys.argv[3:] == ["uvloop"]:
        import uvloop

        uvloop.run(main(sys.argv[1], sys.argv[2]))
    else:
        asyncio.run(main(sys.argv[1], sys.argv[2]))
