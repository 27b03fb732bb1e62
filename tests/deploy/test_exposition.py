"""Check 4's reading of /metrics: families declared without a sample still count as exported,
a kvsched `instance` label is stored as `kvsched_instance`, and a query naming a label its
metrics lack is reported."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from tests.deploy.exposition import (
    component_of,
    families,
    labels_by_sample,
    sample_names,
    total,
    unknown_labels,
)
from tests.deploy.monitoring import Query


def exposition() -> str:
    registry = CollectorRegistry()
    Counter("kvsched_router_fallback", "never incremented", ["reason"], registry=registry)
    Histogram("kvsched_conductor_decision_seconds", "one", registry=registry).observe(0.001)
    placed = Counter("kvsched_conductor_decisions", "two", ["outcome"], registry=registry)
    placed.labels("placed").inc(2)
    pending = Gauge("kvsched_conductor_instance_pending_prefill_tokens", "", ["instance"],
                    registry=registry)  # fmt: skip
    pending.labels("node-0-e0").set(5)
    return generate_latest(registry).decode()


def test_a_declared_family_exports_its_sample_names_before_any_sample() -> None:
    names = sample_names(families(exposition()))
    assert "kvsched_router_fallback_total" in names  # declared, no sample yet
    assert {"kvsched_conductor_decision_seconds_bucket", "kvsched_conductor_decision_seconds_sum",
            "kvsched_conductor_decision_seconds_count"} <= names  # fmt: skip
    assert "kvsched_conductor_decisions_total" in names
    assert "kvsched_conductor_decisions" not in names  # a counter's samples end in _total


def test_labels_are_those_prometheus_stores() -> None:
    labels = labels_by_sample(families(exposition()))
    assert labels["kvsched_conductor_instance_pending_prefill_tokens"] == {"kvsched_instance"}
    assert labels["kvsched_conductor_decisions_total"] == {"outcome"}
    assert "kvsched_router_fallback_total" not in labels  # no sample: labels unknown


def test_a_query_naming_a_label_its_metrics_lack_is_reported() -> None:
    scraped = families(exposition())
    queries = [
        Query("good", "sum by (outcome, namespace) (rate(kvsched_conductor_decisions_total[1m]))"),
        Query(
            "legend", "kvsched_conductor_instance_pending_prefill_tokens", "{{kvsched_instance}}"
        ),
        Query("bad", 'sum by (kind) (rate(kvsched_conductor_decisions_total{reason="x"}[1m]))'),
        Query("unknowable", "sum by (nonsense) (rate(kvsched_router_fallback_total[1m]))"),
    ]
    assert unknown_labels(scraped, queries) == {"bad": {"kind", "reason"}}
    assert total(scraped, "kvsched_conductor_decisions_total", outcome="placed") == 2


def test_each_family_is_looked_for_at_the_component_that_exports_it() -> None:
    assert component_of("kvsched_conductor_is_leader") == "conductor"
    assert component_of("kvsched_messenger_transfer_bytes_total") == "messenger"
    assert component_of("vllm:prefix_cache_hits_total") == "engine"
