"""What one large prompt costs the other requests of a Router, on a live local cluster
(`kvsched up`'s processes, started here: one Router, one engine):

1. gil: in this process, the latency of tokenizing a small prompt on one thread while another
   tokenizes the large text with `encode`, then with `encode_batch`, against the same small
   call alone: whether HF `tokenizers` releases the GIL while it encodes (the Router
   tokenizes large prompts on a thread pool, which only helps where it does);
2. tokenized: a small completion's latency through the Router while it tokenizes the large
   text (1 MiB of prose: within the byte bound, so tokenized in full, ~300k tokens, then
   refused by its count, so no engine's own tokenizing is in the way), against alone;
3. refused: how long a 10 MB prompt takes to be refused (beyond the context by its bytes
   alone; the Router's body worker decodes it, `services.router.bodies`), alone and while
   small completions run, and the small ones' latency meanwhile, against alone (goal:
   refused in under 50 ms, the small one delayed by under 10 ms); refused_inline: the same
   through a second Router without the worker (`--body-worker-bytes 0`), the baseline, the
   two taking turns round by round.

The large requests are sent from a thread of their own; each "alone" is measured in the same
run, just before. Times are milliseconds; "added" compares a percentile of the small
requests' latency during the large ones with the same percentile alone.

    .venv/bin/python -m bench.router_large_prompt [--text-kib 1024] [--small 40] [--rounds 5]
        [--refusals 20]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import aiohttp

from services.common.inference_api.openai_api import PromptTokenizer
from services.launcher.__main__ import demo_keys
from services.launcher.cluster_options import ClusterOptions
from services.launcher.plan import Child, plan_cluster
from services.launcher.supervisor import Supervisor
from services.router.tokenizer import RouterTokenizer

SMALL = {"prompt": "hi", "max_tokens": 1}
TEN_MB = 10 << 20


def prose(kib: int) -> str:
    """About `kib` KiB of varied prose-like text (numbers keep BPE from merging it away)."""
    words: list[str] = []
    size = 0
    while size < kib * 1024:
        words.append(
            f"the request number {len(words)} asks about item {len(words) * 7919 % 10007}, "
        )
        size += len(words[-1])
    return "".join(words)


def summary(ms: list[float]) -> dict[str, float]:
    return {"n": len(ms), "p50_ms": statistics.median(ms), "p99_ms": p99(ms), "max_ms": max(ms)}


def p99(ms: list[float]) -> float:
    return statistics.quantiles(ms, n=100, method="inclusive")[98] if len(ms) > 1 else ms[0]


def compared(alone: list[float], during: list[float]) -> dict[str, float]:
    """How much slower the small requests were during the large ones than alone."""
    return {
        "added_p50_ms": statistics.median(during) - statistics.median(alone),
        "added_p99_ms": p99(during) - p99(alone),
        "added_max_ms": max(during) - statistics.median(alone),
        "ratio_p50": statistics.median(during) / statistics.median(alone),
    }


def gil(text: str, rounds: int) -> dict[str, Any]:
    """Small encodes on this thread, alone and while another thread encodes `text`: with
    `encode` (`PromptTokenizer`), then with `encode_batch` (`RouterTokenizer`)."""
    plain, ours = PromptTokenizer(), RouterTokenizer()

    def small_encodes(more: Callable[[int], bool], since: float) -> list[float]:
        """The time from one small encode to the next (the first: from `since`), each after a
        short pause (as requests come spaced): when another thread holds the GIL, this one
        waits for it, anywhere (even in `Thread.start`)."""
        took: list[float] = []
        last = since
        while more(len(took)):
            time.sleep(0.0005)
            plain.encode("hi there", True)
            now = time.perf_counter()
            took.append((now - last) * 1e3)
            last = now
        return took

    alone = small_encodes(lambda n: n < 200, time.perf_counter())
    out: dict[str, Any] = {
        "text_tokens": len(plain.encode(text, True)),
        "small_alone": summary(alone),
    }
    for name, encode in (("encode", plain.encode), ("encode_batch", ours.encode)):
        during: list[float] = []
        large: list[float] = []
        for _ in range(rounds):
            start = time.perf_counter()
            worker = threading.Thread(target=encode, args=(text, True))
            worker.start()
            during += small_encodes(partial(_first_or_while, worker), start)
            worker.join()
            large.append((time.perf_counter() - start) * 1e3)
        out[name] = {
            "large_ms": summary(large),
            "small_during": summary(during),
            "ratio_p50": statistics.median(during) / statistics.median(alone),
            # How many would have run in that time, as alone: the GIL's share they got.
            "as_alone": sum(large) / statistics.median(alone),
        }
    return out


def _first_or_while(worker: threading.Thread, n: int) -> bool:
    """Measure once, then for as long as `worker` runs."""
    return n < 1 or worker.is_alive()


async def timed(request: Awaitable[tuple[int, bytes]]) -> tuple[int, bytes, float]:
    start = time.perf_counter()
    status, data = await request
    return status, data, (time.perf_counter() - start) * 1e3


async def post(
    http: aiohttp.ClientSession, url: str, body: dict[str, Any], key: str
) -> tuple[int, bytes]:
    headers = {"Authorization": f"Bearer {key}"}
    async with http.post(url, json=body, headers=headers) as resp:
        return resp.status, await resp.read()


def post_blocking(url: str, body: bytes, key: str) -> tuple[int, bytes, float]:
    """POST an encoded body from a thread of its own (sending megabytes releases the GIL),
    so the small requests' client does not wait on it; returns the status, body and ms."""
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    request = urllib.request.Request(url, data=body, headers=headers, method="POST")
    start = time.perf_counter()
    try:
        with urllib.request.urlopen(request, timeout=600) as resp:
            status, data = resp.status, resp.read()
    except urllib.error.HTTPError as err:
        status, data = err.code, err.read()
    return status, data, (time.perf_counter() - start) * 1e3


async def small_alone(http: aiohttp.ClientSession, url: str, key: str, n: int) -> list[float]:
    took = []
    for _ in range(n):
        status, data, ms = await timed(post(http, url, SMALL, key))
        if status != 200:
            raise RuntimeError(f"small request: HTTP {status}: {data[:300]!r}")
        took.append(ms)
    return took


async def small_during(
    http: aiohttp.ClientSession, url: str, key: str, large: bytes
) -> tuple[float, int, list[float]]:
    """The large request's time and status, and the small ones' latencies sent one after the
    other while it was in flight (at least one)."""
    task = asyncio.create_task(asyncio.to_thread(post_blocking, url, large, key))
    took: list[float] = []
    while not task.done() or not took:
        status, data, ms = await timed(post(http, url, SMALL, key))
        if status != 200:
            raise RuntimeError(f"small request: HTTP {status}: {data[:300]!r}")
        took.append(ms)
    large_status, _, large_ms = await task
    return large_ms, large_status, took


def large_runs(
    large_ms: list[float], status: list[int], alone: list[float], during: list[float]
) -> dict[str, Any]:
    """The large requests' times and statuses, and the small ones' latencies alone and during
    them, compared."""
    return {
        "large_ms": summary(large_ms),
        "large_status": sorted(set(status)),
        "small_alone": summary(alone),
        "small_during": summary(during),
        **compared(alone, during),
    }


async def tokenized(
    http: aiohttp.ClientSession, url: str, key: str, text: str, *, rounds: int, small: int
) -> dict[str, Any]:
    """`rounds` times the large text, small requests meanwhile."""
    alone = await small_alone(http, url, key, small)
    body = json.dumps({"prompt": text, "max_tokens": 1}).encode()
    large_ms, status, during = [], [], []
    for _ in range(rounds):
        ms, st, took = await small_during(http, url, key, body)
        large_ms.append(ms)
        status.append(st)
        during += took
    return large_runs(large_ms, status, alone, during)


async def refusals(
    http: aiohttp.ClientSession, urls: dict[str, str], key: str, rounds: int, small: int
) -> dict[str, dict[str, Any]]:
    """For each Router of `urls`, `rounds` 10 MB prompts refused alone and `rounds` with small
    requests meanwhile; the Routers take turns, round by round, so a change in the machine's
    load falls on all of them alike."""
    body = json.dumps({"prompt": "a" * TEN_MB, "max_tokens": 1}).encode()
    alone = {name: await small_alone(http, url, key, small) for name, url in urls.items()}
    refused_alone: dict[str, list[float]] = {name: [] for name in urls}
    runs: dict[str, tuple[list[float], list[int], list[float]]] = {
        name: ([], [], []) for name in urls
    }
    for _ in range(rounds):
        for name, url in urls.items():
            status, data, ms = await asyncio.to_thread(post_blocking, url, body, key)
            if status != 400:
                raise RuntimeError(f"10 MB prompt: HTTP {status}: {data[:300]!r}")
            refused_alone[name].append(ms)
        for name, url in urls.items():
            ms, st, took = await small_during(http, url, key, body)
            large_ms, status_list, during = runs[name]
            large_ms.append(ms)
            status_list.append(st)
            during += took
    return {
        name: {
            "large_alone_ms": summary(refused_alone[name]),
            **large_runs(*runs[name][:2], alone[name], runs[name][2]),
        }
        for name in urls
    }


async def cluster_runs(args: argparse.Namespace, text: str) -> dict[str, Any]:
    """The cluster cases: two Routers, the second one (the baseline) without a body worker
    (`--body-worker-bytes 0`: every body decoded on its event loop)."""
    with tempfile.TemporaryDirectory(prefix="kvsched-bench-") as tmp:
        run_dir = Path(tmp)
        key = demo_keys(run_dir / "api-keys.json")
        opts = ClusterOptions(
            routers=2, nodes=1, engines_per_node=1, policy="cache_aware", time_scale=0.001
        )
        plan = plan_cluster(opts, run_dir, run_dir / "api-keys.json", key)
        plan = replace(plan, children=tuple(map(_inline_second_router, plan.children)))
        sup = Supervisor(plan, run_dir / "logs")
        try:
            await sup.start()
            worker, inline = (r.endpoint["url"] + "/v1/completions" for r in plan.stage("router"))
            timeout = aiohttp.ClientTimeout(total=600)
            async with aiohttp.ClientSession(timeout=timeout) as http:
                for url in (worker, inline):
                    await small_alone(http, url, key, 20)  # warm up
                out: dict[str, Any] = {
                    "tokenized": await tokenized(
                        http, worker, key, text, rounds=args.rounds, small=args.small
                    )
                }
                cases = {"refused": worker, "refused_inline": inline}
                out.update(await refusals(http, cases, key, args.refusals, args.small))
            return out
        finally:
            sup.stop()


def _inline_second_router(child: Child) -> Child:
    if child.name != "router-1":
        return child
    return replace(child, argv=(*child.argv, "--body-worker-bytes", "0"))


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--text-kib", type=int, default=1024, help="the large text's size, KiB")
    p.add_argument("--small", type=int, default=40, help="small requests measured alone")
    p.add_argument("--rounds", type=int, default=5, help="large texts tokenized")
    p.add_argument("--refusals", type=int, default=20, help="10 MB prompts refused (twice)")
    args = p.parse_args()
    text = prose(args.text_kib)
    out = {"gil": gil(text, args.rounds), **asyncio.run(cluster_runs(args, text))}
    g = out["gil"]
    print(
        f"gil: {len(text) >> 10} KiB of text ({g['text_tokens']} tokens); a small encode "
        f"every (0.5 ms pause + encode) alone p50 {g['small_alone']['p50_ms']:.3f} ms"
    )
    for name in ("encode", "encode_batch"):
        e = g[name]
        print(
            f"  during {name} ({e['large_ms']['p50_ms']:.0f} ms): {e['small_during']['n']} "
            f"small encodes ({e['as_alone']:.0f} alone), every p50 "
            f"{e['small_during']['p50_ms']:.3f} ms max {e['small_during']['max_ms']:.3f} ms "
            f"({e['ratio_p50']:.2f}x alone p50)"
        )
    for name in ("tokenized", "refused", "refused_inline"):
        c = out[name]
        if "large_alone_ms" in c:
            a = c["large_alone_ms"]
            print(
                f"{name} alone: p50 {a['p50_ms']:.1f} ms p99 {a['p99_ms']:.1f} ms max "
                f"{a['max_ms']:.1f} ms (n={a['n']})"
            )
        large, alone, during = c["large_ms"], c["small_alone"], c["small_during"]
        print(
            f"{name} with small ones: p50 {large['p50_ms']:.1f} ms p99 {large['p99_ms']:.1f} ms "
            f"(HTTP {c['large_status']}); small alone p50 {alone['p50_ms']:.2f} p99 "
            f"{alone['p99_ms']:.2f} ms, during p50 {during['p50_ms']:.2f} p99 "
            f"{during['p99_ms']:.2f} max {during['max_ms']:.2f} ms (n={during['n']}): added "
            f"p50 {c['added_p50_ms']:.2f} ms, p99 {c['added_p99_ms']:.2f} ms ({c['ratio_p50']:.2f}x"
            " p50)"
        )
    worker, inline = out["refused"], out["refused_inline"]
    print(
        "the body worker vs none (same run): refused alone p50 "
        f"{worker['large_alone_ms']['p50_ms']:.1f} vs {inline['large_alone_ms']['p50_ms']:.1f} ms;"
        f" small requests added p50 {worker['added_p50_ms']:.2f} vs "
        f"{inline['added_p50_ms']:.2f} ms, p99 {worker['added_p99_ms']:.2f} vs "
        f"{inline['added_p99_ms']:.2f} ms"
    )
    print(json.dumps(out))


if __name__ == "__main__":
    main()
