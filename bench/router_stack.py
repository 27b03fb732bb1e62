"""The processes `bench.router` measures: one kvsched cluster (as `kvsched up` starts it) and
the peer routers in front of the same simulated engines, and the targets a client sends to."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from bench.peer_routers import PEERS, PeerProcess, Worker
from services.launcher.__main__ import demo_keys
from services.launcher.cluster_options import ClusterOptions
from services.launcher.plan import plan_cluster
from services.launcher.ports import free_port
from services.launcher.supervisor import Supervisor

DIRECT, KVSCHED, KVSCHED_2 = "direct", "kvsched", "kvsched x2"
READY_TIMEOUT_S = 60.0


@dataclass
class Target:
    """Where a client sends its requests (spread over `urls`), and the processes whose CPU
    the target's requests cost (label -> pid)."""

    name: str
    urls: list[str]
    pids: dict[str, int] = field(default_factory=dict)


async def _worker(http: aiohttp.ClientSession, url: str) -> Worker:
    """The engine's KV-event sockets, from its `/kvsched/info`."""
    async with http.get(f"{url}/kvsched/info") as resp:
        info = await resp.json()
    kv = info["kv_events"]
    return Worker(url, info["model"], kv["endpoint"], kv["replay_endpoint"])


@dataclass
class Stack:
    """One kvsched cluster (`engines` simulated engines) and the peers in front of the same
    engines. `stop()` stops every process, whatever started."""

    args: argparse.Namespace
    run_dir: Path
    capacity_blocks: int
    sup: Supervisor | None = None
    peers: list[PeerProcess] = field(default_factory=list)
    key: str = ""
    model: str = ""
    engines: list[str] = field(default_factory=list)

    async def start(self, http: aiohttp.ClientSession) -> None:
        self.run_dir.mkdir(parents=True)
        self.key = demo_keys(self.run_dir / "api-keys.json")
        opts = ClusterOptions(
            routers=2,
            nodes=1,
            engines_per_node=self.args.engines,
            policy=self.args.policy,
            time_scale=self.args.time_scale,
            engine_flags=(
                "--max-running",
                str(max(self.args.streams, 256)),
                "--capacity-blocks",
                str(self.capacity_blocks),
            ),
        )
        self.model = opts.model
        plan = plan_cluster(opts, self.run_dir, self.run_dir / "api-keys.json", self.key)
        self.sup = Supervisor(plan, self.run_dir / "logs", say=lambda _: None)
        await self.sup.start()
        self.engines = [c.endpoint["url"] for c in plan.stage("engine")]
        workers = [await _worker(http, url) for url in self.engines]
        for name in self.args.peer_names:
            log = self.run_dir / "logs" / f"{name}.log"
            self.peers.append(PeerProcess(PEERS[name], free_port(), free_port(), workers, log))
        for peer in self.peers:
            await self._wait_serves(http, peer)

    async def _wait_serves(self, http: aiohttp.ClientSession, peer: PeerProcess) -> None:
        """A completion through the peer succeeds (it found its workers and their model)."""
        deadline = time.monotonic() + READY_TIMEOUT_S
        body = {"model": self.model, "prompt": "ready?", "max_tokens": 1}
        while time.monotonic() < deadline:
            if why := peer.exited():
                raise RuntimeError(why)
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with http.post(f"{peer.url}/v1/completions", json=body) as resp:
                    if resp.status == 200:
                        return
            await asyncio.sleep(0.2)  # polling interval
        raise RuntimeError(f"{peer.peer.name} not serving after {READY_TIMEOUT_S:g} s")

    def targets(self) -> list[Target]:
        assert self.sup is not None
        pids = self.sup.pids()
        plan = self.sup.plan
        routers = [c.endpoint["url"] for c in plan.stage("router")]
        names = [c.name for c in plan.stage("router")]
        backing = {
            "conductor": pids[plan.stage("conductor")[0].name],
            "messenger": pids[plan.stage("messenger")[0].name],
            "etcd": pids[plan.stage("etcd")[0].name],
        }
        out = [
            Target(DIRECT, self.engines),
            Target(KVSCHED, routers[:1], {"router": pids[names[0]], **backing}),
            Target(
                KVSCHED_2,
                routers,
                {"router": pids[names[0]], "router-1": pids[names[1]], **backing},
            ),
        ]
        out += [Target(p.peer.name, [p.url], {"router": p.pid}) for p in self.peers]
        return out

    def check(self) -> None:
        """Raise if a peer died mid-run (the cluster's own exits show as request errors)."""
        for peer in self.peers:
            if why := peer.exited():
                raise RuntimeError(why)

    def stop(self) -> None:
        for peer in self.peers:
            peer.stop()
        if self.sup is not None:
            self.sup.stop()
