"""The deploy checks' tools, from `.venv-deploy/` (made by `scripts/setup`): a test that
needs one skips, saying how to get it, where it is missing."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import REPO

TOOLS = REPO / ".venv-deploy" / "bin"


def tool(name: str) -> Path:
    """The path of `name` in `.venv-deploy/bin`, or skip the test."""
    path = TOOLS / name
    if not path.exists():
        pytest.skip(f"{name} is not installed: scripts/setup makes .venv-deploy/ with it")
    return path


def kustomize(directory: Path) -> list[dict[str, Any]]:
    """The objects `kubectl kustomize directory` renders."""
    done = subprocess.run(
        [str(tool("kubectl")), "kustomize", str(directory)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


STUB_BASE = """\
apiVersion: v1
kind: ConfigMap
metadata:
  name: kvsched-telemetry
data:
  OTEL_EXPORTER_OTLP_ENDPOINT: ""
"""


def render_with_stub_base(tmp: Path, *components: str) -> list[dict[str, Any]]:
    """Render `deploy/components/<name>` for each of `components` over a stub base that holds
    only what they patch (the `kvsched-telemetry` ConfigMap), in namespace kvsched as the
    overlays set it."""
    (tmp / "telemetry.yaml").write_text(STUB_BASE)
    # kustomize takes components by relative path only.
    paths = [os.path.relpath(REPO / "deploy" / "components" / c, tmp) for c in components]
    kustomization = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "namespace": "kvsched",
        "resources": ["telemetry.yaml"],
        "components": paths,
    }
    (tmp / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    return kustomize(tmp)
