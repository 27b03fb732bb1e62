"""Prometheus reaches what the monitors scrape: in every rendered target with the monitoring
component, each container port a ServiceMonitor or PodMonitor scrapes (the dev engines'
`engine-N` beside their Messenger included) is admitted from Prometheus's namespace by a
NetworkPolicy."""

from __future__ import annotations

import copy

import pytest

from tests.deploy.render import Doc, targets
from tests.deploy.scrapes import admitted, scrapes

TARGETS = [t.name for t in targets()]


def test_production_and_dev_with_monitoring_scrape(rendered: dict[str, tuple[Doc, ...]]) -> None:
    monitored = {name for name, docs in rendered.items() if list(scrapes(docs))}
    assert monitored == {
        "overlays/production",
        "overlays/production+jaeger",
        "overlays/dev+monitoring",
    }


@pytest.mark.parametrize("target", TARGETS)
def test_every_scraped_port_is_open_to_prometheus(
    rendered: dict[str, tuple[Doc, ...]], target: str
) -> None:
    docs = rendered[target]
    closed = [s for s in scrapes(docs) if not admitted(docs, s)]
    assert closed == []


def test_dev_engines_beside_their_messenger_are_scraped_on_their_own_ports(
    rendered: dict[str, tuple[Doc, ...]],
) -> None:
    scraped = {
        (s.monitor, s.workload, s.port_name) for s in scrapes(rendered["overlays/dev+monitoring"])
    }
    messenger = "DaemonSet/kvsched-messenger"
    assert {
        ("PodMonitor/kvsched-engine", messenger, "engine-0"),
        ("PodMonitor/kvsched-engine", messenger, "engine-1"),
        ("PodMonitor/kvsched-messenger", messenger, "http"),
        ("ServiceMonitor/kvsched-conductor", "StatefulSet/kvsched-conductor", "http"),
        ("ServiceMonitor/kvsched-router", "Deployment/kvsched-router", "http"),
    } <= scraped
    assert ("PodMonitor/kvsched-engine", messenger, "http") not in scraped
    assert not [s for s in scraped if s[2] == "grpc"]


def test_a_scraped_port_no_policy_opens_is_caught(rendered: dict[str, tuple[Doc, ...]]) -> None:
    docs = copy.deepcopy(rendered["overlays/dev+monitoring"])
    (engines,) = [
        d
        for d in docs
        if d["kind"] == "NetworkPolicy" and d["metadata"]["name"] == "kvsched-engine"
    ]
    engines["spec"]["ingress"] = engines["spec"]["ingress"][:1]  # the Routers' rule only
    closed = {s.port_name for s in scrapes(docs) if not admitted(docs, s)}
    assert closed == {"engine-0", "engine-1"}
