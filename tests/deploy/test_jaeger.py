"""The Jaeger component (`deploy/components/jaeger`): the telemetry ConfigMap it patches makes
every service export its spans to Jaeger over plaintext OTLP/gRPC, as the services read it;
Jaeger's pod is pinned, non-root and bounded; its Service and NetworkPolicy name ports the
container has; the dev overlay ships it, production exports no spans until told where."""

from __future__ import annotations

from typing import Any

from services.common.telemetry.settings import TelemetrySettings
from tests.conftest import REPO
from tests.deploy.monitoring import load_yaml
from tests.deploy.render import Target, render

JAEGER = REPO / "deploy" / "components" / "jaeger"


def one(kind: str) -> dict[str, Any]:
    (obj,) = [d for p in sorted(JAEGER.glob("*.yaml")) for d in load_yaml(p) if d["kind"] == kind]
    return obj


def test_the_patched_endpoint_is_read_as_plaintext_otlp_to_jaeger() -> None:
    data = one("ConfigMap")["data"]
    settings = TelemetrySettings.from_env("kvsched-router", environ=data)
    assert settings.otlp_endpoint == "http://jaeger:4317"
    assert settings.otlp_insecure  # an http:// endpoint: no TLS to Jaeger inside the namespace


def test_jaegers_pod_is_pinned_unprivileged_and_bounded() -> None:
    pod = one("Deployment")["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False
    assert pod["securityContext"]["runAsNonRoot"] is True
    (container,) = pod["containers"]
    image = container["image"]
    assert ":latest" not in image and "@sha256:" in image and ":1." in image
    security = container["securityContext"]
    assert security["allowPrivilegeEscalation"] is False
    assert security["readOnlyRootFilesystem"] is True
    assert security["capabilities"]["drop"] == ["ALL"]
    for key in ("requests", "limits"):
        assert {"cpu", "memory"} <= container["resources"][key].keys()
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert {"otlp-grpc": 4317, "otlp-http": 4318, "ui": 16686}.items() <= ports.items()
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["port"] in ports


def test_the_service_and_the_network_policy_name_the_containers_ports() -> None:
    pod = one("Deployment")["spec"]["template"]
    ports = {p["name"] for p in pod["spec"]["containers"][0]["ports"]}
    service = one("Service")
    assert service["metadata"]["name"] == "jaeger"
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert {p["port"]: p["targetPort"] for p in service["spec"]["ports"]} == {
        4317: "otlp-grpc",
        4318: "otlp-http",
        16686: "ui",
    }
    policy = one("NetworkPolicy")["spec"]
    assert policy["podSelector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    (rule,) = policy["ingress"]
    kvsched_pods = {"matchLabels": {"app.kubernetes.io/part-of": "kvsched"}}
    assert rule["from"] == [{"podSelector": kvsched_pods}]
    assert {p["port"] for p in rule["ports"]} == {"otlp-grpc", "otlp-http"} <= ports


def test_the_dev_overlay_points_its_telemetry_configmap_at_its_jaeger() -> None:
    objects = render(Target(REPO / "deploy" / "overlays" / "dev"))
    (telemetry,) = [o for o in objects if o["metadata"]["name"] == "kvsched-telemetry"]
    assert telemetry["data"] == {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://jaeger:4317"}
    jaegers = [o for o in objects if o["metadata"]["name"] == "jaeger"]
    assert sorted(o["kind"] for o in jaegers) == [
        "Deployment", "NetworkPolicy", "Service", "ServiceAccount",
    ]  # fmt: skip
    assert all(o["metadata"]["namespace"] == "kvsched" for o in jaegers)


def test_production_exports_no_spans_until_its_operator_names_a_collector() -> None:
    objects = render(Target(REPO / "deploy" / "overlays" / "production"))
    (telemetry,) = [o for o in objects if o["metadata"]["name"] == "kvsched-telemetry"]
    assert telemetry["data"] == {"OTEL_EXPORTER_OTLP_ENDPOINT": ""}
    assert not [o for o in objects if o["metadata"]["name"] == "jaeger"]
