"""Simulator speed of two checkouts (a change and what it changes), in one run.

`bench.sim_speed`'s replay (the Mooncake conversation trace, whole when ../shared is beside
the repository, 8 instances, open loop, load 1, the compiled index) run by each checkout's
own code in a fresh child process for each policy (nothing one replay leaves on the heap
slows the next), the two taking turns policy by policy (the order reversed every round) so
that both see the same machine; each policy's speed is the median over the rounds, given as
simulated seconds per wall second for each checkout and as this checkout's ratio to the
other's, and the same per CPU second the replay used (steadier when other work shares the
machine). Both checkouts must have the compiled index built in place.

    .venv/bin/python -m bench.sim_checkouts ../main [--rounds 3] [--policies all]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from bench.common import REPO, SHARED
from bench.sim_speed import GOAL
from kvsched.sim.compare import expand_policies

# Run inside a checkout: only the replay's long-standing entry points, so an older
# checkout runs it too. Prints one JSON line per policy.
CHILD = """
import json, sys, time
from kvsched.core.cluster import ClusterConfig
from kvsched.sim.prepare import prepare
from kvsched.sim.records import ReplayConfig
from kvsched.sim.replay import run_replay
from kvsched.sim.traces import transform
path, instances, specs = sys.argv[1], int(sys.argv[2]), sys.argv[3].split(",")
prepared = prepare(transform.load(path))
config = ReplayConfig(ClusterConfig(n_instances=instances), seed=0)
for spec in specs:
    cpu = time.process_time()
    result = run_replay(prepared, spec, config)
    cpu = time.process_time() - cpu
    row = {"spec": spec, "simulated": result.end_time, "wall": result.wall_s, "cpu": cpu}
    print(json.dumps(row))
"""


def run_round(
    checkout: Path, trace: Path, instances: int, specs: tuple[str, ...]
) -> dict[str, tuple[float, float, float]]:
    """One replay of every policy in `checkout`'s code: {spec: (simulated s, wall s, CPU s)}."""
    env = {
        **os.environ,
        "PYTHONPATH": str(checkout),
        "KVSCHED_PURE_INDEX": "0",
        "KVSCHED_PURE_SIMCACHE": "0",
    }
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(trace), str(instances), ",".join(specs)],
        check=False,
        cwd=checkout,
        env=env,
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise RuntimeError(f"the replay in {checkout} failed:\n{done.stderr[-2000:]}")
    out = done.stdout
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return {r["spec"]: (r["simulated"], r["wall"], r["cpu"]) for r in rows}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("base", type=Path, help="the other checkout (e.g. ../main)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--policies", default="all")
    parser.add_argument("--instances", type=int, default=8)
    args = parser.parse_args()
    full = SHARED / "traces" / "conversation_trace.jsonl"
    trace = full if full.exists() else REPO / "data" / "traces" / "mooncake_conversation_head.jsonl"
    specs = expand_policies(args.policies)
    checkouts = {"base": args.base.resolve(), "this": REPO}
    walls: dict[tuple[str, str], list[float]] = {}
    cpus: dict[tuple[str, str], list[float]] = {}
    simulated: dict[tuple[str, str], float] = {}
    for r in range(args.rounds):
        order = ("base", "this") if r % 2 == 0 else ("this", "base")
        for spec in specs:
            for name in order:
                [(sim_s, wall_s, cpu_s)] = run_round(
                    checkouts[name], trace, args.instances, (spec,)
                ).values()
                walls.setdefault((name, spec), []).append(wall_s)
                cpus.setdefault((name, spec), []).append(cpu_s)
                simulated[(name, spec)] = sim_s
    print(f"trace {trace.name}, {args.rounds} rounds; base {checkouts['base']}")
    print(
        f"{'policy':<14} {'simulated s':>12} {'base s/w':>9} {'this s/w':>9} {'this/base':>10}"
        f" {'base s/cpu':>11} {'this s/cpu':>11} {'this/base':>10}"
    )
    worst = float("inf")
    for spec in specs:
        span = simulated[("this", spec)]
        base = simulated[("base", spec)] / statistics.median(walls[("base", spec)])
        this = span / statistics.median(walls[("this", spec)])
        # CPU seconds: what the replay itself used, steadier than wall time on a busy machine.
        base_cpu = simulated[("base", spec)] / statistics.median(cpus[("base", spec)])
        this_cpu = span / statistics.median(cpus[("this", spec)])
        worst = min(worst, this)
        # The same replay simulates the same span: a difference means behaviour changed.
        same = "" if simulated[("base", spec)] == span else "  simulated span differs"
        print(
            f"{spec:<14} {span:>12.0f} {base:>8.0f}x {this:>8.0f}x {this / base:>9.2f}x"
            f" {base_cpu:>10.0f}x {this_cpu:>10.0f}x {this_cpu / base_cpu:>9.2f}x{same}"
        )
    verdict = "meets" if worst >= GOAL else "misses"
    print(f"slowest policy here {worst:.0f}x simulated/wall: {verdict} the {GOAL:.0f}x goal")
    print("reproduce: .venv/bin/python -m bench.sim_checkouts ../main")


if __name__ == "__main__":
    main()
