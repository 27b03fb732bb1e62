"""The Conductor process under test, and the CPU and memory the benchmark reads of processes."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from bench.common import REPO
from services.launcher.ports import free_port
from tests.fixtures.etcd import EtcdServer


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process, all its threads."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class ConductorProcess:
    def __init__(
        self, etcd: EtcdServer, policy: str, n: int, log: Path, extra: Sequence[str] = ()
    ) -> None:
        """`extra`: more flags for the Conductor."""
        self.port, self.http_port = free_port(), free_port()
        args = [
            sys.executable, "-m", "services.conductor",
            "--id", "bench",
            "--listen", f"127.0.0.1:{self.port}",
            "--http-listen", f"127.0.0.1:{self.http_port}",
            "--max-instances", str(n),
            "--policy", policy,
            "--persist-blocks", "false",
            "--insecure",
            *extra,
        ]  # fmt: skip
        env = dict(os.environ, KVSCHED_ETCD_ENDPOINTS=etcd.url)
        with log.open("wb") as out:
            self.process = subprocess.Popen(
                args, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT
            )
        self.log = log

    @property
    def url(self) -> str:
        return f"127.0.0.1:{self.port}"

    def metric(self, name: str) -> float:
        url = f"http://127.0.0.1:{self.http_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as r:
            text = r.read().decode()
        m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
        return float(m.group(1)) if m else 0.0

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def rss_mb(pid: int) -> float:
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0
