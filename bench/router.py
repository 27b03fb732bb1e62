"""kvsched's Router side by side with vLLM's and SGLang's Rust routers (`bench.peer_routers`)
and direct calls, in front of the same simulated engines, interleaved round by round in one run:

1. time to first token: requests one at a time, each target in turn (so all see the same
   engines and machine), streamed (first chunk) and not (`max_tokens` 1: the whole answer is
   the first token); reported as p50/p99 and added over direct;
2. throughput: requests per second from 32 closed-loop streaming clients per target (kvsched
   also with both its Routers), the order rotated each round, with the CPU seconds each
   router process used per request (/proc/<pid>/stat utime+stime before and after; for
   kvsched also its Conductor, Messenger and etcd, apart);
3. cached share of prompt tokens on two multi-turn workloads (`bench.router_workloads`), each
   router with its cache-aware policy (kvsched: `--policy`, elastic without SLO admission by
   default; the peers: `cache_aware`, and vllm-router also `kv_aware` as `vllm-router-kv`):
   roomy caches, and a shared prefix with engines short of memory (`--short-capacity-blocks`,
   a second set of engines); direct calls there keep session i on engine i mod n (a sticky
   client, for reference);
4. streams: S streams held open at once through one kvsched Router against the same S straight
   to an engine (goal: S >= 2,000 without an error), opened `--stream-wave` at a time: a
   burst of all S at once is shed by design beyond the Router's `--max-placing` (256).

The peers keep that policy in every round (the speed rounds too). The engines run at
`--time-scale` (default 0.001: a modelled GPU step takes microseconds), so the routers' own
cost is not hidden behind the engine's. kvsched runs as `bench.router` has always started it
(etcd, a Conductor, two Routers, a Messenger, mutual TLS). The peers' virtual environments are
created on first use (`out/bench-venvs/`, pip, network needed once).

    .venv/bin/python -m bench.router [--quick] [--rounds 3]
        [--peers vllm-router,vllm-router-kv,sglang-router]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp

from bench.common import REPO
from bench.peer_routers import PEERS, ensure_installed
from bench.router_measures import cache_shares, first_token, streams, throughput, ttft_round
from bench.router_report import print_report, summarize
from bench.router_stack import KVSCHED_2, Stack
from bench.router_workloads import ROOMY, SHARED_PREFIX


async def warm_up(http: aiohttp.ClientSession, stack: Stack) -> None:
    """Connections, tokenizers and placement streams warm on every target."""
    body = {"model": stack.model, "prompt": "warm", "max_tokens": 2, "stream": True}
    for t in stack.targets():
        for i in range(20):
            await first_token(http, f"{t.urls[i % len(t.urls)]}/v1/completions", body, stack.key)


async def speed_rounds(
    http: aiohttp.ClientSession, stack: Stack, args: argparse.Namespace
) -> dict[str, Any]:
    """`args.rounds` rounds, the target order rotated each round: TTFT probes (the targets
    taking turns request by request), then each target's throughput in turn."""
    targets = stack.targets()
    probes: dict[str, dict[str, list[float]]] = {}
    runs: dict[str, list[dict[str, Any]]] = {t.name: [] for t in targets}
    for r in range(args.rounds):
        order = targets[r % len(targets) :] + targets[: r % len(targets)]
        single = [t for t in order if t.name != KVSCHED_2]  # one Router: the same as kvsched's
        got = await ttft_round(http, single, stack.model, stack.key, args.requests)
        for name, modes in got.items():
            for mode, values in modes.items():
                probes.setdefault(name, {}).setdefault(mode, []).extend(values)
        for t in order:
            runs[t.name].append(
                await throughput(
                    http, t, stack.model, stack.key, clients=args.clients, secs=args.seconds
                )
            )
        stack.check()
    return {
        "probes_per_target": args.requests * args.rounds,
        "summary": summarize(probes, runs),
        "rounds": runs,
        "probes_ms": {
            name: {mode: [round(v * 1e3, 3) for v in values] for mode, values in modes.items()}
            for name, modes in probes.items()
        },
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    """Everything, in two stacks (roomy engines, then engines short of memory); every process
    is stopped on the way out, on failure and Ctrl-C too."""
    for name in args.peer_names:
        ensure_installed(PEERS[name])
    out: dict[str, Any] = {
        "policy": args.policy,
        "time_scale": args.time_scale,
        "engines": args.engines,
        "peers": {n: PEERS[n].version for n in args.peer_names},
    }
    scale = 0.25 if args.quick else 1.0
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=600)
    with tempfile.TemporaryDirectory(prefix="kvsched-bench-") as tmp:
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
            stack = Stack(args, Path(tmp) / "roomy", args.capacity_blocks)
            try:
                await stack.start(http)
                await warm_up(http, stack)
                out |= await speed_rounds(http, stack, args)
                out["cache_share"] = {"roomy": await cache_shares(http, stack, ROOMY.scaled(scale))}
                if args.streams:
                    engine, router = stack.engines[0], stack.targets()[1].urls[0]
                    for name, url in (("streams_direct", engine), ("streams_router", router)):
                        out[name] = await streams(
                            http,
                            url,
                            stack.key,
                            args.streams,
                            args.stream_tokens,
                            wave=args.stream_wave,
                        )
            finally:
                stack.stop()
            short = Stack(args, Path(tmp) / "short", args.short_capacity_blocks)
            try:
                await short.start(http)
                out["cache_share"]["shared_prefix_short_memory"] = await cache_shares(
                    http, short, SHARED_PREFIX.scaled(scale)
                )
            finally:
                short.stop()
    return out


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="fewer requests, shorter runs (CI smoke)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds")
    p.add_argument("--requests", type=int, default=100, help="TTFT probes a round, target, mode")
    p.add_argument("--clients", type=int, default=32, help="throughput: concurrent clients")
    p.add_argument("--seconds", type=float, default=5.0, help="throughput: seconds a target")
    p.add_argument("--streams", type=int, default=2000, help="streams held open (0: skip)")
    p.add_argument(
        "--stream-wave",
        type=int,
        default=128,
        help="streams opened at once (the Router's --max-placing is 256)",
    )
    p.add_argument("--stream-tokens", type=int, default=1024, help="tokens per held stream")
    p.add_argument("--time-scale", type=float, default=0.001, help="engine wall s per model s")
    p.add_argument("--engines", type=int, default=2, help="simulated engines")
    # No SLO admission: at time scale 0.001 a millisecond the Router queues is a policy second
    # (the Conductor counts a request's wait over the time scale), so a loaded Router's
    # requests would be refused as late; the peers admit everything too.
    p.add_argument("--policy", default="elastic:admission=false", help="kvsched's placement policy")
    p.add_argument("--capacity-blocks", type=int, default=200_000, help="roomy engines' KV")
    p.add_argument(
        "--short-capacity-blocks",
        type=int,
        default=1_024,
        help="KV blocks of each engine short of memory",
    )
    p.add_argument(
        "--peers",
        default=",".join(PEERS),
        help=f"peers to run, comma-separated ('': none; {', '.join(PEERS)})",
    )
    p.add_argument(
        "--json",
        type=Path,
        default=REPO / "out" / "bench" / "router.json",
        help="where the results go",
    )
    args = p.parse_args(argv)
    args.peer_names = [n for n in args.peers.split(",") if n]
    unknown = [n for n in args.peer_names if n not in PEERS]
    if unknown:
        p.error(f"unknown peers {unknown}; known: {', '.join(PEERS)}")
    if args.quick:
        args.rounds, args.requests, args.seconds = 1, 20, 2.0
        args.streams, args.stream_tokens = min(args.streams, 200), 16
    return args


def main() -> None:
    args = parse_args()
    out = asyncio.run(run(args))
    print_report(out, args)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=1))
    print(f"results: {args.json}")


if __name__ == "__main__":
    main()
