"""Overload: a local cluster driven open-loop at 3× and 5× its measured capacity. Every
request must be admitted and served within the TTFT SLO, or refused at once with 429 +
Retry-After; none may wait into the client's timeout, and no service's memory may grow
without bound.

The cluster (`kvsched up`'s processes, started here): etcd, one Conductor, two Routers, one
node with two simulated engines. The engines run `--time-scale` times slower than the
modelled H100 (default 20), so capacity is set by the engines — a few tens of requests a
second — and not by Python on a machine of two cores. The Conductor's TTFT objective is
`--ttft-slo` wall seconds (passed in policy seconds: divided by the time scale).

Prompts are synthetic (bench/common.py loads no trace): token ids, one of eight shared
256-token prefixes and a unique tail, 512 tokens in all, 32 tokens out, streamed. Arrivals
are Poisson (seeded).

1. capacity: a ramp of rates, `--step-seconds` each; capacity is the highest rate at which at
   least 99% of all requests were admitted and within the TTFT SLO;
2. overload: 3× and 5× that rate for `--seconds` each (default 60), with a client timeout of
   `--client-timeout` (default 30 s);
3. stall: 3× again, with the Conductor stopped (SIGSTOP) for `--stall` seconds (default 1.5,
   inside its 2 s leader lease): a Conductor that is slow, not gone, where the Routers used to
   decide alone. Its 429s come at the Routers' `--placement-timeout` (0.25 s by default).

Per phase: admitted and their share within the TTFT SLO, 429s and their latency (p50, p99;
goal under 100 ms) and how many carried Retry-After, client timeouts (goal 0), other errors,
the Routers' shed counters and the Conductor's refusals, and the RSS of every service process
before and after. Prints a table and writes out/bench/overload.json.

    .venv/bin/python -m bench.overload [--seconds 60] [--time-scale 20] [--stall 1.5] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from bench.common import REPO, percentile
from bench.grpc_placement.processes import rss_mb
from services.common.inference_api.openai_api import PromptTokenizer
from services.launcher.__main__ import demo_keys
from services.launcher.cluster_options import ClusterOptions
from services.launcher.plan import plan_cluster
from services.launcher.supervisor import Supervisor
from services.loadgen.client import Outcome, complete

PREFIXES = 8
PREFIX_TOKENS = 256
TAIL_TOKENS = 256
OUTPUT_TOKENS = 32
RESERVED = 16  # special tokens at the bottom of the demo vocabulary


@dataclass
class Phase:
    """What one phase sent and got back."""

    name: str
    rate: float
    seconds: float
    outcomes: list[Outcome] = field(default_factory=list)
    answered_at: list[float] = field(default_factory=list)  # monotonic, per outcome

    def summary(self, slo_s: float, client_timeout_s: float) -> dict[str, Any]:
        admitted = [o for o in self.outcomes if o.status == 200]
        within = [o for o in admitted if o.ok and o.first_token_at - o.sent_at <= slo_s]
        refused = [
            (o, at)
            for o, at in zip(self.outcomes, self.answered_at, strict=True)
            if o.status == 429
        ]
        refusal_ms = [(at - o.sent_at) * 1e3 for o, at in refused]
        timeouts = [o for o in self.outcomes if o.status == 0 and "Timeout" in o.error]
        others = Counter(
            str(o.status) if o.status else o.error.split(":")[0]
            for o in self.outcomes
            if o.status not in (200, 429) and o not in timeouts
        )
        admitted_late = [o for o in admitted if o not in within]
        ttfts = [o.first_token_at - o.sent_at for o in admitted if o.first_token_at >= 0]
        return {
            "phase": self.name,
            "rate_rps": round(self.rate, 2),
            "seconds": self.seconds,
            "sent": len(self.outcomes),
            "admitted": len(admitted),
            "admitted_within_slo": len(within),
            "admitted_within_slo_share": len(within) / len(admitted) if admitted else 1.0,
            "admitted_late_or_broken": len(admitted_late),
            "admitted_ttft_p50_s": percentile(ttfts, 50) if ttfts else 0.0,
            "admitted_ttft_p99_s": percentile(ttfts, 99) if ttfts else 0.0,
            "served_within_slo_share_of_all": len(within) / max(1, len(self.outcomes)),
            "refused_429": len(refused),
            "refused_429_with_retry_after": sum(1 for o, _ in refused if o.retry_after_s > 0),
            "refused_429_p50_ms": percentile(refusal_ms, 50) if refusal_ms else 0.0,
            "refused_429_p99_ms": percentile(refusal_ms, 99) if refusal_ms else 0.0,
            "refused_429_max_ms": max(refusal_ms) if refusal_ms else 0.0,
            "client_timeouts": len(timeouts),
            "client_timeout_s": client_timeout_s,
            "other_errors": dict(others),
        }


class Load:
    """Open-loop requests against the Routers, round-robin."""

    def __init__(
        self, http: aiohttp.ClientSession, routers: list[str], key: str, timeout_s: float
    ) -> None:
        self.http = http
        self.routers = routers
        self.key = key
        self.timeout_s = timeout_s
        vocab = PromptTokenizer().vocab_size
        rng = random.Random(7)
        span = vocab - RESERVED
        self.prefixes = [
            [RESERVED + rng.randrange(span) for _ in range(PREFIX_TOKENS)] for _ in range(PREFIXES)
        ]
        self.span = span
        self.sent = 0

    def body(self, i: int) -> dict[str, Any]:
        tail = [RESERVED + (i * 7919 + 104_729 * k) % self.span for k in range(TAIL_TOKENS)]
        return {
            "prompt": self.prefixes[i % PREFIXES] + tail,
            "max_tokens": OUTPUT_TOKENS,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }

    async def one(self, phase: Phase) -> None:
        i = self.sent
        self.sent += 1
        router = self.routers[i % len(self.routers)]
        out = await complete(
            self.http, router, self.body(i), api_key=self.key, session="", timeout_s=self.timeout_s
        )
        phase.outcomes.append(out)
        phase.answered_at.append(time.monotonic())

    async def run(self, phase: Phase, seed: int) -> Phase:
        """Poisson arrivals at `phase.rate` for `phase.seconds`; waits for every answer."""
        rng = random.Random(seed)
        tasks: set[asyncio.Task[None]] = set()
        start = time.monotonic()
        at = 0.0
        while True:
            at += rng.expovariate(phase.rate)
            if at >= phase.seconds:
                break
            delay = start + at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            task = asyncio.create_task(self.one(phase))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.wait(tasks)
        return phase


def minus(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    """What each counter gained (those that did not are left out)."""
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v > before.get(k, 0.0)}


def bucket_quantile(buckets: dict[str, float], name: str, q: float) -> float:
    """The upper bound of the histogram bucket holding quantile `q` (from scraped samples)."""
    pattern = re.compile(rf'^{name}_bucket\{{le="([^"]+)"\}}$')
    cumulative = sorted(
        (float(m.group(1)), count) for key, count in buckets.items() if (m := pattern.match(key))
    )
    if not cumulative or cumulative[-1][1] <= 0:
        return 0.0
    total = cumulative[-1][1]
    return next(le for le, count in cumulative if count >= q * total)


def cpu_s(pids: dict[str, int]) -> dict[str, float]:
    """User plus system CPU seconds each process has used so far."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for name, pid in sorted(pids.items()):
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[name] = (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return out


def rss(pids: dict[str, int]) -> dict[str, float]:
    return {name: round(rss_mb(pid), 1) for name, pid in sorted(pids.items())}


_METRIC = re.compile(r"^(kvsched_\w+?)(?:_total)?(\{[^}]*\})? ([0-9.e+-]+)$")


async def scrape(
    http: aiohttp.ClientSession, urls: list[str], names: tuple[str, ...]
) -> dict[str, float]:
    """The sum over `urls` of each sample whose metric name starts with one of `names`."""
    total: dict[str, float] = {}
    for url in urls:
        async with http.get(f"{url}/metrics") as resp:
            text = await resp.text()
        for line in text.splitlines():
            m = _METRIC.match(line)
            if m and m.group(1).startswith(names) and not m.group(1).endswith("_created"):
                name = m.group(1) + (m.group(2) or "")
                total[name] = total.get(name, 0.0) + float(m.group(3))
    return total


async def capacity(
    load: Load, rates: list[float], step_s: float, slo_s: float, timeout_s: float
) -> tuple[float, list[dict[str, Any]]]:
    """The highest rate of the ramp at which ≥ 99% of all requests were served within the
    SLO (the ramp stops at the first rate below that)."""
    best, steps = rates[0], []
    for k, rate in enumerate(rates):
        phase = await load.run(Phase(f"ramp {rate:g}/s", rate, step_s), seed=100 + k)
        s = phase.summary(slo_s, timeout_s)
        steps.append(s)
        print(
            f"  ramp {rate:6.1f}/s: {s['sent']} sent, {s['admitted']} admitted, "
            f"{s['served_within_slo_share_of_all']:.1%} served within SLO, "
            f"TTFT p99 {s['admitted_ttft_p99_s']:.2f} s",
            flush=True,
        )
        if s["served_within_slo_share_of_all"] < 0.99:
            break
        best = rate
    return best, steps


async def run(args: argparse.Namespace) -> dict[str, Any]:
    scale = args.time_scale
    # The Conductor's objective is in policy seconds: the wall SLO over the time scale.
    os.environ["KVSCHED_CONDUCTOR_TTFT_SLO"] = str(args.ttft_slo / scale)
    with tempfile.TemporaryDirectory(prefix="kvsched-overload-") as tmp:
        run_dir = Path(tmp)
        key = demo_keys(run_dir / "api-keys.json")
        opts = ClusterOptions(routers=2, nodes=1, engines_per_node=2, time_scale=scale)
        plan = plan_cluster(opts, run_dir, run_dir / "api-keys.json", key)
        sup = Supervisor(plan, run_dir / "logs", say=lambda _: None)
        try:
            await sup.start()
            routers = [c.endpoint["url"] for c in plan.stage("router")]
            conductors = [c.endpoint["http_url"] for c in plan.stage("conductor")]
            connector = aiohttp.TCPConnector(limit=0)
            async with aiohttp.ClientSession(connector=connector) as http:
                load = Load(http, routers, key, args.client_timeout)
                await load.run(Phase("warm-up", 2.0, 3.0), seed=1)
                ramp: list[dict[str, Any]] = []
                if args.capacity > 0:  # given: no ramp
                    cap = args.capacity
                else:
                    print(f"capacity ramp ({args.step_seconds:g} s a step):", flush=True)
                    rates = [args.start_rate * 1.25**k for k in range(args.steps)]
                    cap, ramp = await capacity(
                        load, rates, args.step_seconds, args.ttft_slo, args.client_timeout
                    )
                print(f"capacity: {cap:.1f} requests/s", flush=True)
                out: dict[str, Any] = {
                    "time_scale": scale,
                    "ttft_slo_s": args.ttft_slo,
                    "client_timeout_s": args.client_timeout,
                    "prompts": f"synthetic: {PREFIXES} shared {PREFIX_TOKENS}-token prefixes "
                    f"+ a unique {TAIL_TOKENS}-token tail, {OUTPUT_TOKENS} tokens out",
                    "capacity_rps": cap,
                    "ramp": ramp,
                    "phases": [],
                }
                names = ("kvsched_router_shed", "kvsched_router_fallback")
                overhead = ("kvsched_router_overhead_seconds_bucket",)
                for k, factor in enumerate(args.factors):
                    pids = sup.pids()
                    before = rss(pids)
                    cpu0 = cpu_s(pids) | {"bench client": time.process_time()}
                    shed0 = await scrape(http, routers, names)
                    refused0 = await scrape(http, conductors, ("kvsched_conductor_decisions",))
                    overhead0 = await scrape(http, routers, overhead)
                    phase = Phase(f"{factor:g}x", cap * factor, args.seconds)
                    print(f"{phase.name}: {phase.rate:.1f} requests/s for {args.seconds:g} s")
                    await load.run(phase, seed=1000 + k)
                    s = phase.summary(args.ttft_slo, args.client_timeout)
                    s["rss_mb_before"] = before
                    s["rss_mb_after"] = rss(pids)
                    s["machine_load_1m"] = os.getloadavg()[0]  # neighbours' work included
                    cpu1 = cpu_s(pids) | {"bench client": time.process_time()}
                    s["cpu_cores"] = {
                        k: round((v - cpu0.get(k, 0.0)) / phase.seconds, 2) for k, v in cpu1.items()
                    }
                    s["router_counters"] = minus(await scrape(http, routers, names), shed0)
                    refused1 = await scrape(http, conductors, ("kvsched_conductor_decisions",))
                    s["conductor_decisions"] = minus(refused1, refused0)
                    spent = minus(await scrape(http, routers, overhead), overhead0)
                    for q in (50, 99):  # request in to upstream sent, admitted requests
                        key = f"router_overhead_p{q}_s"
                        s[key] = bucket_quantile(spent, "kvsched_router_overhead_seconds", q / 100)
                    out["phases"].append(s)
                if args.stall > 0:
                    out["phases"].append(
                        await stalled(
                            http, load, sup, routers, rate=cap * args.factors[0], args=args
                        )
                    )
            return out
        finally:
            sup.stop()


async def stalled(
    http: aiohttp.ClientSession,
    load: Load,
    sup: Supervisor,
    routers: list[str],
    *,
    rate: float,
    args: argparse.Namespace,
) -> dict[str, Any]:
    """`rate` for `args.stall` + 10 s with the Conductor stopped (SIGSTOP: alive, connected,
    silent) for `args.stall` seconds from the fifth: the slow-Conductor case, where the
    Routers used to decide alone."""
    pids = sup.pids()
    conductor = next(pid for name, pid in pids.items() if name.startswith("conductor"))
    before = rss(pids)
    names = ("kvsched_router_shed", "kvsched_router_fallback")
    counters0 = await scrape(http, routers, names)
    phase = Phase(f"stall {args.stall:g}s", rate, args.stall + 10.0)
    print(f"{phase.name}: {rate:.1f} requests/s, the Conductor stopped {args.stall:g} s from 5 s")

    async def stall() -> None:
        await asyncio.sleep(5.0)
        os.kill(conductor, signal.SIGSTOP)
        try:
            await asyncio.sleep(args.stall)
        finally:
            os.kill(conductor, signal.SIGCONT)

    await asyncio.gather(load.run(phase, seed=2000), stall())
    s = phase.summary(args.ttft_slo, args.client_timeout)
    s["rss_mb_before"] = before
    s["rss_mb_after"] = rss(pids)
    s["machine_load_1m"] = os.getloadavg()[0]
    s["router_counters"] = minus(await scrape(http, routers, names), counters0)
    s["conductor_decisions"] = {}
    return s


def table(out: dict[str, Any]) -> str:
    rows = [
        ("rate (req/s)", "rate_rps", "{:.1f}"),
        ("sent", "sent", "{}"),
        ("admitted", "admitted", "{}"),
        ("admitted within TTFT SLO", "admitted_within_slo_share", "{:.2%}"),
        ("admitted TTFT p50 (s)", "admitted_ttft_p50_s", "{:.2f}"),
        ("admitted TTFT p99 (s)", "admitted_ttft_p99_s", "{:.2f}"),
        ("429", "refused_429", "{}"),
        ("429 with Retry-After", "refused_429_with_retry_after", "{}"),
        ("429 latency p50 (ms)", "refused_429_p50_ms", "{:.1f}"),
        ("429 latency p99 (ms)", "refused_429_p99_ms", "{:.1f}"),
        ("client timeouts", "client_timeouts", "{}"),
        ("machine load average (1 min, at the end)", "machine_load_1m", "{:.1f}"),
        ("Router overhead p99 (s, bucket)", "router_overhead_p99_s", "{:g}"),
        ("other errors", "other_errors", "{}"),
    ]
    phases = out["phases"]
    lines = [
        f"capacity {out['capacity_rps']:.1f} req/s (TTFT SLO {out['ttft_slo_s']:g} s, "
        f"time scale {out['time_scale']:g}; {out['prompts']})",
        "| | " + " | ".join(p["phase"] for p in phases) + " |",
        "|---|" + "---|" * len(phases),
    ]
    for label, k, fmt in rows:
        lines.append(f"| {label} | " + " | ".join(fmt.format(p.get(k, 0)) for p in phases) + " |")
    for p in phases:
        lines.append(f"\n{p['phase']}: Router counters {p['router_counters']}")
        lines.append(f"{p['phase']}: Conductor decisions {p['conductor_decisions']}")
        if "cpu_cores" in p:
            lines.append(f"{p['phase']}: CPU cores used (phase average) {p['cpu_cores']}")
        lines.append(f"{p['phase']}: RSS MB before → after:")
        for name, mb in p["rss_mb_before"].items():
            lines.append(f"  {name:24s} {mb:7.1f} → {p['rss_mb_after'].get(name, 0.0):7.1f}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--seconds", type=float, default=60.0, help="length of each overload phase")
    p.add_argument("--factors", type=float, nargs="+", default=[3.0, 5.0], help="× capacity")
    p.add_argument("--time-scale", type=float, default=20.0, help="engine wall s per model s")
    p.add_argument("--ttft-slo", type=float, default=2.0, help="TTFT objective, wall seconds")
    p.add_argument("--client-timeout", type=float, default=30.0, help="per request, seconds")
    p.add_argument("--start-rate", type=float, default=6.0, help="first rate of the ramp")
    p.add_argument("--steps", type=int, default=8, help="rates in the ramp (×1.25 each)")
    p.add_argument("--capacity", type=float, default=0.0, help="req/s; skips the ramp")
    p.add_argument("--step-seconds", type=float, default=8.0, help="seconds per ramp rate")
    p.add_argument(
        "--stall", type=float, default=1.5, help="seconds the Conductor is stopped (0: skip)"
    )
    p.add_argument("--out", type=Path, default=REPO / "out" / "bench" / "overload.json")
    p.add_argument("--quick", action="store_true", help="short phases (a smoke run)")
    args = p.parse_args()
    if args.quick:
        args.seconds, args.step_seconds, args.steps = 10.0, 4.0, 4
    out = asyncio.run(run(args))
    print(table(out))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
