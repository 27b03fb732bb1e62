"""The monitoring component (`deploy/components/monitoring`), offline: every alert and panel
expression is well-formed PromQL over the services' metric families, the dashboard is a
Grafana dashboard (panels with targets, unique ids, laid out on the grid), the monitors and
the rule validate against prometheus-operator's CRD schemas (`deploy/crds/`), and the
production overlay ships the component. `test_metrics_exported.py` checks the names against
a running cluster; `test_scrapes.py` that the NetworkPolicies let Prometheus scrape."""

from __future__ import annotations

import re
from typing import Any

import pytest

from tests.conftest import REPO
from tests.deploy.monitoring import (
    DASHBOARD,
    MONITORING,
    RULES,
    Query,
    alert_queries,
    dashboard,
    dashboard_queries,
    load_yaml,
    used_metrics,
)
from tests.deploy.promql import check
from tests.deploy.render import Target, render
from tests.deploy.validation import crd_schemas, custom_errors

# Where each metric family comes from: the scrape target whose /metrics exports it.
SERVICE_PREFIXES = ("kvsched_conductor_", "kvsched_router_", "kvsched_messenger_", "vllm:")
LABELS = {"app.kubernetes.io/name": "kvsched", "app.kubernetes.io/part-of": "kvsched"}


@pytest.mark.parametrize("query", alert_queries() + dashboard_queries(), ids=lambda q: q.where)
def test_every_expression_is_well_formed(query: Query) -> None:
    check(query.expr)


def test_every_metric_used_comes_from_a_scraped_service() -> None:
    used = used_metrics()
    assert used, "no metric found in the alerts and the dashboard"
    strays = {name: where for name, where in used.items() if not name.startswith(SERVICE_PREFIXES)}
    assert not strays


def test_the_alerts_the_issue_asks_for_are_there_and_described() -> None:
    (rule,) = load_yaml(RULES)
    rules = [r for group in rule["spec"]["groups"] for r in group["rules"]]
    names = [r["alert"] for r in rules]
    assert len(names) == len(set(names))
    assert {
        "KvschedNoConductorLeader",
        "KvschedKvEventLagGrowing",
        "KvschedRejectionRate",
        "KvschedTransfersFailing",
        "KvschedRouterFallback",
        "KvschedPersistBacklog",
    } <= set(names)
    for r in rules:
        assert r["labels"]["severity"] in ("warning", "critical"), r["alert"]
        assert r["annotations"]["summary"] and r["annotations"]["description"], r["alert"]
        assert re.fullmatch(r"\d+[smh]", r["for"]), r["alert"]
    leader = next(r for r in rules if r["alert"] == "KvschedNoConductorLeader")
    assert leader["for"] == "10s"
    assert "absent(kvsched_conductor_is_leader)" in leader["expr"]  # no Conductor scraped at all


def test_the_dashboard_is_a_grafana_dashboard() -> None:
    body = dashboard()
    assert body["uid"] and body["title"] and isinstance(body["schemaVersion"], int)
    panels = body["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    variables = {v["name"] for v in body["templating"]["list"]}
    cells: set[tuple[int, int]] = set()
    for panel in panels:
        grid = panel["gridPos"]
        assert grid["w"] > 0 and grid["h"] > 0 and grid["x"] + grid["w"] <= 24, panel["title"]
        mine = {(x, y) for x in range(grid["x"], grid["x"] + grid["w"])
                for y in range(grid["y"], grid["y"] + grid["h"])}  # fmt: skip
        assert not cells & mine, f"{panel['title']!r} overlaps another panel"
        cells |= mine
        if panel["type"] == "row":
            continue
        assert panel["type"] in ("timeseries", "stat", "gauge", "heatmap", "state-timeline")
        targets = panel["targets"]
        assert targets, f"{panel['title']!r} has no query"
        refs = [t["refId"] for t in targets]
        assert len(refs) == len(set(refs)), panel["title"]
        for target in targets:
            for var in re.findall(r"\$\{?(\w+)", target["expr"]):
                assert var.startswith("__") or var in variables, (panel["title"], var)
        assert panel["datasource"]["uid"] == "${datasource}"


def test_the_dashboard_has_the_panels_an_operator_looks_at_first() -> None:
    panels = {p["title"]: p for p in dashboard()["panels"] if p["type"] != "row"}
    wanted = {
        "Decisions/s": "kvsched_conductor_decisions_total",
        "Decision latency": "kvsched_conductor_decision_seconds_bucket",
        "Cache-hit share of prompt tokens per instance": "vllm:prefix_cache_hits_total",
        "Pending prefill per instance (hotspots)": "kvsched_conductor_instance_pending_prefill",
        "Migrations and transfers/s": "kvsched_conductor_transfers_total",
        "Transfer throughput": "kvsched_conductor_transfer_bytes_total",
        "Rejections/s": "kvsched_router_shed_total",
        "Conductor leader": "kvsched_conductor_is_leader",
    }
    for title, metric in wanted.items():
        assert any(metric in t["expr"] for t in panels[title]["targets"]), title


def monitoring_objects() -> list[dict[str, Any]]:
    return [doc for path in sorted(MONITORING.glob("*.yaml")) for doc in load_yaml(path)
            if doc["kind"] not in ("Kustomization", "Component")]  # fmt: skip


def _name(obj: dict[str, Any]) -> str:
    return f"{obj['kind']}/{obj['metadata']['name']}"


def custom_resources() -> list[dict[str, Any]]:
    return [o for o in monitoring_objects() if o["apiVersion"].startswith("monitoring.coreos.com/")]


@pytest.mark.parametrize("obj", custom_resources(), ids=_name)
def test_each_custom_resource_validates_against_its_crd(obj: dict[str, Any]) -> None:
    assert custom_errors(obj, crd_schemas()) == []


def test_a_field_the_crd_does_not_name_is_an_error() -> None:
    monitor = next(o for o in custom_resources() if o["kind"] == "ServiceMonitor")
    monitor["spec"]["endpoints"][0]["metricRelabeling"] = []  # a typo: ...Relabelings
    assert any("metricRelabeling" in e for e in custom_errors(monitor, crd_schemas()))


def test_the_monitors_scrape_each_component_on_its_port_named_http() -> None:
    scraped = {}
    for obj in custom_resources():
        if obj["kind"] not in ("ServiceMonitor", "PodMonitor"):
            continue
        assert LABELS.items() <= obj["metadata"]["labels"].items()
        selector = obj["spec"]["selector"]
        component = selector["matchLabels"].get("app.kubernetes.io/component")
        endpoints = obj["spec"].get("endpoints") or obj["spec"]["podMetricsEndpoints"]
        if component is not None:
            assert [e["port"] for e in endpoints] == ["http"]
            scraped[component] = obj["kind"]
    assert scraped == {
        "conductor": "ServiceMonitor",
        "router": "ServiceMonitor",
        "messenger": "PodMonitor",
    }


@pytest.mark.parametrize(
    ("component", "port", "kept"),
    [
        ("vllm", "http", True),
        ("engine", "http", True),
        ("messenger", "engine-0", True),  # dev: simulated engines in the Messenger's pod
        ("messenger", "engine-12", True),
        ("messenger", "http", False),  # the Messenger's own metrics: its PodMonitor's
        ("messenger", "grpc", False),
        ("vllm", "kv-events", False),
        ("router", "http", False),
    ],
)
def test_the_engine_monitor_keeps_each_engines_port_only(
    component: str, port: str, kept: bool
) -> None:
    (monitor,) = [o for o in custom_resources() if o["metadata"]["name"] == "kvsched-engine"]
    (expression,) = monitor["spec"]["selector"]["matchExpressions"]
    assert expression["key"] == "app.kubernetes.io/component"
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert "port" not in endpoint  # every container port is a candidate: the relabeling keeps
    (keep,) = endpoint["relabelings"]
    assert keep["action"] == "keep"
    # Prometheus anchors a relabeling's regex at both ends.
    matched = re.fullmatch(keep["regex"], f"{component}{keep['separator']}{port}") is not None
    assert matched == kept and (not kept or component in expression["values"])


def test_production_ships_the_component_with_the_dashboard_in_a_labelled_configmap() -> None:
    objects = render(Target(REPO / "deploy" / "overlays" / "production"))
    kinds = [o["kind"] for o in objects]
    assert kinds.count("ServiceMonitor") == 2 and kinds.count("PodMonitor") == 2
    assert kinds.count("PrometheusRule") == 1
    (board,) = [o for o in objects if o["metadata"]["name"] == "kvsched-dashboard"]
    assert board["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert board["metadata"]["namespace"] == "kvsched"
    assert board["data"]["kvsched.json"] == DASHBOARD.read_text()
