"""`kvsched bench`: replay a trace slice through live Routers, report it with the simulator's
metrics and keys (`report.json`), and compare with the simulator on the same slice."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from kvsched.core.cluster import SloConfig
from kvsched.core.latency import load_latency
from kvsched.core.models import model_config
from kvsched.core.topology import TopologyConfig
from kvsched.sim.cli import DEFAULT_MODE, add_trace_arguments, load_trace
from kvsched.sim.compare import (
    Comparison,
    config_section,
    replay_config,
    run_comparison,
    trace_section,
)
from kvsched.sim.hardware import HardwareOptions
from kvsched.sim.meters import HotspotMeter
from kvsched.sim.prepare import prepare
from kvsched.sim.progress import ProgressBar
from kvsched.sim.report import markdown_table, write_report
from kvsched.sim.summary import measured_calls
from services.common.inference_api.openai_api import DEFAULT_MODEL, PromptTokenizer
from services.loadgen.driver import Driver, Target, split_routers
from services.loadgen.observe import conductor_migrations, engine_counters, sample_loads
from services.loadgen.report import comparison, comparison_table, live_row


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvsched bench", description=__doc__)
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--endpoints", type=Path, help="endpoints file written by `kvsched up`")
    where.add_argument("--router", help="Router URL(s), comma-separated")
    p.add_argument("--api-key", default="", help="with --router (default: the file's demo key)")
    p.add_argument("--policy", help="with --router: the Conductor's policy, for the comparison")
    p.add_argument("--instances", type=int, help="with --router: engines behind the Routers")
    p.add_argument("--time-scale", type=float, help="with --router: the engines' time scale")
    add_trace_arguments(p)
    p.add_argument("--out", type=Path, help="directory for report.json and table.md")
    p.add_argument("--timeout", type=float, default=600.0, help="per request, wall seconds")
    p.add_argument("--max-in-flight", type=int, default=2048, help="open requests at most")
    p.add_argument("--no-compare", action="store_true", help="skip the simulator run")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return asyncio.run(_bench(args))
    except (ValueError, OSError) as exc:
        print(f"kvsched bench: {exc}", file=sys.stderr)
        return 2


async def _bench(args: argparse.Namespace) -> int:
    ep: dict[str, Any] = {}
    if args.endpoints is not None:
        ep = json.loads(args.endpoints.read_text())
    routers = tuple(r["url"] for r in ep.get("routers", [])) or split_routers(args.router or "")
    engines = [e["url"] for e in ep.get("engines", [])]
    conductors = [c["http_url"] for c in ep.get("conductors", [])]
    policy = ep.get("policy") or args.policy
    n = len(engines) or args.instances
    if not routers or not policy or not n:
        raise ValueError("with --router, also give --policy and --instances")
    trace, fmt = load_trace(args)
    block_size = int(ep.get("block_size", trace.block_tokens))
    if block_size != trace.block_tokens:
        print(
            f"warning: the cluster hashes {block_size}-token blocks, the trace "
            f"{trace.block_tokens}-token ones: APC is not comparable with the simulator",
            file=sys.stderr,
        )
    target = Target(
        routers=tuple(routers),
        api_key=args.api_key or ep.get("api_key", ""),
        model=ep.get("model", DEFAULT_MODEL),
        block_size=trace.block_tokens,
        vocab=PromptTokenizer().vocab_size,
        n_instances=n,
        time_scale=float(ep.get("time_scale") or args.time_scale or 1.0),
        timeout_s=args.timeout,
        max_in_flight=args.max_in_flight,
    )
    mode = args.mode or DEFAULT_MODE[fmt]
    cmp = Comparison(
        trace=trace,
        trace_path=str(args.trace),
        policies=(policy,),
        instances=n,
        seed=args.seed,
        load=args.load,
        closed_loop=mode == "closed",
        slo=SloConfig(args.ttft_slo, args.tpot_slo),
        warmup_fraction=args.warmup,
        **live_cluster_shape(ep),
    )
    config = replay_config(cmp)
    bar = None if args.quiet else ProgressBar()
    driver = Driver(
        trace,
        target,
        closed_loop=cmp.closed_loop,
        load=cmp.load,
        seed=cmp.seed,
        progress=(lambda f: bar(f"live {policy}", f)) if bar else None,
    )
    driver.instances.update({e["id"]: slot for slot, e in enumerate(ep.get("engines", []))})
    started = time.perf_counter()
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as http:
        before = await engine_counters(http, engines)
        migrations_before = await conductor_migrations(http, conductors)
        hotspot = HotspotMeter(n, config.cluster.chunk_tokens)
        stop = asyncio.Event()
        sampler = asyncio.ensure_future(sample_loads(http, engines, hotspot, driver.now, stop))
        run = await driver.run(http)
        stop.set()
        await sampler
        after = await engine_counters(http, engines)
        migrations = await conductor_migrations(http, conductors) - migrations_before
    deltas = [
        {k: (a[k] - b[k]) for k in a} if a is not None and b is not None else None
        for a, b in zip(after, before, strict=True)
    ]
    if not engines:
        hotspot = HotspotMeter(n, config.cluster.chunk_tokens)  # nothing sampled: NaN
        hotspot.queued_known = False
    row = live_row(
        run,
        trace,
        config,
        spec=policy,
        hotspot=hotspot,
        counters=deltas,
        migrations=migrations,
    )
    prepared = prepare(trace, seed=cmp.seed)
    window = measured_calls(trace, config, run.group_start)
    max_len = config.max_model_len or model_config(config.cluster.model).max_model_len
    oversize = np.array([c.input_tokens > max_len for c in trace.calls], dtype=bool)
    report: dict[str, Any] = {
        "trace": trace_section(
            cmp,
            prepared,
            window & ~oversize,
            int((window & oversize).sum()),
            latency=load_latency(config.cluster.latency_profile),
            chunk_tokens=config.cluster.chunk_tokens,
        ),
        "config": {
            **config_section(cmp, config),
            "live": {"routers": list(routers), "time_scale": target.time_scale},
        },
        "wall_seconds": time.perf_counter() - started,
        "simulated_seconds": row["simulated_seconds"],
        "timing": {policy: {"wall_seconds": row.pop("wall_seconds")}},
        "policies": {policy: row},
    }
    print(f"live: {len(routers)} router(s), {n} engines, policy {policy}, mode {mode}")
    print(markdown_table({f"{policy} (live)": row}))
    if not args.no_compare:
        sim = run_comparison(cmp, None, figures=False)["policies"][policy]
        report["simulated"] = {policy: sim}
        report["live_vs_simulated"] = comparison(row, sim)
        print("\nlive against the simulator on the same slice:")
        print(comparison_table(report["live_vs_simulated"]))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        write_report(args.out / "report.json", report)
        print(f"\nreport: {args.out / 'report.json'}")
    failed = row.get("errors", 0)
    return 1 if failed or not math.isfinite(row.get("apc", math.nan)) else 0


def live_cluster_shape(ep: dict[str, Any]) -> dict[str, Any]:
    """What the simulated run takes from the live cluster beyond the trace: the engines'
    model (their KV bytes per token), the latency profile its Conductors price with (its KV
    capacity included) and how many share a node (same-node transfers use the GPUs'
    links)."""
    shape: dict[str, Any] = {}
    hardware = {key: ep[key] for key in ("model_config", "latency_profile") if ep.get(key)}
    if hardware:
        shape["hardware"] = HardwareOptions(**hardware)
    per_node = Counter(e.get("node", "") for e in ep.get("engines", []))
    if per_node:
        shape["topology"] = TopologyConfig(instances_per_node=max(per_node.values()))
    return shape


if __name__ == "__main__":
    sys.exit(main())
