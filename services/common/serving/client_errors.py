"""Logging the mistakes clients make (a malformed body, an undecodable RPC): a WARNING each,
never a traceback, and at most a burst of them at a time so a fuzzer or a broken client
cannot flood the log; what was left out is counted in the next line that gets through."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable


class ClientErrorLog:
    """A token bucket in front of `logger.warning`: `burst` lines at once, then one every
    `1 / per_s` seconds. Thread-safe (gRPC's sync handlers run on a pool)."""

    def __init__(
        self,
        logger: logging.Logger,
        *,
        burst: int = 10,
        per_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._logger = logger
        self._burst = float(burst)
        self._per_s = per_s
        self._clock = clock
        self._tokens = float(burst)
        self._last = clock()
        self._left_out = 0
        self._lock = threading.Lock()

    def warning(self, message: str, *args: object) -> bool:
        """Log `message % args` at WARNING unless over the rate; returns whether it was."""
        with self._lock:
            now = self._clock()
            self._tokens = min(self._burst, self._tokens + (now - self._last) * self._per_s)
            self._last = now
            if self._tokens < 1.0:
                self._left_out += 1
                return False
            self._tokens -= 1.0
            left_out, self._left_out = self._left_out, 0
        if left_out:
            message += " (and %d client errors not logged)"
            args = (*args, left_out)
        self._logger.warning(message, *args)
        return True
