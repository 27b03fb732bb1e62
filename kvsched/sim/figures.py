"""PNG figures of a comparison: headline bars, TTFT CDFs, per-instance load heatmaps."""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from kvsched.sim.records import ReplayResult

HEADLINES = (
    ("ttft_p90", "TTFT p90 (s)", "lower is better"),
    ("apc", "APC (prompt tokens reused)", "higher is better"),
    ("hotspot_index", "Hotspot index (queued prefill s, max − mean)", "lower is better"),
    ("hotspot_pmr", "HPMR (max/mean pending, busy instants)", "lower is better"),
    ("tpot_p90", "TPOT p90 (s)", "lower is better"),
    ("slo_attainment", "SLO attainment", "higher is better"),
    ("amplification", "Wall-clock amplification", "lower is better"),
)


def write_figures(
    out: Path,
    rows: Mapping[str, Mapping[str, Any]],
    results: Mapping[str, ReplayResult],
    ttfts: Mapping[str, np.ndarray],
    title: str,
    *,
    goodput: Mapping[str, Any] | None = None,
) -> list[Path]:
    """Write every figure into `out`; returns their paths."""
    out.mkdir(parents=True, exist_ok=True)
    paths = [_bars(out / "headline.png", rows, title), _cdf(out / "ttft_cdf.png", ttfts, title)]
    if goodput:
        paths.append(_goodput(out / "goodput.png", goodput, title))
    heat_dir = out / "heatmaps"
    heat_dir.mkdir(exist_ok=True)
    for name, result in results.items():
        paths.append(_heatmap(heat_dir / f"{_safe(name)}.png", name, result))
    return paths


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in name)


def _bars(path: Path, rows: Mapping[str, Mapping[str, Any]], title: str) -> Path:
    names = list(rows)
    metrics = [m for m in HEADLINES if any(_finite(rows[n].get(m[0])) for n in names)]
    cols = 3
    nrows = math.ceil(len(metrics) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(5.2 * cols, 3.6 * nrows), squeeze=False)
    colors = ["#d62728" if n.startswith("elastic") else "#4c72b0" for n in names]
    for ax, (key, label, hint) in zip(axes.flat, metrics, strict=False):
        values = [
            float(rows[n].get(key) or 0.0) if _finite(rows[n].get(key)) else 0.0 for n in names
        ]
        ax.barh(names, values, color=colors)
        ax.set_title(f"{label}\n({hint})", fontsize=10)
        ax.invert_yaxis()
        ax.tick_params(labelsize=8)
        for i, v in enumerate(values):
            ax.text(v, i, f" {v:.3g}", va="center", fontsize=7)
    for ax in list(axes.flat)[len(metrics) :]:
        ax.axis("off")
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _cdf(path: Path, ttfts: Mapping[str, np.ndarray], title: str) -> Path:
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for name, values in ttfts.items():
        if not len(values):
            continue
        xs = np.sort(values)
        ys = np.arange(1, len(xs) + 1) / len(xs)
        ax.plot(np.maximum(xs, 1e-3), ys, label=name, **_line_style(name))
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (s, log scale)")
    ax.set_ylabel("share of requests")
    ax.axhline(0.9, color="grey", linewidth=0.6, linestyle=":")
    ax.grid(True, which="both", linewidth=0.3)
    ax.legend(fontsize=8, loc="lower right")
    ax.set_title(f"TTFT CDF — {title}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _goodput(path: Path, goodput: Mapping[str, Any], title: str) -> Path:
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    loads = goodput["loads"]
    for name, curve in goodput["policies"].items():
        style = _line_style(name)
        # Loads above a policy's knee are not run (null): left out of its line.
        attained = [math.nan if a is None else a for a in curve["slo_attainment"]]
        ax.plot(loads, attained, marker="o", markersize=3, label=name, **style)
    ax.axhline(goodput["attainment_target"], color="grey", linewidth=0.8, linestyle=":")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("offered load (arrival-rate multiplier, log scale)")
    ax.set_ylabel("SLO attainment")
    ax.grid(True, which="both", linewidth=0.3)
    ax.legend(fontsize=8, loc="lower left")
    ax.set_title(f"Goodput sweep — {title}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _heatmap(path: Path, name: str, result: ReplayResult, bins: int = 200) -> Path:
    end = result.end_time
    grid = result.hotspot.heatmap(0.0, end, bins)
    fig, ax = plt.subplots(figsize=(10, 0.35 * grid.shape[0] + 1.6))
    image = ax.imshow(
        grid,
        aspect="auto",
        origin="lower",
        extent=(0.0, end, -0.5, grid.shape[0] - 0.5),
        cmap="magma",
        interpolation="nearest",
    )
    for start, source, target, _ in result.migrations.events:
        ax.annotate(
            "",
            xy=(start, target),
            xytext=(start, source),
            arrowprops={"arrowstyle": "->", "color": "#00e5ff", "linewidth": 0.7},
        )
    ax.set_xlabel("simulated time (s)")
    ax.set_ylabel("instance")
    ax.set_title(f"{name}: pending prefill tokens per instance (arrows: migrations)", fontsize=10)
    fig.colorbar(image, ax=ax, label="tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _line_style(name: str) -> dict[str, Any]:
    """Our policy stands out in every line plot."""
    if name.startswith("elastic"):
        return {"linewidth": 2.4, "color": "#d62728"}
    return {"linewidth": 1.2}


def _finite(value: object) -> bool:
    return isinstance(value, int | float) and math.isfinite(value)
