"""Starting the planned processes in order, knowing when each serves, and stopping them."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import os
import signal
import ssl
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import aiohttp

from services.launcher.plan import READY_TIMEOUT_S, STAGES, Child, ClusterPlan, child_env

STOP_TIMEOUT_S = 10.0
POLL_S = 0.05
# The processes' logs are for their owner only: they tell about users' requests (request ids,
# errors, whatever a DEBUG log adds), and a run dir is often under the shared /tmp.
LOG_DIR_MODE = 0o700
LOG_FILE_MODE = 0o600


def make_log_dir(path: Path) -> None:
    """Create the logs directory (and its parents), owner-only whatever the umask, an
    existing one (a reused `--run-dir`) included."""
    path.mkdir(mode=LOG_DIR_MODE, parents=True, exist_ok=True)
    path.chmod(LOG_DIR_MODE)


def open_log(path: Path) -> IO[bytes]:
    """Open `path` to write a process's log from its start, owner-only whatever the umask,
    an existing file included."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, LOG_FILE_MODE)
    try:
        os.fchmod(fd, LOG_FILE_MODE)  # O_CREAT's mode does not apply to an existing file
    except OSError:
        os.close(fd)
        raise
    return os.fdopen(fd, "wb")


class StartError(RuntimeError):
    """A process exited or never became ready; the message points at its log."""


@dataclass
class Running:
    child: Child
    process: subprocess.Popen[bytes]
    log_path: Path
    reported_exit: bool = False


@dataclass
class Supervisor:
    """Owns the cluster's processes; `stop()` is idempotent and always leaves none behind."""

    plan: ClusterPlan
    log_dir: Path
    say: Callable[[str], None] = print
    running: dict[str, Running] = field(default_factory=dict)
    # What the Conductors' admin HTTP API asks for (the plan's admin token), once minted.
    _admin_headers: dict[str, str] = field(default_factory=dict)

    def pids(self) -> dict[str, int]:
        return {name: r.process.pid for name, r in self.running.items()}

    async def start(self) -> None:
        """Mint the cluster's credentials (unless it is insecure), then start stage by stage;
        each stage must serve before the next starts."""
        make_log_dir(self.log_dir)
        base = dict(os.environ)
        creds = self.plan.credentials
        if creds is not None:
            creds.write(datetime.datetime.now(datetime.UTC))
            token = creds.admin_token_file.read_text().strip()
            self._admin_headers = {"Authorization": f"Bearer {token}"}
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1.0)) as http:
            for stage in STAGES:
                children = self.plan.stage(stage)
                for child in children:
                    self._spawn(child, base)
                await asyncio.gather(*(self._wait_ready(http, c) for c in children))
                if stage == "messenger":
                    await self._wait_registered(http)

    def _spawn(self, child: Child, base: dict[str, str]) -> None:
        log_path = self.log_dir / f"{child.name}.log"
        with open_log(log_path) as log:
            # A session of its own: Ctrl-C reaches `kvsched up` only, which then stops the
            # children in order (Routers first, etcd last).
            process = subprocess.Popen(
                child.argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=child_env(child, base),
                start_new_session=True,
            )
        self.running[child.name] = Running(child, process, log_path)

    async def _wait_ready(self, http: aiohttp.ClientSession, child: Child) -> None:
        run = self.running[child.name]
        deadline = time.monotonic() + child.ready_timeout_s
        while time.monotonic() < deadline:
            if run.process.poll() is not None:
                raise StartError(self._exit_message(run))
            if await _serves(http, child):
                return
            await asyncio.sleep(POLL_S)  # polling interval
        raise StartError(
            f"{child.name} not ready after {child.ready_timeout_s:g} s; log: {run.log_path}"
        )

    async def _wait_registered(self, http: aiohttp.ClientSession) -> None:
        """Every engine is registered with the Conductor (its Messenger did it)."""
        want = {c.endpoint["id"] for c in self.plan.stage("engine")}
        conductors = [c.endpoint["http_url"] for c in self.plan.stage("conductor")]
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            for url in conductors:
                with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError):
                    stats = f"{url}/api/nodes/stats"
                    async with http.get(stats, headers=self._admin_headers) as resp:
                        body = await resp.json()
                        rows = body.get("instances", body) if isinstance(body, dict) else body
                        have = {row.get("instance_id") for row in rows if isinstance(row, dict)}
                        if want <= have:
                            return
            await asyncio.sleep(POLL_S)  # polling interval
        raise StartError(f"engines not all registered after {READY_TIMEOUT_S:g} s: {sorted(want)}")

    def check_exits(self) -> None:
        """Say once about each process that exited on its own."""
        for run in self.running.values():
            if not run.reported_exit and run.process.poll() is not None:
                run.reported_exit = True
                self.say(self._exit_message(run))

    def _exit_message(self, run: Running) -> str:
        return f"{run.child.name} exited with code {run.process.returncode}; log: {run.log_path}"

    def stop(self) -> None:
        """SIGTERM stage by stage in reverse order, SIGKILL what does not exit in time."""
        for stage in reversed(STAGES):
            group = [r for r in self.running.values() if r.child.stage == stage]
            for run in group:
                _signal(run.process, signal.SIGTERM)
            deadline = time.monotonic() + STOP_TIMEOUT_S
            for run in group:
                try:
                    run.process.wait(max(deadline - time.monotonic(), 0.0))
                except subprocess.TimeoutExpired:
                    _signal(run.process, signal.SIGKILL)
                    run.process.wait()


def _ssl_context(child: Child) -> ssl.SSLContext | bool:
    """The readiness check's TLS: the child's CA and a client certificate, or the default."""
    tls = child.ready_tls
    if tls is None:
        return True
    context = ssl.create_default_context(cafile=tls.ca_file)
    if tls.cert_file and tls.key_file:
        context.load_cert_chain(tls.cert_file, tls.key_file)
    return context


async def _serves(http: aiohttp.ClientSession, child: Child) -> bool:
    try:
        async with http.get(child.ready_url, ssl=_ssl_context(child)) as resp:
            if resp.status != 200:
                return False
            if child.stage == "etcd":
                return '"health":"true"' in await resp.text()
            if child.stage == "conductor":
                body: Any = await resp.json()
                return bool(body.get("leader_id"))
            return True
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return False


def _signal(process: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(sig)
