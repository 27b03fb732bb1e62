"""What Prometheus scrapes in a rendered target, as prometheus-operator turns the monitors into
scrape targets, and whether the NetworkPolicies let it through: a ServiceMonitor's endpoint
port is a Service's port, reaching its target port on the pods the Service selects; a
PodMonitor's is a container port by name, or (no port named) every container port its `keep`
and `drop` relabelings let pass."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

from tests.deploy.render import Doc, containers, pod_templates

PROMETHEUS_NAMESPACE = "monitoring"  # where the base's kvsched-scrape expects Prometheus


@dataclass(frozen=True)
class Scrape:
    """One container port a monitor scrapes, on the pods of one workload."""

    monitor: str  # e.g. "PodMonitor/kvsched-engine"
    workload: str
    labels: tuple[tuple[str, str], ...]  # the pod template's
    port_name: str
    port_number: int


def selects(selector: Doc, labels: dict[str, str]) -> bool:
    """A label selector (matchLabels, and matchExpressions with In and NotIn) on `labels`."""
    if not all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expression in selector.get("matchExpressions", []):
        present = labels.get(expression["key"]) in expression.get("values", [])
        if present != (expression["operator"] == "In"):
            return False
    return True


def _meta_label(label: str) -> str:
    return "__meta_kubernetes_pod_label_" + re.sub(r"[^a-zA-Z0-9_]", "_", label)


def _kept(endpoint: Doc, labels: dict[str, str], container: Doc, port: Doc) -> bool:
    meta = {_meta_label(k): v for k, v in labels.items()}
    meta["__meta_kubernetes_pod_container_name"] = container["name"]
    meta["__meta_kubernetes_pod_container_port_name"] = port.get("name", "")
    for relabeling in endpoint.get("relabelings", []):
        action = relabeling.get("action", "replace")
        if action not in ("keep", "drop"):
            continue
        value = relabeling.get("separator", ";").join(
            meta.get(s, "") for s in relabeling.get("sourceLabels", [])
        )
        # Prometheus anchors a relabeling's regex at both ends.
        matched = re.fullmatch(relabeling.get("regex", "(.*)"), value) is not None
        if matched != (action == "keep"):
            return False
    return True


def scrapes(docs: tuple[Doc, ...]) -> Iterator[Scrape]:
    """Every container port the monitors among `docs` scrape on pods the pod network reaches
    (host-network pods aside: NetworkPolicies do not apply to them)."""
    pods = [
        (f"{w['kind']}/{w['metadata']['name']}", t)
        for w, t in pod_templates(docs)
        if not t["spec"].get("hostNetwork")
    ]
    services = [d for d in docs if d["kind"] == "Service"]
    for monitor in (d for d in docs if d["kind"] in ("PodMonitor", "ServiceMonitor")):
        name = f"{monitor['kind']}/{monitor['metadata']['name']}"
        spec = monitor["spec"]
        for workload, template in pods:
            labels = template["metadata"]["labels"]
            if monitor["kind"] == "PodMonitor":
                if not selects(spec["selector"], labels):
                    continue
                wanted = [(e, e.get("port")) for e in spec["podMetricsEndpoints"]]
            else:
                wanted = [
                    (endpoint, port.get("targetPort", port["port"]))
                    for service in services
                    if selects(spec["selector"], service["metadata"].get("labels", {}))
                    and selects({"matchLabels": service["spec"].get("selector", {})}, labels)
                    for endpoint in spec["endpoints"]
                    for port in service["spec"]["ports"]
                    if port.get("name") == endpoint.get("port")
                ]
            for endpoint, target in wanted:
                for container in containers(template, init=False):
                    for port in container.get("ports", []):
                        if target is None:
                            if not _kept(endpoint, labels, container, port):
                                continue
                        elif target not in (port.get("name"), port["containerPort"]):
                            continue
                        yield Scrape(
                            name, workload, tuple(sorted(labels.items())),
                            port.get("name", ""), port["containerPort"],
                        )  # fmt: skip


def admitted(docs: tuple[Doc, ...], scrape: Scrape) -> bool:
    """Whether a NetworkPolicy among `docs` admits Prometheus's namespace to `scrape`'s port."""
    labels = dict(scrape.labels)
    for policy in (d for d in docs if d["kind"] == "NetworkPolicy"):
        spec = policy["spec"]
        if not selects(spec.get("podSelector", {}), labels):
            continue
        for rule in spec.get("ingress", []):
            ports = [p.get("port") for p in rule.get("ports", [])]
            if ports and scrape.port_name not in ports and scrape.port_number not in ports:
                continue
            peers = rule.get("from")
            if peers is None or any(_admits_prometheus(peer) for peer in peers):
                return True
    return False


def _admits_prometheus(peer: Doc) -> bool:
    namespaces = peer.get("namespaceSelector")
    if namespaces is None or peer.get("podSelector"):
        return False  # no namespaceSelector: the policy's own namespace only
    labels = {"kubernetes.io/metadata.name": PROMETHEUS_NAMESPACE}
    return selects(namespaces, labels)
