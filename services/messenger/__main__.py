"""`python -m services.messenger` (or `kvsched messenger`): run one Messenger until SIGINT or
SIGTERM, then deregister its instances and shut down."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from functools import partial

from opentelemetry.sdk.trace import TracerProvider

from services.common.serving.process import run_service, until_stopped
from services.messenger.app import Messenger
from services.messenger.settings import MessengerSettings, parse


async def serve(settings: MessengerSettings, provider: TracerProvider) -> None:
    messenger = Messenger(settings, tracer_provider=provider)
    await messenger.start()
    print(
        f"messenger node={messenger.settings.node} grpc={messenger.url} http={messenger.http_url}",
        flush=True,
    )
    await until_stopped()
    await messenger.stop()


def main(argv: Sequence[str] | None = None) -> int:
    settings = parse(argv)
    return run_service("messenger", partial(serve, settings), settings.log)


if __name__ == "__main__":
    sys.exit(main())
