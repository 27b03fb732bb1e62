"""A blocking client of the node's KV pool socket (its wire format:
`services.dataplane.pool_wire`), for the connector: vLLM's scheduler and workers call it from
their own threads, between and around steps.

A call that cannot be made (no Messenger, a broken connection, a timeout) raises
`PoolUnavailable`; the connector then goes on without the pool (a miss, not an error), and
the next call connects again. A call on a connection kept from earlier calls that breaks
before any answer (the Messenger restarted meanwhile) is made once more on a new one."""

from __future__ import annotations

import socket
import threading
from typing import Any, NoReturn

from services.dataplane.pool_wire import WireError, body_length, decode, encode


class PoolUnavailable(Exception):
    """The pool could not be asked."""


class _Stale(Exception):
    """The connection broke before the call got any answer."""


class PoolRefusal(Exception):
    """The pool answered no (its reason is the message)."""


class PoolClient:
    """Calls to the pool at the Unix socket `path`, one at a time."""

    def __init__(self, path: str, *, timeout_s: float = 5.0) -> None:
        self.path = path
        self.timeout_s = timeout_s
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()

    def call(self, op: str, **arguments: Any) -> dict[str, Any]:
        """One call's results; raises `PoolRefusal` or `PoolUnavailable`."""
        message = encode({"op": op, **arguments})
        with self._lock:
            answer = None
            if self._sock is not None:  # kept from earlier calls: it may be stale
                try:
                    answer = self._exchange(self._sock, message)
                except _Stale:
                    self._drop()
                except (OSError, WireError) as exc:
                    self._fail(exc)
            if answer is None:
                try:
                    answer = self._exchange(self._connected(), message)
                except (_Stale, OSError, WireError) as exc:
                    self._fail(exc)
        if answer.get("ok") is not True:
            raise PoolRefusal(str(answer.get("error", "no reason given")))
        return answer

    def _exchange(self, sock: socket.socket, message: bytes) -> dict[str, Any]:
        """Send and read the answer; `_Stale` when the connection broke before any of it."""
        try:
            sock.sendall(message)
            header = sock.recv(4)
        except (BrokenPipeError, ConnectionResetError) as exc:
            raise _Stale(str(exc)) from None
        if not header:
            raise _Stale("the pool closed the connection")
        header += _read(sock, 4 - len(header))
        return decode(_read(sock, body_length(header)))

    def _fail(self, exc: BaseException) -> NoReturn:
        self._drop()
        raise PoolUnavailable(f"the KV pool at {self.path}: {exc}") from None

    def close(self) -> None:
        with self._lock:
            self._drop()

    def _connected(self) -> socket.socket:
        if self._sock is None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(self.timeout_s)
            try:
                sock.connect(self.path)
            except OSError:
                sock.close()
                raise
            self._sock = sock
        return self._sock

    def _drop(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def _read(sock: socket.socket, n: int) -> bytes:
    chunks, left = [], n
    while left:
        chunk = sock.recv(left)
        if not chunk:
            raise ConnectionError("the pool closed the connection")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)
