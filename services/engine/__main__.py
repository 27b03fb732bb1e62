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

from services.common.http_site import start_site
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
    except (ValueError, OSError, zmq.ZMQError) as exc:  # bad model, no KV memory, port taken
        raise SystemExit(f"kvsched engine: error: {exc}") from None
    # handler_cancellation: a client that hangs up cancels its handler, which aborts its
    # request in the engine (vLLM aborts on disconnect too, streaming or not).
    runner, bound = await start_site(
        api.app,
        settings.listen,
        backlog=4096,
        handler_cancellation=True,
        shutdown_timeout=settings.shutdown_grace_s,
    )
    await api.start()
    host = settings.listen.rpartition(":")[0]
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


def main(argv: Sequence[str] | None = None) -> int:
    configure_logging()
    uvloop.run(serve(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
