"""`kvsched` command line: replay a trace through policies and report."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path

from kvsched.core.cluster import SloConfig
from kvsched.core.topology import TopologyConfig
from kvsched.sim.compare import (
    Comparison,
    config_section,
    expand_policies,
    replay_config,
    run_comparison,
)
from kvsched.sim.hardware import add_hardware_arguments, hardware_from_args
from kvsched.sim.knee import KneeRun, KneeSearch, run_knees
from kvsched.sim.knee_seeds import SeedParts, code_digest, file_digest, run_key
from kvsched.sim.progress import ProgressBar
from kvsched.sim.report import write_report
from kvsched.sim.tiers import NVME_GEN4_READ, PCIE_GEN5_ACHIEVED, TierConfig, TierSize
from kvsched.sim.traces import transform
from kvsched.sim.traces.model import Trace
from kvsched.sim.traces.weka import weka_shared_prefix

# Defaults per trace format: loop mode and token scale (Claude-sized agentic contexts shrink to
# fit a 128K-context model). Both are recorded in the report.
DEFAULT_MODE = {"mooncake": "open", "weka": "closed", "azure": "open"}
DEFAULT_TOKEN_SCALE = {"mooncake": 1.0, "weka": 0.25, "azure": 1.0}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvsched", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    rp = sub.add_parser("replay", help="replay a trace through one or more policies")
    add_trace_arguments(rp)
    rp.add_argument("--policies", default="all", help="'all' or NAME[:k=v,...][,NAME...]")
    rp.add_argument("--instances", type=int, default=8)
    rp.add_argument("--out", type=Path, help="directory for report.json, table.md and figures")
    rp.add_argument(
        "--sweep",
        metavar="L1,L2,...",
        help="also replay at these loads; goodput = highest load with SLO attainment >= 90%%",
    )
    rp.add_argument(
        "--sweep-scale-repeat",
        action="store_true",
        help="closed loop: replay --repeat x L / --load copies of each session at sweep load L, "
        "so the sessions' start window keeps its length (a steady state, not a burst)",
    )
    add_tier_arguments(rp)
    rp.add_argument("--no-figures", action="store_true")
    rp.add_argument("--quiet", action="store_true", help="no progress bar")
    add_hardware_arguments(rp)
    kp = sub.add_parser(
        "knee",
        help="closed loop: each policy's capacity knee by bisection, over seeds (kvsched.sim.knee)",
    )
    add_trace_arguments(kp)
    kp.add_argument("--policies", default="all", help="'all' or NAME[:k=v,...][,NAME...]")
    kp.add_argument("--instances", type=int, default=8)
    kp.add_argument(
        "--bracket", default="24:64", metavar="LO:HI", help="loads to start from (default 24:64)"
    )
    kp.add_argument(
        "--tolerance", type=float, default=0.02, help="stop at hi - lo <= this x lo (0.02)"
    )
    kp.add_argument(
        "--full-probes",
        action="store_true",
        help="replay a probe that misses to its end, for its figures (by default it stops once "
        "its miss is certain: the same knee, far sooner)",
    )
    kp.add_argument("--seeds", default="0,1,2,3,4", help="comma-separated seeds (0,1,2,3,4)")
    kp.add_argument(
        "--reference",
        default="llmd,dynamo,sglang,mooncake,cache_aware",
        help="baselines whose best goodput load, per seed, every policy is replayed at",
    )
    kp.add_argument(
        "--search",
        metavar="POLICIES",
        help="the policies whose knee is searched (default: every one of --policies); the "
        "rest are replayed at the reference load only",
    )
    kp.add_argument("--jobs", type=int, default=1, help="processes sharing the searches")
    kp.add_argument(
        "--out",
        type=Path,
        required=True,
        help="directory for knee.json, and seeds/ with each finished seed (a run with the "
        "same flags and code goes on from them)",
    )
    kp.add_argument("--quiet", action="store_true")
    add_tier_arguments(kp)
    add_hardware_arguments(kp)
    kp.set_defaults(sweep=None, sweep_scale_repeat=False)
    return parser


def add_tier_arguments(rp: argparse.ArgumentParser) -> None:
    """The node KV pool's flags (DRAM and SSD tiers, off by default)."""
    tier = rp.add_argument_group("node KV pool (DRAM and SSD tiers; off by default)")
    tier.add_argument(
        "--dram-tier",
        type=_tier_size,
        default=TierSize(),
        metavar="X",
        help="each node's DRAM tier: X times the node's GPU KV capacity (4 or 4x), or tokens "
        "per node with a t suffix (2000000t); 0: off",
    )
    tier.add_argument(
        "--dram-bandwidth",
        type=float,
        default=PCIE_GEN5_ACHIEVED / 1e9,
        metavar="GB/S",
        help="each GPU's host link (PCIe), each way (default: %(default)g, Gen5 x16 achieved)",
    )
    tier.add_argument(
        "--ssd-tier",
        type=_tier_size,
        default=TierSize(),
        metavar="X",
        help="each node's SSD tier below DRAM, sized as --dram-tier; 0: off",
    )
    tier.add_argument(
        "--ssd-bandwidth",
        type=float,
        default=NVME_GEN4_READ / 1e9,
        metavar="GB/S",
        help="each node's SSD (default: %(default)g, NVMe Gen4 read)",
    )
    tier.add_argument(
        "--instances-per-node",
        type=int,
        default=TopologyConfig().instances_per_node,
        metavar="N",
        help="instances sharing a node (and its DRAM tier) (default: %(default)s)",
    )


def _tier_size(text: str) -> TierSize:
    try:
        return TierSize.parse(text)
    except ValueError as exc:  # argparse shows an ArgumentTypeError's own message
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_trace_arguments(p: argparse.ArgumentParser) -> None:
    """Which trace, which part of it and how to replay it: shared by `kvsched replay` and the
    live load generator (`kvsched bench`), so both replay the same calls the same way."""
    p.add_argument("--trace", required=True, type=Path, help="trace file (.jsonl, .jsonl.xz, .csv)")
    p.add_argument("--trace-format", choices=sorted(DEFAULT_MODE), help="default: detected")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--load", type=float, default=1.0, help="arrival-rate multiplier")
    cap = p.add_mutually_exclusive_group()
    cap.add_argument("--max-requests", type=int, help="replay only the first N calls")
    cap.add_argument("--max-sessions", type=int, help="replay only the first N sessions/groups")
    cap.add_argument(
        "--sessions",
        metavar="A:B",
        help="weka: replay agentic traces A..B-1 (in file order), e.g. a held-out half",
    )
    p.add_argument("--mode", choices=("open", "closed"), help="default: closed for weka")
    p.add_argument("--token-scale", type=float, help="multiply prompt lengths (default per format)")
    p.add_argument(
        "--shared-prefix",
        type=Path,
        metavar="META_JSON",
        help="weka: model the shared Claude Code system prefix (trace meta JSON)",
    )
    p.add_argument(
        "--max-gap", type=float, metavar="S", help="closed loop: cap think/idle gaps at S seconds"
    )
    p.add_argument(
        "--repeat",
        type=int,
        default=1,
        metavar="K",
        help="closed loop: replay every agentic trace K times as distinct users",
    )
    p.add_argument("--ttft-slo", type=float, default=SloConfig().ttft_s, help="seconds")
    p.add_argument("--tpot-slo", type=float, default=SloConfig().tpot_s, help="seconds")
    p.add_argument("--warmup", type=float, default=0.05, help="share of the trace excluded")


def load_trace(args: argparse.Namespace) -> tuple[Trace, str]:
    """The trace the arguments name, selected, transformed and repeated."""
    base, fmt = select_trace(args)
    return repeated(base, fmt, args, args.repeat), fmt


def select_trace(args: argparse.Namespace) -> tuple[Trace, str]:
    """The trace the arguments name, selected and transformed, before `--repeat` and
    `--token-scale` (`repeated`)."""
    fmt = args.trace_format or transform.detect_format(args.trace)
    opts: dict[str, int | None] = {}
    if args.max_sessions is not None:
        if fmt != "weka":
            raise ValueError("--max-sessions applies to session traces (weka); use --max-requests")
        opts["max_sessions"] = args.max_sessions
    trace = transform.load(args.trace, fmt, **opts)
    if args.sessions is not None:
        if fmt != "weka":
            raise ValueError("--sessions applies to weka traces")
        start, sep, stop = args.sessions.partition(":")
        if not sep or not start.isdigit() or not stop.isdigit():
            raise ValueError(f"--sessions takes A:B, got {args.sessions!r}")
        trace = transform.select_groups(trace, int(start), int(stop))
    if args.max_requests is not None:
        trace = transform.cap_requests(trace, args.max_requests)
    if args.shared_prefix is not None:
        if fmt != "weka":
            raise ValueError("--shared-prefix applies to weka traces")
        trace = weka_shared_prefix(trace, args.shared_prefix)
    if args.max_gap is not None:
        trace = transform.cap_gaps(trace, args.max_gap)
    return trace, fmt


def repeated(trace: Trace, fmt: str, args: argparse.Namespace, times: int) -> Trace:
    """The selected trace with `times` copies of each group, then token-scaled (the last
    steps of `load_trace`: a sweep that scales the copies with the load redoes them)."""
    if times != 1:
        trace = transform.repeat_groups(trace, times)
    scale = args.token_scale if args.token_scale is not None else DEFAULT_TOKEN_SCALE[fmt]
    if scale != 1.0:
        trace = transform.scale_tokens(trace, scale)
    return trace


def parse_loads(text: str | None) -> tuple[float, ...]:
    if not text:
        return ()
    try:
        loads = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"--sweep takes comma-separated loads, got {text!r}") from None
    if not loads or min(loads) <= 0:
        raise ValueError("--sweep loads must be positive")
    return loads


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "knee":
            run, policies, searched = knee_run(args)
        else:
            cmp = comparison(args)
    except (ValueError, OSError) as exc:
        parser.exit(2, f"kvsched: error: {exc}\n")
    if args.command == "knee":
        return run_knee_command(run, policies, searched, args)
    bar = None if args.quiet else ProgressBar()
    run_comparison(cmp, args.out, figures=not args.no_figures, stream=sys.stdout, progress=bar)
    return 0


def comparison(args: argparse.Namespace, selected: tuple[Trace, str] | None = None) -> Comparison:
    """The comparison `kvsched replay`'s parsed `args` ask for (trace loaded, unless
    `selected` brings `select_trace`'s answer); raises ValueError or OSError naming what is
    wrong."""
    base, fmt = selected or select_trace(args)
    trace = repeated(base, fmt, args, args.repeat)
    mode = args.mode or DEFAULT_MODE[fmt]
    if mode == "closed" and not any(c.after >= 0 for c in trace.calls):
        raise ValueError(f"{fmt} traces carry no turn dependencies: use --mode open")
    sweep_repeat_trace: Callable[[int], Trace] | None = None
    if args.sweep_scale_repeat:
        if mode != "closed" or not args.sweep:
            raise ValueError("--sweep-scale-repeat applies to closed-loop sweeps (--sweep)")
        sweep_repeat_trace = partial(repeated, base, fmt, args)
    cmp = Comparison(
        trace=trace,
        trace_path=str(args.trace),
        policies=expand_policies(args.policies),
        instances=args.instances,
        seed=args.seed,
        load=args.load,
        closed_loop=mode == "closed",
        slo=SloConfig(ttft_s=args.ttft_slo, tpot_s=args.tpot_slo),
        warmup_fraction=args.warmup,
        sweep_loads=parse_loads(args.sweep),
        hardware=hardware_from_args(args),
        topology=TopologyConfig(instances_per_node=args.instances_per_node),
        tier=TierConfig(
            dram=args.dram_tier,
            ssd=args.ssd_tier,
            pcie_bandwidth=args.dram_bandwidth * 1e9,
            ssd_bandwidth=args.ssd_bandwidth * 1e9,
        ),
        repeat=args.repeat,
        sweep_repeat_trace=sweep_repeat_trace,
    )
    if args.instances <= 0 or args.load <= 0:
        raise ValueError("--instances and --load must be positive")
    return cmp


def knee_run(args: argparse.Namespace) -> tuple[KneeRun, tuple[str, ...], tuple[str, ...]]:
    """The knee search `kvsched knee`'s `args` ask for: the run, its policies and the ones
    searched; raises ValueError."""
    base, fmt = select_trace(args)
    cmp = comparison(args, (base, fmt))
    if not cmp.closed_loop:
        raise ValueError("kvsched knee searches closed-loop replays (session traces)")
    lo, sep, hi = args.bracket.partition(":")
    try:
        search = KneeSearch(float(lo), float(hi), args.tolerance, stop_early=not args.full_probes)
        seeds = tuple(int(x) for x in args.seeds.split(",") if x.strip())
    except ValueError as exc:
        raise ValueError(f"--bracket LO:HI and --seeds N,N,...: {exc}") from None
    if not sep or not seeds or args.jobs < 1:
        raise ValueError("--bracket takes LO:HI, --seeds at least one seed, --jobs >= 1")
    scale = args.token_scale if args.token_scale is not None else DEFAULT_TOKEN_SCALE[fmt]
    reference = expand_policies(args.reference)
    run = KneeRun(cmp, base, scale, search, seeds, reference)
    searched = expand_policies(args.search) if args.search else cmp.policies
    unknown = sorted(set(searched) - set(cmp.policies))
    if unknown:
        raise ValueError(f"--search names policies not in --policies: {', '.join(unknown)}")
    if not set(reference) & set(searched):
        raise ValueError("--search leaves out every --reference policy: none sets the load")
    return run, cmp.policies, searched


# Flags that change how a knee run goes, not what it finds.
RUN_ONLY_FLAGS = frozenset({"out", "jobs", "quiet", "seeds", "command", "trace"})


def seed_parts(args: argparse.Namespace) -> SeedParts:
    """Where this run's finished seeds are kept (`<out>/seeds`), keyed by every other flag,
    the trace file's bytes and the simulator's code."""
    settings = {k: v for k, v in vars(args).items() if k not in RUN_ONLY_FLAGS}
    trace = Path(args.trace)
    settings["trace_sha256"] = file_digest(trace) if trace.is_file() else str(trace)
    return SeedParts(args.out / "seeds", run_key(settings, code_digest()))


def run_knee_command(
    run: KneeRun, policies: tuple[str, ...], searched: tuple[str, ...], args: argparse.Namespace
) -> int:
    started = time.perf_counter()
    done = [0]

    def tick(label: str) -> None:
        done[0] += 1
        if not args.quiet:
            print(
                f"[{done[0]}/{len(run.seeds)}] {label} ({time.perf_counter() - started:.0f} s)",
                file=sys.stderr,
            )

    kept = seed_parts(args)
    finished = kept.load(run.seeds)
    if finished and not args.quiet:
        print(f"seeds {', '.join(map(str, finished))} kept from an earlier run", file=sys.stderr)
    report = run_knees(
        run,
        policies,
        jobs=args.jobs,
        progress=tick,
        searched=searched,
        finished=finished,
        on_seed=kept.save,
    )
    report["config"] = config_section(run.base, replay_config(run.base))
    report["trace"] = {
        "path": str(args.trace),
        "groups": len(transform.group_order(run.base_trace)),
    }
    report["wall_seconds"] = time.perf_counter() - started
    args.out.mkdir(parents=True, exist_ok=True)
    write_report(args.out / "knee.json", report)
    searches = len(searched) * len(run.seeds)
    print(
        f"{searches} searches, {len(policies)} policies at the reference: {args.out / 'knee.json'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
