"""The rendered manifests against the code they deploy: every Service selects a pod template
and targets a port it names; every probe asks a port and path (or the gRPC health service)
that its container serves; every flag and `KVSCHED_*` variable of a kvsched container is one
its service's own parser takes; every Secret, ConfigMap and volume claim is in the overlay or
listed as the operator's in deploy/README.md."""

from __future__ import annotations

import ast
import os
import re
from collections.abc import Callable, Iterator
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from services.common.serving import health_probe
from services.conductor import settings as conductor_settings
from services.engine import settings as engine_settings
from services.messenger import settings as messenger_settings
from services.router import settings as router_settings
from tests.deploy.render import Doc, containers, pod_templates, targets
from tests.deploy.tools import DEPLOY, ROOT

TARGETS = [t.name for t in targets()]
PARSERS: dict[str, Callable[[list[str]], Any]] = {
    "conductor": conductor_settings.parse,
    "router": router_settings.parse,
    "messenger": messenger_settings.parse,
    "engine": engine_settings.parse,
}
# The HTTP endpoints of the servers kvsched does not own, as their documentation names them.
THIRD_PARTY_PATHS = {
    "kvsched-vllm": {"/health", "/metrics", "/load"},  # vLLM's OpenAI server (Dockerfile.vllm)
    "quay.io/coreos/etcd": {"/livez", "/readyz", "/health", "/metrics"},  # --listen-metrics-urls
    "jaegertracing/all-in-one": {"/", "/metrics"},  # its admin port (14269): health at /
}
# What the downward API gives a pod, as stand-ins of the right shape.
FIELD_VALUES = {
    "metadata.name": "kvsched-conductor-0",
    "metadata.namespace": "kvsched",
    "spec.nodeName": "gpu-node-1",
    "status.hostIP": "10.0.0.7",
    "status.podIP": "10.1.2.3",
}


def is_kvsched(container: Doc) -> bool:
    return str(container["image"]).split(":")[0].rsplit("/", 1)[-1] == "kvsched"


def image_name(container: Doc) -> str:
    """The image's repository: without its digest (`@sha256:...`) and its tag."""
    image = str(container["image"]).split("@", 1)[0]
    repository, _, tag = image.rpartition(":")
    return repository if repository and "/" not in tag else image


@cache
def http_routes(service: str) -> frozenset[str]:
    """The paths service `service`'s aiohttp apps route (`web.get("/path", ...)` and the
    like, read from its package's code)."""
    paths = set()
    for path in (ROOT / "services" / service).glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("get", "post", "put", "delete")
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "web"
                and node.args
                and isinstance(node.args[0], ast.Constant)
            ):
                paths.add(str(node.args[0].value))
    return frozenset(paths)


def serves_grpc_health(service: str) -> bool:
    """Whether the service starts the common gRPC server (health service included)."""
    return any(
        "start_grpc_server(" in path.read_text(encoding="utf-8")
        for path in (ROOT / "services" / service).glob("*.py")
    )


def container_env(container: Doc) -> dict[str, str]:
    """The container's environment as the kubelet makes it: downward-API fields as stand-ins,
    Secret values as placeholders, `$(VAR)` expanded in order."""
    env: dict[str, str] = {}
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = expand(var["value"], env)
        elif "fieldRef" in var.get("valueFrom", {}):
            env[var["name"]] = FIELD_VALUES[var["valueFrom"]["fieldRef"]["fieldPath"]]
        else:
            env[var["name"]] = "from-a-secret"
    return env


def expand(text: str, env: dict[str, str]) -> str:
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m[1], m[0]), text)


class RecordingEnviron(dict[str, str]):
    """An environment that remembers which variables were asked for."""

    def __init__(self, values: dict[str, str]) -> None:
        super().__init__(values)
        self.read: set[str] = set()

    def get(self, key: str, default: Any = None) -> Any:
        self.read.add(key)
        return super().get(key, default)

    def __getitem__(self, key: str) -> str:
        self.read.add(key)
        return super().__getitem__(key)

    def __contains__(self, key: object) -> bool:
        self.read.add(str(key))
        return super().__contains__(key)


def _in(tmp: Path, values: list[str]) -> list[str]:
    """`values` with each absolute path moved under `tmp`, the leaves made as files (a file a
    parser reads, such as the admin token, then exists)."""
    paths = sorted({v for v in values if v.startswith("/")})
    for path in paths:
        under = tmp / path.lstrip("/")
        if any(other.startswith(path + "/") for other in paths):
            under.mkdir(parents=True, exist_ok=True)
        else:
            under.parent.mkdir(parents=True, exist_ok=True)
            under.write_text("placeholder\n")
    return [str(tmp / v.lstrip("/")) if v.startswith("/") else v for v in values]


def parse_as_pod(
    parser: Callable[[list[str]], Any],
    argv: list[str],
    env: dict[str, str],
    tmp: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> set[str]:
    """Run `parser` on `argv` in `env` (files under `tmp`); the variables it read. Fails the
    test, with the parser's message, when it refuses."""
    values = _in(tmp, [*argv, *env.values()])
    argv, env = values[: len(argv)], dict(zip(env, values[len(argv) :], strict=True))
    environ = RecordingEnviron(env)
    with monkeypatch.context() as m:
        m.setattr(os, "environ", environ)
        try:
            parser(argv)
        except SystemExit as exc:
            pytest.fail(f"{' '.join(argv)}: refused by the service's parser (exit {exc.code})")
    return environ.read


def kvsched_containers(docs: tuple[Doc, ...]) -> Iterator[tuple[str, Doc]]:
    for workload, template in pod_templates(docs):
        for container in containers(template):
            if is_kvsched(container):
                yield f"{workload['metadata']['name']}/{container['name']}", container


@pytest.mark.parametrize("target", TARGETS)
def test_every_flag_and_variable_is_taken_by_the_service(
    rendered: dict[str, tuple[Doc, ...]],
    target: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    checked = 0
    for where, container in kvsched_containers(rendered[target]):
        if container.get("command"):
            continue  # an init container's own command (e.g. copying the connector)
        env = container_env(container)
        args = [expand(a, env) for a in container.get("args", [])]
        # The kubelet expands a variable only when it is defined before: none may be left.
        unexpanded = [v for v in [*args, *env.values()] if "$(" in v]
        assert not unexpanded, f"{where}: {unexpanded} name no variable defined before"
        command, flags = args[0], args[1:]
        assert command in PARSERS, f"{where}: kvsched {command} is no service"
        read = parse_as_pod(PARSERS[command], flags, env, tmp_path / where, monkeypatch)
        probes = [container.get(p, {}).get("exec") for p in ("readinessProbe", "livenessProbe")]
        for probe in filter(None, probes):
            argv = probe["command"]
            assert argv[:2] == ["kvsched", "health"], f"{where}: {argv}"
            read |= parse_as_pod(health_probe.parse, argv[2:], env, tmp_path, monkeypatch)
        unread = {k for k in env if k.startswith("KVSCHED_")} - read
        assert not unread, f"{where}: {sorted(unread)} are read by no parser of kvsched {command}"
        checked += 1
    assert checked >= 3, capsys.readouterr().err


def test_a_flag_the_service_lacks_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(pytest.fail.Exception, match="refused"):
        parse_as_pod(router_settings.parse, ["--no-such-flag", "1"], {}, tmp_path, monkeypatch)
    read = parse_as_pod(
        router_settings.parse,
        ["--insecure", "--no-auth"],
        {"KVSCHED_ROUTER_MODEL": "m", "KVSCHED_ROUTR_TYPO": "1"},
        tmp_path,
        monkeypatch,
    )
    assert "KVSCHED_ROUTER_MODEL" in read and "KVSCHED_ROUTR_TYPO" not in read


def _port_of(container: Doc, port: int | str) -> Doc | None:
    for declared in container.get("ports", []):
        if port in (declared.get("name"), declared["containerPort"]):
            return dict(declared)
    return None


@pytest.mark.parametrize("target", TARGETS)
def test_every_probe_asks_what_its_container_serves(
    rendered: dict[str, tuple[Doc, ...]], target: str
) -> None:
    for workload, template in pod_templates(rendered[target]):
        for container in containers(template, init=False):
            where = f"{target}: {workload['metadata']['name']}/{container['name']}"
            env = container_env(container)
            service = expand(container.get("args", [""])[0], env) if is_kvsched(container) else ""
            for kind in ("readinessProbe", "livenessProbe", "startupProbe"):
                probe = container.get(kind)
                if probe is None:
                    continue
                if "httpGet" in probe:
                    port = _port_of(container, probe["httpGet"]["port"])
                    assert port is not None, f"{where}: {kind} port is not the container's"
                    paths = (
                        http_routes(service)
                        if is_kvsched(container)
                        else THIRD_PARTY_PATHS[image_name(container)]
                    )
                    assert probe["httpGet"]["path"] in paths, f"{where}: {kind} path not served"
                else:
                    argv = probe["exec"]["command"]
                    args, _tls = health_probe.parse(argv[2:])
                    port = _port_of(container, "grpc")
                    assert port is not None and serves_grpc_health(service), where
                    assert args.address == f"127.0.0.1:{port['containerPort']}", where


def test_the_probed_paths_are_read_from_the_code() -> None:
    assert {"/health", "/metrics"} <= http_routes("router")
    assert {"/health", "/ready"} <= http_routes("messenger")
    assert "/api/leader" in http_routes("conductor") and "/health" not in http_routes("conductor")
    assert serves_grpc_health("conductor") and not serves_grpc_health("engine")


def _selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


@pytest.mark.parametrize("target", TARGETS)
def test_every_service_selects_pods_and_their_named_ports(
    rendered: dict[str, tuple[Doc, ...]], target: str
) -> None:
    docs = rendered[target]
    templates = [t for _, t in pod_templates(docs)]
    for service in (d for d in docs if d["kind"] == "Service"):
        name = f"{target}: Service/{service['metadata']['name']}"
        selector = service["spec"].get("selector", {})
        selected = [t for t in templates if _selects(selector, t["metadata"]["labels"])]
        assert selected, f"{name} selects no pod template"
        for port in service["spec"]["ports"]:
            wanted = port.get("targetPort", port["port"])
            assert isinstance(wanted, str), f"{name}: target port {wanted} is not by name"
            assert any(_port_of(c, wanted) for t in selected for c in containers(t, init=False)), (
                f"{name}: no selected container has a port named {wanted}"
            )


def operator_supplied() -> dict[str, str]:
    """deploy/README.md's table of what the operator supplies: name -> kind."""
    rows = {}
    for line in (DEPLOY / "README.md").read_text(encoding="utf-8").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| `") and len(cells) >= 2:
            rows[cells[0].strip("`")] = cells[1]
    return rows


def references(docs: tuple[Doc, ...]) -> Iterator[tuple[str, str]]:
    """(kind, name) of every Secret, ConfigMap and volume claim a pod template uses."""
    for _, template in pod_templates(docs):
        for volume in template["spec"].get("volumes", []):
            if "secret" in volume:
                yield "Secret", volume["secret"]["secretName"]
            if "configMap" in volume:
                yield "ConfigMap", volume["configMap"]["name"]
            if "persistentVolumeClaim" in volume:
                yield "PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"]
            for source in volume.get("projected", {}).get("sources", []):
                for kind in ("secret", "configMap"):
                    if kind in source:
                        yield kind[0].upper() + kind[1:], source[kind]["name"]
        for container in containers(template):
            for source in container.get("envFrom", []):
                if "configMapRef" in source:
                    yield "ConfigMap", source["configMapRef"]["name"]
                if "secretRef" in source:
                    yield "Secret", source["secretRef"]["name"]
            for var in container.get("env", []):
                ref = var.get("valueFrom", {})
                if "secretKeyRef" in ref:
                    yield "Secret", ref["secretKeyRef"]["name"]
                if "configMapKeyRef" in ref:
                    yield "ConfigMap", ref["configMapKeyRef"]["name"]


@pytest.mark.parametrize("target", TARGETS)
def test_every_secret_and_config_map_is_there_or_the_operators(
    rendered: dict[str, tuple[Doc, ...]], target: str
) -> None:
    docs = rendered[target]
    present = {(d["kind"], d["metadata"]["name"]) for d in docs}
    supplied = operator_supplied()
    for kind, name in set(references(docs)):
        if (kind, name) in present:
            continue
        assert supplied.get(name) == kind, (
            f"{target}: {kind} {name} is neither in the overlay nor in deploy/README.md's table"
        )
    for kind in ("Secret",):  # no secret value in any manifest
        assert not [d for d in docs if d["kind"] == kind], f"{target} holds a {kind}"
