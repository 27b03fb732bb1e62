"""`python -m services.engine` (or `kvsched engine`): run one simulated vLLM-compatible engine
until SIGINT or SIGTERM; then stop taking requests, let open streams finish for the grace
period, and close."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import Sequence

import uvloop
from aiohttp import web

from services.common.openai_api import PromptTokenizer
from services.common.telemetry import (
    TelemetrySettings,
    get_tracer,
    setup_tracing,
    shutdown_tracing,
)
from services.engine.app import EngineApp
from services.engine.kv_publisher import KvEventPublisher
from services.engine.model import LiveEngine
from services.engine.settings import KV_TOPIC, parse
from services.engine.text import Words


async def serve(argv: Sequence[str] | None = None) -> None:
    settings = parse(argv)
    provider = setup_tracing(TelemetrySettings.from_env("kvsched-engine"), set_global=True)
    publisher = KvEventPublisher(
        settings.kv_events,
        settings.kv_replay,
        topic=KV_TOPIC.encode(),
        shape=settings.event_shape,
    )
    publisher.start()
    live = LiveEngine(settings, publisher)
    tokenizer = PromptTokenizer(settings.tokenizer)
    api = EngineApp(live, tokenizer, Words(tokenizer, settings.seed), get_tracer(provider))
    runner = web.AppRunner(api.app, access_log=None, shutdown_timeout=settings.shutdown_grace_s)
    await runner.setup()
    host, _, port = settings.listen.rpartition(":")
    site = web.TCPSite(runner, host, int(port), backlog=4096)
    await site.start()
    live.start()
    print(
        f"engine {settings.instance_id} http={settings.listen} kv-events={publisher.endpoint}",
        flush=True,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    # The runner stops accepting, then gives open streams the grace period; the model keeps
    # stepping meanwhile so they can finish.
    await runner.cleanup()
    await live.stop()
    await publisher.close()
    with contextlib.suppress(Exception):
        shutdown_tracing(provider)


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    uvloop.run(serve(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
