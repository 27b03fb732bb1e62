"""The live engine's model clock: model seconds paced by the wall clock (`scale` wall seconds
a model second), and a sleep until a model time that a wake-up cuts short."""

from __future__ import annotations

import asyncio
import time


class ModelClock:
    """Model time since the clock was made. One sleeper at a time (the step loop)."""

    def __init__(self, scale: float) -> None:
        self.scale = scale
        self._t0 = time.monotonic()
        self._wake: asyncio.Future[bool] | None = None  # set while the loop sleeps

    def now(self) -> float:
        """Model seconds since the engine started."""
        return (time.monotonic() - self._t0) / self.scale

    async def sleep(self, until: float | None) -> bool:
        """Sleep until model time `until` (None: until woken); True when woken first."""
        loop = asyncio.get_running_loop()
        handle = None
        wake: asyncio.Future[bool] = loop.create_future()
        if until is not None:
            # An absolute wall-clock deadline, so timer and scheduling latency never add up.
            delay = until * self.scale - (time.monotonic() - self._t0)
            if delay <= 0:
                return False
            handle = loop.call_later(delay, _resolve, wake)
        self._wake = wake
        try:
            return await wake
        finally:
            self._wake = None
            if handle is not None:
                handle.cancel()

    def wake(self) -> None:
        """End the current sleep now (nothing happens when none is under way)."""
        wake, self._wake = self._wake, None
        if wake is not None and not wake.done():
            wake.set_result(True)


def _resolve(future: asyncio.Future[bool]) -> None:
    if not future.done():
        future.set_result(False)  # the deadline, not a wake-up
