"""deploy/make-secrets makes the Secrets the dev overlay mounts: every file a kvsched
container is told to read from a mounted Secret is a key of that Secret, for every pod the
overlay makes (each Conductor by its name, each node's Messenger by its node), and each
certificate names its component's identity and the address its peers dial."""

from __future__ import annotations

import base64
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from cryptography import x509

from tests.deploy.render import Doc, containers, pod_templates
from tests.deploy.test_crossrefs import container_env, expand
from tests.deploy.tools import DEPLOY, ROOT, tool

NODES = {"kind-worker": "172.18.0.3", "kind-worker2": "172.18.0.4"}


@pytest.fixture(scope="module")
def secrets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, bytes]]:
    """The Secrets make-secrets applies, by name (key -> bytes), with a stand-in kubectl
    that knows two nodes and keeps what it is asked to apply."""
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
    assert result.stdout.strip().startswith("kvs-"), "the demo key is printed once"
    out: dict[str, dict[str, bytes]] = {}
    for doc in yaml.safe_load_all(applied.read_text()):
        if doc:
            out[doc["metadata"]["name"]] = {
                k: base64.b64decode(v) for k, v in doc.get("data", {}).items()
            }
    return out


def pod_envs(workload: Doc, container: Doc) -> list[dict[str, str]]:
    """The environment of each pod the workload makes (by pod name or node)."""
    base = container_env(container)
    if workload["kind"] == "StatefulSet":
        name = workload["metadata"]["name"]
        pods = [f"{name}-{i}" for i in range(workload["spec"]["replicas"])]
        return [_with(container, base, "metadata.name", pod) for pod in pods]
    if workload["kind"] == "DaemonSet":
        return [_with(container, base, "spec.nodeName", node) for node in NODES]
    return [base]


def _with(container: Doc, base: dict[str, str], field: str, value: str) -> dict[str, str]:
    env: dict[str, str] = {}
    for var in container.get("env", []):
        ref = var.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
        if ref == field:
            env[var["name"]] = value
        elif "value" in var:
            env[var["name"]] = expand(var["value"], env)
        else:
            env[var["name"]] = base[var["name"]]
    return env


def test_every_mounted_file_a_container_reads_is_in_its_secret(
    rendered: dict[str, tuple[Doc, ...]], secrets: dict[str, dict[str, bytes]]
) -> None:
    checked = 0
    for workload, template in pod_templates(rendered["overlays/dev"]):
        mounts_from = {
            v["name"]: v["secret"]["secretName"]
            for v in template["spec"].get("volumes", [])
            if "secret" in v
        }
        for container in containers(template):
            mounts = {
                m["mountPath"]: mounts_from[m["name"]]
                for m in container.get("volumeMounts", [])
                if m["name"] in mounts_from
            }
            for env in pod_envs(workload, container):
                argv = container.get("args") or container.get("command") or []
                values = [expand(a, env) for a in argv]
                for value in [*values, *env.values()]:
                    for path, secret in mounts.items():
                        if value.startswith(path + "/"):
                            key = value.removeprefix(path + "/")
                            assert key in secrets[secret], f"{secret} has no {key}"
                            checked += 1
    assert checked > 20


def _cert(pem: bytes) -> tuple[set[str], set[str]]:
    cert = x509.load_pem_x509_certificate(pem)
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    dns = set(sans.get_values_for_type(x509.DNSName))
    dns |= {str(ip) for ip in sans.get_values_for_type(x509.IPAddress)}
    return set(sans.get_values_for_type(x509.UniformResourceIdentifier)), dns


def test_each_certificate_names_its_identity_and_address(
    secrets: dict[str, dict[str, bytes]],
) -> None:
    uris, names = _cert(secrets["kvsched-messenger-tls"]["kind-worker.crt"])
    assert uris == {"spiffe://kvsched/messenger/kind-worker"}
    assert {"*.kvsched-messenger.kvsched.svc.cluster.local", "127.0.0.1"} <= names
    uris, names = _cert(secrets["kvsched-conductor-tls"]["kvsched-conductor-0.crt"])
    assert uris == {"spiffe://kvsched/conductor/kvsched-conductor-0"}
    assert "kvsched-conductor-0.kvsched-conductor" in names
    uris, names = _cert(secrets["kvsched-router-tls"]["router.crt"])
    assert uris == {"spiffe://kvsched/router/router"}
    _, names = _cert(secrets["kvsched-etcd-tls"]["etcd.crt"])
    assert "kvsched-etcd-0.kvsched-etcd" in names
    token = secrets["kvsched-admin-token"]["token"]
    assert re.fullmatch(rb"[A-Za-z0-9]{30,}", token)
