"""The tests' PromQL reader: the metric names it finds, and the mistakes it refuses."""

from __future__ import annotations

import pytest

from tests.deploy.promql import PromqlError, check, label_names, metric_names


@pytest.mark.parametrize(
    ("expr", "names"),
    [
        ("up", {"up"}),
        ('vllm:prefix_cache_hits_total{namespace="$namespace"}', {"vllm:prefix_cache_hits_total"}),
        (
            "histogram_quantile(0.99, sum by (namespace, le) "
            "(rate(kvsched_conductor_kv_event_lag_seconds_bucket[5m])))",
            {"kvsched_conductor_kv_event_lag_seconds_bucket"},
        ),
        (
            "sum(rate(a_total[5m] offset 10m))"
            " / sum without (pod) (rate(b_count[$__rate_interval]))",
            {"a_total", "b_count"},
        ),
        ("x and on (pod) (y == 1) or absent(z)", {"x", "y", "z"}),
        ("a * on (pod) group_left (node) b > bool 1e-3", {"a", "b"}),
        ("max_over_time(deriv(g[10m:1m])[1h:])", {"g"}),
        ('sum(x{outcome=~"rejected|overloaded", kind!="a,b}"}) by (kind)', {"x"}),
        ("1 - kvsched_router_conductor_up", {"kvsched_router_conductor_up"}),
    ],
)
def test_it_finds_every_selected_metric_and_nothing_else(expr: str, names: set[str]) -> None:
    assert metric_names(expr) == names


def test_it_finds_the_labels_matched_grouped_and_joined_on() -> None:
    expr = (
        'sum by (namespace, le) (rate(x_bucket{kind="a", outcome=~"b"}[5m]))'
        " and on (pod) group_left (node) y"
    )
    assert label_names(expr) == {"namespace", "le", "kind", "outcome", "pod", "node"}
    assert label_names("sum(rate(x[5m])) / 2") == set()


@pytest.mark.parametrize(
    ("expr", "why"),
    [
        ("", "empty"),
        ("sum(rate(x[5m])", "unclosed"),
        ("rate(x[5m]))", "unbalanced"),
        ("x{a=b}", "must be a string"),
        ('x{a=="b"}', "operator"),
        ('x{a="b"', "end"),
        ("ratee(x[5m])", "unknown function"),
        ("rate(x[5 m])", "bad range"),
        ("x offset", "duration"),
        ("sum by x", "labels"),
        ("x # y", "unexpected"),
        ("histogram_quantile", "needs its arguments"),
    ],
)
def test_a_malformed_expression_is_refused(expr: str, why: str) -> None:
    with pytest.raises(PromqlError, match=why):
        check(expr)
