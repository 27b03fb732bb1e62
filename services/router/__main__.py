"""`python -m services.router` (or `kvsched router`): run one Router until SIGINT or SIGTERM,
then drain (new requests get 503, open streams finish within `--drain-timeout`) and exit 0."""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from functools import partial

from opentelemetry.sdk.trace import TracerProvider

from services.common.serving.process import freeze_heap, run_service, until_stopped
from services.router.app import Router
from services.router.settings import RouterSettings, parse


async def serve(settings: RouterSettings, provider: TracerProvider) -> None:
    router = Router(settings, tracer_provider=provider)
    await router.start()
    # Its modules, tokenizer and pools are loaded: the collector leaves them alone, and runs
    # less often over each request's short-lived objects.
    freeze_heap()
    print(f"router {settings.router_id} http={router.url} grpc={router.grpc_url}", flush=True)
    await until_stopped()
    if not await router.drain(settings.drain_timeout_s):
        logging.getLogger(__name__).warning(
            "%d streams still open after %.0f s; closing them",
            router.streams_open,
            settings.drain_timeout_s,
        )
    await router.stop()


def main(argv: Sequence[str] | None = None) -> int:
    settings = parse(argv)
    # (cannot listen, unreadable keys file, ...)
    return run_service(
        "router", partial(serve, settings), settings.log, fails_with=(OSError, ValueError)
    )


if __name__ == "__main__":
    sys.exit(main())
