"""Rendering `deploy/` as it is applied, for every check of the manifests: each overlay as it
ships (with the components its kustomization names), and each overlay with a component it
leaves out added the way deploy/README.md says to add one (a kustomization of one's own naming
the overlay, the component and the namespace). kustomize is `kubectl kustomize`; the objects
are walked with `pod_templates` and `containers`."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import yaml

from tests.deploy.tools import DEPLOY, run_tool

NAMESPACE = "kvsched"  # what the overlays set
Doc = dict[str, Any]


@dataclass(frozen=True)
class Target:
    """What `kubectl apply -k` is given: an overlay, plus components it leaves out (none: the
    overlay as it ships)."""

    overlay: Path
    added: tuple[Path, ...] = ()

    @property
    def name(self) -> str:
        """e.g. `overlays/dev`, `overlays/production+jaeger`."""
        return "+".join([f"overlays/{self.overlay.name}", *(c.name for c in self.added)])


def overlay_components(overlay: Path) -> set[Path]:
    """The components `overlay`'s kustomization names, resolved."""
    kustomization = yaml.safe_load((overlay / "kustomization.yaml").read_text(encoding="utf-8"))
    return {(overlay / c).resolve() for c in kustomization.get("components", [])}


def _folders(kind: str) -> list[Path]:
    folder = DEPLOY / kind
    return sorted(p for p in folder.iterdir() if (p / "kustomization.yaml").exists())


def targets() -> list[Target]:
    """Every overlay as it ships, then every overlay with each component it leaves out."""
    overlays = _folders("overlays")
    found = [Target(overlay) for overlay in overlays]
    for overlay in overlays:
        included = overlay_components(overlay)
        left_out = [c for c in _folders("components") if c.resolve() not in included]
        found += [Target(overlay, (component,)) for component in left_out]
    return found


@cache
def render(target: Target) -> tuple[Doc, ...]:
    """The objects `kubectl kustomize` makes of `target`."""
    if not target.added:
        return _kustomize(target.overlay)
    with tempfile.TemporaryDirectory() as tmp:
        # kustomize takes roots only as paths relative to the kustomization. The namespace is
        # set again: the overlay's does not reach what is added beside it.
        overlay = os.path.relpath(target.overlay, tmp)
        added = [os.path.relpath(c, tmp) for c in target.added]
        (Path(tmp) / "kustomization.yaml").write_text(
            "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
            f"namespace: {NAMESPACE}\nresources: [{json.dumps(overlay)}]\n"
            f"components: {json.dumps(added)}\n",
            encoding="utf-8",
        )
        return _kustomize(Path(tmp))


def _kustomize(folder: Path) -> tuple[Doc, ...]:
    result = run_tool("kubectl", "kustomize", "--load-restrictor=LoadRestrictionsNone", str(folder))
    if result.returncode != 0:
        raise AssertionError(f"kustomize failed on {folder}: {result.stderr}")
    return tuple(doc for doc in yaml.safe_load_all(result.stdout) if doc)


def to_yaml(docs: tuple[Doc, ...] | list[Doc]) -> str:
    return yaml.safe_dump_all(docs, sort_keys=False)


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
