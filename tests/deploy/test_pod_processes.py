"""A pod's command line, run: the dev overlay's Conductor started with its rendered args and
environment (addresses moved to loopback ports, its Secrets' files, as deploy/make-secrets
makes them, where the pod mounts them), against an etcd serving mutual TLS with the etcd
Secret's certificate, becomes the leader, and its rendered gRPC health probe (`kvsched
health` with the pod's own certificate) passes, as the kubelet would run it."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

from services.launcher.ports import free_port
from tests.deploy.render import Doc, containers
from tests.deploy.test_crossrefs import FIELD_VALUES, expand
from tests.fixtures.etcd import EtcdTls, start_etcd
from tests.fixtures.poll import wait_for
from tests.fixtures.process import ServiceProcess

POD = "kvsched-conductor-0"


def _workload(docs: tuple[Doc, ...], kind: str, name: str) -> Doc:
    (found,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return found


def _mount_secrets(
    template: Doc, container: Doc, secrets: dict[str, dict[str, bytes]], root: Path
) -> dict[str, Path]:
    """Write each Secret the container mounts where it mounts it, under `root`; mount path
    -> where it is here."""
    by_volume = {
        v["name"]: v["secret"]["secretName"] for v in template["spec"]["volumes"] if "secret" in v
    }
    placed = {}
    for mount in container["volumeMounts"]:
        if mount["name"] in by_volume:
            folder = root / mount["mountPath"].lstrip("/")
            folder.mkdir(parents=True)
            for key, value in secrets[by_volume[mount["name"]]].items():
                (folder / key).write_bytes(value)
            placed[mount["mountPath"]] = folder
    return placed


def _here(value: str, placed: dict[str, Path], moved: dict[str, str]) -> str:
    """`value` with its mounted folder and its address (`moved`) as they are here."""
    for mount, folder in placed.items():
        if value.startswith(mount + "/"):
            return str(folder) + value.removeprefix(mount)
    return moved.get(value, value)


async def test_the_dev_conductor_pod_leads_and_passes_its_probe(
    rendered: dict[str, tuple[Doc, ...]],
    secrets: dict[str, dict[str, bytes]],
    tmp_path: Path,
) -> None:
    workload = _workload(rendered["overlays/dev"], "StatefulSet", "kvsched-conductor")
    template = workload["spec"]["template"]
    (container,) = containers(template)
    placed = _mount_secrets(template, container, secrets, tmp_path / "pod")
    etcd_files = _mount_secrets(
        *_etcd_pod(rendered["overlays/dev"]), secrets, tmp_path / "etcd-pod"
    )["/etc/etcd/tls"]
    tls = EtcdTls(
        etcd_files / "ca.crt",
        etcd_files / "etcd.crt",
        etcd_files / "etcd.key",
        placed["/etc/kvsched/tls"] / f"{POD}.crt",
        placed["/etc/kvsched/tls"] / f"{POD}.key",
    )
    grpc_port, http_port = free_port(), free_port()
    with start_etcd(tmp_path, tls=tls) as etcd:
        moved = {
            "0.0.0.0:50051": f"127.0.0.1:{grpc_port}",
            "0.0.0.0:8081": f"127.0.0.1:{http_port}",
            f"{POD}.kvsched-conductor:50051": f"127.0.0.1:{grpc_port}",
            "https://kvsched-etcd-0.kvsched-etcd:2379": etcd.url,
        }
        env = {"POD_NAME": POD}
        for var in container["env"]:
            if "value" in var:
                env[var["name"]] = _here(expand(var["value"], env), placed, moved)
            else:
                assert var["valueFrom"]["fieldRef"]["fieldPath"] in FIELD_VALUES
        args = [_here(expand(a, env), placed, moved) for a in container["args"]]
        process = ServiceProcess(
            [sys.executable, "-m", "services.cli", *args],
            tmp_path / "conductor.log",
            env={**os.environ, **env},
        )
        try:
            probe = [
                _here(word, placed, {"127.0.0.1:50051": f"127.0.0.1:{grpc_port}"})
                for word in container["readinessProbe"]["exec"]["command"]
            ]
            probe_env = {**os.environ, **env}

            def passes() -> bool:
                argv = [sys.executable, "-m", "services.cli", *probe[1:]]
                done = subprocess.run(
                    argv, env=probe_env, capture_output=True, timeout=10, check=False
                )
                return done.returncode == 0

            def leads() -> bool:
                url = f"http://127.0.0.1:{http_port}/api/leader"
                try:
                    with urllib.request.urlopen(url, timeout=5) as answer:
                        return bool(json.load(answer).get("leader_id") == POD)
                except OSError:
                    return False

            try:
                await wait_for(lambda: asyncio.to_thread(passes), 60.0, interval=0.2)
                await wait_for(lambda: asyncio.to_thread(leads), 30.0, interval=0.1)
            except AssertionError as exc:
                log = (tmp_path / "conductor.log").read_text()
                raise AssertionError(f"{exc}; the Conductor's log:\n{log[-3000:]}") from None
            assert process.process.poll() is None, "the Conductor exited"
        finally:
            process.stop()


def _etcd_pod(docs: tuple[Doc, ...]) -> tuple[Doc, Doc]:
    etcd = _workload(docs, "StatefulSet", "kvsched-etcd")
    template = etcd["spec"]["template"]
    (container,) = containers(template)
    return template, container
