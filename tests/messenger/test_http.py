"""The Messenger's readiness answer: 503 with the reason and Retry-After until it can move KV."""

from __future__ import annotations

from aiohttp.test_utils import TestClient, TestServer
from prometheus_client import CollectorRegistry

from services.messenger.http import MessengerHttp


async def test_unready_is_503_with_retry_after_then_ready() -> None:
    reason: list[str | None] = ["no engine answered yet"]
    http = MessengerHttp(CollectorRegistry(), lambda: [], lambda: None, unready=lambda: reason[0])
    async with TestClient(TestServer(http.app, host="127.0.0.1")) as client:
        async with client.get("/ready") as r:
            assert (r.status, r.headers["Retry-After"]) == (503, "1")
            assert await r.json() == {"status": "unready", "reason": "no engine answered yet"}
        reason[0] = None
        async with client.get("/ready") as r:
            assert r.status == 200 and "Retry-After" not in r.headers
