"""Durable topics: a broadcast topic kept in a JetStream stream.

A message published on ``<prefix>.topic.<topic>`` is an ordinary core NATS
publish; when the topic is durable, the stream ``<prefix>_topic_<topic>``
captures it as well, and each observer group reads the stream through a
durable consumer of its own. An observer that was down finds the consumer
where it left it and catches up; a message is acknowledged once it has been
handled, so one whose handling failed is delivered again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import nats.errors
import nats.js.errors
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, StorageType, StreamConfig

from fleetbus.bus._replicas import ensure_replicas, placement_error, wanted_replicas
from fleetbus.bus._serve import Request
from fleetbus.bus._stream_config import require
from fleetbus.bus.connection import Bus
from fleetbus.errors import ProtocolError, StoreError
from fleetbus.protocol import decode

__all__ = ["DurableTopic"]

logger = logging.getLogger(__name__)

DEFAULT_MAX_AGE = 7 * 24 * 3600.0
"""Seconds a durable topic keeps a message."""


class DurableTopic:
    """One durable topic, read by one observer group.

    Args:
        bus: the connection.
        topic: the topic's name.
        consumer: the durable consumer's name (one per observer group).
        max_age: seconds the stream keeps a message.
        batch: messages fetched at once.
        ack_wait: seconds a fetched message may take to be handled before it
            is delivered again.
    """

    def __init__(
        self,
        bus: Bus,
        topic: str,
        *,
        consumer: str,
        max_age: float = DEFAULT_MAX_AGE,
        batch: int = 64,
        ack_wait: float = 300.0,
    ) -> None:
        self.bus = bus
        self.topic = topic
        self.subject = bus.subjects.topic(topic)
        self.stream = bus.subjects.topic_stream(topic)
        self.consumer = consumer
        self.max_age = max_age
        self.batch = batch
        self.ack_wait = ack_wait

    async def ensure(self) -> None:
        """Create the topic's stream if it is missing.

        Raises:
            StoreError: JetStream refused or is off.
        """
        js = self.bus.nc.jetstream()
        what = f"topic stream {self.stream}"
        wanted = wanted_replicas(self.bus, None)
        try:
            try:
                await js.stream_info(self.stream)
            except nats.js.errors.NotFoundError:
                made = await js.add_stream(
                    StreamConfig(
                        name=self.stream,
                        subjects=[self.subject],
                        max_age=self.max_age,
                        storage=StorageType.FILE,
                        num_replicas=wanted,
                    )
                )
                needed = {"max_age": float(self.max_age), "num_replicas": wanted}
                require(made.config, needed, what=what, server=self.bus.server_version)
            else:
                await ensure_replicas(js, self.stream, wanted, what=what)
        except StoreError:
            raise
        except (nats.errors.Error, TimeoutError) as exc:
            error = placement_error(exc, what=what, wanted=wanted, bus=self.bus)
            raise error or StoreError(f"opening {what} failed: {exc}") from exc

    async def run(
        self,
        handler: Callable[[Request], Awaitable[Any]],
        *,
        stop: asyncio.Event,
        ready: asyncio.Event,
    ) -> None:
        """Hand each message, in order, to ``handler`` until ``stop`` is set;
        acknowledge it once handled (a handler that raises: delivered again).

        Raises:
            StoreError: the stream or the consumer cannot be opened.
        """
        await self.ensure()
        js = self.bus.nc.jetstream()
        try:
            sub = await js.pull_subscribe(
                self.subject,
                durable=self.consumer,
                stream=self.stream,
                config=ConsumerConfig(
                    ack_policy=AckPolicy.EXPLICIT,
                    deliver_policy=DeliverPolicy.NEW,
                    ack_wait=self.ack_wait,
                    max_ack_pending=self.batch * 4,
                ),
            )
        except (nats.errors.Error, TimeoutError) as exc:
            raise StoreError(f"reading topic {self.topic} failed: {exc}") from exc
        ready.set()
        try:
            while not stop.is_set():
                try:
                    msgs = await sub.fetch(self.batch, timeout=1.0)
                except (nats.errors.TimeoutError, TimeoutError):
                    continue
                except nats.errors.Error as exc:
                    logger.warning("topic %s: fetch failed: %s", self.topic, exc)
                    await asyncio.sleep(0.5)
                    continue
                for msg in msgs:
                    await self._handle(msg, handler)
        finally:
            try:
                await sub.unsubscribe()  # the durable consumer stays, with its position
            except nats.errors.Error as exc:
                logger.debug("topic %s: unsubscribe: %s", self.topic, exc)

    async def _handle(self, msg: Any, handler: Callable[[Request], Awaitable[Any]]) -> None:
        data = bytes(msg.data)
        try:
            message = decode(data)
        except ProtocolError as exc:
            logger.warning("topic %s: a message is unreadable, dropped: %s", self.topic, exc)
            await _settle(msg.ack())
            return
        try:
            await handler(Request(message, msg.subject, len(data)))
        except Exception:
            logger.exception("topic %s: a message could not be handled; it comes again", self.topic)
            await _settle(msg.nak(delay=1.0))
            return
        await _settle(msg.ack())


async def _settle(ack: Awaitable[Any]) -> None:
    try:
        await ack
    except nats.errors.Error as exc:  # redelivered after ack_wait: handling is idempotent enough
        logger.debug("topic ack failed: %s", exc)
