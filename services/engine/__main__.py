"""`python -m services.engine` (or `kvsched engine`): run one simulated vLLM-compatible engine
until SIGINT or SIGTERM; then stop accepting connections and new requests, let open requests
finish for the grace period (`--shutdown-grace`), abort what is left, close the sockets and
exit 0."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from functools import partial

import zmq
from opentelemetry.sdk.trace import TracerProvider

from services.common.serving.http_site import start_site
from services.common.serving.process import run_service, until_stopped
from services.common.telemetry import get_tracer
from services.engine.app import build
from services.engine.settings import EngineSettings, parse


async def serve(settings: EngineSettings, provider: TracerProvider) -> None:
    api = build(settings, get_tracer(provider))  # bad model, no KV memory, port taken: fail
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


def main(argv: Sequence[str] | None = None) -> int:
    settings = parse(argv)
    return run_service(
        "engine",
        partial(serve, settings),
        settings.log,
        fails_with=(ValueError, OSError, zmq.ZMQError),
    )


if __name__ == "__main__":
    sys.exit(main())
