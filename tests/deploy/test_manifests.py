"""deploy/ renders and validates: every overlay (as it ships, and with each component it
leaves out) renders with kustomize, every built-in object passes kubernetes-validate
--strict, every custom resource its CRD's schema, checkov finds nothing (each skip says why),
and every pod has its resources, probes and a locked-down security context."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.deploy.render import (
    Doc,
    Target,
    containers,
    overlay_components,
    pod_templates,
    render,
    targets,
)
from tests.deploy.tools import DEPLOY
from tests.deploy.validation import builtin_errors, crd_schemas, custom_errors, is_custom

TARGETS = [t.name for t in targets()]
NAMESPACED_EXCEPT = {"Namespace", "CustomResourceDefinition", "ClusterRole", "ClusterRoleBinding"}
COMPONENTS = {"conductor", "router", "messenger", "engine", "vllm", "etcd", "jaeger"}


def test_the_overlays_ship_their_components_and_the_others_are_checked_added() -> None:
    """dev ships Jaeger (it runs on any cluster), production the monitoring component (its
    cluster has prometheus-operator); each is also rendered with the component it leaves
    out, as deploy/README.md says to add one."""
    components = {c.name: c.resolve() for c in (DEPLOY / "components").iterdir()}
    assert overlay_components(DEPLOY / "overlays" / "dev") == {components["jaeger"]}
    assert overlay_components(DEPLOY / "overlays" / "production") == {components["monitoring"]}
    assert TARGETS == [
        "overlays/dev",
        "overlays/production",
        "overlays/dev+monitoring",
        "overlays/production+jaeger",
    ]


def test_a_component_added_to_an_overlay_is_in_its_namespace(tmp_path: Path) -> None:
    """A component added beside an overlay gets the overlay's namespace (the added
    kustomization sets it again)."""
    (tmp_path / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1alpha1\nkind: Component\npatches:\n"
        "  - patch: |-\n      apiVersion: v1\n      kind: ConfigMap\n      metadata:\n"
        "        name: kvsched-telemetry\n      data:\n"
        "        OTEL_EXPORTER_OTLP_ENDPOINT: http://collector:4317\n"
        "resources: [extra.yaml]\n"
    )
    (tmp_path / "extra.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: extra\ndata: {}\n"
    )
    docs = render(Target(DEPLOY / "overlays" / "production", (tmp_path,)))
    (telemetry,) = [d for d in docs if d["metadata"]["name"] == "kvsched-telemetry"]
    assert telemetry["data"]["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://collector:4317"
    (extra,) = [d for d in docs if d["metadata"]["name"] == "extra"]
    assert extra["metadata"]["namespace"] == "kvsched"


@pytest.mark.parametrize("target", TARGETS)
def test_every_object_is_labelled_and_in_the_namespace(
    rendered: dict[str, tuple[Doc, ...]], target: str
) -> None:
    docs = rendered[target]
    assert docs, f"{target} renders nothing"
    for doc in docs:
        meta, name = doc["metadata"], f"{target}: {doc['kind']}/{doc['metadata']['name']}"
        labels = meta.get("labels", {})
        assert labels.get("app.kubernetes.io/name") == "kvsched", name
        assert labels.get("app.kubernetes.io/part-of") == "kvsched", name
        if doc["kind"] not in NAMESPACED_EXCEPT:
            assert meta.get("namespace") == "kvsched", name
    for workload, template in pod_templates(docs):
        labels = template["metadata"]["labels"]
        assert labels.get("app.kubernetes.io/component") in COMPONENTS, workload["metadata"]
        assert labels.get("app.kubernetes.io/part-of") == "kvsched"


@pytest.mark.parametrize("target", TARGETS)
def test_builtin_objects_validate_strictly(
    rendered: dict[str, tuple[Doc, ...]], target: str
) -> None:
    schemas = crd_schemas()
    builtin = [doc for doc in rendered[target] if not is_custom(doc, schemas)]
    assert builtin_errors(builtin) == []


def test_an_unknown_field_is_caught() -> None:
    bad = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "x"}, "datum": {}}
    errors = builtin_errors([bad])
    assert errors and "datum" in errors[0]
    unknown = {"apiVersion": "example.com/v1", "kind": "Nothing", "metadata": {"name": "x"}}
    assert builtin_errors([unknown]), "a kind without a schema must not pass unchecked"


@pytest.mark.parametrize("target", TARGETS)
def test_custom_resources_validate_against_their_crds(
    rendered: dict[str, tuple[Doc, ...]], target: str
) -> None:
    schemas = crd_schemas()
    errors = [
        e
        for doc in rendered[target]
        if is_custom(doc, schemas)
        for e in custom_errors(doc, schemas)
    ]
    assert errors == []


def test_a_custom_resource_breaking_its_schema_is_caught() -> None:
    schema = {
        "type": "object",
        "properties": {
            "spec": {
                "type": "object",
                "required": ["size"],
                "properties": {"size": {"type": "integer"}},
            }
        },
    }
    schemas = {("example.com/v1", "Thing"): schema}
    good = {"apiVersion": "example.com/v1", "kind": "Thing", "metadata": {"name": "a"}}
    assert is_custom(good, schemas)
    assert custom_errors({**good, "spec": {"size": 3}}, schemas) == []
    (error,) = custom_errors({**good, "spec": {"size": "big"}}, schemas)
    assert "spec/size" in error


def test_checkov_finds_nothing_and_every_skip_says_why(checkov_report: Doc) -> None:
    (report,) = checkov_report["reports"]
    summary = report["summary"]
    assert summary["passed"] > 100
    failed = report["results"]["failed_checks"]
    assert summary["failed"] == 0, [(c["check_id"], c["resource"]) for c in failed]
    for check in report["results"].get("skipped_checks", []):
        reason = (check.get("check_result") or {}).get("suppress_comment", "")
        assert len(reason) > 20, (
            f"{check['check_id']} on {check['resource']} skipped without a reason"
        )


@pytest.mark.parametrize("target", TARGETS)
def test_every_pod_is_bounded_probed_and_locked_down(
    rendered: dict[str, tuple[Doc, ...]], target: str
) -> None:
    for workload, template in pod_templates(rendered[target]):
        spec, name = template["spec"], f"{target}: {workload['metadata']['name']}"
        assert spec.get("automountServiceAccountToken") is False, name
        assert spec.get("serviceAccountName", "default") != "default", name
        pod_security = spec.get("securityContext", {})
        assert pod_security.get("seccompProfile", {}).get("type") == "RuntimeDefault", name
        for container in containers(template):
            where = f"{name}/{container['name']}"
            resources = container.get("resources", {})
            for bound in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(resources.get(bound, {})), where
            security = container.get("securityContext", {})
            assert security.get("allowPrivilegeEscalation") is False, where
            assert security.get("capabilities", {}).get("drop") == ["ALL"], where
            added = set(security.get("capabilities", {}).get("add", []))
            assert added <= {"IPC_LOCK", "CHOWN", "FOWNER"}, where
            assert security.get("readOnlyRootFilesystem") is True, where
        for container in containers(template, init=False):
            where = f"{name}/{container['name']}"
            assert "readinessProbe" in container and "livenessProbe" in container, where
        if workload["kind"] == "Job":
            continue
        non_root = pod_security.get("runAsNonRoot") is True
        assert non_root, name


@pytest.mark.parametrize("target", TARGETS)
def test_every_kvsched_service_serves_and_calls_mutual_tls(
    rendered: dict[str, tuple[Doc, ...]], target: str
) -> None:
    """No service runs `--insecure`; each names its certificate, key and client CA."""
    for _, template in pod_templates(rendered[target]):
        for container in containers(template, init=False):
            args = container.get("args", [])
            if not args or args[0] not in ("conductor", "router", "messenger"):
                continue
            assert "--insecure" not in args, container["name"]
            assert sum(a.endswith("client-ca") for a in args) == 1, container["name"]
            assert sum(a.endswith("-cert") for a in args) == 2, container["name"]
