"""Free loopback ports."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A loopback TCP port nothing listens on right now (another process may still take it
    before it is bound: callers that can, retry)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Ports:
    """Hands out free ports, never the same one twice (the OS may offer a port again once
    its probe socket is closed)."""

    def __init__(self) -> None:
        self._given: set[int] = set()

    def __call__(self) -> int:
        while True:
            port = free_port()
            if port not in self._given:
                self._given.add(port)
                return port
