"""The live replay's report: the same metrics, computed by the same code, as `kvsched replay`
(`kvsched.sim.summary.summarize`), next to the simulator's run of the same slice."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from kvsched.core.cluster import build_cluster
from kvsched.core.policies import POLICIES, parse_spec
from kvsched.sim.engine import Engine
from kvsched.sim.engine_state import EngineSpec
from kvsched.sim.meters import HotspotMeter
from kvsched.sim.migrations import MigrationLog
from kvsched.sim.records import ReplayConfig, ReplayResult
from kvsched.sim.summary import summarize
from kvsched.sim.traces.model import Trace
from services.loadgen.driver import LiveRun
from services.loadgen.observe import ENGINE_COUNTERS

# Compared side by side: (key, format).
COMPARED = (
    ("completed", "{:.0f}"),
    ("rejected", "{:.0f}"),
    ("apc", "{:.3f}"),
    ("apc_local", "{:.3f}"),
    ("migrations", "{:.0f}"),
    ("ttft_p50", "{:.3f}"),
    ("ttft_p90", "{:.3f}"),
    ("tpot_p50", "{:.4f}"),
    ("tpot_p90", "{:.4f}"),
    ("e2e_p50", "{:.2f}"),
    ("hotspot_index", "{:.3f}"),
    ("hotspot_pmr", "{:.2f}"),
)


def live_row(
    run: LiveRun,
    trace: Trace,
    config: ReplayConfig,
    *,
    spec: str,
    hotspot: HotspotMeter,
    counters: Sequence[Mapping[str, float] | None],
    migrations: float,
) -> dict[str, Any]:
    """The policy's row, as `summarize` makes it for a simulated replay. Engine counters are
    the live engines' own (deltas over the run); NaN where an engine did not report them."""
    name, params = parse_spec(spec)
    cluster_cfg = replace(
        config.cluster,
        block_size=trace.block_tokens,
        roles=POLICIES[name].roles(config.cluster.n_instances, params),
    )
    cluster = build_cluster(cluster_cfg)
    engine_spec = EngineSpec(
        block_size=trace.block_tokens,
        capacity_pages=cluster.capacity_blocks,
        chunk_tokens=cluster_cfg.chunk_tokens,
        max_running=cluster_cfg.max_running,
        layers=cluster.cost.model.layers,
    )
    engines = []
    for slot in range(cluster_cfg.n_instances):
        engine = Engine(slot, engine_spec, cluster.cost.latency)
        got = counters[slot] if slot < len(counters) else None
        for key in ENGINE_COUNTERS:
            value = got[key] if got is not None else math.nan
            setattr(engine, key, value)
        engines.append(engine)
    log = MigrationLog()
    log.count = int(migrations) if math.isfinite(migrations) else 0
    result = ReplayResult(
        reqs=run.reqs,
        cluster=cluster,
        engines=engines,
        hotspot=hotspot,
        gaps=run.gaps,
        migrations=log,
        transfers={},
        group_start=run.group_start,
        end_time=run.end_time,
        events=0,
        wall_s=run.wall_s,
    )
    row = summarize(result, trace, config)
    row.pop("events")
    row["errors"] = sum(1 for o in run.outcomes if o is not None and o.status not in (200, 429))
    return row


def comparison(live: Mapping[str, Any], sim: Mapping[str, Any]) -> dict[str, dict[str, float]]:
    out = {}
    for key, _ in COMPARED:
        a, b = float(live.get(key, math.nan)), float(sim.get(key, math.nan))
        ratio = a / b if b and math.isfinite(a) and math.isfinite(b) else math.nan
        out[key] = {"live": a, "simulated": b, "live_over_simulated": ratio}
    return out


def comparison_table(rows: Mapping[str, Mapping[str, float]]) -> str:
    lines = ["| metric | live | simulated | live / sim |", "|---|---:|---:|---:|"]
    for key, fmt in COMPARED:
        row = rows[key]
        cells = [_fmt(fmt, row["live"]), _fmt(fmt, row["simulated"])]
        cells.append(_fmt("{:.2f}", row["live_over_simulated"]))
        lines.append(f"| {key} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _fmt(fmt: str, value: float) -> str:
    return fmt.format(value) if math.isfinite(value) else "–"
