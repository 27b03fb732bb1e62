"""`python -m services.router` (or `kvsched router`): run one Router until SIGINT or SIGTERM,
then drain (new requests get 503, open streams finish within `--drain-timeout`) and exit 0."""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Sequence

import uvloop

from services.common.process import configure_logging, until_stopped
from services.common.telemetry import TelemetrySettings, setup_tracing
from services.router.server import Router
from services.router.settings import RouterSettings, parse


async def serve(settings: RouterSettings) -> None:
    provider = setup_tracing(TelemetrySettings.from_env("kvsched-router"), set_global=True)
    router = Router(settings, tracer_provider=provider)
    await router.start()
    print(f"router {settings.router_id} http={router.url} grpc={router.grpc_url}", flush=True)
    await until_stopped()
    if not await router.drain(settings.drain_timeout_s):
        logging.getLogger(__name__).warning(
            "%d streams still open after %.0f s; closing them",
            router.streams_open,
            settings.drain_timeout_s,
        )
    await router.stop()
    await asyncio.to_thread(provider.shutdown)


def main(argv: Sequence[str] | None = None) -> int:
    configure_logging()
    settings = parse(argv)
    try:
        uvloop.run(serve(settings))
    except (OSError, ValueError) as exc:  # cannot listen, unreadable keys file, ...
        print(f"kvsched router: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
