"""What the commands that serve HTTP (``fleetbus dashboard``, ``fleetbus
gateway``) share: their socket, and uvicorn without its own signal handling."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator
from typing import Any

from fleetbus.errors import ConfigError

__all__ = ["ANY_HOST", "listen", "server_class"]

ANY_HOST = ("0.0.0.0", "::", "")
"""Addresses that listen on every interface."""


def listen(host: str, port: int, what: str) -> socket.socket:
    """A listening socket (bound here, so that a busy port is one clear line).

    Raises:
        ConfigError: the address cannot be bound.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family)
    except OSError as exc:
        raise ConfigError(f"{what} cannot listen on {host}:{port}: {exc.strerror or exc}") from exc


def server_class(uvicorn: Any) -> Any:
    """uvicorn's ``Server`` without its own signal handling: the command's
    handlers stop what it serves first, so that live streams end."""

    class Server(uvicorn.Server):  # type: ignore[misc]
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            yield

    return Server
