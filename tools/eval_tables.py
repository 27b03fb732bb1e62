"""Print the compact markdown tables of docs/evaluation.md from out/eval/*/report.json (a
sweep's report as SLO attainment per load and goodput).

.venv/bin/python tools/eval_tables.py [out/eval]
"""

from __future__ import annotations

import json
import sys
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
    return "\n".join(lines)


def goodput_table(report: dict[str, Any]) -> str:
    """SLO attainment per swept load and the goodput, one row a policy (a sweep's report)."""
    sweep = report["goodput"]
    loads = sweep["loads"]
    rows = sweep["policies"]
    best = [max(row["slo_attainment"][i] for row in rows.values()) for i in range(len(loads))]
    top = max(row["goodput_load"] for row in rows.values())
    head = " | ".join(f"load {load:g}" for load in loads)
    lines = [f"| policy | {head} | goodput |", "|---|" + "---:|" * (len(loads) + 1)]
    for name, row in rows.items():
        cells = [
            f"**{v:.3f}**" if v == best[i] else f"{v:.3f}"
            for i, v in enumerate(row["slo_attainment"])
        ]
        g = f"{row['goodput_load']:g}"
        cells.append(f"**{g}**" if row["goodput_load"] == top else g)
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    root = Path(sys.argv[1] if len(sys.argv) > 1 else "out/eval")
    for path in sorted(root.glob("*/report.json")):
        report = json.loads(path.read_text())
        print(f"### {path.parent.name}\n")
        print(goodput_table(report) if "goodput" in report else table(report))
        print()


if __name__ == "__main__":
    main()
