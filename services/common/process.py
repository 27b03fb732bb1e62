"""What every service process does around its own work: log lines in one format, and
waiting for SIGINT or SIGTERM before shutting down gracefully."""

from __future__ import annotations

import asyncio
import logging
import signal

LOG_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"


def configure_logging() -> None:
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)


async def until_stopped() -> None:
    """Return once the process receives SIGINT or SIGTERM (on the running loop)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
