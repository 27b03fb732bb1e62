"""tools/eval_tables.py: goodput over seeds with t intervals, on hand-made reports."""

from __future__ import annotations

import math
from typing import Any

import pytest

from tools.eval_tables import goodput_table, knee_tables, mean_ci, seeds_table, tiers_table


def report(
    goodput: dict[str, tuple[float, float | None]], knee: float | None = 8.0
) -> dict[str, Any]:
    """A sweep report: each policy's (goodput load, sessions per instance there)."""
    loads = [2.0, 4.0, 8.0]
    return {
        "goodput": {
            "loads": loads,
            "repeats": [1, 2, 4],
            "policies": {
                name: {
                    "slo_attainment": [0.97, 0.93, 0.8 if knee else 0.91],
                    "goodput_load": load if knee else 8.0,
                    "knee_load": knee,
                    "goodput_sessions_per_instance": sessions,
                }
                for name, (load, sessions) in goodput.items()
            },
        }
    }


def test_mean_ci_is_students_t_over_the_values() -> None:
    mean, half = mean_ci([1.0, 2.0, 3.0])
    assert mean == 2.0
    assert half == pytest.approx(4.303 * 1.0 / math.sqrt(3))  # t(0.975, 2 df) x s / sqrt(n)
    assert mean_ci([5.0, 5.0]) == (5.0, 0.0)
    assert math.isnan(mean_ci([5.0])[1])
    with pytest.raises(ValueError, match="no values"):
        mean_ci([])


def test_seeds_table_pairs_elastic_with_each_baseline_by_seed() -> None:
    seeds = [
        report({"ear": (2.0, 5.0), "sticky": (3.0, 7.0), "elastic": (3.0, 7.1)}),
        report({"ear": (2.5, 6.0), "sticky": (3.5, 8.0), "elastic": (3.2, 7.4)}),
        report({"ear": (2.6, 6.4), "sticky": (2.9, 6.9), "elastic": (3.4, 7.9)}),
    ]
    lines = {line.split(" | ")[0].strip("| "): line for line in seeds_table(seeds).splitlines()}
    # ear: load differences 1.0, 0.7, 0.8 -> mean 0.83, s 0.153, 4.303 x s / sqrt(3) = 0.38
    assert "| +0.833 ± 0.38 | yes |" in lines["ear"]
    # sessions per instance 5.0, 6.0, 6.4: mean 5.80, s 0.721, half-width 1.79
    assert "| 2, 2.5, 2.6 | 5.80 ± 1.79 |" in lines["ear"]
    # sticky: differences 0, -0.3, 0.5 -> the interval holds 0
    assert lines["sticky"].endswith("| no |")
    assert "| – | – |" in lines["elastic"]


def test_a_policy_that_never_reached_its_knee_reads_as_a_lower_bound() -> None:
    seeds = [
        report({"ear": (2.0, 5.0), "elastic": (3.0, 6.0)}, knee=None),
        report({"ear": (2.0, 5.0), "elastic": (3.0, 6.0)}),
    ]
    assert "| elastic | ≥ 8, 3 |" in seeds_table(seeds)
    curve = goodput_table(seeds[0])
    assert "| **0.910** | **≥ 8** | 6.00 |" in curve


def test_open_loop_seeds_spread_the_goodput_load() -> None:
    seeds = [report({"ear": (2.0, None), "elastic": (3.0, None)}) for _ in range(2)]
    table = seeds_table(seeds)
    assert "| goodput load per seed | mean ± 95% CI |" in table
    assert "| ear | 2, 2 | 2.00 ± 0.00 | +1 ± 0.00 | yes |" in table


def test_curve_marks_loads_above_the_knee_as_not_run() -> None:
    sweep = report({"ear": (4.0, 2.0), "elastic": (4.0, 3.0)})
    sweep["goodput"]["policies"]["ear"]["slo_attainment"] = [0.95, 0.85, None]
    sweep["goodput"]["policies"]["ear"]["goodput_load"] = 2.0
    table = goodput_table(sweep)
    assert "| ear | 0.950 | 0.850 | – | 2 | 2.00 |" in table
    assert "Copies of each session replayed per load: 1, 2, 4." in table


def test_tiers_table_pairs_each_policy_without_and_with_the_tier() -> None:
    def rows(apc: dict[str, float]) -> dict[str, Any]:
        return {
            "policies": {
                name: {"hotspot_index": 0.1, "ttft_p90": 1.0 - a, "apc": a, "slo_attainment": 0.9}
                for name, a in apc.items()
            }
        }

    text = tiers_table(rows({"a": 0.1, "b": 0.2}), rows({"a": 0.4, "b": 0.3, "c": 0.5}))
    lines = text.splitlines()
    assert len(lines) == 4  # c ran with the tier only: no pair, no row
    assert lines[2].startswith(
        "| a | **0.100** / **0.100** | 0.900 / **0.600** | 0.100 / **0.400**"
    )
    assert lines[3].startswith(
        "| b | **0.100** / **0.100** | **0.800** / 0.700 | **0.200** / 0.300"
    )


def knee_report(loads: dict[str, list[float]], p90: dict[str, list[float]]) -> dict[str, Any]:
    """A `kvsched knee` report: each policy's goodput load and TTFT p90 per seed."""
    seeds = range(len(next(iter(loads.values()))))
    return {
        "policies": list(loads),
        "reference_policies": ["llmd"],
        "seeds": {
            str(s): {
                "reference_load": loads["llmd"][s],
                "policies": {
                    name: {
                        "goodput_load": loads[name][s],
                        "knee_load": loads[name][s] * 1.02,
                        "sessions_per_instance": loads[name][s] / 4,
                        "at_reference": {
                            "slo_attainment": 0.9,
                            "ttft_mean": 0.5,
                            "ttft_p90": p90[name][s],
                            "ttft_p99": 3.0,
                            "apc": 0.8,
                            "hotspot_index": 0.1,
                        },
                    }
                    for name in loads
                },
            }
            for s in seeds
        },
    }


def test_knee_tables_pair_the_ratios_by_seed() -> None:
    text = knee_tables(
        knee_report(
            {"llmd": [40, 44, 42], "elastic": [52, 57.2, 54.6]},
            {"llmd": [1.0, 2.0, 1.5], "elastic": [0.6, 1.2, 0.9]},
        )
    )
    rows = {line.split(" | ")[0].strip("| "): line for line in text.splitlines() if "|" in line}
    goodput_row = next(line for line in text.splitlines() if line.startswith("| llmd | 40"))
    assert "1.300 ± 0.000 | yes" in goodput_row  # 1.3x on every seed
    p90_row = next(line for line in text.splitlines() if line.startswith("| llmd | 0.900"))
    assert "0.600 ± 0.000 | yes" in p90_row
    assert "elastic" in rows and "(40, 44, 42; the best of llmd)" in text
    mixed = knee_tables(
        knee_report(
            {"llmd": [40, 44, 42], "elastic": [44, 44, 40]},
            {"llmd": [1.0, 1.0, 1.0], "elastic": [1.0, 1.0, 1.0]},
        )
    )
    assert "| no |" in next(line for line in mixed.splitlines() if line.startswith("| llmd | 40"))


def test_a_policy_not_searched_appears_only_at_the_reference_load() -> None:
    report = knee_report(
        {"llmd": [40, 44], "elastic": [44, 48], "sticky": [0, 0]},
        {"llmd": [1.0, 1.0], "elastic": [0.9, 0.9], "sticky": [2.0, 2.0]},
    )
    report["searched"] = ["llmd", "elastic"]
    for seed, ceiling in zip(report["seeds"].values(), (0.95, 0.97), strict=True):
        seed["apc_ceiling"] = ceiling
    text = knee_tables(report)
    assert "APC ceiling at the reference load, per seed: 0.950, 0.970." in text
    assert not any(line.startswith("| sticky | 0, 0") for line in text.splitlines())
    assert "replayed at the reference load only: sticky." in text
    assert any(line.startswith("| sticky | 0.900 |") for line in text.splitlines())
