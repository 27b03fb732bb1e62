"""`bench.router`'s measurements against one target: time to first token, closed-loop
throughput with the CPU its processes used, streams held open, cached share of prompt tokens."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp

from bench.common import cpu_seconds
from bench.router_stack import DIRECT, KVSCHED_2, Stack, Target
from bench.router_workloads import Workload, run_workload


class Refused(RuntimeError):
    """A 429 or 503: the target shed the request (kvsched's Router does when the Conductor
    does not answer within its placement timeout)."""


async def first_token(
    http: aiohttp.ClientSession, url: str, body: dict[str, Any], key: str
) -> float:
    """Seconds to the first streamed chunk (the stream is read to its end), or to the whole
    answer when `body` does not stream."""
    start = time.perf_counter()
    first = 0.0
    async with http.post(url, json=body, headers={"Authorization": f"Bearer {key}"}) as resp:
        if resp.status != 200:
            kind = Refused if resp.status in (429, 503) else RuntimeError
            raise kind(f"{url}: HTTP {resp.status}: {await resp.text()}")
        if not body.get("stream"):
            await resp.read()
            return time.perf_counter() - start
        async for line in resp.content:
            if line.startswith(b"data: ") and not first:
                first = time.perf_counter() - start
    return first


async def ttft_round(
    http: aiohttp.ClientSession, targets: list[Target], model: str, key: str, n: int
) -> dict[str, dict[str, list[float]]]:
    """n probes per target and mode, the targets taking turns request by request."""
    out: dict[str, dict[str, list[float]]] = {t.name: {"stream": [], "whole": []} for t in targets}
    for i in range(n):
        prompt = f"overhead probe {i % 8} " * 24
        for stream, mode in ((True, "stream"), (False, "whole")):
            body = {
                "model": model,
                "prompt": prompt,
                "max_tokens": 4 if stream else 1,
                "stream": stream,
            }
            for t in targets:
                url = f"{t.urls[i % len(t.urls)]}/v1/completions"
                out[t.name][mode].append(await first_token(http, url, body, key))
    return out


async def throughput(
    http: aiohttp.ClientSession, target: Target, model: str, key: str, *, clients: int, secs: float
) -> dict[str, Any]:
    """Completed requests per second from `clients` closed-loop streaming clients spread over
    the target's URLs, the requests refused (429/503: counted, and the client goes on with its
    next request), and the CPU seconds each of the target's processes used meanwhile."""
    done = refused = 0
    stop = time.perf_counter() + secs

    async def client(i: int) -> None:
        nonlocal done, refused
        url = f"{target.urls[i % len(target.urls)]}/v1/completions"
        body = {"model": model, "prompt": f"throughput {i} " * 16, "max_tokens": 8, "stream": True}
        while time.perf_counter() < stop:
            try:
                await first_token(http, url, body, key)
                done += 1
            except Refused:
                refused += 1

    cpu0 = {label: cpu_seconds(pid) for label, pid in target.pids.items()}
    start = time.perf_counter()
    await asyncio.gather(*(client(i) for i in range(clients)))
    elapsed = time.perf_counter() - start
    cpu = {label: cpu_seconds(pid) - cpu0[label] for label, pid in target.pids.items()}
    return {"requests": done, "refused": refused, "seconds": elapsed, "cpu_s": cpu}


async def streams(
    http: aiohttp.ClientSession, url: str, key: str, count: int, tokens: int, *, wave: int
) -> dict[str, Any]:
    """Open `count` streams, `wave` at a time (the next wave once every stream of this one has
    its answer's headers, so the streams pile up as long-lived ones do rather than arrive in
    one burst), hold them all open and read each to [DONE]. `peak_open` counts the streams
    answered 200 and not yet ended; errors are counted by HTTP status ("cut": a stream that
    ended without [DONE], or a failed connection), with the first answer of each status."""
    open_now = peak = errors = 0
    why: dict[str, int] = {}
    samples: dict[str, str] = {}

    async def one(i: int, answered: asyncio.Future[None]) -> None:
        nonlocal open_now, peak, errors
        body = {"prompt": f"stream {i}", "max_tokens": tokens, "stream": True}
        last, status = b"", "cut"
        try:
            async with http.post(
                f"{url}/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}
            ) as resp:
                answered.set_result(None)
                if resp.status == 200:
                    open_now += 1
                    peak = max(peak, open_now)
                    try:
                        async for line in resp.content:
                            if line.strip():
                                last = line
                    finally:
                        open_now -= 1
                else:
                    status = str(resp.status)
                    samples.setdefault(status, (await resp.text())[:200])
        except (aiohttp.ClientError, TimeoutError):
            pass
        finally:
            if not answered.done():
                answered.set_result(None)
        if last.strip() != b"data: [DONE]":
            errors += 1
            why[status] = why.get(status, 0) + 1

    start = time.perf_counter()
    loop = asyncio.get_running_loop()
    tasks: list[asyncio.Task[None]] = []
    for first in range(0, count, wave):
        answers = [loop.create_future() for _ in range(first, min(first + wave, count))]
        tasks += [loop.create_task(one(first + j, a)) for j, a in enumerate(answers)]
        await asyncio.gather(*answers)
    await asyncio.gather(*tasks)
    return {
        "streams": count,
        "wave": wave,
        "errors": errors,
        "error_statuses": why,
        "error_samples": samples,
        "peak_open": peak,
        "seconds": time.perf_counter() - start,
    }


async def cache_shares(
    http: aiohttp.ClientSession, stack: Stack, workload: Workload
) -> dict[str, Any]:
    """The workload through each target in turn (its own salt), kvsched x2 left out."""
    out: dict[str, Any] = {}
    for t in stack.targets():
        if t.name == KVSCHED_2:
            continue
        result = await run_workload(
            http,
            t.urls,
            workload,
            salt=f"[{t.name}]",
            model=stack.model,
            key=stack.key,
            sticky=t.name == DIRECT,
        )
        out[t.name] = result.as_dict()
        stack.check()
    return out
