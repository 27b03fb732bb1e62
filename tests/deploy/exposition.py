"""Reading the services' /metrics as Prometheus will store it, for check 4: which sample names
each scrape target can export (a family is declared before any sample of it exists), which
labels its samples carry once the monitors relabel them, and which labels a query names that
its metrics do not have."""

from __future__ import annotations

import re
from collections.abc import Iterable

from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from tests.deploy.monitoring import Query
from tests.deploy.promql import label_names, metric_names

# The scrape target that exports each family, by its name's prefix.
COMPONENT = {
    "kvsched_conductor_": "conductor",
    "kvsched_router_": "router",
    "kvsched_messenger_": "messenger",
    "vllm:": "engine",
}
# The sample names a family of each type can have (the family named without them).
SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("", "_sum", "_count", "_created"),
    "info": ("_info",),
}
# The labels Prometheus gives every series it scrapes through prometheus-operator's monitors.
TARGET_LABELS = frozenset(
    {"namespace", "pod", "instance", "job", "service", "endpoint", "container"}
)
_LEGEND_LABEL = re.compile(r"\{\{\s*(\w+)\s*\}\}")


def families(text: str) -> list[Metric]:
    """The metric families of a /metrics answer (Prometheus's text format)."""
    return list(text_string_to_metric_families(text))


def component_of(name: str) -> str:
    """The component whose /metrics exports metric `name` (by its prefix)."""
    return next(c for prefix, c in COMPONENT.items() if name.startswith(prefix))


def sample_names(scraped: Iterable[Metric]) -> set[str]:
    """Every sample name the families can export, whether or not a sample was observed yet
    (a labelled counter nobody incremented is declared, with no sample)."""
    names: set[str] = set()
    for family in scraped:
        names.update(family.name + s for s in SUFFIXES.get(family.type, ("",)))
        names.update(sample.name for sample in family.samples)
    return names


def labels_by_sample(scraped: Iterable[Metric]) -> dict[str, set[str]]:
    """Each observed sample name's label names as Prometheus stores them: the monitors rename
    a kvsched `instance` label `kvsched_instance`."""
    labels: dict[str, set[str]] = {}
    for family in scraped:
        for sample in family.samples:
            names = {"kvsched_instance" if k == "instance" else k for k in sample.labels}
            labels.setdefault(sample.name, set()).update(names)
    return labels


def unknown_labels(scraped: Iterable[Metric], queries: Iterable[Query]) -> dict[str, set[str]]:
    """Per query, the labels it matches, groups by or shows in its legend that none of its
    metrics' samples has, nor Prometheus adds (queries whose metrics have no sample yet
    cannot be told, and are left out)."""
    observed = labels_by_sample(scraped)
    unknown = {}
    for query in queries:
        names = [n for n in metric_names(query.expr) if n in observed]
        if not names:
            continue
        seen = set().union(*(observed[n] for n in names)) | TARGET_LABELS
        wanted = label_names(query.expr) | set(_LEGEND_LABEL.findall(query.legend))
        if wanted - seen:
            unknown[query.where] = wanted - seen
    return unknown


def total(scraped: Iterable[Metric], sample_name: str, **labels: str) -> float:
    """The sum of the samples named `sample_name` whose labels include `labels`."""
    return sum(
        s.value
        for family in scraped
        for s in family.samples
        if s.name == sample_name and labels.items() <= s.labels.items()
    )
