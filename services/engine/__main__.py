"""`python -m services.engine` (or `kvsched engine`): run one simulated vLLM-compatible engine
until SIGINT or SIGTERM; then stop accepting connections and new requests, let open requests
finish for the grace period (`--shutdown-grace`), abort what is left, close the sockets and
exit 0."""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import Sequence

import uvloop
import zmq
from aiohttp import web

from services.common.process import configure_logging, until_stopped
from services.common.telemetry import (
    TelemetrySettings,
    get_tracer,
    setup_tracing,
    shutdown_tracing,
)
from services.engine.app import build
from services.engine.settings import parse


async def serve(argv: Sequence[str] | None = None) -> None:
    settings = parse(argv)
    provider = setup_tracing(TelemetrySettings.from_env("kvsched-engine"), set_global=True)
    try:
        api = build(settings, get_tracer(provider))
    except (ValueError, zmq.ZMQError) as exc:  # unknown model or profile, endpoint taken
        raise SystemExit(f"kvsched engine: error: {exc}") from None
    # handler_cancellation: a client that hangs up cancels its handler, which aborts its
    # request in the engine (vLLM aborts on disconnect too, streaming or not).
    runner = web.AppRunner(
        api.app,
        access_log=None,
        handler_cancellation=True,
        shutdown_timeout=settings.shutdown_grace_s,
    )
    await runner.setup()
    host, _, port = settings.listen.rpartition(":")
    site = web.TCPSite(runner, host, int(port), backlog=4096)
    await site.start()
    await api.start()
    bound = _bound_port(site) or port
    print(
        f"engine {settings.instance_id} http=http://{host}:{bound} "
        f"kv-events={api.live.publisher.endpoint}",
        flush=True,
    )
    await until_stopped()
    api.draining = True
    # The runner stops listening, then gives open requests the grace period (the model keeps
    # stepping meanwhile) and cancels the rest, which aborts them.
    await runner.cleanup()
    await api.close()
    with contextlib.suppress(Exception):
        await asyncio.to_thread(shutdown_tracing, provider)


def _bound_port(site: web.TCPSite) -> int | None:
    server = site._server  # the bound socket tells the port when 0 was asked for
    sockets = getattr(server, "sockets", None) or []
    return int(sockets[0].getsockname()[1]) if sockets else None


def main(argv: Sequence[str] | None = None) -> int:
    configure_logging()
    uvloop.run(serve(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
