"""Free ports come from below the kernel's ephemeral range, where outgoing connections never
take their source ports, and each is free when handed out."""

from __future__ import annotations

import socket

from services.launcher.ports import Ports, _ephemeral_start


def test_ports_are_free_distinct_and_below_the_ephemeral_range() -> None:
    ports = Ports()
    given = [ports() for _ in range(50)]
    assert len(set(given)) == 50
    start = _ephemeral_start()
    if start is not None:
        assert all(port < start for port in given)
    for port in given:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", port))  # raises if the port was not free
