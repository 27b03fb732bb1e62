"""`python -m bench.grpc_placement`: see the package docstring."""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import uvloop

from bench import grpc_placement
from bench.grpc_placement.baseline import baseline
from bench.grpc_placement.measure import Plan, measure
from bench.grpc_placement.report import print_policy, verdicts
from bench.grpc_placement.results import ModeResult
from bench.grpc_placement.workload import BLOCK, HASH_FORMS, SESSIONS, build_workload


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.grpc_placement",
        description=grpc_placement.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--instances", type=int, default=64)
    parser.add_argument("--blocks", type=int, default=1_000_000)
    parser.add_argument("--prompt-tokens", type=int, default=32_768)
    parser.add_argument("--requests", type=int, default=1000, help="decisions per timed mode")
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=16, help="in flight per stream")
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--policy", default="elastic,cache_aware", help="comma-separated")
    parser.add_argument("--batch-blocks", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--system-share",
        type=float,
        default=0.5,
        help="share of indexed chains under the shared system prefix (bench.placement: 0.5)",
    )
    parser.add_argument(
        "--hashes",
        default=",".join(HASH_FORMS),
        help="how requests carry their block hashes, comma-separated: repeated (block_hashes), "
        "packed (packed_block_hashes); with both, each phase runs once in each",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="times each timed phase runs (interleaved with the others), pooled in its row",
    )
    parser.add_argument(
        "--no-batched",
        action="store_true",
        help="leave out the batched streamed phases (items queued together in one message)",
    )
    parser.add_argument("--quick", action="store_true", help="small smoke run")
    parser.add_argument("--profile", type=Path, help="py-spy the Conductor into this folder")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, _interrupt)  # clean up the Conductor and etcd on kill
    if args.quick:
        args.blocks, args.requests, args.warmup = min(args.blocks, 100_000), 100, 30
    if args.profile is not None:
        if not (shutil.which("py-spy") or (Path(sys.executable).parent / "py-spy").exists()):
            parser.error("--profile needs py-spy: .venv/bin/pip install py-spy")
        args.profile.mkdir(parents=True, exist_ok=True)
    policies = [p.strip() for p in args.policy.split(",") if p.strip()]
    forms = tuple(dict.fromkeys(f.strip() for f in args.hashes.split(",") if f.strip()))
    if not forms or any(f not in HASH_FORMS for f in forms):
        parser.error(f"--hashes takes {' and/or '.join(HASH_FORMS)}")
    started = time.perf_counter()
    work = build_workload(
        args.instances,
        args.blocks,
        args.prompt_tokens,
        args.batch_blocks,
        seed=args.seed,
        share=args.system_share,
    )
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    plan = Plan(
        args.warmup,
        args.requests,
        args.concurrency,
        args.streams,
        forms,
        args.rounds,
        batched=not args.no_batched,
    )
    cores = os.cpu_count() or 1
    print(
        f"{args.instances} instances, {work.blocks:,} indexed blocks in {len(work.batches)} "
        f"PublishKvEvents batches, {args.prompt_tokens:,}-token prompts "
        f"({args.prompt_tokens // BLOCK:,} block hashes), every 4th request in one of "
        f"{SESSIONS} sessions"
    )
    print(
        f"machine: {cores} cores; the client (this process, grpc.aio on uvloop), the Conductor "
        f"process and etcd share them"
    )
    all_results: dict[str, list[ModeResult]] = {}
    with tempfile.TemporaryDirectory(prefix="grpc-placement-") as tmp:
        for policy in policies:
            results, log, info = uvloop.run(measure(policy, work, plan, Path(tmp), args.profile))
            baseline(policy, work, log, {r.name: r for r in results})
            all_results[policy] = results
            print_policy(policy, results, info)
    verdicts(all_results)
    print(
        "in-process, same: the same decisions replayed through a ConductorState in this "
        "process at the times they were sent (request_info + place; rate also counts the "
        "finish and load report work). x: gRPC over in-process (latency) / gRPC rate over "
        "in-process rate. srv place: the Conductor's own decision_seconds histogram. "
        "agree: same instance as in process. rebinds: decisions that waited for etcd "
        "(their session's binding changed), with the gRPC latency p50 of those and of the "
        "others. packed vs repeated: each phase run with the hashes as packed_block_hashes "
        "and as block_hashes (their Finish too), on the same Conductor, the order alternating "
        "phase by phase; x: packed over repeated. batched vs one item a message: each "
        "streamed phase again with the items queued together (placements and finishes) sent "
        "as one ScheduleStreamBatch, at most 64; msgs: stream messages the Conductor received "
        "(in) and sent (out) per decision; x: batched over single."
    )
    print(f"wall time {time.perf_counter() - started:.0f} s")
    flags = " ".join(a for a in sys.argv[1:])
    print(f"reproduce: .venv/bin/python -m bench.grpc_placement {flags}".rstrip())


if __name__ == "__main__":
    main()
