"""Simulator speed: simulated seconds per wall second, per policy.

Replays the Mooncake conversation trace (the whole public file when ../shared is beside the
repository, else the shipped 3,000-row slice) on 8 simulated instances, open loop, load 1.
Two baselines are measured in the same run: `round_robin` (the cheapest placement), and each
policy on the references of the compiled parts (the pure-Python prefix index, numpy scoring
and the Python engine cache: `ReplayConfig.pure`) beside its compiled ones (the default);
each policy's speed is printed as absolute simulated/wall seconds (compiled) and as ratios to
both. `--pure` runs the references only.

    .venv/bin/python -m bench.sim_speed [--repeats 3] [--policies all] [--pure]
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

from bench.common import REPO, SHARED
from kvsched.core.cluster import ClusterConfig
from kvsched.sim.compare import expand_policies
from kvsched.sim.prepare import PreparedTrace, prepare
from kvsched.sim.records import ReplayConfig
from kvsched.sim.replay import run_replay
from kvsched.sim.traces import transform

GOAL = 2000.0  # issue 16: simulated seconds per wall second, every policy


def speed(
    prepared: PreparedTrace, spec: str, config: ReplayConfig, repeats: int, pure: bool
) -> tuple[float, float, float]:
    """Simulated seconds per wall second (median of `repeats` runs) and the simulated span."""
    config = replace(config, pure=pure)
    runs = [run_replay(prepared, spec, config) for _ in range(repeats)]
    wall = sorted(r.wall_s for r in runs)[len(runs) // 2]
    return runs[0].end_time / wall, runs[0].end_time, wall


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--policies", default="all")
    parser.add_argument("--instances", type=int, default=8)
    parser.add_argument("--pure", action="store_true", help="the core's references only")
    args = parser.parse_args()
    full = SHARED / "traces" / "conversation_trace.jsonl"
    path = full if full.exists() else REPO / "data" / "traces" / "mooncake_conversation_head.jsonl"
    started = time.perf_counter()
    prepared = prepare(transform.load(path))
    prep_s = time.perf_counter() - started
    config = ReplayConfig(ClusterConfig(n_instances=args.instances), seed=0)
    specs = expand_policies(args.policies)
    if "round_robin" not in specs:
        specs = ("round_robin", *specs)
    print(f"trace {path.name}: {len(prepared.trace.calls)} calls, prepared in {prep_s:.2f} s")
    print(
        f"{'policy':<14} {'simulated s':>12} {'wall s':>8} {'sim/wall':>9} {'vs rr':>8}"
        + ("" if args.pure else f" {'pure s/w':>9} {'vs pure':>8}")
    )
    speeds: dict[str, float] = {}
    for spec in specs:
        fast, simulated, wall = speed(prepared, spec, config, args.repeats, pure=args.pure)
        speeds[spec] = fast
        ratio = fast / speeds["round_robin"]
        text = f"{spec:<14} {simulated:>12.0f} {wall:>8.2f} {fast:>8.0f}x {ratio:>7.2f}x"
        if not args.pure:
            pure, _, _ = speed(prepared, spec, config, args.repeats, pure=True)
            text += f" {pure:>8.0f}x {fast / pure:>7.2f}x"
        print(text)
    worst = min(speeds.values())
    verdict = "meets" if worst >= GOAL else "misses"
    print(
        f"slowest policy {worst:.0f}x simulated/wall: {verdict} the {GOAL:.0f}x goal "
        f"(median of {args.repeats} runs each)"
    )
    print("reproduce: .venv/bin/python -m bench.sim_speed")


if __name__ == "__main__":
    main()
