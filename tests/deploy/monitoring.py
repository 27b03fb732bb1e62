"""What the monitoring component asks of Prometheus: every PromQL expression of its alerts
(`deploy/components/monitoring/prometheusrule.yaml`) and of its Grafana dashboard
(`dashboards/kvsched.json`), each with where it comes from, and the metric names they use."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tests.conftest import REPO
from tests.deploy.promql import metric_names

MONITORING = REPO / "deploy" / "components" / "monitoring"
DASHBOARD = MONITORING / "dashboards" / "kvsched.json"
RULES = MONITORING / "prometheusrule.yaml"


@dataclass(frozen=True, slots=True)
class Query:
    """One PromQL expression and where it is used (an alert, or a dashboard panel)."""

    where: str
    expr: str
    legend: str = ""  # a panel's legend format: `{{label}}` names a label of the result


def load_yaml(path: Path) -> list[dict[str, Any]]:
    """The YAML documents of `path` (empty ones left out)."""
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def dashboard() -> dict[str, Any]:
    body: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return body


def alert_queries() -> list[Query]:
    (rule,) = load_yaml(RULES)
    return [
        Query(f"alert {r['alert']}", r["expr"])
        for group in rule["spec"]["groups"]
        for r in group["rules"]
    ]


def dashboard_queries() -> list[Query]:
    return [
        Query(
            f"panel {panel['title']!r} {target['refId']}",
            target["expr"],
            target.get("legendFormat", ""),
        )
        for panel in dashboard()["panels"]
        for target in panel.get("targets", [])
    ]


def used_metrics() -> dict[str, list[str]]:
    """Every metric name the alerts and the dashboard use, with where each is used."""
    used: dict[str, list[str]] = {}
    for query in alert_queries() + dashboard_queries():
        for name in metric_names(query.expr):
            used.setdefault(name, []).append(query.where)
    return used
