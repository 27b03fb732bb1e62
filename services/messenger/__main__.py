"""`python -m services.messenger` (or `kvsched messenger`): run one Messenger until SIGINT or
SIGTERM, then deregister its instances and shut down."""

from __future__ import annotations

import sys
from collections.abc import Sequence

import uvloop

from services.common.process import configure_logging, until_stopped
from services.common.telemetry import TelemetrySettings, setup_tracing
from services.messenger.app import Messenger
from services.messenger.settings import parse


async def serve(argv: Sequence[str] | None = None) -> None:
    settings = parse(argv)
    provider = setup_tracing(TelemetrySettings.from_env("kvsched-messenger"), set_global=True)
    messenger = Messenger(settings, tracer_provider=provider)
    await messenger.start()
    print(
        f"messenger node={messenger.settings.node} grpc={messenger.url} http={messenger.http_url}",
        flush=True,
    )
    await until_stopped()
    await messenger.stop()


def main(argv: Sequence[str] | None = None) -> int:
    configure_logging()
    uvloop.run(serve(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
