"""Rendering and validating `deploy/`, for every check of the manifests: each overlay (and each
component of `deploy/components/`, applied to the dev overlay) rendered by kustomize
(`kubectl kustomize`), built-in objects validated by kubernetes-validate in strict mode
against a pinned Kubernetes version, custom resources against the CRD schemas in
`deploy/crds/` (any CRD file there), and checkov over the rendered YAML."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from tests.deploy.tools import DEPLOY, run_tool

KUBERNETES_VERSION = "1.34.0"  # what kubernetes-validate checks built-in objects against
Doc = dict[str, Any]


@dataclass(frozen=True)
class Target:
    """Something that renders: an overlay, or a component applied to the dev overlay."""

    name: str  # e.g. "overlays/dev", "components/jaeger"
    path: Path

    @property
    def is_component(self) -> bool:
        return self.name.startswith("components/")


def targets() -> list[Target]:
    """Every overlay and every component, as found in `deploy/`."""
    found = []
    for kind in ("overlays", "components"):
        folder = DEPLOY / kind
        if folder.is_dir():
            for path in sorted(p for p in folder.iterdir() if (p / "kustomization.yaml").exists()):
                found.append(Target(f"{kind}/{path.name}", path))
    return found


@cache
def render(target: Target) -> tuple[Doc, ...]:
    """The objects `kubectl kustomize` makes of `target` (a component: on the dev overlay)."""
    if not target.is_component:
        return _kustomize(target.path)
    with tempfile.TemporaryDirectory() as tmp:
        # kustomize takes roots only as paths relative to the kustomization.
        overlay = os.path.relpath(DEPLOY / "overlays" / "dev", tmp)
        component = os.path.relpath(target.path, tmp)
        (Path(tmp) / "kustomization.yaml").write_text(
            "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
            f"resources: [{json.dumps(overlay)}]\ncomponents: [{json.dumps(component)}]\n",
            encoding="utf-8",
        )
        return _kustomize(Path(tmp))


def _kustomize(folder: Path) -> tuple[Doc, ...]:
    result = run_tool("kubectl", "kustomize", "--load-restrictor=LoadRestrictionsNone", str(folder))
    if result.returncode != 0:
        raise AssertionError(f"kustomize failed on {folder}: {result.stderr}")
    return tuple(doc for doc in yaml.safe_load_all(result.stdout) if doc)


def to_yaml(docs: tuple[Doc, ...]) -> str:
    return yaml.safe_dump_all(docs, sort_keys=False)


# ---- schemas -------------------------------------------------------------------------------


@cache
def crd_schemas() -> dict[tuple[str, str, str], Doc]:
    """(group, version, kind) -> openAPIV3Schema of every CRD in `deploy/crds/`."""
    schemas: dict[tuple[str, str, str], Doc] = {}
    for path in sorted((DEPLOY / "crds").glob("*.yaml")) if (DEPLOY / "crds").is_dir() else []:
        for doc in yaml.safe_load_all(path.read_text(encoding="utf-8")):
            if not doc or doc.get("kind") != "CustomResourceDefinition":
                continue
            spec = doc["spec"]
            for version in spec["versions"]:
                schema = version.get("schema", {}).get("openAPIV3Schema")
                if schema is not None:
                    key = (spec["group"], version["name"], spec["names"]["kind"])
                    schemas[key] = schema
    return schemas


def group_version(doc: Doc) -> tuple[str, str]:
    group, _, version = str(doc.get("apiVersion", "")).rpartition("/")
    return group, version


def is_custom(doc: Doc, schemas: dict[tuple[str, str, str], Doc]) -> bool:
    """Whether `doc` is a custom resource of a CRD the repository ships."""
    group, version = group_version(doc)
    return (group, version, str(doc.get("kind"))) in schemas


def custom_errors(doc: Doc, schemas: dict[tuple[str, str, str], Doc]) -> list[str]:
    """Where `doc` breaks its CRD's schema (empty: it validates)."""
    group, version = group_version(doc)
    schema = schemas[(group, version, str(doc["kind"]))]
    validator = jsonschema.Draft7Validator(schema)
    name = f"{doc['kind']}/{doc.get('metadata', {}).get('name')}"
    return [
        f"{name}: {'/'.join(map(str, e.absolute_path)) or '(root)'}: {e.message}"
        for e in validator.iter_errors(doc)
    ]


def builtin_errors(docs: list[Doc]) -> list[str]:
    """kubernetes-validate --strict's complaints about `docs` (empty: all validate). An object
    it has no schema for is a complaint too: every kind must be checked by something."""
    if not docs:
        return []
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "objects.yaml"
        path.write_text(yaml.safe_dump_all(docs, sort_keys=False), encoding="utf-8")
        result = run_tool(
            "kubernetes-validate", "--strict", "-k", KUBERNETES_VERSION, "--quiet", str(path)
        )
    lines = (result.stdout + result.stderr).splitlines()
    errors = [line for line in lines if line.startswith(("ERROR", "WARN"))]
    if result.returncode != 0 and not errors:
        errors = lines or [f"kubernetes-validate exited {result.returncode}"]
    return errors


# ---- checkov -------------------------------------------------------------------------------


def checkov(rendered: dict[str, tuple[Doc, ...]], dockerfile: Path | None = None) -> Doc:
    """One checkov run over every rendered target (one file each) and, if given, a
    Dockerfile; its JSON report, a list of one report per framework."""
    with tempfile.TemporaryDirectory() as tmp:
        for name, docs in rendered.items():
            (Path(tmp) / f"{name.replace('/', '-')}.yaml").write_text(to_yaml(docs))
        args = ["-d", tmp, "--framework", "kubernetes", "--skip-download", "--quiet", "-o", "json"]
        result = run_tool("checkov", *args, timeout=300)
    report = json.loads(result.stdout)
    return {"reports": report if isinstance(report, list) else [report]}


# ---- walking the objects -------------------------------------------------------------------

WORKLOADS = ("Deployment", "StatefulSet", "DaemonSet", "Job", "ReplicaSet")


def pod_templates(docs: tuple[Doc, ...]) -> Iterator[tuple[Doc, Doc]]:
    """(workload, its pod template) for every workload among `docs`."""
    for doc in docs:
        if doc.get("kind") in WORKLOADS:
            yield doc, doc["spec"]["template"]


def containers(template: Doc, *, init: bool = True) -> list[Doc]:
    spec = template["spec"]
    return list(spec.get("containers", [])) + (list(spec.get("initContainers", [])) if init else [])
