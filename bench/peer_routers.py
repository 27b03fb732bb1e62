"""The Rust routers `bench.router` measures kvsched's Router against: vLLM's (`vllm-router`) and
SGLang's (`sglang-router`), each a pinned PyPI release in a virtual environment of its own
under `out/bench-venvs/` (benchmark dependencies, not kvsched's), started in front of the same
engines on loopback.

Both run their own cache-aware policy (`cache_aware`, their default: an approximate radix tree
of the prompt text per worker, balanced when loads differ by more than 64 requests and 1.5×);
vllm-router also runs as `vllm-router-kv` with its `kv_aware` policy, which indexes the
blocks the engines report in their KV events (as kvsched's Conductor does) and tokenizes the
prompt with the engines' tokenizer to match them. Each needs a `--prometheus-port` of its own
(both default to 29000). sglang-router learns a worker's model from SGLang's `/server_info`
and `/model_info` (the simulated engine serves both) and refuses a completion without `model`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from bench.common import REPO

VENVS = REPO / "out" / "bench-venvs"
STOP_TIMEOUT_S = 5.0
INSTALL_TIMEOUT_S = 600.0

TOKENIZER = REPO / "kvsched" / "data" / "tokenizer" / "tokenizer.json"  # the engines' own


@dataclass(frozen=True)
class Worker:
    """A simulated engine as a peer router sees it: its URL and its KV-event sockets."""

    url: str
    model: str  # the served model name
    kv_events: str  # ZMQ PUB
    kv_replay: str  # ZMQ ROUTER answering replay requests


# (port, prometheus port, workers) -> the arguments after the executable
Argv = Callable[[int, int, list[Worker]], list[str]]


def _common(port: int, metrics_port: int, workers: list[Worker]) -> list[str]:
    return [
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--worker-urls",
        *(w.url for w in workers),
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(metrics_port),
    ]


def _vllm_router_argv(port: int, metrics_port: int, workers: list[Worker]) -> list[str]:
    return [
        *_common(port, metrics_port, workers),
        "--policy",
        "cache_aware",
        "--log-level",
        "warning",
    ]


def _vllm_router_kv_argv(port: int, metrics_port: int, workers: list[Worker]) -> list[str]:
    """kv_aware: an index of the blocks the engines report in their KV events (vLLM's ZMQ
    events, replayed from the engines' replay sockets on a gap), matched against the prompt's
    blocks as the router tokenizes it (`VLLM_ROUTER_TOKENIZER`)."""
    sources: list[str] = []
    for w in workers:
        sources += [
            "--kv-event-source",
            f"{w.url}={w.kv_events}",
            "--kv-event-replay-source",
            f"{w.url}={w.kv_replay}",
        ]
    return [
        *_common(port, metrics_port, workers),
        "--policy",
        "kv_aware",
        *sources,
        "--kv-event-block-size",
        "16",
        "--kv-event-model",
        workers[0].model,
        "--log-level",
        "warning",
    ]


def _sglang_router_argv(port: int, metrics_port: int, workers: list[Worker]) -> list[str]:
    return [
        "launch",
        *_common(port, metrics_port, workers),
        "--policy",
        "cache_aware",
        "--log-level",
        "warn",
    ]


@dataclass(frozen=True)
class PeerRouter:
    """A peer router: the PyPI package (pinned), its executable and how to start it."""

    name: str  # as the bench reports it
    package: str
    version: str
    executable: str
    argv: Argv
    env: tuple[tuple[str, str], ...] = ()

    @property
    def venv(self) -> Path:
        return VENVS / f"{self.package}-{self.version}"

    @property
    def binary(self) -> Path:
        return self.venv / "bin" / self.executable

    def installed(self) -> bool:
        """The pinned version's environment is there (installed by `ensure_installed`)."""
        marker = self.venv / "installed"
        return (
            marker.is_file()
            and marker.read_text().strip() == self.version
            and (self.binary.is_file())
        )


PEERS: dict[str, PeerRouter] = {
    p.name: p
    for p in (
        PeerRouter("vllm-router", "vllm-router", "0.1.17", "vllm-router", _vllm_router_argv),
        PeerRouter(
            "vllm-router-kv",
            "vllm-router",
            "0.1.17",
            "vllm-router",
            _vllm_router_kv_argv,
            (("VLLM_ROUTER_TOKENIZER", str(TOKENIZER)),),
        ),
        PeerRouter("sglang-router", "sglang-router", "0.3.2", "sglang-router", _sglang_router_argv),
    )
}


def ensure_installed(peer: PeerRouter, say: Callable[[str], None] = print) -> None:
    """Create `peer.venv` and pip-install the pinned release into it, unless it is there
    already. Raises `RuntimeError` (with pip's output) when the install fails; a failed install
    leaves no marker, so the next run tries again."""
    if peer.installed():
        return
    say(f"installing {peer.package}=={peer.version} into {peer.venv.relative_to(REPO)} ...")
    peer.venv.parent.mkdir(parents=True, exist_ok=True)
    steps = [
        [sys.executable, "-m", "venv", "--clear", str(peer.venv)],
        [
            str(peer.venv / "bin" / "python"),
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            f"{peer.package}=={peer.version}",
        ],
    ]
    for argv in steps:
        done = subprocess.run(
            argv, check=False, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S
        )
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed:\n{done.stdout}{done.stderr}")
    (peer.venv / "installed").write_text(peer.version + "\n")


class PeerProcess:
    """One running peer router; `stop()` is idempotent and leaves no process behind."""

    def __init__(
        self, peer: PeerRouter, port: int, metrics_port: int, workers: list[Worker], log: Path
    ) -> None:
        self.peer = peer
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log
        out: IO[bytes]
        with open(log, "wb") as out:
            # A session of its own, like the cluster's processes: Ctrl-C reaches the bench,
            # which stops it.
            self.process = subprocess.Popen(
                [str(peer.binary), *peer.argv(port, metrics_port, workers)],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env={**os.environ, "RUST_LOG": "warn", **dict(peer.env)},
            )

    @property
    def pid(self) -> int:
        return self.process.pid

    def exited(self) -> str | None:
        """Why it is gone (with its log), or None while it runs."""
        code = self.process.poll()
        return None if code is None else f"{self.peer.name} exited {code}; log: {self.log_path}"

    def stop(self) -> None:
        if self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
