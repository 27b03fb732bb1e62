"""Free loopback ports, picked below the kernel's ephemeral range.

A port probed free can be taken before its service binds it. Ports handed out by `bind(0)`
come from the ephemeral range, where every outgoing connection of a busy machine (gRPC, HTTP,
etcd clients) also takes its source port, so such a race is common there; below that range
only another listener can take the port."""

from __future__ import annotations

import random
import socket
from pathlib import Path

_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST = 10_000  # well above the ports that system services listen on
_TRIES = 200


def _ephemeral_start() -> int | None:
    try:
        return int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A loopback TCP port nothing listens on right now, below the ephemeral range where the
    kernel tells it (else any free one). Another listener may still take it before it is
    bound: callers that can, retry."""
    start = _ephemeral_start()
    if start is not None and start > _LOWEST:
        pick = random.SystemRandom()
        for _ in range(_TRIES):
            port = pick.randrange(_LOWEST, start)
            if _bindable(port):
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Ports:
    """Hands out free ports, never the same one twice."""

    def __init__(self) -> None:
        self._given: set[int] = set()

    def __call__(self) -> int:
        while True:
            port = free_port()
            if port not in self._given:
                self._given.add(port)
                return port
