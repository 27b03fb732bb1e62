"""The Messenger's HTTP endpoint: `/metrics` (Prometheus), `/health` and `/ready`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from services.common.serving.api_errors import unavailable_headers
from services.common.serving.http_site import start_site

if TYPE_CHECKING:
    from clients.python.kv_stream import KvEventStream
    from services.messenger.relay import EngineRelay


class MessengerHttp:
    """`/health` answers 200 while the process runs, with what it relays in the body;
    `/ready` 200 once it can move KV (`unready()` says why not, else None: 503 with the
    reason); `/metrics` exposes `registry`."""

    def __init__(
        self,
        registry: CollectorRegistry,
        relays: Callable[[], Sequence[EngineRelay]],
        stream: Callable[[], KvEventStream | None],
        unready: Callable[[], str | None] = lambda: None,
    ) -> None:
        self._registry = registry
        self._relays = relays
        self._stream = stream
        self._unready = unready
        self.app = web.Application()
        self.app.add_routes(
            [
                web.get("/metrics", self.metrics),
                web.get("/health", self.health),
                web.get("/ready", self.ready),
            ]
        )
        self._runner: web.AppRunner | None = None

    async def start(self, listen: str) -> int:
        """Listen on `host:port` (port 0: any free one); returns the port."""
        self._runner, port = await start_site(self.app, listen)
        return port

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def metrics(self, request: web.Request) -> web.Response:
        body = generate_latest(self._registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def ready(self, request: web.Request) -> web.Response:
        reason = self._unready()
        if reason is not None:
            body = {"status": "unready", "reason": reason}
            return web.json_response(body, status=503, headers=unavailable_headers())
        return web.json_response({"status": "ready"})

    async def health(self, request: web.Request) -> web.Response:
        stream = self._stream()
        engines = [
            {
                "engine": r.engine_url,
                "instance_id": r.instance_id,
                "up": r.up,
                "registered": r.registered,
                "events": (
                    stream.instance_state(r.instance_id) if stream and r.instance_id else None
                ),
            }
            for r in self._relays()
        ]
        conductor = None if stream is None else stream.connected_to
        return web.json_response({"status": "ok", "conductor": conductor, "engines": engines})
