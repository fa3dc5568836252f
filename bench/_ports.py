"""Free local TCP ports, for the benchmarks that start servers of their own."""

from __future__ import annotations

import socket


def free_ports(count: int) -> list[int]:
    """``count`` ports nothing listens on now (all held at once, so they differ)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def free_port() -> int:
    """A port nothing listens on now."""
    return free_ports(1)[0]
