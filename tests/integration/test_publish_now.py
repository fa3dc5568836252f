"""``Client.publish_now``: a publish queued without a coroutine while the
connection is plainly up, and refused (for nats-py's ``publish`` to do what
it does) in every other case."""

from __future__ import annotations

import asyncio

import nats.errors
import pytest
from nats.aio.msg import Msg

from fleetbus.bus import Bus
from fleetbus.bus._seam import Client


async def test_a_publish_now_arrives_as_a_publish_does(bus: Bus) -> None:
    nc = bus._nc
    assert isinstance(nc, Client)
    got: asyncio.Queue[tuple[str, str, bytes]] = asyncio.Queue()

    async def keep(msg: Msg) -> None:
        await got.put((msg.subject, msg.reply, msg.data))

    await nc.subscribe("now.>", cb=keep)
    await nc.flush()
    out_msgs = nc.stats["out_msgs"]
    assert nc.publish_now("now.a", b"first")
    assert nc.publish_now("now.b", b"second", "reply.to")
    assert nc.publish_now("now.c", b"")
    received = [await asyncio.wait_for(got.get(), 5) for _ in range(3)]
    assert received == [
        ("now.a", "", b"first"),
        ("now.b", "reply.to", b"second"),
        ("now.c", "", b""),
    ]
    assert nc.stats["out_msgs"] == out_msgs + 3


@pytest.mark.parametrize(
    ("subject", "reply"),
    [("", ""), ("has space", ""), ("cr\r\nPUB x 1", ""), ("ok", "bad\treply")],
)
async def test_an_empty_subject_or_one_with_whitespace_is_left_to_publish(
    bus: Bus, subject: str, reply: str
) -> None:
    nc = bus._nc
    assert isinstance(nc, Client)
    assert not nc.publish_now(subject, b"x", reply)
    with pytest.raises(nats.errors.BadSubjectError):
        await nc.publish(subject, b"x", reply=reply)


async def test_a_payload_past_the_servers_limit_is_left_to_publish(bus: Bus) -> None:
    nc = bus._nc
    assert isinstance(nc, Client)
    too_large = b"x" * (nc.max_payload + 1)
    pending = nc._pending_data_size
    assert not nc.publish_now("now.large", too_large)
    assert nc._pending_data_size == pending  # nothing queued
    with pytest.raises(nats.errors.MaxPayloadError):
        await nc.publish("now.large", too_large)


async def test_a_connection_not_plainly_up_is_left_to_publish(bus: Bus) -> None:
    nc = bus._nc
    assert isinstance(nc, Client)
    await bus.close()
    assert not nc.publish_now("now.closed", b"x")
    with pytest.raises(nats.errors.ConnectionClosedError):
        await nc.publish("now.closed", b"x")


async def test_a_publish_past_the_pending_limit_is_left_to_publish(bus: Bus) -> None:
    """``publish`` flushes first when the pending buffer would pass its
    limit (and waits for it): that is not for ``publish_now``."""
    nc = bus._nc
    assert isinstance(nc, Client)
    limit = nc._max_pending_size
    nc._max_pending_size = 16
    try:
        assert not nc.publish_now("now.pending", b"more than sixteen bytes of payload")
    finally:
        nc._max_pending_size = limit
    assert nc.publish_now("now.pending", b"more than sixteen bytes of payload")
