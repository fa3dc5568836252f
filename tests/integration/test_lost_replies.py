"""A reply lost with the responder's connection is sent again once the
connection is back, so the caller has it at once instead of after its whole
timeout (a cluster node that dies just after its worker answered).

The responder reaches the real nats-server through a TCP link the test
controls: it swallows what the responder writes (the reply, lost as with a
dying server), then cuts the connection; nats-py reconnects through it.
"""

from __future__ import annotations

import asyncio
import contextlib

from fleetbus.bus import Bus, EmbeddedServer, Request
from fleetbus.bus._serve import RecentReplies
from fleetbus.protocol import Message, ToolCall, ToolResult


class Link:
    """A TCP proxy to a server: what clients write can be swallowed, and
    every connection through it cut."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.swallow = False
        self.swallowed = 0
        """Bytes swallowed so far."""
        self._writers: list[asyncio.StreamWriter] = []
        self._pumps: set[asyncio.Task[None]] = set()
        self._server: asyncio.Server | None = None
        self.port = 0

    async def start(self) -> Link:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        self._writers += [writer, up_writer]
        for task in (
            asyncio.create_task(self._pump(reader, up_writer, upstream=True)),
            asyncio.create_task(self._pump(up_reader, writer, upstream=False)),
        ):
            self._pumps.add(task)
            task.add_done_callback(self._pumps.discard)

    async def _pump(
        self, source: asyncio.StreamReader, sink: asyncio.StreamWriter, *, upstream: bool
    ) -> None:
        with contextlib.suppress(ConnectionError, OSError):
            while data := await source.read(65536):
                if upstream and self.swallow:
                    self.swallowed += len(data)
                    continue
                sink.write(data)
                await sink.drain()
        sink.close()

    def cut(self) -> None:
        """Close every connection through the link (the server died)."""
        writers, self._writers = self._writers, []
        for writer in writers:
            writer.close()

    async def close(self) -> None:
        self.cut()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        for task in list(self._pumps):
            task.cancel()
        await asyncio.gather(*self._pumps, return_exceptions=True)


async def test_a_reply_lost_with_the_responders_connection_is_sent_again_once_it_is_back(
    nats_server: EmbeddedServer, bus: Bus, prefix: str
) -> None:
    link = await Link(int(nats_server.url.rsplit(":", 1)[1])).start()
    responder = await Bus.connect(link.url, prefix=prefix, name="lossy-worker")
    calls: list[str] = []

    async def answer_then_lose_the_link(request: Request) -> Message:
        message = request.message
        assert isinstance(message, ToolCall)
        calls.append(message.call_id or "")
        link.swallow = True  # what the responder writes from now on is lost
        return ToolResult(call_id=message.call_id, tool_name="t", status="success", content="ok")

    stop = asyncio.Event()
    ready = asyncio.Event()
    try:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(
                responder.serve(
                    f"{prefix}.lossy", answer_then_lose_the_link, stop=stop, ready=ready
                )
            )
            await ready.wait()
            asking = tg.create_task(
                bus.request(
                    f"{prefix}.lossy", ToolCall(tool_name="t", call_id="c-lost"), timeout=20
                )
            )
            while link.swallowed == 0:  # noqa: ASYNC110 - the reply went into the link
                await asyncio.sleep(0.01)
            link.swallow = False
            link.cut()  # the connection dies with the reply in it
            reply = await asyncio.wait_for(asking, 15)  # not the 20 s of the request
            stop.set()
    finally:
        await responder.close()
        await link.close()
    assert isinstance(reply, ToolResult)
    assert reply.call_id == "c-lost"
    assert reply.content == "ok"
    assert calls == ["c-lost"]  # sent again by the responder, not asked again


def test_recent_replies_keep_the_newest_within_their_limits() -> None:
    recent = RecentReplies(most=3, most_bytes=10)
    for n in range(5):
        recent.add(f"r.{n}", b"ab")
    assert [subject for subject, _ in recent.since(0.0)] == ["r.2", "r.3", "r.4"]
    recent.add("big", b"x" * 11)  # larger than all of them: not kept
    assert len(recent) == 3
    recent.add("r.5", b"x" * 8)  # 2 + 8 bytes: only the newest fit with it
    assert [subject for subject, _ in recent.since(0.0)] == ["r.4", "r.5"]
    assert recent.since(float("inf")) == []
