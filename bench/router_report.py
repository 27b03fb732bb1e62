"""`bench.router`'s summary (added latency over direct, ratios, CPU per request) and its table."""

from __future__ import annotations

import argparse
import statistics
from typing import Any

from bench.common import percentile
from bench.peer_routers import PEERS
from bench.router_stack import DIRECT


def summarize(
    probes: dict[str, dict[str, list[float]]], rounds: dict[str, list[dict[str, Any]]]
) -> dict[str, Any]:
    """Per target: TTFT p50/p99 and added over direct (streamed and not), requests/s (mean of
    the rounds) as a ratio to direct and to the faster peer, CPU ms per request by process."""
    out: dict[str, Any] = {}
    direct = probes[DIRECT]
    for name, modes in probes.items():
        row: dict[str, Any] = {}
        for mode, values in modes.items():
            p50, p99 = statistics.median(values), percentile(values, 99)
            row[f"{mode}_p50_ms"], row[f"{mode}_p99_ms"] = p50 * 1e3, p99 * 1e3
            row[f"{mode}_added_p50_ms"] = (p50 - statistics.median(direct[mode])) * 1e3
            row[f"{mode}_added_p99_ms"] = (p99 - percentile(direct[mode], 99)) * 1e3
        out[name] = row
    for name, runs in rounds.items():
        requests = sum(r["requests"] for r in runs)
        row = out.setdefault(name, {})
        row["rps_rounds"] = [r["requests"] / r["seconds"] for r in runs]
        row["rps"] = statistics.fmean(row["rps_rounds"])
        row["refused"] = sum(r["refused"] for r in runs)
        labels = runs[0]["cpu_s"].keys()
        row["cpu_ms_per_request"] = {
            label: 1e3 * sum(r["cpu_s"][label] for r in runs) / max(requests, 1) for label in labels
        }
    peer_rps = [out[p]["rps"] for p in PEERS if p in rounds]
    for row in out.values():
        if "rps" in row:
            row["rps_over_direct"] = row["rps"] / out[DIRECT]["rps"]
            if peer_rps:
                row["rps_over_faster_peer"] = row["rps"] / max(peer_rps)
    return out


def print_report(out: dict[str, Any], args: argparse.Namespace) -> None:
    s = out["summary"]
    print(
        f"\nTTFT ({out['probes_per_target']} probes per target and mode, one at a time, "
        "interleaved), ms; added = over direct"
    )
    print(
        f"  {'target':<14}{'stream p50':>11}{'p99':>8}{'added p50':>10}{'p99':>8}"
        f"{'whole p50':>11}{'p99':>8}{'added p50':>10}{'p99':>8}"
    )
    for name, r in s.items():
        if "stream_p50_ms" not in r:
            continue
        print(
            f"  {name:<14}{r['stream_p50_ms']:>11.2f}{r['stream_p99_ms']:>8.2f}"
            f"{r['stream_added_p50_ms']:>+10.2f}{r['stream_added_p99_ms']:>+8.2f}"
            f"{r['whole_p50_ms']:>11.2f}{r['whole_p99_ms']:>8.2f}"
            f"{r['whole_added_p50_ms']:>+10.2f}{r['whole_added_p99_ms']:>+8.2f}"
        )
    print(
        f"throughput ({args.clients} clients, {args.seconds:g} s a target, {args.rounds} "
        "rounds); CPU ms per request by process"
    )
    for name, r in s.items():
        cpu = ", ".join(f"{k} {v:.2f}" for k, v in r["cpu_ms_per_request"].items()) or "-"
        faster = r.get("rps_over_faster_peer")
        peer = f", {faster:.2f}x the faster peer" if faster is not None else ""
        print(
            f"  {name:<14}{r['rps']:>7.0f}/s ({r['rps_over_direct']:.2f}x direct{peer}), "
            f"{r['refused']} refused; cpu: {cpu}"
        )
    for wl, rows in out["cache_share"].items():
        print(f"cached share of prompt tokens, {wl}:")
        for name, r in rows.items():
            print(
                f"  {name:<14}{100 * r['cached_share']:>6.1f}%  ({r['cached_tokens']}/"
                f"{r['prompt_tokens']} tokens, {r['requests']} requests, "
                f"{r['errors']} errors, {r['seconds']:.1f} s)"
            )
    if "streams_direct" in out:
        for name in ("streams_direct", "streams_router"):
            r = out[name]
            print(
                f"{name}: {r['streams']} held open ({r['wave']} opened at a time), "
                f"{r['errors']} errors {r['error_statuses']}, "
                f"peak open {r['peak_open']}, {r['seconds']:.1f} s"
            )
