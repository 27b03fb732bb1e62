"""`python -m services.conductor` (or `kvsched conductor`): run one Conductor until SIGINT or
SIGTERM, then shut down gracefully."""

from __future__ import annotations

import gc
import sys
from collections.abc import Sequence

import uvloop

from services.common.process import configure_logging, until_stopped
from services.common.telemetry import TelemetrySettings, setup_tracing
from services.conductor.app import Conductor
from services.conductor.settings import parse


async def serve(argv: Sequence[str] | None = None) -> None:
    settings = parse(argv)
    provider = setup_tracing(TelemetrySettings.from_env("kvsched-conductor"), set_global=True)
    conductor = Conductor(settings, tracer_provider=provider)
    await conductor.start()
    # The index and sessions loaded at start live as long as the process: keep the cyclic
    # collector off them, and collect young objects less often (placement allocates many
    # short-lived ones), which takes the collector's pauses out of the placement tail.
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 20, 100)
    print(
        f"conductor {settings.conductor_id} grpc={conductor.url} http={conductor.http_url}",
        flush=True,
    )
    await until_stopped()
    await conductor.stop()


def main(argv: Sequence[str] | None = None) -> int:
    configure_logging()
    uvloop.run(serve(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
