"""A trivial nats-py responder: the floor fleetbus is measured against.

Usage: python bench/_raw_responder.py URL SUBJECT [uvloop] [BYTES]

``BYTES``: the size of its reply (a tool result padded to it), when it
stands in for a fleetbus tool worker whose results are that size.
"""

from __future__ import annotations

import asyncio
import signal
import sys

import nats
from nats.aio.msg import Msg

REPLY = b'{"type":"tool_result","status":"success","content":null}'


def reply_of(size: int | None) -> bytes:
    """:data:`REPLY`, padded to ``size`` bytes when given."""
    if size is None or size <= len(REPLY) + 9:
        return REPLY
    return REPLY[:-1] + b',"pad":"' + b"p" * (size - len(REPLY) - 9) + b'"}'


async def main(url: str, subject: str, reply: bytes = REPLY) -> None:
    nc = await nats.connect(url)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)

    async def respond(msg: Msg) -> None:
        await msg.respond(reply)

    await nc.subscribe(subject, queue="raw", cb=respond)
    await nc.flush()
    print("ready", flush=True)
    await stop.wait()
    await nc.drain()


if __name__ == "__main__":
    options = sys.argv[3:]
    size = next((int(o) for o in options if o.isdigit()), None)
    running = main(sys.argv[1], sys.argv[2], reply_of(size))
    if "uvloop" in options:
        import uvloop

        uvloop.run(running)
    else:
        asyncio.run(running)
