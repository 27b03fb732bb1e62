"""The dev overlay's pods, run as processes: each kvsched container started with its rendered
args and environment (the downward API's values those of a stand-in pod, every address moved
to a loopback port, the Secrets as deploy/make-secrets makes them written where the pod
mounts them), beside an etcd serving mutual TLS with the etcd Secret's certificate. So every
hop's certificate, identity and host name, the admin token, the API keys and the node's KV
pool are those of the manifests: the Conductor leads and passes its rendered probe (`kvsched
health` with its own certificate); one node's Messenger pod (the Messenger and its two
engines) registers both engines; a Router pod serves a completion with the demo tenant's key
from one of them. What differs from a cluster is only the network: loopback, not pod IPs."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import tempfile
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import aiohttp
import pytest

from services.launcher.ports import free_port
from tests.deploy.conftest import NODES, MadeSecrets
from tests.deploy.render import Doc, containers
from tests.deploy.test_crossrefs import expand
from tests.fixtures.etcd import EtcdTls, start_etcd
from tests.fixtures.poll import wait_for
from tests.fixtures.process import ServiceProcess

CONDUCTOR_POD = "kvsched-conductor-0"
NODE = next(iter(NODES))
MESSENGER_POD = "kvsched-messenger-x7k2p"
ADDRESS = re.compile(r"(?:0\.0\.0\.0|127\.0\.0\.1|[a-z0-9.-]+\.kvsched-[a-z]+[a-z0-9.-]*):(\d+)")


def workload(docs: tuple[Doc, ...], kind: str, name: str) -> Doc:
    (found,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return found


class Pod:
    """One pod of a workload as processes here: its Secrets written where it mounts them,
    its memory folders (the node's KV pool) as short temporary folders, its ports moved."""

    def __init__(
        self,
        doc: Doc,
        fields: dict[str, str],
        secrets: MadeSecrets,
        root: Path,
        ports: dict[int, int],
    ) -> None:
        self.template = doc["spec"]["template"]
        self.fields = fields  # downward API: fieldPath -> value
        self.ports = ports  # port in the manifests -> port here (shared by all pods)
        self.root = root
        self.folders: dict[str, str] = {}
        by_volume = {v["name"]: v for v in self.template["spec"].get("volumes", [])}
        for container in containers(self.template):
            for mount in container.get("volumeMounts", []):
                volume = by_volume.get(mount["name"], {})  # a claim template's: unused here
                path = mount["mountPath"]
                if path in self.folders:
                    continue
                if "secret" in volume:
                    folder = root / path.lstrip("/")
                    folder.mkdir(parents=True)
                    for key, value in secrets.secrets[volume["secret"]["secretName"]].items():
                        (folder / key).write_bytes(value)
                    self.folders[path] = str(folder)
                elif path.startswith("/run/"):  # a Unix socket's folder: its path stays short
                    self.folders[path] = tempfile.mkdtemp(prefix="kvs-pod-")

    def here(self, value: str) -> str:
        for mount, folder in self.folders.items():
            if value == mount or value.startswith(mount + "/"):
                return folder + value.removeprefix(mount)

        def move(match: re.Match[str]) -> str:
            port = int(match[1])
            if port not in self.ports:
                self.ports[port] = free_port()
            return f"127.0.0.1:{self.ports[port]}"

        return ADDRESS.sub(move, value)

    def env(self, container: Doc, etcd_url: str) -> dict[str, str]:
        env: dict[str, str] = {}
        for var in container.get("env", []):
            if var["name"] == "KVSCHED_ETCD_ENDPOINTS":
                env[var["name"]] = etcd_url  # the members' names: this one etcd here
            elif "value" in var:
                env[var["name"]] = self.here(expand(var["value"], env))
            else:
                env[var["name"]] = self.fields[var["valueFrom"]["fieldRef"]["fieldPath"]]
        return env

    def start(self, name: str, etcd_url: str, log_dir: Path) -> tuple[ServiceProcess, Doc]:
        (container,) = [c for c in containers(self.template) if c["name"] == name]
        env = self.env(container, etcd_url)
        args = [self.here(expand(a, env)) for a in container["args"]]
        process = ServiceProcess(
            [sys.executable, "-m", "services.cli", *args],
            log_dir / f"{name}.log",
            env={**os.environ, **env},
        )
        return process, {"container": container, "env": env}


@pytest.mark.slow
async def test_the_dev_overlays_pods_serve_a_completion(
    rendered: dict[str, tuple[Doc, ...]], made_secrets: MadeSecrets, tmp_path: Path
) -> None:
    docs = rendered["overlays/dev"]
    ports: dict[int, int] = {}
    logs = tmp_path / "logs"
    logs.mkdir()
    conductor = Pod(
        workload(docs, "StatefulSet", "kvsched-conductor"),
        {"metadata.name": CONDUCTOR_POD},
        made_secrets,
        tmp_path / "conductor",
        ports,
    )
    etcd = Pod(
        workload(docs, "StatefulSet", "kvsched-etcd"),
        {"metadata.name": "kvsched-etcd-0"},
        made_secrets,
        tmp_path / "etcd",
        ports,
    )
    messenger = Pod(
        workload(docs, "DaemonSet", "kvsched-messenger"),
        {
            "metadata.name": MESSENGER_POD,
            "spec.nodeName": NODE,
            "status.podIP": "127.0.0.1",
            "status.hostIP": "127.0.0.1",
        },
        made_secrets,
        tmp_path / "messenger",
        ports,
    )
    router = Pod(
        workload(docs, "Deployment", "kvsched-router"), {}, made_secrets, tmp_path / "router", ports
    )
    etcd_tls, own = Path(etcd.folders["/etc/etcd/tls"]), Path(conductor.folders["/etc/kvsched/tls"])
    tls = EtcdTls(
        etcd_tls / "ca.crt",
        etcd_tls / "etcd.crt",
        etcd_tls / "etcd.key",
        own / f"{CONDUCTOR_POD}.crt",
        own / f"{CONDUCTOR_POD}.key",
    )
    processes: list[ServiceProcess] = []
    with start_etcd(tmp_path, tls=tls) as etcd_server:
        try:
            started = conductor.start("conductor", etcd_server.url, logs)
            processes.append(started[0])
            await _wait(lambda: _probe_passes(conductor, started[1]), 60.0, logs)
            for name in ("engine-0", "engine-1", "messenger"):
                processes.append(messenger.start(name, etcd_server.url, logs)[0])
            token = made_secrets.secrets["kvsched-admin-token"]["token"].decode()
            http = f"http://127.0.0.1:{ports[8081]}"
            await _wait(lambda: _instances(http, token) == {f"{NODE}-e0", f"{NODE}-e1"}, 60.0, logs)
            processes.append(router.start("router", etcd_server.url, logs)[0])
            served = await _wait_for_completion(ports[8000], made_secrets.demo_key, logs)
            assert served in {f"{NODE}-e0", f"{NODE}-e1"}
        finally:
            for process in reversed(processes):
                process.stop()


async def _wait(predicate: Callable[[], bool], timeout: float, logs: Path) -> None:
    """Poll `predicate` (blocking: in a thread) until true; the logs' tails if never."""
    try:
        await wait_for(lambda: asyncio.to_thread(predicate), timeout, interval=0.2)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{_tails(logs)}") from None


def _tails(logs: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-1500:]}" for p in sorted(logs.glob("*.log")))


def _probe_passes(pod: Pod, started: Doc) -> bool:
    """The container's readiness probe, as the kubelet runs it (in the container's env)."""
    argv = [pod.here(word) for word in started["container"]["readinessProbe"]["exec"]["command"]]
    done = subprocess.run(
        [sys.executable, "-m", "services.cli", *argv[1:]],
        env={**os.environ, **started["env"]},
        capture_output=True,
        timeout=10,
        check=False,
    )
    return done.returncode == 0


def _instances(http: str, token: str) -> set[str]:
    request = urllib.request.Request(
        f"{http}/api/nodes/stats", headers={"Authorization": f"Bearer {token}"}
    )
    try:
        with urllib.request.urlopen(request, timeout=5) as answer:
            body = json.load(answer)
    except OSError:
        return set()
    rows: Iterator[Doc] = iter(body if isinstance(body, list) else body.get("instances", []))
    return {row["instance_id"] for row in rows}


async def _wait_for_completion(port: int, key: str, logs: Path) -> str:
    """The instance that served one chat completion through the Router (once it is up)."""
    body = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
    headers = {"Authorization": f"Bearer {key}", "x-session-id": "deploy-check"}

    async def served() -> str:
        try:
            async with (
                aiohttp.ClientSession() as session,
                session.post(
                    f"http://127.0.0.1:{port}/v1/chat/completions", json=body, headers=headers
                ) as answer,
            ):
                if answer.status != 200:
                    return ""
                await answer.read()
                return str(answer.headers.get("x-kvsched-instance", ""))
        except aiohttp.ClientError:
            return ""

    try:
        return await wait_for(served, 60.0, interval=0.2)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{_tails(logs)}") from None
