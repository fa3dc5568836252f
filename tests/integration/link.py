"""A TCP link between clients and a real nats-server that a test controls:
it can swallow what passes one way (lost as with a dying server), hold what
clients write from a given command on, and cut every connection."""

from __future__ import annotations

import asyncio
import contextlib


class Link:
    """A TCP proxy to a server: what clients write can be swallowed or held,
    and every connection through it cut."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.swallow = False
        """Swallow what clients write (to the server)."""
        self.swallow_incoming = False
        """Swallow what the server writes (to the clients)."""
        self.swallowed = 0
        """Bytes swallowed so far."""
        self._hold_from: bytes | None = None
        self._holding: list[tuple[asyncio.StreamWriter, bytes]] = []
        self.held = asyncio.Event()
        """Set once something clients write is held (:meth:`hold_from`)."""
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
                if self.swallow if upstream else self.swallow_incoming:
                    self.swallowed += len(data)
                    continue
                if upstream and (self._holding or self._hold_from is not None):
                    data = self._hold(sink, data)
                sink.write(data)
                await sink.drain()
        sink.close()

    def hold_from(self, marker: bytes) -> None:
        """Hold what clients write from the next ``marker`` on (the bytes
        before it pass), in order, until :meth:`release`."""
        self._hold_from = marker

    def _hold(self, sink: asyncio.StreamWriter, data: bytes) -> bytes:
        """What of ``data`` passes now; the rest is held."""
        if not self._holding:
            assert self._hold_from is not None
            at = data.find(self._hold_from)
            if at < 0:
                return data
            data, rest = data[:at], data[at:]
            self._hold_from = None
            self.held.set()
        else:
            rest, data = data, b""
        self._holding.append((sink, rest))
        return data

    def release(self) -> None:
        """Let what is held through, and what follows it."""
        holding, self._holding = self._holding, []
        for sink, data in holding:
            sink.write(data)

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
