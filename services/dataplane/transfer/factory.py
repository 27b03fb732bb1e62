"""Opening a backend by name (the Messenger's configuration): `open_backend`, the names it
knows (`BACKENDS`) and why one cannot run here (`backend_missing`)."""

from __future__ import annotations

from services.dataplane.transfer import mooncake_backend
from services.dataplane.transfer.backend import Backend
from services.dataplane.transfer.mooncake_backend import MooncakeBackend
from services.dataplane.transfer.tcp_backend import TcpBackend

BACKENDS = ("mooncake", "tcp")


def backend_missing(name: str) -> str | None:
    """What backend `name` lacks here to run (the Mooncake wheel, for "mooncake"), or None."""
    if name == "mooncake" and not mooncake_backend.installed():
        return mooncake_backend.MISSING
    return None


def open_backend(
    name: str,
    host: str,
    *,
    port: int = 0,
    timeout_s: float = 30.0,
    mooncake_protocol: str = "tcp",
    mooncake_device: str = "",
) -> Backend:
    """A backend serving on `host` (the address peers reach this Messenger at).

    "tcp": our server on `port` (0: any free port); a read fails once the peer makes no
    progress for `timeout_s`. "mooncake": a TransferEngine on `host` (it picks its own port)
    over `mooncake_protocol` ("tcp" or "rdma" on `mooncake_device`); a batch fails after
    `timeout_s`. Raises `ValueError` for another name."""
    if name == "tcp":
        return TcpBackend(host, port, idle_s=timeout_s)
    if name == "mooncake":
        return MooncakeBackend(
            host, protocol=mooncake_protocol, device=mooncake_device, read_timeout_s=timeout_s
        )
    raise ValueError(f"unknown transfer backend {name!r}; choose one of {', '.join(BACKENDS)}")
