"""Placement-decision time of two checkouts (a change and what it changes), in one run.

`bench.placement`'s cluster (64 instances, 1M indexed blocks, 32K-token prompts, the compiled
index and scoring) and prompts, built by each checkout's own code in a child process: each
round the child makes `--decisions` decisions (`recording.place`, one policy) on a fresh
cluster, `--passes` times over, and keeps each decision's fastest pass (the machine's other
work lands on a few passes, not on all). The two checkouts take turns round by round (the
order reversed every round). Printed per checkout: the median over rounds of the p50 of those
per-decision times, and this checkout's ratio to the other's. Both checkouts must have the
compiled extensions built in place; both must decide alike (the bench fails otherwise).

    .venv/bin/python -m bench.placement_checkouts ../main [--rounds 3] [--policy elastic]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from bench.common import REPO

# Run inside a checkout: only bench.placement's long-standing entry points, so an older
# checkout runs it too. Prints one JSON line.
CHILD = """
import gc, inspect, json, random, statistics, sys, time
import bench.placement as placement
from bench.placement import build, requests
from kvsched.core import recording
spec, count, passes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
# Compiled index and scoring: the last build where build() takes one, else pure=False (and the
# environment below) in the checkouts from before the core read no environment.
takes_build = list(inspect.signature(build).parameters)[2] == "build_"
compiled = placement.BUILDS[-1] if takes_build else False
best, decided = None, None
for _ in range(passes):
    rng = random.Random(1)
    cluster, policy, chains = build(spec, rng, compiled)
    reqs = requests(chains, count, rng)
    play = random.Random(2)
    gc.collect()
    gc.freeze()
    times, made = [], []
    for i, req in enumerate(reqs):
        t = time.perf_counter()
        decision = recording.place(cluster, policy, req, i * 0.01, play)
        times.append(time.perf_counter() - t)
        made.append((decision.instance, decision.rule, repr(decision.estimated_ttft_s)))
    gc.unfreeze()
    best = times if best is None else list(map(min, best, times))
    decided = made
print(json.dumps({"p50": statistics.median(best), "decided": decided}))
"""


def run_round(checkout: Path, spec: str, decisions: int, passes: int) -> tuple[float, list[str]]:
    """One round in `checkout`'s code: (p50 of the per-decision fastest times, decisions)."""
    env = {**os.environ, "PYTHONPATH": str(checkout), "KVSCHED_PURE_INDEX": "0"}
    env.pop("KVSCHED_PURE_SCORING", None)
    done = subprocess.run(
        [sys.executable, "-c", CHILD, spec, str(decisions), str(passes)],
        check=False,
        cwd=checkout,
        env=env,
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise RuntimeError(f"the decisions in {checkout} failed:\n{done.stderr[-2000:]}")
    row = json.loads(done.stdout.strip().splitlines()[-1])
    return float(row["p50"]), [json.dumps(d) for d in row["decided"]]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("base", type=Path, help="the other checkout (e.g. ../main)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--policy", default="elastic")
    parser.add_argument("--decisions", type=int, default=800)
    parser.add_argument("--passes", type=int, default=5)
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.decisions < 1 or args.passes < 1:
        parser.error("--rounds, --decisions and --passes must be at least 1")
    checkouts = {"this": REPO, "base": args.base.resolve()}
    p50s: dict[str, list[float]] = {name: [] for name in checkouts}
    decided: dict[str, list[str]] = {}
    for k in range(args.rounds):
        order = list(checkouts) if k % 2 == 0 else list(reversed(checkouts))
        for name in order:
            p50, made = run_round(checkouts[name], args.policy, args.decisions, args.passes)
            p50s[name].append(p50)
            decided[name] = made
    if decided["this"] != decided["base"]:
        raise SystemExit(f"{args.policy}: the two checkouts decided differently")
    this, base = (statistics.median(p50s[name]) for name in ("this", "base"))
    print(
        f"{args.policy}, {args.decisions} decisions, fastest of {args.passes} passes each, "
        f"median of {args.rounds} rounds (ms per decision, p50)"
    )
    print(f"this checkout ({REPO.name}) {this * 1e3:.4f}")
    print(f"base ({checkouts['base']}) {base * 1e3:.4f}")
    print(f"this / base {this / base:.3f}")
    print(f"reproduce: .venv/bin/python -m bench.placement_checkouts {args.base}")


if __name__ == "__main__":
    main()
