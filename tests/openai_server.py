"""A fake OpenAI-compatible server for tests: ``POST /v1/chat/completions``.

Each test scripts the answers, in order, and reads back what was sent::

    with FakeOpenAIServer() as server:
        server.add(sse(text_chunks("Hel", "lo"), usage=(12, 3)))
        server.add(error_reply(429, "slow down", headers={"Retry-After": "0"}))
        model = OpenAIChatModel("fake-model", base_url=server.url)
        ...
        assert server.bodies[0]["messages"][0]["role"] == "system"

A :func:`completion` is one whole answer sent the way the request asks: a
``chat.completion`` JSON body when ``stream`` is false, SSE chunks (the text
split in pieces) when it is true; so one script serves both transports::

    server.add(completion('{"name": "add", "arguments": {"a": 1, "b": 2}}'))

The server is a stdlib :class:`~http.server.ThreadingHTTPServer` on
127.0.0.1 and a random port, in a thread of its own. A request that finds no
scripted reply left gets a 418 whose message says so, so a test that sends one
call too many fails with a readable error instead of hanging; unless the
server has a ``fallback``, the reply to every request past the script (a
model that answers anything, any number of times)::

    with FakeOpenAIServer(fallback=completion("I do not know.")) as server:
        ...
"""

from __future__ import annotations

import json
import queue
import socket
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any

__all__ = [
    "CompletionReply",
    "FakeOpenAIServer",
    "JsonReply",
    "RecordedRequest",
    "SseReply",
    "chunk",
    "completion",
    "error_reply",
    "finish_chunk",
    "reasoning_chunks",
    "sse",
    "text_chunks",
    "tool_call_chunks",
    "usage_chunk",
]

MODEL = "fake-model"


@dataclass(frozen=True)
class JsonReply:
    """A plain HTTP answer: a status, headers and a JSON body."""

    body: Any
    status: int = 200
    headers: Mapping[str, str] = field(default_factory=dict)
    delay: float = 0.0
    """Seconds to wait before answering (to provoke read timeouts)."""


@dataclass(frozen=True)
class SseReply:
    """A streamed answer: ``data: {chunk}`` events, then ``data: [DONE]``.

    The body is sent with chunked transfer encoding, so that ``drop=True``
    (close the socket after the chunks, without ending the body) is a broken
    connection to the client, not a normal end of the stream.
    """

    chunks: list[dict[str, Any] | str]
    done: bool = True
    """Send ``data: [DONE]`` after the chunks."""
    drop: bool = False
    """Close the connection after the chunks, mid-body."""
    delay: float = 0.0


@dataclass(frozen=True)
class CompletionReply:
    """One whole answer, sent as the request asks: JSON, or SSE when it streams."""

    text: str | None = None
    tool_calls: tuple[tuple[str, str, str], ...] = ()
    """``(call_id, name, arguments)`` of native tool calls."""
    reasoning: str | None = None
    finish_reason: str | None = None
    """Default: ``tool_calls`` when there are calls, else ``stop``."""
    usage: tuple[int, int] = (10, 5)
    pieces: int = 3
    """SSE: the text is sent in this many chunks (cut anywhere, as servers do)."""
    delay: float = 0.0

    def as_json(self) -> JsonReply:
        """The ``chat.completion`` body."""
        message: dict[str, Any] = {"role": "assistant", "content": self.text}
        if self.reasoning is not None:
            message["reasoning_content"] = self.reasoning
        if self.tool_calls:
            message["tool_calls"] = [
                {"id": i, "type": "function", "function": {"name": n, "arguments": a}}
                for i, n, a in self.tool_calls
            ]
        prompt, completion_tokens = self.usage
        body = {
            "id": "chatcmpl-fake",
            "object": "chat.completion",
            "created": 1_700_000_000,
            "model": MODEL,
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "logprobs": None,
                    "finish_reason": self._finish(),
                }
            ],
            "usage": {
                "prompt_tokens": prompt,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt + completion_tokens,
            },
        }
        return JsonReply(body, delay=self.delay)

    def as_sse(self) -> SseReply:
        """The same answer as chunks."""
        chunks: list[dict[str, Any] | str] = []
        if self.reasoning is not None:
            chunks.extend(reasoning_chunks(self.reasoning))
        if self.text:
            size = max(1, -(-len(self.text) // max(1, self.pieces)))
            chunks.extend(
                text_chunks(*(self.text[i : i + size] for i in range(0, len(self.text), size)))
            )
        for index, (call_id, name, arguments) in enumerate(self.tool_calls):
            half = len(arguments) // 2
            chunks.extend(
                tool_call_chunks(index, call_id, name, arguments[:half], arguments[half:])
            )
        reply = sse(chunks, finish=self._finish(), usage=self.usage)
        return SseReply(reply.chunks, delay=self.delay)

    def _finish(self) -> str:
        return self.finish_reason or ("tool_calls" if self.tool_calls else "stop")


Reply = JsonReply | SseReply | CompletionReply


@dataclass(frozen=True)
class RecordedRequest:
    """One request the server received."""

    path: str
    headers: dict[str, str]
    body: dict[str, Any]


class FakeOpenAIServer:
    """A scripted OpenAI-compatible HTTP server (a context manager).

    Attributes:
        requests: every request received, in order.
        fallback: the reply to a request that finds no scripted reply left
            (``None``: a 418 saying so).
    """

    def __init__(self, replies: Iterable[Reply] = (), *, fallback: Reply | None = None) -> None:
        self._replies: queue.SimpleQueue[Reply] = queue.SimpleQueue()
        self.requests: list[RecordedRequest] = []
        self.fallback = fallback
        self._lock = threading.Lock()
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self.add(*replies)

    @property
    def url(self) -> str:
        """The base URL to give a client (``http://127.0.0.1:PORT/v1``)."""
        if self._httpd is None:
            raise RuntimeError("the fake OpenAI server is not started")
        host, port = self._httpd.server_address[:2]
        return f"http://{host!s}:{port}/v1"

    @property
    def bodies(self) -> list[dict[str, Any]]:
        """The JSON bodies received, in order."""
        with self._lock:
            return [r.body for r in self.requests]

    def add(self, *replies: Reply) -> None:
        """Queue replies, answered in order, one per request."""
        for reply in replies:
            self._replies.put(reply)

    def start(self, host: str = "127.0.0.1") -> None:
        """Listen on ``host`` (a container reaches ``0.0.0.0``), a random
        port, in a daemon thread."""
        handler = type("Handler", (_Handler,), {"fake": self})
        self._httpd = _Server((host, 0), handler)
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        """Stop serving and close the listening socket."""
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._httpd = None
        self._thread = None

    def __enter__(self) -> FakeOpenAIServer:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def _record(self, request: RecordedRequest) -> Reply:
        with self._lock:
            self.requests.append(request)
        try:
            return self._replies.get_nowait()
        except queue.Empty:
            if self.fallback is not None:
                return self.fallback
            n = len(self.requests)
            return error_reply(418, f"fake server: no scripted reply left for request #{n}")


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        # Dropped and timed-out connections are what some tests are about.
        pass


class _Handler(BaseHTTPRequestHandler):
    fake: FakeOpenAIServer
    protocol_version = "HTTP/1.1"
    timeout = 5  # idle keep-alive connections end, and their threads with them

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length)
        try:
            body = json.loads(raw) if raw else {}
        except ValueError:
            body = {"_unparsed": raw.decode(errors="replace")}
        headers = {k.lower(): v for k, v in self.headers.items()}
        reply = self.fake._record(RecordedRequest(self.path, headers, body))
        if not self.path.rstrip("/").endswith("/chat/completions"):
            reply = error_reply(404, f"fake server: no route {self.path}")
        if isinstance(reply, CompletionReply):
            reply = reply.as_sse() if body.get("stream") else reply.as_json()
        time.sleep(reply.delay)
        if isinstance(reply, JsonReply):
            self._json(reply)
        else:
            self._sse(reply)

    def _json(self, reply: JsonReply) -> None:
        data = json.dumps(reply.body).encode()
        self.send_response(reply.status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for name, value in reply.headers.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(data)

    def _sse(self, reply: SseReply) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.send_header("Cache-Control", "no-cache")
        self.end_headers()
        for item in reply.chunks:
            payload = item if isinstance(item, str) else json.dumps(item)
            self._frame(f"data: {payload}\n\n".encode())
        if reply.drop:
            self.wfile.flush()
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
            return
        if reply.done:
            self._frame(b"data: [DONE]\n\n")
        self.wfile.write(b"0\r\n\r\n")

    def _frame(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()


# -- building replies ---------------------------------------------------------------


def error_reply(
    status: int,
    message: str,
    *,
    headers: Mapping[str, str] | None = None,
    code: str | None = None,
) -> JsonReply:
    """An OpenAI-style error answer: ``{"error": {"message": …}}``."""
    error = {"message": message, "type": "invalid_request_error", "param": None, "code": code}
    return JsonReply({"error": error}, status=status, headers=dict(headers or {}))


def completion(
    text: str | None = None,
    *,
    tool_calls: Iterable[tuple[str, str, str]] = (),
    reasoning: str | None = None,
    finish: str | None = None,
    pieces: int = 3,
) -> CompletionReply:
    """A whole answer, sent as JSON or SSE as the request asks (see :class:`CompletionReply`)."""
    return CompletionReply(
        text=text,
        tool_calls=tuple(tool_calls),
        reasoning=reasoning,
        finish_reason=finish,
        pieces=pieces,
    )


def chunk(
    delta: dict[str, Any] | None = None,
    *,
    finish_reason: str | None = None,
    usage: tuple[int, int] | None = None,
    choices: bool = True,
) -> dict[str, Any]:
    """One ``chat.completion.chunk``; ``choices=False`` for a chunk with none."""
    body: dict[str, Any] = {
        "id": "chatcmpl-fake",
        "object": "chat.completion.chunk",
        "created": 1_700_000_000,
        "model": MODEL,
        "choices": [],
    }
    if choices:
        body["choices"] = [
            {"index": 0, "delta": delta or {}, "logprobs": None, "finish_reason": finish_reason}
        ]
    if usage is not None:
        prompt, completion = usage
        body["usage"] = {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }
    return body


def text_chunks(*pieces: str) -> list[dict[str, Any]]:
    """Answer text, one chunk per piece (the first one says the role)."""
    return [
        chunk({"role": "assistant", "content": p} if i == 0 else {"content": p})
        for i, p in enumerate(pieces)
    ]


def reasoning_chunks(*pieces: str) -> list[dict[str, Any]]:
    """Reasoning, DeepSeek style: ``delta.reasoning_content``."""
    return [chunk({"reasoning_content": p}) for p in pieces]


def tool_call_chunks(
    index: int, call_id: str, name: str, *argument_pieces: str
) -> list[dict[str, Any]]:
    """One tool call, split as OpenAI streams it: id and name first, with no
    arguments, then the arguments string in pieces."""
    first = {
        "index": index,
        "id": call_id,
        "type": "function",
        "function": {"name": name, "arguments": ""},
    }
    rest = [{"index": index, "function": {"arguments": p}} for p in argument_pieces]
    return [chunk({"tool_calls": [call]}) for call in [first, *rest]]


def finish_chunk(reason: str = "stop") -> dict[str, Any]:
    """The chunk that ends a choice."""
    return chunk({}, finish_reason=reason)


def usage_chunk(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    """The last chunk with ``include_usage``: no choices, the token counts."""
    return chunk(choices=False, usage=(prompt_tokens, completion_tokens))


def sse(
    chunks: Iterable[dict[str, Any] | str],
    *,
    finish: str | None = "stop",
    usage: tuple[int, int] | None = (10, 5),
    done: bool = True,
    drop: bool = False,
) -> SseReply:
    """A streamed answer: ``chunks``, then a finish chunk and a usage chunk
    (either left out when ``None``)."""
    items = list(chunks)
    if finish is not None:
        items.append(finish_chunk(finish))
    if usage is not None:
        items.append(usage_chunk(*usage))
    return SseReply(items, done=done, drop=drop)
