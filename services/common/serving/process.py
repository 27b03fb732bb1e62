"""How every service process runs around its own work: its log lines (`logs`), the event
loop (uvloop, else asyncio's own: `event_loop`), the process's tracer provider (from
`OTEL_*`, global, flushed at exit), waiting for SIGINT or SIGTERM before shutting down
gracefully, and a one-line message rather than a traceback when it cannot start."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from typing import Any

from opentelemetry.sdk.trace import TracerProvider

from services.common.serving.logs import LogSettings, configure_logging
from services.common.telemetry import TelemetrySettings, setup_tracing, shutdown_tracing

Serve = Callable[[TracerProvider], Awaitable[None]]
# `asyncio` runs a service on asyncio's own event loop even where uvloop imports (to compare
# the two, or to step around a uvloop fault); anything else, or unset: uvloop when it imports.
EVENT_LOOP_ENV = "KVSCHED_EVENT_LOOP"
Runner = Callable[[Coroutine[Any, Any, None]], None]

log = logging.getLogger(__name__)


def event_loop(env: Mapping[str, str] = os.environ) -> tuple[str, Runner]:
    """The event loop a service runs on, by name, and the function that runs a coroutine to
    its end on a new one: uvloop (under the Router's load a Messenger uses 0.7x the CPU a
    request it uses on asyncio's loop, the Conductor 0.9x: `bench.router_checkouts . --base-env
    KVSCHED_EVENT_LOOP=asyncio`), or asyncio's own where uvloop cannot be imported (it is a
    dependency, but a platform without its wheel, or a build without it, still runs) or
    `KVSCHED_EVENT_LOOP=asyncio` asks."""
    if env.get(EVENT_LOOP_ENV, "").strip().lower() != "asyncio":
        try:
            import uvloop  # noqa: PLC0415 (optional: the fallback below runs without it)
        except ImportError:
            pass
        else:
            return "uvloop", uvloop.run
    return "asyncio", asyncio.run


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


def run_service(
    name: str, serve: Serve, logs: LogSettings, *, fails_with: tuple[type[Exception], ...] = ()
) -> int:
    """Run `serve(provider)` on a new loop of `event_loop()`, logging as `logs` says, and
    return the exit status. `provider` is the process's global tracer provider, for service
    `kvsched-<name>`, shut down (its spans flushed) once `serve` returns. An exception in
    `fails_with` (a taken port, an unreadable file) ends the process with `kvsched <name>:
    <what>` on stderr and status 1."""
    configure_logging(logs)
    loop_name, run = event_loop()
    if loop_name != "uvloop":
        log.info("kvsched %s runs on asyncio's own event loop, not uvloop", name)
    try:
        run(_traced(name, serve))
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
