"""`python -m services.conductor` (or `kvsched conductor`): run one Conductor until SIGINT or
SIGTERM, then shut down gracefully."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from functools import partial

from opentelemetry.sdk.trace import TracerProvider

from services.common.serving.process import freeze_heap, run_service, until_stopped
from services.conductor.app import Conductor
from services.conductor.settings import ConductorSettings, parse


async def serve(settings: ConductorSettings, provider: TracerProvider) -> None:
    conductor = Conductor(settings, tracer_provider=provider)
    await conductor.start()
    # The index and sessions loaded at start live as long as the process.
    freeze_heap()
    print(
        f"conductor {settings.conductor_id} grpc={conductor.url} http={conductor.http_url}",
        flush=True,
    )
    await until_stopped()
    await conductor.stop()


def main(argv: Sequence[str] | None = None) -> int:
    settings = parse(argv)
    return run_service("conductor", partial(serve, settings), settings.log, fails_with=(OSError,))


if __name__ == "__main__":
    sys.exit(main())
