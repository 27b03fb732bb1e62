"""Run several policies on one trace and assemble the report (table, JSON, figures)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from kvsched.core.cluster import ClusterConfig, SloConfig
from kvsched.core.latency import LatencyModel, load_latency
from kvsched.core.models import model_config
from kvsched.core.policies import ALL_POLICIES, parse_spec
from kvsched.core.topology import DISTANCE_NAMES, TopologyConfig
from kvsched.sim.hardware import HardwareOptions
from kvsched.sim.prepare import PreparedTrace, prepare
from kvsched.sim.records import ReplayConfig, ReplayResult
from kvsched.sim.replay import run_replay
from kvsched.sim.report import markdown_table, write_report
from kvsched.sim.summary import measured_calls, summarize
from kvsched.sim.sweep import SweepPlan, sweep_goodput
from kvsched.sim.tiers import TierConfig
from kvsched.sim.traces import ceiling
from kvsched.sim.traces.model import Trace


@dataclass(frozen=True)
class Comparison:
    """One comparison run: which trace (already loaded and scaled), which policies, how."""

    trace: Trace
    trace_path: str
    policies: tuple[str, ...]
    instances: int
    seed: int = 0
    load: float = 1.0
    closed_loop: bool = False
    slo: SloConfig = field(default_factory=SloConfig)
    topology: TopologyConfig = field(default_factory=TopologyConfig)
    warmup_fraction: float = 0.05
    hardware: HardwareOptions = field(default_factory=HardwareOptions)  # model, GPU, KV, links
    sweep_loads: tuple[float, ...] = ()  # loads to sweep for goodput (besides `load`)
    tier: TierConfig = field(default_factory=TierConfig)  # the node KV pool (off by default)
    repeat: int = 1  # closed loop: copies of each session in `trace` (--repeat)
    # Closed loop: the trace with k copies of each session; given, the sweep scales the copies
    # with the load so the sessions' start window keeps its length (kvsched.sim.sweep).
    sweep_repeat_trace: Callable[[int], Trace] | None = None
    pure: bool = False  # the references of the compiled parts (`ReplayConfig.pure`)


def expand_policies(text: str) -> tuple[str, ...]:
    """`all` or a comma-separated list of policy specs (each validated)."""
    if text.strip() == "all":
        return ALL_POLICIES
    specs = tuple(p.strip() for p in _split_specs(text) if p.strip())
    for spec in specs:
        parse_spec(spec)
    if not specs:
        raise ValueError("no policy named")
    return specs


def _split_specs(text: str) -> list[str]:
    """Split on commas that start a new policy name (`a,b:x=1,y=2,c` → a | b:x=1,y=2 | c)."""
    parts: list[str] = []
    for item in text.split(","):
        if parts and ":" in parts[-1] and "=" in item and ":" not in item:
            parts[-1] += "," + item
        else:
            parts.append(item)
    return parts


def replay_config(cmp: Comparison) -> ReplayConfig:
    cluster = ClusterConfig(
        n_instances=cmp.instances,
        latency_profile=cmp.hardware.latency_profile,
        model=cmp.hardware.model_config,
        kv_capacity_tokens=cmp.hardware.capacity_tokens(),
        slo=cmp.slo,
        topology=cmp.hardware.topology(cmp.topology),
        block_size=cmp.trace.block_tokens,
        pool_link=cmp.tier.pool_link(),  # the policies price a load as the engines pay it
    )
    return ReplayConfig(
        cluster=cluster,
        max_model_len=cmp.hardware.max_model_len,
        seed=cmp.seed,
        load=cmp.load,
        closed_loop=cmp.closed_loop,
        warmup_fraction=cmp.warmup_fraction,
        tier=cmp.tier,
        pure=cmp.pure,
    )


def run_comparison(
    cmp: Comparison,
    out: Path | None,
    *,
    figures: bool = True,
    stream: TextIO | None = None,
    progress: Callable[[str, float], None] | None = None,
) -> dict[str, Any]:
    """Replay every policy, print the table to `stream`, write `report.json` and figures
    into `out` (when given). Returns the report."""
    started = time.perf_counter()
    prepared = prepare(cmp.trace, seed=cmp.seed)
    config = replay_config(cmp)
    rows: dict[str, dict[str, Any]] = {}
    results: dict[str, ReplayResult] = {}
    ttfts: dict[str, np.ndarray] = {}
    timing: dict[str, dict[str, float]] = {}
    for spec in cmp.policies:
        tick = (lambda frac, s=spec: progress(s, frac)) if progress else None
        result = run_replay(prepared, spec, config, tick)
        row = summarize(result, cmp.trace, config)
        timing[spec] = {
            "wall_seconds": row.pop("wall_seconds"),
            "simulated_seconds": row["simulated_seconds"],
            "events": row.pop("events"),
        }
        rows[spec] = row
        results[spec] = result
        if progress is not None:
            progress(spec, 1.0)
        ttfts[spec] = _ttfts(result, cmp.trace, config)
    goodput: dict[str, Any] = {}
    if cmp.sweep_loads:
        plan = SweepPlan.of(
            cmp.sweep_loads, cmp.load, cmp.repeat, scale_repeat=cmp.sweep_repeat_trace is not None
        )
        goodput = sweep_goodput(
            plan,
            cmp.policies,
            config,
            (cmp.trace, prepared),
            rows,
            repeat_trace=cmp.sweep_repeat_trace,
            progress=progress,
            checkpoint=partial_writer(out),
        )
    first = next(iter(results.values()))
    window = measured_calls(cmp.trace, config, first.group_start)
    # Prompts longer than the model's context are refused by every policy alike: the ceilings
    # leave them out, as the served APC does.
    max_len = config.max_model_len or first.cluster.cost.model.max_model_len
    oversize = np.array([c.input_tokens > max_len for c in cmp.trace.calls], dtype=bool)
    report = {
        "trace": trace_section(
            cmp,
            prepared,
            window & ~oversize,
            int((window & oversize).sum()),
            latency=first.cluster.cost.latency,
            chunk_tokens=config.cluster.chunk_tokens,
        ),
        "config": config_section(cmp, config),
        "wall_seconds": time.perf_counter() - started,
        "simulated_seconds": sum(t["simulated_seconds"] for t in timing.values()),
        "timing": timing,
        "policies": rows,
    }
    if goodput:
        report["goodput"] = goodput
    table = markdown_table(rows)
    if stream is not None:
        print(_headline(cmp), file=stream)
        print(table, file=stream)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        write_report(out / "report.json", report)
        (out / PARTIAL_SWEEP).unlink(missing_ok=True)
        (out / "table.md").write_text(_headline(cmp) + "\n\n" + table + "\n", encoding="utf-8")
        if figures:
            try:  # matplotlib is the `figures` extra: without it the report is all there is
                from kvsched.sim.figures import write_figures  # noqa: PLC0415
            except ImportError:
                print(NO_FIGURES, file=sys.stderr)
            else:
                write_figures(out, rows, results, ttfts, _headline(cmp), goodput=goodput)
        if stream is not None:
            print(f"\nreport: {out / 'report.json'}  figures: {out}", file=stream)
    return report


PARTIAL_SWEEP = "goodput.partial.json"
NO_FIGURES = "figures left out: they need matplotlib (pip install 'kvsched[figures]')"


def partial_writer(out: Path | None) -> Callable[[dict[str, Any]], None] | None:
    """Writes the sweep so far to `out/goodput.partial.json` after each load (a long sweep
    can be read before it ends); the finished report replaces it."""
    if out is None:
        return None

    def write(section: dict[str, Any]) -> None:
        out.mkdir(parents=True, exist_ok=True)
        write_report(out / PARTIAL_SWEEP, section)

    return write


def _headline(cmp: Comparison) -> str:
    mode = "closed loop" if cmp.closed_loop else "open loop"
    tier = ""
    if cmp.tier.on:
        tier = f", DRAM tier {cmp.tier.dram.describe()}"
        if cmp.tier.ssd.on:
            tier += f", SSD tier {cmp.tier.ssd.describe()}"
    return (
        f"{Path(cmp.trace_path).name}: {len(cmp.trace.calls)} calls, {cmp.instances} instances, "
        f"{mode}, load {cmp.load:g}, seed {cmp.seed}{tier}"
    )


def _ttfts(result: ReplayResult, trace: Trace, config: ReplayConfig) -> np.ndarray:
    measured = measured_calls(trace, config, result.group_start)
    return np.array(
        [
            r.first_token_at - r.arrival
            for r, m in zip(result.reqs, measured, strict=True)
            if m and r.first_token_at >= 0 and not r.rejected
        ]
    )


def trace_section(
    cmp: Comparison,
    prepared: PreparedTrace,
    window: np.ndarray,
    oversize: int,
    *,
    latency: LatencyModel,
    chunk_tokens: int,
) -> dict[str, Any]:
    """Facts of the replayed trace; the APC ceilings and the TTFT floor (on `latency`, in
    passes of `chunk_tokens`) are over the measurement window (the `_all` ceilings over every
    call)."""
    trace = cmp.trace
    sessions = {c.session for c in trace.calls if c.session}
    groups = {c.group for c in trace.calls if c.group}
    return {
        "path": cmp.trace_path,
        "name": trace.name,
        "format": trace.format,
        "calls": len(trace.calls),
        "sessions": len(sessions),
        "groups": len(groups),
        "block_tokens": trace.block_tokens,
        "span_s": trace.span_s,
        "prompt_tokens": int(sum(c.input_tokens for c in trace.calls)),
        "output_tokens": int(sum(c.output_tokens for c in trace.calls)),
        "measured_calls": int(window.sum()),
        "oversize_calls": oversize,
        "ideal_apc_global": ceiling.ideal_apc(trace, scope="global", window=list(window)),
        "ideal_apc_session": ceiling.ideal_apc(trace, scope="session", window=list(window)),
        "ideal_apc_global_all": ceiling.ideal_apc(trace, scope="global"),
        "ideal_apc_session_all": ceiling.ideal_apc(trace, scope="session"),
        "ttft_floor": ceiling.ttft_floor(trace, latency, chunk_tokens, window),
        "distinct_blocks": len({h for chain in prepared.hashes for h in chain}),
        "notes": dict(trace.notes),
    }


def config_section(cmp: Comparison, config: ReplayConfig) -> dict[str, Any]:
    cluster = config.cluster
    latency = load_latency(cluster.latency_profile)
    model = model_config(cluster.model)
    links = {
        name: {
            "bandwidth_gb_per_s": link.bandwidth_bytes_per_s / 1e9,
            "setup_ms": link.setup_s * 1e3,
        }
        for name, link in zip(DISTANCE_NAMES, cluster.topology.links, strict=True)
    }
    return {
        "policies": list(cmp.policies),
        "instances": cmp.instances,
        "seed": cmp.seed,
        "load": cmp.load,
        "mode": "closed" if cmp.closed_loop else "open",
        "warmup_fraction": cmp.warmup_fraction,
        "slo": asdict(cmp.slo),
        "model": model.name,
        "kv_bytes_per_token": model.kv_bytes_per_token,
        "max_model_len": config.max_model_len or model.max_model_len,
        "gpu": latency.gpu,
        "latency_profile": asdict(latency),
        "kv_capacity_tokens": cluster.kv_capacity_tokens or latency.kv_capacity_tokens,
        "block_size": cluster.block_size,
        "chunk_tokens": cluster.chunk_tokens,
        "max_running": cluster.max_running,
        "speculative_ttl_s": cluster.speculative_ttl_s,
        "topology": {
            "instances_per_node": cluster.topology.instances_per_node,
            "nodes_per_rack": cluster.topology.nodes_per_rack,
            "racks_per_spine": cluster.topology.racks_per_spine,
            "links": links,
        },
        "hardware": cmp.hardware.record(),
        "tier": cmp.tier.record(),
    }
