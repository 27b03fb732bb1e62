"""Sweep the node KV pool's DRAM tier size: `kvsched replay` once per size, the same trace,
policies and seed, and one table and figure of APC and TTFT p90 against the size.

    python -m tools.tier_sweep --trace ../shared/traces/conversation_trace.jsonl \
        [--policies cache_aware,mooncake,elastic] [--sizes 0,1,2,4,8] [--instances 8] \
        [--out out/tier_sweep]

Writes `sweep.json` (each size's `policies` rows and `config.tier`), `sweep.md` (the table of
docs/evaluation.md, "Node KV pool") and `tier_sweep.png` into `--out`.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from kvsched.sim.compare import Comparison, expand_policies, run_comparison
from kvsched.sim.tiers import TierConfig, TierSize
from kvsched.sim.traces import transform


def sweep(
    trace_path: Path, policies: tuple[str, ...], sizes: Sequence[float], instances: int
) -> dict[str, Any]:
    """{size: {"tier": config.tier, "policies": rows}} for each DRAM tier size."""
    fmt = transform.detect_format(trace_path)
    if fmt == "weka":  # closed loop, scaled tokens: `kvsched replay --dram-tier` has the options
        raise ValueError("tier_sweep replays open-loop traces (mooncake, azure), not weka")
    trace = transform.load(trace_path, fmt)
    out: dict[str, Any] = {}
    for size in sizes:
        cmp = Comparison(
            trace=trace,
            trace_path=str(trace_path),
            policies=policies,
            instances=instances,
            tier=TierConfig(dram=TierSize(factor=size)),
        )
        report = run_comparison(cmp, None, figures=False)
        out[f"{size:g}"] = {"tier": report["config"]["tier"], "policies": report["policies"]}
    return out


def table(result: dict[str, Any]) -> str:
    lines = [
        "| DRAM tier | policy | APC | APC load | TTFT p50 | TTFT p90 | TTFT p99 | SLO att. |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for size, run in result.items():
        for spec, row in run["policies"].items():
            lines.append(
                f"| {size}× | {spec} | {row['apc']:.3f} | {row.get('apc_load', 0.0):.3f} | "
                f"{row['ttft_p50']:.3f} | {row['ttft_p90']:.3f} | {row['ttft_p99']:.2f} | "
                f"{row['slo_attainment']:.3f} |"
            )
    return "\n".join(lines)


def figure(result: dict[str, Any], path: Path, title: str) -> None:
    sizes = [float(s) for s in result]
    specs = list(next(iter(result.values()))["policies"])
    fig, (apc, ttft) = plt.subplots(1, 2, figsize=(10, 4))
    for spec in specs:
        rows = [run["policies"][spec] for run in result.values()]
        apc.plot(sizes, [r["apc"] for r in rows], marker="o", label=spec)
        ttft.plot(sizes, [r["ttft_p90"] for r in rows], marker="o", label=spec)
    apc.set(xlabel="DRAM tier (× the node's GPU KV)", ylabel="APC", title="prefix reuse")
    ttft.set(xlabel="DRAM tier (× the node's GPU KV)", ylabel="TTFT p90 (s)", title="TTFT p90")
    apc.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", type=Path, required=True)
    parser.add_argument("--policies", default="cache_aware,mooncake,elastic")
    parser.add_argument("--sizes", default="0,1,2,4,8", help="DRAM tier sizes (× GPU KV)")
    parser.add_argument("--instances", type=int, default=8)
    parser.add_argument("--out", type=Path, default=Path("out/tier_sweep"))
    args = parser.parse_args(argv)
    try:
        sizes = [float(s) for s in args.sizes.split(",") if s.strip()]
        if not sizes or min(sizes) < 0:
            raise ValueError("--sizes takes non-negative multiples, e.g. 0,1,2,4,8")
        policies = expand_policies(args.policies)
        result = sweep(args.trace, policies, sizes, args.instances)
    except (ValueError, OSError) as exc:
        parser.exit(2, f"tier_sweep: error: {exc}\n")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sweep.json").write_text(json.dumps(result, indent=1), encoding="utf-8")
    (args.out / "sweep.md").write_text(table(result) + "\n", encoding="utf-8")
    title = f"{args.trace.name}, {args.instances} instances: DRAM tier size"
    figure(result, args.out / "tier_sweep.png", title)
    print(table(result))
    print(f"\n{args.out / 'tier_sweep.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
