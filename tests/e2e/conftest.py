"""A whole cluster started the way a user starts it, `kvsched up`, for end-to-end tests:
real etcd, a Conductor, two Routers, two Messengers and four simulated engines on loopback,
all exporting traces to an in-process OTLP receiver."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest

from services.common.security.identity import Identity, Role
from services.common.security.pki import cert_files
from services.common.security.tls import ClientTls, channel_credentials
from services.common.store.etcd import EtcdStore
from services.common.store.interface import EtcdSettings
from tests.conftest import REPO
from tests.fixtures.otlp import OtlpReceiver

START_TIMEOUT_S = 120.0
TIME_SCALE = 0.1  # engines run ten times faster than the modelled GPU
INSTANCE_TTL_S = 2
ADMIN = Identity(Role.ADMIN, "operator")  # the operator's identity `kvsched up` mints


@dataclass
class LocalCluster:
    """A running `kvsched up` and what its endpoints file says."""

    process: subprocess.Popen[bytes]
    endpoints: dict[str, Any]
    log: Path
    otlp: OtlpReceiver
    run_dir: Path

    @property
    def routers(self) -> list[str]:
        return [r["url"] for r in self.endpoints["routers"]]

    @property
    def conductor_http(self) -> str:
        return str(self.endpoints["conductors"][0]["http_url"])

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.endpoints['api_key']}"}

    @property
    def admin_headers(self) -> dict[str, str]:
        """What the Conductors' admin HTTP API asks for (nothing with `--insecure`)."""
        admin = self.endpoints.get("admin")
        if admin is None:
            return {}
        token = Path(admin["token_file"]).read_text().strip()
        return {"Authorization": f"Bearer {token}"}

    def tls(self, identity: Identity = ADMIN) -> ClientTls | None:
        """`identity`'s mTLS files (`kvsched up` minted one per component, and the operator's:
        the default), None for an `--insecure` cluster."""
        if "admin" not in self.endpoints:
            return None
        return cert_files(self.run_dir / "tls", identity).client()

    def credentials(self, identity: Identity = ADMIN) -> grpc.ChannelCredentials | None:
        """gRPC channel credentials calling as `identity` (None: plaintext)."""
        return channel_credentials(self.tls(identity))

    def etcd_settings(self) -> EtcdSettings:
        """How a test reaches the cluster's etcd (mTLS, as the operator, unless insecure)."""
        settings = EtcdSettings(endpoints=(self.endpoints["etcd"]["url"],))
        tls = self.tls()
        if tls is None:
            return settings
        return replace(
            settings, ca_file=tls.ca_file, cert_file=tls.cert_file, key_file=tls.key_file
        )

    def engine(self, instance_id: str) -> dict[str, Any]:
        return next(e for e in self.endpoints["engines"] if e["id"] == instance_id)

    async def explain(self, http: aiohttp.ClientSession, hashes: list[int]) -> list[Any]:
        """The leader's candidates for a prompt of the block chain `hashes` (the admin
        explain: each instance's hit, by tier too, and its policy's terms)."""
        async with http.post(
            f"{self.conductor_http}/api/explain",
            json={"block_hashes": hashes},
            headers=self.admin_headers,
        ) as resp:
            body = await resp.json()
            assert resp.status == 200, body
        return list(body["candidates"])

    @property
    def salt(self) -> str:
        """The demo tenant's cache salt (the engines' and the Routers' hashes start from it)."""
        keys = json.loads((self.run_dir / "api-keys.json").read_text())
        return str(keys["tenants"]["demo"]["salt"])


@contextlib.contextmanager
def local_cluster(
    tmp: Path,
    *flags: str,
    time_scale: float = TIME_SCALE,
    start_timeout_s: float = START_TIMEOUT_S,
    extra_env: Mapping[str, str] | None = None,
) -> Iterator[LocalCluster]:
    """`kvsched up` with `flags` (engines at `time_scale`, leases of `INSTANCE_TTL_S`) and
    `extra_env` added to its environment, its spans sent to an in-process OTLP receiver; stopped
    with SIGINT on exit."""
    otlp = OtlpReceiver()
    otlp.start()
    endpoints_file = tmp / "endpoints.json"
    log = tmp / "up.log"
    env = dict(
        os.environ,
        OTEL_EXPORTER_OTLP_ENDPOINT=otlp.endpoint,
        OTEL_BSP_SCHEDULE_DELAY="50",  # export spans within 50 ms, not 5 s
        # Loaded CI machines: a placement answered late is shed with a 429, which these
        # tests do not expect; the shedding has its own tests (tests/router/test_fallback.py).
        KVSCHED_ROUTER_PLACEMENT_TIMEOUT="1.0",
    )
    env.update(extra_env or {})
    args = [sys.executable, "-m", "services.launcher", "--endpoints-file", str(endpoints_file)]
    args += ["--run-dir", str(tmp / "run"), "--time-scale", str(time_scale)]
    args += ["--instance-ttl", str(INSTANCE_TTL_S), *flags]
    with log.open("wb") as out:
        process = subprocess.Popen(args, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + start_timeout_s
        while not endpoints_file.exists():
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"kvsched up did not start; log:\n{log.read_text()[-4000:]}")
            time.sleep(0.05)  # polling interval
        endpoints = json.loads(endpoints_file.read_text())
        yield LocalCluster(process, endpoints, log, otlp, tmp / "run")
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                process.kill()
        otlp.stop()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with local_cluster(tmp_path_factory.mktemp("up"), "--policy", "elastic") as up:
        yield up


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        yield session


@pytest.fixture
async def etcd_client(cluster: LocalCluster) -> AsyncIterator[EtcdStore]:
    """A client of the cluster's etcd (each module's `cluster`)."""
    store = EtcdStore(cluster.etcd_settings())
    await store.connect()
    yield store
    await store.close()
