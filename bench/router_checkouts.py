"""kvsched's Router from two checkouts (a change and what it changes), in one run: one
`bench.router` stack (etcd, a Conductor, two Routers, a Messenger, two simulated engines at
time scale 0.001, mutual TLS) started from each checkout's own code, measured interleaved so
both see the same machine: time to first token (the four targets, each stack's Router and
its engines direct, taking turns probe by probe, streamed and not), then 32-client throughput
bursts (the order reversed every round) with the CPU its Router, and the Conductor, Messenger
and etcd behind it, used per request. Each checkout's Router is reported against the direct
calls to its own engines. `--base-env NAME=VALUE` sets a variable in the base stack's
processes only: with `.` as the base it compares one checkout with and without a setting
(e.g. `KVSCHED_EVENT_LOOP=asyncio`: asyncio's own event loop against uvloop).

Run it from either checkout; both must have the compiled index built in place and import
with this interpreter (`cwd` decides which code a stack's processes run):

    .venv/bin/python -m bench.router_checkouts ../main [--rounds 6] [--seconds 3]
    .venv/bin/python -m bench.router_checkouts . --base-env KVSCHED_EVENT_LOOP=asyncio
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import aiohttp

from bench.common import REPO, percentile
from bench.router import parse_args as router_args
from bench.router import warm_up
from bench.router_measures import throughput, ttft_round
from bench.router_stack import Stack, Target


@contextlib.contextmanager
def running_from(checkout: Path, env: dict[str, str] | None = None) -> Iterator[None]:
    """Processes started inside run `checkout`'s code (their cwd, first on their path), with
    `env` added to their environment."""
    cwd = Path.cwd()
    added = {"PYTHONPATH": str(checkout), **(env or {})}
    saved = {name: os.environ.get(name) for name in added}
    os.chdir(checkout)
    os.environ.update(added)
    try:
        yield
    finally:
        os.chdir(cwd)
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


async def run(args: argparse.Namespace) -> dict[str, Any]:
    stack_args = router_args(["--peers", "", "--streams", "0"])
    names = {"base": args.base.resolve(), "this": args.this.resolve()}
    probes: dict[str, list[float]] = {}
    bursts: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="kvsched-bench-") as tmp:
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector) as http:
            stacks: dict[str, Stack] = {}
            try:
                for name, checkout in names.items():
                    stack = Stack(stack_args, Path(tmp) / name, stack_args.capacity_blocks)
                    stacks[name] = stack
                    with running_from(checkout, args.base_env if name == "base" else None):
                        await stack.start(http)
                    await warm_up(http, stack)
                targets: list[tuple[Target, Stack]] = []
                for name, stack in stacks.items():
                    direct, router = stack.targets()[:2]
                    targets.append((Target(f"{name} direct", direct.urls), stack))
                    targets.append((Target(f"{name} router", router.urls, router.pids), stack))
                for r in range(args.rounds):
                    order = targets if r % 2 == 0 else targets[::-1]
                    for _ in range(args.requests):
                        for target, stack in order:
                            got = await ttft_round(http, [target], stack.model, stack.key, 1)
                            for mode, values in got[target.name].items():
                                probes.setdefault(f"{target.name} {mode}", []).extend(values)
                    for target, stack in order:
                        bursts.setdefault(target.name, []).append(
                            await throughput(
                                http,
                                target,
                                stack.model,
                                stack.key,
                                clients=args.clients,
                                secs=args.seconds,
                            )
                        )
            finally:
                for stack in stacks.values():
                    stack.stop()
    checkouts = {k: str(v) for k, v in names.items()}
    return {"checkouts": checkouts, "base_env": args.base_env} | summarize(probes, bursts)


def summarize(
    probes: dict[str, list[float]], bursts: dict[str, list[dict[str, Any]]]
) -> dict[str, Any]:
    """Per checkout: its Router's TTFT p50/p99 and added p50 over its own engines direct,
    requests/s over direct, refusals, CPU ms a request of its Router and of the Conductor,
    Messenger and etcd behind it."""
    out: dict[str, Any] = {}
    for name in ("base", "this"):
        row: dict[str, Any] = {}
        for mode in ("stream", "whole"):
            direct = statistics.median(probes[f"{name} direct {mode}"])
            routed = probes[f"{name} router {mode}"]
            row[f"{mode}_direct_p50_ms"] = direct * 1e3
            row[f"{mode}_p50_ms"] = statistics.median(routed) * 1e3
            row[f"{mode}_p99_ms"] = percentile(routed, 99) * 1e3
            row[f"{mode}_added_p50_ms"] = (statistics.median(routed) - direct) * 1e3
        rate = {}
        for kind in ("direct", "router"):
            runs = bursts[f"{name} {kind}"]
            rate[kind] = sum(r["requests"] for r in runs) / sum(r["seconds"] for r in runs)
        runs = bursts[f"{name} router"]
        served = sum(r["requests"] for r in runs)
        row["direct_rps"], row["router_rps"] = rate["direct"], rate["router"]
        row["rps_over_direct"] = rate["router"] / rate["direct"]
        row["refused"] = sum(r["refused"] for r in runs)
        for label in runs[0]["cpu_s"]:
            used = sum(r["cpu_s"][label] for r in runs)
            row[f"{label}_cpu_ms_per_request"] = 1e3 * used / served
        out[name] = row
    return out


BACKING = ("conductor", "messenger", "etcd")


def report(out: dict[str, Any]) -> str:
    lines = [
        "checkout  added TTFT p50, stream / whole   requests/s (x direct)   CPU a request: "
        "Router + Conductor, Messenger, etcd"
    ]
    for name in ("base", "this"):
        row = out[name]
        refused = f"  ({row['refused']} refused)" if row["refused"] else ""
        behind = " + ".join(f"{row[f'{b}_cpu_ms_per_request']:.3f}" for b in BACKING)
        lines.append(
            f"{name:8s}  +{row['stream_added_p50_ms']:.2f} / +{row['whole_added_p50_ms']:.2f} ms"
            f"{'':13s}{row['router_rps']:5.0f} ({row['rps_over_direct']:.2f}x of "
            f"{row['direct_rps']:.0f})   {row['router_cpu_ms_per_request']:.3f} + {behind} ms"
            f"{refused}"
        )
    base, this = out["base"], out["this"]
    ratios = ", ".join(
        f"{label} {this[f'{label}_cpu_ms_per_request'] / base[f'{label}_cpu_ms_per_request']:.3f}x"
        for label in ("router", *BACKING)
    )
    rate = this["rps_over_direct"] / base["rps_over_direct"]
    lines.append(f"this / base: CPU a request {ratios}; requests/s over direct {rate:.3f}x")
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("base", type=Path, help="the checkout to compare against (e.g. ../main)")
    p.add_argument("--this", type=Path, default=REPO, help="the other checkout (default: this)")
    p.add_argument(
        "--base-env",
        type=_env_setting,
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="set in the base stack's processes' environment (repeatable), e.g. "
        "KVSCHED_EVENT_LOOP=asyncio with base '.' compares the event loops in one checkout",
    )
    p.add_argument("--rounds", type=int, default=6, help="interleaved rounds")
    p.add_argument("--requests", type=int, default=40, help="TTFT probes a round, target, mode")
    p.add_argument("--clients", type=int, default=32, help="throughput: concurrent clients")
    p.add_argument("--seconds", type=float, default=3.0, help="throughput: seconds a burst")
    p.add_argument(
        "--json",
        type=Path,
        default=REPO / "out" / "bench" / "router_checkouts.json",
        help="where the results go",
    )
    args = p.parse_args(argv)
    args.base_env = dict(args.base_env)
    return args


def _env_setting(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    return name, value


def main() -> None:
    args = parse_args()
    out = asyncio.run(run(args))
    print(report(out))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=1))
    print(f"results: {args.json}")


if __name__ == "__main__":
    main()
