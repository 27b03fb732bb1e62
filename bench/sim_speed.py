"""Simulator speed: simulated seconds per wall second, per policy.

Replays the Mooncake conversation trace (the whole public file when ../shared is beside the
repository, else the shipped 3,000-row slice) on 8 simulated instances, open loop, load 1.
The baseline measured in the same run is `round_robin` (the cheapest placement): each policy's
speed is printed as absolute simulated/wall seconds and as a ratio to that baseline.

    .venv/bin/python -m bench.sim_speed [--repeats 3] [--policies all]
"""

from __future__ import annotations

import argparse
import time

from bench.common import REPO, SHARED
from kvsched.core.cluster import ClusterConfig
from kvsched.sim.compare import expand_policies
from kvsched.sim.prepare import prepare
from kvsched.sim.records import ReplayConfig
from kvsched.sim.replay import run_replay
from kvsched.sim.traces import transform

GOAL = 1000.0


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--policies", default="all")
    parser.add_argument("--instances", type=int, default=8)
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
    print(f"{'policy':<14} {'simulated s':>12} {'wall s':>8} {'sim/wall':>9} {'vs rr':>8}")
    speeds: dict[str, float] = {}
    for spec in specs:
        runs = [run_replay(prepared, spec, config) for _ in range(args.repeats)]
        wall = sorted(r.wall_s for r in runs)[len(runs) // 2]
        simulated = runs[0].end_time
        speeds[spec] = simulated / wall
        ratio = speeds[spec] / speeds["round_robin"]
        print(f"{spec:<14} {simulated:>12.0f} {wall:>8.2f} {speeds[spec]:>8.0f}x {ratio:>7.2f}x")
    worst = min(speeds.values())
    verdict = "meets" if worst >= GOAL else "misses"
    print(
        f"slowest policy {worst:.0f}x simulated/wall: {verdict} the {GOAL:.0f}x goal "
        f"(median of {args.repeats} runs each)"
    )
    print("reproduce: .venv/bin/python -m bench.sim_speed")


if __name__ == "__main__":
    main()
