"""How every service process runs around its own work: log lines in one format, the uvloop
event loop, the process's tracer provider (from `OTEL_*`, global, flushed at exit), waiting
for SIGINT or SIGTERM before shutting down gracefully, and a one-line message rather than a
traceback when it cannot start."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
import sys
from collections.abc import Awaitable, Callable

import uvloop
from opentelemetry.sdk.trace import TracerProvider

from services.common.telemetry import TelemetrySettings, setup_tracing, shutdown_tracing

LOG_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"
Serve = Callable[[TracerProvider], Awaitable[None]]


def configure_logging() -> None:
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)


async def until_stopped() -> None:
    """Return once the process receives SIGINT or SIGTERM (on the running loop)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


def freeze_heap() -> None:
    """Keep the cyclic collector off everything alive now, and collect young objects less
    often: call once the state that lives as long as the process is loaded. A service that
    allocates many short-lived objects per request (the Conductor's placement) then loses
    the collector's pauses from its latency tail."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 20, 100)


def run_service(name: str, serve: Serve, *, fails_with: tuple[type[Exception], ...] = ()) -> int:
    """Run `serve(provider)` on uvloop and return the exit status. `provider` is the
    process's global tracer provider, for service `kvsched-<name>`, shut down (its spans
    flushed) once `serve` returns. An exception in `fails_with` (a taken port, an unreadable
    file) ends the process with `kvsched <name>: <what>` on stderr and status 1."""
    configure_logging()
    try:
        uvloop.run(_traced(name, serve))
    except fails_with as exc:
        print(f"kvsched {name}: {exc}", file=sys.stderr)
        return 1
    return 0


async def _traced(name: str, serve: Serve) -> None:
    provider = setup_tracing(TelemetrySettings.from_env(f"kvsched-{name}"), set_global=True)
    try:
        await serve(provider)
    finally:
        # The exporter may be unreachable by now; exiting matters more than the last spans.
        with contextlib.suppress(Exception):
            await asyncio.to_thread(shutdown_tracing, provider)
