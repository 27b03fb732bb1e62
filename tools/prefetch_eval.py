"""Idle-gap prefetch on an agentic trace: TTFT of the turns that follow a long idle gap, per
policy, with the node's DRAM tier on (docs/evaluation.md, "Idle-gap prefetch").

    python -m tools.prefetch_eval replay --trace ../shared/traces/weka_cc_agentic/\
weka_cc_agentic_calls.jsonl.xz --sessions 0:60 --token-scale 1.0 --max-gap 300 \
        --dram-tier 4 --kv-capacity 200000 --load 16 \
        --policies elastic:prefetch=1,elastic,ear,cache_aware [--long-gap 30]

Takes `kvsched replay`'s flags (trace, hardware, tier, policies, load, seed), replays each policy
once and prints one markdown row per policy: TTFT p50/p90/p99 over all measured turns and over
the measured turns whose recorded gap before them exceeds `--long-gap` seconds (a closed-loop
turn after a tool call or a human pause), the share of those turns' prompt tokens loaded from
the tier, and the prefetches' outcomes.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import numpy as np

from kvsched.sim.cli import build_parser, comparison
from kvsched.sim.compare import replay_config
from kvsched.sim.prepare import prepare
from kvsched.sim.replay import Replay
from kvsched.sim.summary import measured_calls


def _pcts(values: list[float]) -> str:
    if not values:
        return "- | - | -"
    p50, p90, p99 = np.percentile(np.array(values), [50, 90, 99])
    return f"{p50:.3f} | {p90:.3f} | {p99:.3f}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    extra = argparse.ArgumentParser(add_help=False)
    extra.add_argument("--long-gap", type=float, default=30.0, metavar="S")
    known, rest = extra.parse_known_args(argv)
    args = parser.parse_args(rest)
    try:
        cmp = comparison(args)
    except (ValueError, OSError) as exc:
        parser.exit(2, f"prefetch_eval: error: {exc}\n")
    config = replay_config(cmp)
    prepared = prepare(cmp.trace, seed=cmp.seed)
    calls = cmp.trace.calls
    print(
        f"| policy | TTFT p50 | p90 | p99 | after gap > {known.long_gap:g} s: turns | "
        "p50 | p90 | p99 | loaded share | prefetches loaded / not needed / skipped |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for spec in cmp.policies:
        replay = Replay(prepared, spec, config)
        result = replay.run()
        measured = measured_calls(cmp.trace, config, result.group_start)
        every: list[float] = []
        long: list[float] = []
        loaded = prompt = 0
        for req, m in zip(result.reqs, measured, strict=True):
            if not m or req.rejected or req.first_token_at < 0:
                continue
            ttft = req.first_token_at - req.arrival
            every.append(ttft)
            call = calls[req.call]
            if call.after >= 0 and call.gap_s > known.long_gap:
                long.append(ttft)
                loaded += req.tier_hit
                prompt += call.input_tokens
        done = replay.transfers.prefetches
        share = loaded / prompt if prompt else 0.0
        print(
            f"| {spec} | {_pcts(every)} | {len(long)} | {_pcts(long)} | {share:.3f} | "
            f"{done['loaded']} / {done['not_needed']} / {done['skipped']} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
