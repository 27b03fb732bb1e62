"""The tables printed per policy and the verdicts against the goals."""

from __future__ import annotations

from bench.common import percentile
from bench.grpc_placement.profile import print_profile
from bench.grpc_placement.results import BATCHED, ModeResult

GOAL_P99_MS = 1.0
GOAL_RATE = 10_000.0
W = 31  # the mode column's width


def _p50(values: list[float]) -> str:
    return f"{percentile(values, 50) * 1e3:.3f}" if values else "-"


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f}"


def print_policy(policy: str, results: list[ModeResult], info: dict[str, float]) -> None:
    print(
        f"\npolicy {policy}: index loaded over gRPC in {info['load_s']:.1f} s "
        f"({info['indexed']:,.0f} distinct instance-block pairs listed); Conductor RSS "
        f"{info['server_rss_mb']:.0f} MB after load, {info['server_rss_end_mb']:.0f} MB at the end"
    )
    head = (
        f"{'mode':<{W}} {'n':>5} {'p50 ms':>8} {'p99 ms':>8} {'decisions/s':>11} "
        f"{'p50 x':>6} {'p99 x':>6} {'rate x':>6}"
    )
    print(head)
    print("-" * len(head))
    for r in results:
        if r.name.startswith("warm"):
            continue
        b50, b99 = percentile(r.base_latencies, 50), percentile(r.base_latencies, 99)
        print(
            f"{'  in-process, same':<{W}} {len(r.base_latencies):>5} {ms(b50):>8} {ms(b99):>8} "
            f"{r.base_rate:>11,.0f} {1.0:>6.2f} {1.0:>6.2f} {1.0:>6.2f}"
        )
        p50, p99 = percentile(r.latencies, 50), percentile(r.latencies, 99)
        print(
            f"{r.name:<{W}} {len(r.latencies):>5} {ms(p50):>8} {ms(p99):>8} {r.rate:>11,.0f} "
            f"{p50 / b50:>6.1f} {p99 / b99:>6.1f} {r.rate / r.base_rate:>6.2f}"
        )
    print_forms(results)
    print_batched(results)
    for r in results:
        print_profile(r)
    print(
        f"\n{'mode':<{W}} {'srv CPU':>8} {'srv place':>9} {'in-proc':>8} {'client CPU':>10} "
        f"{'etcd CPU':>8} {'agree':>6} {'rejected':>8} {'errors':>6} {'rebinds':>7} "
        f"{'rebind p50':>10} {'others p50':>10}"
    )
    print(f"{'(mean per decision)':<{W}} {'ms':>8} {'ms':>9} {'ms':>8} {'ms':>10} {'ms':>8}")
    for r in results:
        if r.name.startswith("warm"):
            continue
        n = max(len(r.latencies), 1)
        base_mean = sum(r.base_latencies) / max(len(r.base_latencies), 1)
        print(
            f"{r.name:<{W}} {r.server_cpu_s / n * 1e3:>8.3f} {r.server_place_s / n * 1e3:>9.3f} "
            f"{base_mean * 1e3:>8.3f} {r.client_cpu_s / n * 1e3:>10.3f} "
            f"{r.etcd_cpu_s / n * 1e3:>8.3f} "
            f"{r.agree / n:>6.0%} {r.rejected:>8} {r.errors:>6} {r.rebinds:>7} "
            f"{_p50([v for k, v in r.by_id.items() if k in r.rebound_ids]):>10} "
            f"{_p50([v for k, v in r.by_id.items() if k not in r.rebound_ids]):>10}"
        )


def print_forms(results: list[ModeResult]) -> None:
    """Each phase's packed-hash run against its repeated-hash run (the baseline), when the
    run measured both."""
    pairs: dict[str, dict[str, ModeResult]] = {}
    for r in results:
        if not r.name.startswith("warm"):
            pairs.setdefault(r.name.rpartition(", ")[0], {})[r.form] = r
    rows = [(name, p["repeated"], p["packed"]) for name, p in pairs.items() if len(p) == 2]
    if not rows:
        return
    print(
        f"\n{'packed vs repeated hashes':<{W}} {'p50 ms':>15} {'p99 ms':>15} "
        f"{'decisions/s':>15} {'srv CPU ms':>13} {'srv place ms':>13} {'p50 x':>6} "
        f"{'p99 x':>6} {'rate x':>6} {'CPU x':>6} {'place x':>7}"
    )
    print(f"{'(repeated / packed)':<{W}}")
    for name, rep, packed in rows:
        (r50, r99), (p50, p99) = (
            (percentile(r.latencies, 50), percentile(r.latencies, 99)) for r in (rep, packed)
        )
        rcpu, pcpu = (r.server_cpu_s / max(len(r.latencies), 1) for r in (rep, packed))
        rplace, pplace = (r.server_place_s / max(len(r.latencies), 1) for r in (rep, packed))
        print(
            f"{name:<{W}} {ms(r50):>7}/{ms(p50):<7} {ms(r99):>7}/{ms(p99):<7} "
            f"{rep.rate:>7,.0f}/{packed.rate:<7,.0f} {ms(rcpu):>6}/{ms(pcpu):<6} "
            f"{ms(rplace):>6}/{ms(pplace):<6} {p50 / r50:>6.2f} {p99 / r99:>6.2f} "
            f"{packed.rate / rep.rate:>6.2f} {pcpu / rcpu:>6.2f} {pplace / rplace:>7.2f}"
        )


def print_batched(results: list[ModeResult]) -> None:
    """Each batched streamed phase against the same phase with one item a message (the
    baseline), with the stream messages the Conductor received and sent per decision."""
    by_name = {r.name: r for r in results}
    rows = [
        (r.name.replace(f" {BATCHED}", ""), by_name.get(r.name.replace(f" {BATCHED}", "")), r)
        for r in results
        if r.batched
    ]
    if not rows:
        return
    print(
        f"\n{'batched vs one item a message':<{W}} {'p50 ms':>15} {'p99 ms':>15} "
        f"{'decisions/s':>15} {'srv CPU ms':>13} {'msgs in':>11} {'msgs out':>11} "
        f"{'p50 x':>6} {'p99 x':>6} {'rate x':>6} {'CPU x':>6}"
    )
    print(f"{'(single / batched; msgs a decision)':<{W}}")
    for name, single, batched in rows:
        if single is None:
            continue
        (s50, s99), (b50, b99) = (
            (percentile(r.latencies, 50), percentile(r.latencies, 99)) for r in (single, batched)
        )
        n_single, n_batched = (max(len(r.latencies), 1) for r in (single, batched))
        scpu, bcpu = single.server_cpu_s / n_single, batched.server_cpu_s / n_batched
        print(
            f"{name:<{W}} {ms(s50):>7}/{ms(b50):<7} {ms(s99):>7}/{ms(b99):<7} "
            f"{single.rate:>7,.0f}/{batched.rate:<7,.0f} {ms(scpu):>6}/{ms(bcpu):<6} "
            f"{single.messages_in / n_single:>5.2f}/{batched.messages_in / n_batched:<5.2f} "
            f"{single.messages_out / n_single:>5.2f}/{batched.messages_out / n_batched:<5.2f} "
            f"{b50 / s50:>6.2f} {b99 / s99:>6.2f} {batched.rate / single.rate:>6.2f} "
            f"{bcpu / scpu:>6.2f}"
        )


def verdicts(all_results: dict[str, list[ModeResult]]) -> None:
    print()
    for policy, results in all_results.items():
        timed = [r for r in results if not r.name.startswith("warm")]
        streamed = [r for r in timed if "stream" in r.name]
        best_p99 = min(streamed, key=lambda r: percentile(r.latencies, 99))
        best_rate = max(streamed, key=lambda r: r.rate)  # unary's is 1 / latency, not load
        p99 = percentile(best_p99.latencies, 99) * 1e3
        ok99 = "met" if p99 <= GOAL_P99_MS else "missed"
        okr = "met" if best_rate.rate >= GOAL_RATE else "missed"
        print(
            f"{policy}: goal p99 <= {GOAL_P99_MS:g} ms streamed: {ok99} "
            f"(best {p99:.2f} ms, {best_p99.name}); goal >= {GOAL_RATE:,.0f} decisions/s: {okr} "
            f"(best {best_rate.rate:,.0f}/s, {best_rate.name})"
        )
