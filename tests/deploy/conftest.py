"""The rendered overlays and components, once per session (kustomize and checkov take
seconds each)."""

from __future__ import annotations

import base64
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from tests.deploy.render import Doc, render, targets
from tests.deploy.scan import checkov
from tests.deploy.tools import DEPLOY, ROOT, tool

NODES = {"kind-worker": "172.18.0.3", "kind-worker2": "172.18.0.4"}  # the stand-in cluster's


@pytest.fixture(scope="session")
def rendered() -> dict[str, tuple[Doc, ...]]:
    """Every target's objects, by name (`overlays/dev`, ...)."""
    return {target.name: render(target) for target in targets()}


@pytest.fixture(scope="session")
def checkov_report(rendered: dict[str, tuple[Doc, ...]]) -> Doc:
    return checkov(rendered)


@dataclass(frozen=True)
class MadeSecrets:
    secrets: dict[str, dict[str, bytes]]  # by name: key -> bytes
    demo_key: str  # the demo tenant's API key, printed once


@pytest.fixture(scope="session")
def secrets(made_secrets: MadeSecrets) -> dict[str, dict[str, bytes]]:
    return made_secrets.secrets


@pytest.fixture(scope="session")
def made_secrets(tmp_path_factory: pytest.TempPathFactory) -> MadeSecrets:
    """What make-secrets applies, with a stand-in kubectl that knows two nodes and keeps
    what it is asked to apply."""
    kubectl = tool("kubectl")
    tmp = tmp_path_factory.mktemp("secrets")
    applied = tmp / "applied.yaml"
    nodes = "".join(f"{name} {ip}\\n" for name, ip in NODES.items())
    stub = tmp / "kubectl"
    stub.write_text(
        "#!/usr/bin/env bash\n"
        'case "$1 $2" in\n'
        f'    "get nodes") printf "{nodes}" ;;\n'
        f'    "create secret") exec {kubectl} "$@" ;;\n'
        f'    "apply -f") cat >> {applied}; echo --- >> {applied} ;;\n'
        '    *) echo "unexpected: $*" >&2; exit 1 ;;\n'
        "esac\n"
    )
    stub.chmod(0o755)
    bin_dir = Path(sys.executable).parent
    env = {
        "PATH": "/usr/bin:/bin",
        "KUBECTL": str(stub),
        "KVSCHED": str(bin_dir / "kvsched"),
        "PYTHON": sys.executable,
    }
    result = subprocess.run(
        [str(DEPLOY / "make-secrets"), "--dir", str(tmp / "pki")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    demo_key = result.stdout.strip()
    assert demo_key.startswith("kvs-"), "the demo key is printed once"
    out: dict[str, dict[str, bytes]] = {}
    for doc in yaml.safe_load_all(applied.read_text()):
        if doc:
            out[doc["metadata"]["name"]] = {
                k: base64.b64decode(v) for k, v in doc.get("data", {}).items()
            }
    return MadeSecrets(out, demo_key)
