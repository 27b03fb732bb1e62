"""Print the compact markdown tables of docs/evaluation.md from out/eval/*/report.json (a
sweep's report as SLO attainment per load and goodput).

.venv/bin/python tools/eval_tables.py [out/eval]
.venv/bin/python tools/eval_tables.py --seeds out/eval/weka_knee_seed0 out/eval/weka_knee_seed1 ...
    (goodput over seeds with 95% intervals, and the first seed's attainment per load)
.venv/bin/python tools/eval_tables.py --knee out/eval/knee_memory
    (`kvsched knee`'s goodput per seed with paired ratios and intervals, and every policy at
    the best baseline's goodput load)
.venv/bin/python tools/eval_tables.py --tiers out/eval/conv_tier0 out/eval/conv_tier4
    (each policy without and with the DRAM tier, side by side)
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

COLUMNS = (
    ("ttft_p50", "TTFT p50", "{:.3f}", min),
    ("ttft_p90", "TTFT p90", "{:.3f}", min),
    ("ttft_p99", "TTFT p99", "{:.2f}", min),
    ("tpot_p90", "TPOT p90", "{:.4f}", min),
    ("apc", "APC", "{:.3f}", max),
    ("hotspot_index", "Hotspot", "{:.3f}", min),
    ("hotspot_pmr", "HPMR", "{:.2f}", min),
    ("hot_time_share", "Hot time", "{:.2f}", min),
    ("persistent_skew", "Skew", "{:.2f}", min),
    ("amplification", "Ampl.", "{:.3f}", min),
    ("session_ratio_p90", "Sess. p90", "{:.3f}", min),
    ("slo_attainment", "SLO att.", "{:.3f}", max),
    ("goodput_load", "Goodput", "{:g}", max),
    ("migrations", "Migr.", "{:d}", None),
)


def table(report: dict[str, Any]) -> str:
    rows = report["policies"]
    cols = [c for c in COLUMNS if any(row.get(c[0]) is not None for row in rows.values())]
    best = {}
    for key, _, _, pick in cols:
        values = [row[key] for row in rows.values() if row.get(key) is not None]
        if pick is not None and values:
            best[key] = pick(values)
    lines = ["| policy | " + " | ".join(c[1] for c in cols) + " |", "|---|" + "---:|" * len(cols)]
    for name, row in rows.items():
        cells = []
        for key, _, fmt, _ in cols:
            value = row.get(key)
            text = "–" if value is None else fmt.format(value)
            cells.append(f"**{text}**" if value is not None and value == best.get(key) else text)
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    trace = report["trace"]
    lines.append(
        f"\nAPC ceilings over the measured window: {trace['ideal_apc_global']:.3f} (any session), "
        f"{trace['ideal_apc_session']:.3f} (same session only)."
    )
    floor = trace.get("ttft_floor")
    if floor:
        lines.append(
            "TTFT floor (each call alone on an idle instance, every reusable prefix in GPU "
            f"memory): p50 {floor['p50']:.3f}, p90 {floor['p90']:.3f}, p99 {floor['p99']:.2f}."
        )
    return "\n".join(lines)


PER_INSTANCE = "goodput_sessions_per_instance"


def goodput_table(report: dict[str, Any]) -> str:
    """SLO attainment per swept load and the goodput, one row a policy (a sweep's report).
    A load above a policy's knee that the sweep did not run reads `–`; closed loop adds the
    sessions in flight per instance at the goodput load."""
    sweep = report["goodput"]
    loads = sweep["loads"]
    rows = sweep["policies"]
    best = [
        max((row["slo_attainment"][i] for row in rows.values() if _ran(row, i)), default=None)
        for i in range(len(loads))
    ]
    top = max(row["goodput_load"] for row in rows.values())
    per_instance = any(
        row.get("goodput_sessions_per_instance") is not None for row in rows.values()
    )
    head = " | ".join(f"load {load:g}" for load in loads)
    extra = " | sessions/instance" if per_instance else ""
    lines = [
        f"| policy | {head} | goodput{extra} |",
        "|---|" + "---:|" * (len(loads) + 1 + per_instance),
    ]
    for name, row in rows.items():
        cells = []
        for i, v in enumerate(row["slo_attainment"]):
            text = "–" if v is None else f"{v:.3f}"
            cells.append(f"**{text}**" if v is not None and v == best[i] else text)
        g = ("≥ " if row.get("knee_load", 0) is None else "") + f"{row['goodput_load']:g}"
        cells.append(f"**{g}**" if row["goodput_load"] == top else g)
        if per_instance:
            cells.append(_num(row.get(PER_INSTANCE), "{:.2f}"))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    if "repeats" in sweep and any(k != 1 for k in sweep["repeats"]):
        copies = ", ".join(f"{k}" for k in sweep["repeats"])
        lines.append(f"\nCopies of each session replayed per load: {copies}.")
    return "\n".join(lines)


def _ran(row: dict[str, Any], i: int) -> bool:
    return row["slo_attainment"][i] is not None


def _num(value: float | None, fmt: str) -> str:
    return "–" if value is None else fmt.format(value)


# Two-sided 95% quantiles of Student's t by degrees of freedom (1-30); beyond, the normal's.
T95 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
    2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)  # fmt: skip


def mean_ci(values: Sequence[float]) -> tuple[float, float]:
    """Mean and the half-width of its 95% confidence interval (Student's t over the values,
    n-1 degrees of freedom; the half-width is NaN for a single value)."""
    n = len(values)
    if n == 0:
        raise ValueError("no values")
    mean = sum(values) / n
    if n == 1:
        return mean, math.nan
    var = sum((v - mean) ** 2 for v in values) / (n - 1)
    t = T95[n - 2] if n - 1 <= len(T95) else 1.96
    return mean, t * math.sqrt(var / n)


def goodput_by_seed(reports: Sequence[dict[str, Any]], key: str) -> dict[str, list[float | None]]:
    """Each policy's `key` (goodput load, sessions per instance), one value a report (seed),
    for the policies present in every report, in the first report's order."""
    names = [n for n in reports[0]["goodput"]["policies"]]
    names = [n for n in names if all(n in r["goodput"]["policies"] for r in reports)]
    return {n: [r["goodput"]["policies"][n].get(key) for r in reports] for n in names}


def seeds_table(reports: Sequence[dict[str, Any]], reference: str = "elastic") -> str:
    """Goodput per policy over the reports (seeds): the goodput load of each seed; closed loop,
    the sessions in flight per instance there, mean and 95% interval (open loop: the load's);
    and `reference` minus the policy in goodput load, paired by seed, with its interval and
    whether that excludes 0. The load, not the sessions in flight, is compared: at the same load
    a policy whose sessions finish sooner holds fewer of them in flight (Little's law). `≥`
    marks a policy that never fell below the target on some seed (a lower bound)."""
    loads = goodput_by_seed(reports, "goodput_load")
    sessions = goodput_by_seed(reports, PER_INSTANCE)
    closed = any(v is not None for vals in sessions.values() for v in vals)
    ref = loads.get(reference)
    spread_head = "sessions/instance, mean ± 95% CI" if closed else "mean ± 95% CI"
    lines = [
        f"| policy | goodput load per seed | {spread_head} | {reference} − policy (load) "
        "| excludes 0 |",
        "|---|---|---:|---:|:---:|",
    ]
    for name, vals in loads.items():
        censored = any(r["goodput"]["policies"][name]["knee_load"] is None for r in reports)
        mark = "≥ " if censored else ""
        spread_of = sessions[name] if closed else vals
        if any(v is None for v in vals) or any(v is None for v in spread_of):
            lines.append(f"| {name} | – | – | – | – |")
            continue
        per_seed = ", ".join(f"{v:g}" for v in vals if v is not None)
        m, h = mean_ci([v for v in spread_of if v is not None])
        diff, excl = "–", "–"
        if ref is not None and name != reference and all(v is not None for v in ref):
            d = [a - b for a, b in zip(ref, vals, strict=True) if a is not None and b is not None]
            dm, dh = mean_ci(d)
            diff = f"{dm:+.3g} ± {dh:.2f}"
            excl = "yes" if abs(dm) > dh else "no"
        lines.append(f"| {name} | {mark}{per_seed} | {m:.2f} ± {h:.2f} | {diff} | {excl} |")
    return "\n".join(lines)


def knee_tables(report: dict[str, Any], ours: str = "elastic") -> str:
    """`kvsched knee`'s report (knee.json) as two tables. Goodput: per policy the goodput
    load of each seed, the sessions in flight per instance there (mean ± 95% interval over
    the seeds), and `ours` over the policy in goodput load, the ratio paired by seed with its
    interval and whether that excludes 1 (the searched policies only). At the reference load
    (each seed's best baseline's goodput load): TTFT mean, p90 and p99, APC and the hotspot
    index, means over the seeds, and `ours`'s TTFT p90 over the policy's, paired by seed."""
    seeds = list(report["seeds"].values())
    names = report["policies"]

    def per_seed(name: str, key: str) -> list[float]:
        return [float(seed["policies"][name][key] or 0.0) for seed in seeds]

    def at_ref(name: str, key: str) -> list[float]:
        rows = [seed["policies"][name]["at_reference"] for seed in seeds]
        return [math.nan if row is None or row[key] is None else float(row[key]) for row in rows]

    def ratio(a: list[float], b: list[float]) -> tuple[str, str]:
        pairs = [x / y for x, y in zip(a, b, strict=True) if y and math.isfinite(x / y)]
        if len(pairs) < 2:
            return "–", "–"
        m, h = mean_ci(pairs)
        return f"{m:.3f} ± {h:.3f}", "yes" if abs(m - 1.0) > h else "no"

    refs = ", ".join(f"{seed['reference_load']:g}" for seed in seeds)
    lines = [
        f"| policy | goodput load per seed | sessions/instance, mean ± 95% CI | {ours} / policy "
        "(load) | excludes 1 |",
        "|---|---|---:|---:|:---:|",
    ]
    searched = report.get("searched", names)
    for name in searched:
        loads = per_seed(name, "goodput_load")
        censored = any(seed["policies"][name]["knee_load"] is None for seed in seeds)
        m, h = mean_ci(per_seed(name, "sessions_per_instance"))
        cell, excl = ("–", "–") if name == ours else ratio(per_seed(ours, "goodput_load"), loads)
        text = ("≥ " if censored else "") + ", ".join(f"{v:g}" for v in loads)
        lines.append(f"| {name} | {text} | {m:.2f} ± {h:.2f} | {cell} | {excl} |")
    unsearched = [name for name in names if name not in searched]
    if unsearched:
        lines += [
            "",
            f"Not searched, replayed at the reference load only: {', '.join(unsearched)}.",
        ]
    lines += [
        "",
        f"At each seed's reference load ({refs}; the best of "
        f"{', '.join(report['reference_policies'])}), means over the seeds:",
        "",
        f"| policy | SLO att. | TTFT mean | TTFT p90 | TTFT p99 | APC | Hotspot | {ours} / policy "
        "(TTFT p90) | excludes 1 |",
        "|---|---:|---:|---:|---:|---:|---:|---:|:---:|",
    ]
    for name in names:
        cells = [
            _mean_text(at_ref(name, key), fmt)
            for key, fmt in (
                ("slo_attainment", "{:.3f}"),
                ("ttft_mean", "{:.3f}"),
                ("ttft_p90", "{:.3f}"),
                ("ttft_p99", "{:.2f}"),
                ("apc", "{:.3f}"),
                ("hotspot_index", "{:.3f}"),
            )
        ]
        cell, excl = (
            ("–", "–")
            if name == ours
            else ratio(at_ref(ours, "ttft_p90"), at_ref(name, "ttft_p90"))
        )
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {cell} | {excl} |")
    ceilings = [seed.get("apc_ceiling") for seed in seeds]
    if all(c is not None for c in ceilings):
        lines += [
            "",
            "APC ceiling at the reference load, per seed: "
            + ", ".join(f"{c:.3f}" for c in ceilings)
            + ".",
        ]
    return "\n".join(lines)


def _mean_text(values: list[float], fmt: str) -> str:
    finite = [v for v in values if math.isfinite(v)]
    return fmt.format(sum(finite) / len(finite)) if finite else "–"


TIER_COLUMNS = (
    ("hotspot_index", "Hotspot", "{:.3f}", min),
    ("ttft_p90", "TTFT p90", "{:.3f}", min),
    ("apc", "APC", "{:.3f}", max),
    ("slo_attainment", "SLO att.", "{:.3f}", max),
)


def tiers_table(without: dict[str, Any], with_tier: dict[str, Any]) -> str:
    """Each policy of both reports as `without / with` the tier, a pair per column of
    `TIER_COLUMNS`; bold marks the best value of each half of a column."""
    names = [n for n in without["policies"] if n in with_tier["policies"]]
    halves = (without["policies"], with_tier["policies"])
    best = {
        (key, i): pick(rows[n][key] for n in names)
        for key, _, _, pick in TIER_COLUMNS
        for i, rows in enumerate(halves)
    }
    heads = " | ".join(f"{head} (no tier / tier)" for _, head, _, _ in TIER_COLUMNS)
    lines = [
        f"| policy | {heads} |",
        "|---|" + "---:|" * len(TIER_COLUMNS),
    ]
    for name in names:
        cells = []
        for key, _, fmt, _ in TIER_COLUMNS:
            pair = []
            for i, rows in enumerate(halves):
                text = fmt.format(rows[name][key])
                pair.append(f"**{text}**" if rows[name][key] == best[(key, i)] else text)
            cells.append(" / ".join(pair))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    if sys.argv[1:2] == ["--tiers"]:
        off, on = (json.loads((Path(d) / "report.json").read_text()) for d in sys.argv[2:4])
        print(tiers_table(off, on))
        return
    if sys.argv[1:2] == ["--knee"]:
        print(knee_tables(json.loads((Path(sys.argv[2]) / "knee.json").read_text())))
        return
    if sys.argv[1:2] == ["--seeds"]:
        reports = [json.loads((Path(d) / "report.json").read_text()) for d in sys.argv[2:]]
        print(seeds_table(reports))
        print(f"\n### {Path(sys.argv[2]).name}: SLO attainment per load\n")
        print(goodput_table(reports[0]))
        return
    root = Path(sys.argv[1] if len(sys.argv) > 1 else "out/eval")
    for path in sorted(root.glob("*/report.json")):
        report = json.loads(path.read_text())
        print(f"### {path.parent.name}\n")
        print(goodput_table(report) if "goodput" in report else table(report))
        print()


if __name__ == "__main__":
    main()
