"""Router benchmarks on a live local cluster (`kvsched up`'s processes, started here):

1. overhead: time to first token through a Router against straight to the engine, requests
   one at a time and interleaved, so both see the same engine and machine (goal: p50 added
   ≤ 1 ms);
2. throughput: requests per second from concurrent closed-loop clients, direct against one
   Router against two Routers;
3. streams: S streaming requests held open at once through one Router, against the same S
   straight to the engine (goal: S ≥ 2,000 without an error).

The engines run at `--time-scale` (default 0.001: a modelled GPU step takes microseconds), so
the Router's own cost is not hidden behind the engine's.

    .venv/bin/python -m bench.router [--quick] [--streams 2000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from bench.common import percentile
from services.launcher.__main__ import demo_keys
from services.launcher.plan import ClusterOptions, plan_cluster
from services.launcher.supervisor import Supervisor


async def ttft(http: aiohttp.ClientSession, url: str, body: dict[str, Any], key: str) -> float:
    """Seconds to the first streamed chunk; the stream is read to its end."""
    start = time.perf_counter()
    first = 0.0
    async with http.post(url, json=body, headers={"Authorization": f"Bearer {key}"}) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{url}: HTTP {resp.status}: {await resp.text()}")
        async for line in resp.content:
            if line.startswith(b"data: ") and not first:
                first = time.perf_counter() - start
    return first


async def overhead(
    http: aiohttp.ClientSession, router: str, engine: str, key: str, n: int
) -> dict[str, float]:
    direct, routed = [], []
    for i in range(n):
        body = {"prompt": f"overhead probe {i % 8} " * 24, "max_tokens": 4, "stream": True}
        direct.append(await ttft(http, f"{engine}/v1/completions", body, key))
        routed.append(await ttft(http, f"{router}/v1/completions", body, key))
    d50, r50 = statistics.median(direct), statistics.median(routed)
    return {
        "direct_p50_ms": d50 * 1e3,
        "router_p50_ms": r50 * 1e3,
        "direct_p99_ms": percentile(direct, 99) * 1e3,
        "router_p99_ms": percentile(routed, 99) * 1e3,
        "added_p50_ms": (r50 - d50) * 1e3,
        "ratio_p50": r50 / d50,
    }


async def throughput(
    http: aiohttp.ClientSession, urls: list[str], key: str, clients: int, seconds: float
) -> float:
    """Completed requests per second from `clients` closed-loop clients spread over `urls`."""
    done = 0
    stop = time.perf_counter() + seconds

    async def client(i: int) -> None:
        nonlocal done
        url = f"{urls[i % len(urls)]}/v1/completions"
        body = {"prompt": f"throughput {i} " * 16, "max_tokens": 8, "stream": True}
        while time.perf_counter() < stop:
            await ttft(http, url, body, key)
            done += 1

    start = time.perf_counter()
    await asyncio.gather(*(client(i) for i in range(clients)))
    return done / (time.perf_counter() - start)


async def streams(
    http: aiohttp.ClientSession, url: str, key: str, count: int, tokens: int
) -> dict[str, float]:
    """Open `count` streams at once and read them all to [DONE]; errors are counted."""
    open_now = peak = errors = 0

    async def one(i: int) -> None:
        nonlocal open_now, peak, errors
        body = {"prompt": f"stream {i}", "max_tokens": tokens, "stream": True}
        last = b""
        try:
            async with http.post(
                f"{url}/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}
            ) as resp:
                open_now += 1
                peak = max(peak, open_now)
                try:
                    if resp.status == 200:
                        async for line in resp.content:
                            if line.strip():
                                last = line
                finally:
                    open_now -= 1
        except (aiohttp.ClientError, TimeoutError):
            pass
        if last.strip() != b"data: [DONE]":
            errors += 1

    start = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(count)))
    return {
        "streams": count,
        "errors": errors,
        "peak_open": peak,
        "seconds": time.perf_counter() - start,
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="kvsched-bench-") as tmp:
        run_dir = Path(tmp)
        key = demo_keys(run_dir / "api-keys.json")
        opts = ClusterOptions(
            routers=2,
            nodes=1,
            engines_per_node=1,
            policy="cache_aware",
            time_scale=args.time_scale,
            engine_flags=(
                "--max-running",
                str(max(args.streams, 256)),
                "--capacity-blocks",
                "200000",
            ),
        )
        plan = plan_cluster(opts, run_dir, run_dir / "api-keys.json", key)
        sup = Supervisor(plan, run_dir / "logs")
        try:
            await sup.start()
            routers = [c.endpoint["url"] for c in plan.stage("router")]
            engine = plan.stage("engine")[0].endpoint["url"]
            connector = aiohttp.TCPConnector(limit=0)
            timeout = aiohttp.ClientTimeout(total=600)
            async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
                for _ in range(20):  # warm up connections, the tokenizer and the placement stream
                    await ttft(
                        http,
                        f"{routers[0]}/v1/completions",
                        {"prompt": "warm", "max_tokens": 2, "stream": True},
                        key,
                    )
                    await ttft(
                        http,
                        f"{routers[1]}/v1/completions",
                        {"prompt": "warm", "max_tokens": 2, "stream": True},
                        key,
                    )
                out: dict[str, Any] = {
                    "overhead": await overhead(http, routers[0], engine, key, args.requests)
                }
                secs = args.seconds
                direct = await throughput(http, [engine], key, args.clients, secs)
                one = await throughput(http, routers[:1], key, args.clients, secs)
                two = await throughput(http, routers, key, args.clients, secs)
                out["throughput"] = {
                    "direct_rps": direct,
                    "one_router_rps": one,
                    "two_routers_rps": two,
                    "one_router_over_direct": one / direct,
                    "two_over_one_router": two / one,
                }
                out["streams_direct"] = await streams(
                    http, engine, key, args.streams, args.stream_tokens
                )
                out["streams_router"] = await streams(
                    http, routers[0], key, args.streams, args.stream_tokens
                )
            return out
        finally:
            sup.stop()


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="fewer requests, shorter runs (CI smoke)")
    p.add_argument("--requests", type=int, default=400, help="overhead: request pairs")
    p.add_argument("--clients", type=int, default=32, help="throughput: concurrent clients")
    p.add_argument("--seconds", type=float, default=10.0, help="throughput: seconds per setup")
    p.add_argument("--streams", type=int, default=2000, help="streams held open at once")
    p.add_argument("--stream-tokens", type=int, default=1024, help="tokens per held stream")
    p.add_argument("--time-scale", type=float, default=0.001, help="engine wall s per model s")
    args = p.parse_args()
    if args.quick:
        args.requests, args.seconds, args.streams, args.stream_tokens = 50, 2.0, 200, 16
    out = asyncio.run(run(args))
    o, t = out["overhead"], out["throughput"]
    print(f"overhead (TTFT, {args.requests} interleaved pairs):")
    print(
        f"  direct p50 {o['direct_p50_ms']:.2f} ms p99 {o['direct_p99_ms']:.2f} ms; "
        f"router p50 {o['router_p50_ms']:.2f} ms p99 {o['router_p99_ms']:.2f} ms"
    )
    print(
        f"  added p50 {o['added_p50_ms']:.2f} ms ({o['ratio_p50']:.2f}x direct; goal <= 1 ms added)"
    )
    print(f"throughput ({args.clients} closed-loop clients, {args.seconds:g} s each):")
    print(
        f"  direct {t['direct_rps']:.0f}/s, 1 router {t['one_router_rps']:.0f}/s "
        f"({t['one_router_over_direct']:.2f}x direct), 2 routers {t['two_routers_rps']:.0f}/s "
        f"({t['two_over_one_router']:.2f}x one)"
    )
    for name in ("streams_direct", "streams_router"):
        s = out[name]
        print(
            f"{name}: {s['streams']} at once, {s['errors']} errors, "
            f"peak open {s['peak_open']}, {s['seconds']:.1f} s"
        )
    ratio = out["streams_router"]["seconds"] / out["streams_direct"]["seconds"]
    print(f"  router / direct time for the streams: {ratio:.2f}x")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
