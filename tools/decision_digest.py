"""Digests of what the replay decides, to show a refactor changed no behaviour.

For each bundled trace slice and each policy, replays the trace as `kvsched replay` does (its
defaults: 8 instances, seed 0, load 1, the format's loop mode and token scale) and prints two
SHA-256 digests: of every decision in arrival order (instance, decode instance, cached and
fetched tokens, rule, estimated TTFT, transfers) and of the report's `policies` row. Equal
digests before and after a change mean the same decisions and the same report.

    python -m tools.decision_digest [--policies cache_aware,mooncake,elastic]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from kvsched.sim.cli import DEFAULT_MODE, build_parser, load_trace
from kvsched.sim.compare import Comparison, replay_config, run_comparison
from kvsched.sim.prepare import prepare
from kvsched.sim.records import ReplayConfig
from kvsched.sim.replay import Replay

SLICES = Path(__file__).resolve().parents[1] / "data" / "traces"
TRACES = ("mooncake_conversation_head.jsonl", "weka_cc_agentic_sample.jsonl.xz")
POLICIES = ("cache_aware", "mooncake", "elastic")


def decision_rows(replay: Replay) -> list[tuple[Any, ...]]:
    """Every call's decision as plain values (the first one when a turn was retried)."""
    rows: list[tuple[Any, ...]] = []
    for req in replay.reqs:
        d = req.decision
        if d is None:
            rows.append((req.call, "not placed"))
            continue
        transfers = tuple(
            (t.kind.value, t.source, t.target, t.block_hashes, t.skip_blocks, t.on_critical_path)
            for t in d.transfers
        )
        rows.append(
            (
                req.call,
                d.rejected,
                d.instance,
                d.decode_instance,
                d.cached_tokens,
                d.fetched_tokens,
                d.rule,
                repr(d.estimated_ttft_s),
                transfers,
            )
        )
    return rows


def digest(value: Any) -> str:
    text = json.dumps(value, sort_keys=True, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def digests(
    path: Path, policies: Sequence[str], *, pure: bool = False
) -> dict[str, dict[str, str]]:
    """{policy: {"decisions": …, "policies_row": …}} for one trace file, on the core's
    compiled kernels or, when `pure`, its references."""
    trace, fmt = load_trace(build_parser().parse_args(["replay", "--trace", str(path)]))
    cmp = Comparison(
        trace=trace,
        trace_path=path.name,
        policies=tuple(policies),
        instances=8,
        closed_loop=DEFAULT_MODE[fmt] == "closed",
        pure=pure,
    )
    report = run_comparison(cmp, None, figures=False)
    config: ReplayConfig = replay_config(cmp)
    kept = replace(config, keep_decisions=True)
    prepared = prepare(cmp.trace, seed=cmp.seed)
    out: dict[str, dict[str, str]] = {}
    for spec in policies:
        replay = Replay(prepared, spec, kept)
        replay.run()
        out[spec] = {
            "decisions": digest(decision_rows(replay)),
            "policies_row": digest(report["policies"][spec]),
        }
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policies", default=",".join(POLICIES))
    args = parser.parse_args(argv)
    policies = tuple(p for p in args.policies.split(",") if p)
    for name in TRACES:
        for spec, pair in digests(SLICES / name, policies).items():
            print(f"{name:36} {spec:12} decisions {pair['decisions']}  row {pair['policies_row']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
