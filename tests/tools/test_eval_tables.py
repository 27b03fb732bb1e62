"""tools/eval_tables.py: goodput over seeds with t intervals, on hand-made reports."""

from __future__ import annotations

import math
from typing import Any

import pytest

from tools.eval_tables import goodput_table, mean_ci, seeds_table


def report(per_instance: dict[str, float], knee: float | None = 8.0) -> dict[str, Any]:
    """A sweep report whose policies reach `per_instance` sessions per instance at load 4."""
    loads = [2.0, 4.0, 8.0]
    return {
        "goodput": {
            "loads": loads,
            "repeats": [1, 2, 4],
            "policies": {
                name: {
                    "slo_attainment": [0.97, 0.93, 0.8 if knee else 0.91],
                    "goodput_load": 4.0 if knee else 8.0,
                    "knee_load": knee,
                    "goodput_sessions_per_instance": value,
                }
                for name, value in per_instance.items()
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
        report({"ear": 2.0, "sticky": 3.0, "elastic": 3.0}),
        report({"ear": 2.5, "sticky": 3.5, "elastic": 3.2}),
        report({"ear": 2.6, "sticky": 2.9, "elastic": 3.4}),
    ]
    lines = {line.split(" | ")[0].strip("| "): line for line in seeds_table(seeds).splitlines()}
    # ear: differences 1.0, 0.7, 0.8 -> mean 0.83, s 0.153, half-width 4.303 x s / sqrt(3) = 0.38
    assert "+0.83 ± 0.38 | yes" in lines["ear"]
    assert "2.00, 2.50, 2.60 | 2.37 ± " in lines["ear"]
    # sticky: differences 0, -0.3, 0.5 -> the interval holds 0
    assert lines["sticky"].endswith("| no |")
    assert "| – | – |" in lines["elastic"]


def test_a_policy_that_never_reached_its_knee_reads_as_a_lower_bound() -> None:
    seeds = [report({"ear": 2.0, "elastic": 3.0}, knee=None), report({"ear": 2.0, "elastic": 3.0})]
    assert "≥ 3.00" in seeds_table(seeds)
    curve = goodput_table(seeds[0])
    assert "| **0.910** | **≥ 8** | 3.00 |" in curve


def test_curve_marks_loads_above_the_knee_as_not_run() -> None:
    sweep = report({"ear": 2.0, "elastic": 3.0})
    sweep["goodput"]["policies"]["ear"]["slo_attainment"] = [0.95, 0.85, None]
    sweep["goodput"]["policies"]["ear"]["goodput_load"] = 2.0
    table = goodput_table(sweep)
    assert "| ear | 0.950 | 0.850 | – | 2 | 2.00 |" in table
    assert "Copies of each session replayed per load: 1, 2, 4." in table
