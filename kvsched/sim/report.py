"""The comparison report: a markdown table for people, `report.json` for scripts."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

# Columns of the markdown table: key, header, format.
TABLE = (
    ("ttft_mean", "TTFT mean", "{:.3f}"),
    ("ttft_p50", "TTFT p50", "{:.3f}"),
    ("ttft_p90", "TTFT p90", "{:.3f}"),
    ("ttft_p99", "TTFT p99", "{:.3f}"),
    ("tpot_p90", "TPOT p90", "{:.4f}"),
    ("e2e_p90", "E2E p90", "{:.2f}"),
    ("apc", "APC", "{:.3f}"),
    ("apc_transfer", "APC xfer", "{:.3f}"),
    ("apc_load", "APC load", "{:.3f}"),
    ("hotspot_index", "Hotspot", "{:.3f}"),
    ("hotspot_pmr", "HPMR", "{:.2f}"),
    ("hotspot_cv", "HCV", "{:.2f}"),
    ("amplification", "Ampl.", "{:.2f}"),
    ("slo_attainment", "SLO att.", "{:.3f}"),
    ("goodput_load", "Goodput", "{:g}"),
    ("goodput_sessions_per_instance", "Sess./inst.", "{:.2f}"),
    ("completed", "Done", "{:d}"),
    ("rejected", "Rej.", "{:d}"),
    ("migrations", "Migr.", "{:d}"),
)


def markdown_table(rows: Mapping[str, Mapping[str, Any]]) -> str:
    """One line per policy; the best value of each column in bold."""
    best = _best_per_column(rows)
    columns = [c for c in TABLE if any(c[0] in row for row in rows.values())]
    header = "| policy | " + " | ".join(h for _, h, _ in columns) + " |"
    rule = "|---|" + "---:|" * len(columns)
    lines = [header, rule]
    for name, row in rows.items():
        cells = []
        for key, _, fmt in columns:
            value = row.get(key)
            text = _fmt(value, fmt)
            if key in best and value == best[key] and text != "–":
                text = f"**{text}**"
            cells.append(text)
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


_LOWER_BETTER = {
    "ttft_mean",
    "ttft_p50",
    "ttft_p90",
    "ttft_p99",
    "tpot_p90",
    "e2e_p90",
    "hotspot_index",
    "hotspot_pmr",
    "hotspot_cv",
    "amplification",
}
_HIGHER_BETTER = {"apc", "slo_attainment", "goodput_load", "goodput_sessions_per_instance"}


def _best_per_column(rows: Mapping[str, Mapping[str, Any]]) -> dict[str, float]:
    best: dict[str, float] = {}
    for key in _LOWER_BETTER | _HIGHER_BETTER:
        values = [float(r[key]) for r in rows.values() if _finite(r.get(key))]
        if values:
            best[key] = min(values) if key in _LOWER_BETTER else max(values)
    return best


def _fmt(value: Any, fmt: str) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "–"
    try:
        return fmt.format(value)
    except (ValueError, TypeError):
        return str(value)


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and math.isfinite(value)


def to_jsonable(value: Any) -> Any:
    """Replace NaN/inf by None (JSON has no NaN) and numpy scalars by Python numbers."""
    if isinstance(value, dict):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [to_jsonable(v) for v in value]
    if hasattr(value, "item") and not isinstance(value, str):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def write_report(path: Path, report: Mapping[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        json.dumps(to_jsonable(report), indent=2, sort_keys=False) + "\n", encoding="utf-8"
    )
