"""What the load generator reads from the cluster besides its own requests: engine load over
time (for the hotspot index), engine counters, and the Conductor's migration count."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Sequence
from typing import Any

import aiohttp

from kvsched.sim.meters import HotspotMeter

SAMPLE_S = 0.05  # wall seconds between load samples
ENGINE_COUNTERS = ("busy_s", "kv_area", "batch_area", "passes", "decode_passes", "mixed_passes")
_TIMEOUT = aiohttp.ClientTimeout(total=2.0)


async def get_json(http: aiohttp.ClientSession, url: str) -> Any:
    """GET `url` as JSON; None when it does not answer with JSON."""
    with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError):
        async with http.get(url, timeout=_TIMEOUT) as resp:
            if resp.status == 200:
                return await resp.json()
    return None


async def sample_loads(
    http: aiohttp.ClientSession,
    engines: Sequence[str],
    meter: HotspotMeter,
    now: Callable[[], float],
    stop: asyncio.Event,
) -> None:
    """Feed each engine's pending prefill tokens and queued prefill seconds into `meter`
    until `stop` is set. An engine that answers without saying what is queued (no
    `queued_prefill_s`), or no engine ever saying it (real vLLM has no `/kvsched/load`), leaves
    the hotspot index unknown, rather than 0."""
    said = False
    while not stop.is_set():
        tick = time.monotonic()
        loads = await asyncio.gather(*(get_json(http, f"{u}/kvsched/load") for u in engines))
        t = now()
        for slot, load in enumerate(loads):
            if isinstance(load, dict):
                meter.set(t, slot, float(load.get("pending_prefill_tokens", 0)))
                queued = load.get("queued_prefill_s")
                if isinstance(queued, int | float):
                    meter.set_queued(t, slot, float(queued))
                    said = True
                else:
                    meter.queued_known = False
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(max(SAMPLE_S - (time.monotonic() - tick), 0.0)):
                await stop.wait()
    if not said:
        meter.queued_known = False
    meter.finish(now())


async def engine_counters(
    http: aiohttp.ClientSession, engines: Sequence[str]
) -> list[dict[str, float] | None]:
    """Each engine's cumulative step counters (`/kvsched/stats`), None where unavailable."""
    stats = await asyncio.gather(*(get_json(http, f"{u}/kvsched/stats") for u in engines))
    return [
        {k: float(s.get(k, 0.0)) for k in ENGINE_COUNTERS} if isinstance(s, dict) else None
        for s in stats
    ]


async def conductor_migrations(http: aiohttp.ClientSession, conductors: Sequence[str]) -> float:
    """Migrations the leading Conductor has decided so far (NaN when none answers)."""
    for url in conductors:
        leader = await get_json(http, f"{url}/api/leader")
        if not isinstance(leader, dict) or not leader.get("is_leader"):
            continue
        with contextlib.suppress(aiohttp.ClientError, TimeoutError):
            async with http.get(f"{url}/metrics", timeout=_TIMEOUT) as resp:
                for line in (await resp.text()).splitlines():
                    if line.startswith("kvsched_conductor_migrations "):
                        return float(line.split()[1])
    return float("nan")
