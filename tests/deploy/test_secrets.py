"""deploy/make-secrets makes the Secrets the dev overlay mounts: every file a kvsched
container is told to read from a mounted Secret is a key of that Secret, for every pod the
overlay makes (each Conductor by its name, each node's Messenger by its node), and each
certificate names its component's identity and the address its peers dial."""

from __future__ import annotations

import re

from cryptography import x509

from tests.deploy.conftest import NODES
from tests.deploy.render import Doc, containers, pod_templates
from tests.deploy.test_crossrefs import container_env, expand


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
