"""A failover drill on a running `kvsched up --conductors 2` cluster, for the end-to-end test
(which asserts) and `bench.failover` (which reports): 8 clients stream chat turns of their own
sessions through the Routers; an engine is SIGKILLed and leaves; then the leader is SIGKILLed
`rounds` times in a row, the killed one restarted as a standby after each round (so there
always is one). Each round measures the takeover (kill to the standby serving), the session
bindings changed (in etcd, and in the new leader's memory), event cursors that went back, the
Messengers' counters (resyncs, registrations, re-sent batches and blocks) and the clients'
failed requests."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from clients.python import ConductorClient
from services.common.store.etcd import EtcdStore
from services.conductor import keys
from tests.e2e.conftest import LocalCluster
from tests.fixtures.poll import wait_for

CLIENTS = 8
TAKEOVER_GOAL_S = 2.0
THINK_S = 0.05  # between a client's turns: steady load the 2-core machine keeps up with


@dataclass
class Load:
    """What the streaming clients did: turns completed per client, and every failure."""

    turns: Counter[int] = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)
    fallbacks: int = 0  # answers the Router placed alone (the Conductor did not answer)
    hosts: dict[int, str] = field(default_factory=dict)  # where each client's last turn ran
    placed: dict[int, str] = field(default_factory=dict)  # ... the last the Conductor placed
    moved: int = 0  # turns the Routers placed alone elsewhere than the Conductor's last

    def snapshot(self) -> Counter[int]:
        return Counter(self.turns)

    async def each_client_turns(self, after: Counter[int], n: int, timeout_s: float) -> None:
        """Wait until every client has completed `n` more turns than in `after`."""
        await wait_for(
            lambda: all(self.turns[c] >= after[c] + n for c in range(CLIENTS)),
            timeout_s,
            interval=0.05,
            message=f"every client completes {n} more turns",
        )


async def _client(
    cluster: LocalCluster, http: aiohttp.ClientSession, c: int, load: Load, stop: asyncio.Event
) -> None:
    """One user: a session of chat turns, streamed, through the Routers in turn."""
    messages: list[dict[str, str]] = [{"role": "system", "content": f"Client {c}. " * 30}]
    headers = {**cluster.auth, "x-session-id": f"failover-{c}"}
    turn = 0
    while not stop.is_set():
        messages.append({"role": "user", "content": f"Turn {turn} of {c}: go on. " * 6})
        body = {"model": cluster.endpoints["model"], "messages": messages[-9:], "max_tokens": 6,
                "stream": True}  # fmt: skip
        router = cluster.routers[(c + turn) % len(cluster.routers)]
        try:
            async with http.post(
                f"{router}/v1/chat/completions", json=body, headers=headers
            ) as resp:
                raw = await resp.read()
                if resp.status != 200 or not raw.rstrip().endswith(b"data: [DONE]"):
                    load.failures.append(f"client {c} turn {turn}: {resp.status} {raw[-200:]!r}")
                else:
                    load.turns[c] += 1
                    host = resp.headers["x-kvsched-instance"]
                    load.hosts[c] = host
                    if resp.headers.get("x-kvsched-fallback") == "1":
                        load.fallbacks += 1
                        load.moved += load.placed.get(c, host) != host
                    else:
                        load.placed[c] = host
        except (aiohttp.ClientError, TimeoutError) as exc:
            load.failures.append(f"client {c} turn {turn}: {exc!r}")
        messages.append({"role": "assistant", "content": "ok"})
        turn += 1
        await asyncio.sleep(THINK_S)


@contextlib.asynccontextmanager
async def streaming_load(cluster: LocalCluster) -> AsyncIterator[Load]:
    load, stop = Load(), asyncio.Event()
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        tasks = [asyncio.create_task(_client(cluster, http, c, load, stop)) for c in range(CLIENTS)]
        try:
            yield load
        finally:
            stop.set()
            await asyncio.wait(tasks, timeout=30)
            for task in tasks:
                task.cancel()


@dataclass
class ConductorProc:
    """One Conductor of the cluster: where it serves and how to start it again."""

    url: str
    http_url: str
    pid: int
    argv: list[str]
    env: dict[str, str]
    cwd: str

    @staticmethod
    def of(entry: dict[str, Any]) -> ConductorProc:
        pid = int(entry["pid"])
        proc = Path(f"/proc/{pid}")
        argv = proc.joinpath("cmdline").read_bytes().rstrip(b"\0").split(b"\0")
        env = dict(
            item.split("=", 1)
            for item in proc.joinpath("environ").read_bytes().decode().split("\0")
            if "=" in item
        )
        cwd = os.readlink(proc / "cwd")
        return ConductorProc(
            entry["url"], entry["http_url"], pid, [a.decode() for a in argv], env, cwd
        )


async def _leader_http(http: aiohttp.ClientSession, conductor: ConductorProc) -> dict[str, Any]:
    try:
        async with http.get(f"{conductor.http_url}/api/leader") as resp:
            body: dict[str, Any] = await resp.json()
            return body
    except aiohttp.ClientError:
        return {}


async def _messenger_counts(http: aiohttp.ClientSession, cluster: LocalCluster) -> Counter[str]:
    """The Messengers' counters the test watches, summed over Messengers and instances."""
    wanted = ("resyncs", "registrations", "resent_blocks", "resent_batches", "engine_registered")
    out: Counter[str] = Counter()
    for messenger in cluster.endpoints["messengers"]:
        async with http.get(f"{messenger['http_url']}/metrics") as resp:
            text = await resp.text()
        for line in text.splitlines():
            if line.startswith("#"):
                continue
            name = line.split("{", 1)[0].split(" ", 1)[0].removeprefix("kvsched_messenger_")
            name = name.removesuffix("_total")
            if name in wanted:
                out[name] += int(float(line.rsplit(" ", 1)[1]))
    return out


async def _conductor_metric(
    http: aiohttp.ClientSession, conductor: ConductorProc, name: str
) -> int:
    """A metric on `conductor`'s /metrics (`name` with its labels), 0 when absent or when
    the Conductor does not answer."""
    try:
        async with http.get(f"{conductor.http_url}/metrics") as resp:
            text = await resp.text()
    except aiohttp.ClientError:
        return 0
    return sum(
        int(float(line.rsplit(" ", 1)[1]))
        for line in text.splitlines()
        if line.startswith(name + " ")
    )


# The mirrored KV event batches a Conductor applied when it took over (the dead leader's
# unflushed tail, which the Messengers would otherwise send again), and the Messengers'
# mirror calls open to it (one each once it is warm).
MIRRORED_APPLIED = 'kvsched_conductor_mirrored_kv_event_batches_total{outcome="applied"}'
MIRROR_CALLS = "kvsched_conductor_kv_event_mirror_calls"


async def _cursors(etcd: EtcdStore) -> dict[str, int]:
    """Every instance's KV event cursor as etcd records it."""
    return {
        keys.tail(kv.key.decode(), keys.CURSORS): int(kv.value)
        for kv in await etcd.get_prefix(keys.CURSORS.encode())
    }


async def _bindings(etcd: EtcdStore) -> dict[str, str]:
    """Every session's host as etcd records it."""
    out = {}
    for kv in await etcd.get_prefix(keys.SESSIONS.encode()):
        session_id = keys.tail(kv.key.decode(), keys.SESSIONS)
        out[session_id] = keys.decode_session(session_id, kv.value, None)[1]
    return out


@dataclass(frozen=True)
class RoundResult:
    """What one leader kill changed."""

    takeover_s: float  # SIGKILL to the standby serving
    bindings: int  # sessions bound before the kill
    changed: dict[str, tuple[str, str | None]]  # session: (host before, after) in etcd
    adopted_otherwise: dict[str, str]  # session: host the new leader holds, if not etcd's
    cursors_behind: dict[str, tuple[int, int | None]]  # instance: (cursor before, after)
    counts: Counter[str]  # the Messengers' counters: what the round added
    failures: list[str]  # client requests that failed during the round
    fallbacks: int  # answers the Routers placed alone during the round
    moved: int  # of those, turns served elsewhere than their session's binding
    mirrored: int  # KV event batches the new leader applied from the Messengers' mirror

    def line(self, n: int) -> str:
        c = self.counts
        return (
            f"round {n}: takeover {self.takeover_s:.2f} s, {len(self.changed)} of "
            f"{self.bindings} bindings changed, resyncs {c['resyncs']}, registrations "
            f"{c['registrations']}, re-sent batches {c['resent_batches']} "
            f"({c['resent_blocks']} blocks), mirrored batches applied {self.mirrored}, "
            f"fallbacks {self.fallbacks} "
            f"({self.moved} turns elsewhere), "
            f"failed requests {len(self.failures)}"
        )


async def drill(cluster: LocalCluster, rounds: int, workdir: Path) -> list[RoundResult]:
    """Run the drill on `cluster` (started with `--conductors 2`); restarted Conductors log
    to `workdir` and are stopped at the end."""
    conductors = [ConductorProc.of(entry) for entry in cluster.endpoints["conductors"]]
    restarted: list[subprocess.Popen[bytes]] = []
    etcd = EtcdStore(cluster.etcd_settings())
    await etcd.connect()
    results: list[RoundResult] = []
    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http,
            streaming_load(cluster) as load,
        ):
            await load.each_client_turns(Counter(), 3, 60.0)
            await _kill_an_engine(http, cluster, conductors, load)
            for n in range(rounds):
                result, killed = await _kill_the_leader(http, cluster, conductors, load, etcd)
                results.append(result)
                # The killed leader comes back as the standby of the next round.
                with (workdir / f"conductor-restart-{n}.log").open("wb") as log:
                    process = subprocess.Popen(
                        killed.argv, env=killed.env, cwd=killed.cwd, stdout=log, stderr=log
                    )
                restarted.append(process)
                killed.pid = process.pid
    finally:
        await etcd.close()
        for process in restarted:
            process.terminate()
        for process in restarted:
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
    return results


async def _kill_an_engine(
    http: aiohttp.ClientSession,
    cluster: LocalCluster,
    conductors: list[ConductorProc],
    load: Load,
) -> None:
    """The probe's scenario: an engine dies first; it leaves, its sessions rebind. The
    requests in flight on it fail: not the leader's doing, so forgotten."""
    victim = load.hosts[0]
    os.kill(cluster.engine(victim)["pid"], signal.SIGKILL)

    async def victim_gone() -> bool:
        for c in conductors:
            if (await _leader_http(http, c)).get("is_leader"):
                async with http.get(
                    f"{c.http_url}/api/nodes/stats", headers=cluster.admin_headers
                ) as resp:
                    rows = (await resp.json())["instances"]
                return victim not in {row["instance_id"] for row in rows}
        return False

    await wait_for(victim_gone, 15.0, interval=0.1, message=f"{victim} leaves")
    await load.each_client_turns(load.snapshot(), 2, 60.0)
    load.failures.clear()


async def _kill_the_leader(
    http: aiohttp.ClientSession,
    cluster: LocalCluster,
    conductors: list[ConductorProc],
    load: Load,
    etcd: EtcdStore,
) -> tuple[RoundResult, ConductorProc]:
    """Kill the leader; returns what it changed and the Conductor killed."""

    async def roles() -> tuple[ConductorProc, ConductorProc] | None:
        """(leader, standby following it), once there are both."""
        states = [await _leader_http(http, c) for c in conductors]
        pairs = list(zip(conductors, states, strict=True))
        leading = [c for c, s in pairs if s.get("is_leader")]
        following = [c for c, s in pairs if s and not s["is_leader"] and s["leader_id"]]
        if not (leading and following):
            return None
        # Warm: every Messenger mirrors its KV events to it (a standby restarted moments ago
        # may not be reached yet, and would need the dead leader's tail sent again).
        calls = await _conductor_metric(http, following[0], MIRROR_CALLS)
        return (leading[0], following[0]) if calls >= len(cluster.endpoints["messengers"]) else None

    found = await wait_for(roles, 30.0, interval=0.1, message="a leader and a standby")
    assert found is not None
    leader, standby = found
    await load.each_client_turns(load.snapshot(), 1, 60.0)
    before, cursors = await _bindings(etcd), await _cursors(etcd)
    counts = await _messenger_counts(http, cluster)
    mirrored = await _conductor_metric(http, standby, MIRRORED_APPLIED)
    turns, fallbacks, failures = load.snapshot(), load.fallbacks, len(load.failures)
    moved = load.moved
    os.kill(leader.pid, signal.SIGKILL)
    killed = time.monotonic()

    async def serves() -> bool:
        return bool((await _leader_http(http, standby)).get("is_leader"))

    await wait_for(serves, 10.0, interval=0.02, message="the standby leads")
    takeover_s = time.monotonic() - killed
    await load.each_client_turns(turns, 3, 60.0)
    after, resumed = await _bindings(etcd), await _cursors(etcd)
    async with ConductorClient(
        [standby.url], deadline_s=2.0, credentials=cluster.credentials()
    ) as client:
        held = {sid: (await client.get_session(sid)).host_instance_id for sid in before}
    delta = await _messenger_counts(http, cluster)
    mirrored = await _conductor_metric(http, standby, MIRRORED_APPLIED) - mirrored
    delta.subtract(counts)
    result = RoundResult(
        takeover_s=takeover_s,
        bindings=sum(1 for host in before.values() if host),
        changed={s: (h, after.get(s)) for s, h in before.items() if h and after.get(s) != h},
        adopted_otherwise={s: h for s, h in held.items() if h != after.get(s)},
        cursors_behind={
            i: (c, resumed.get(i)) for i, c in cursors.items() if resumed.get(i, 0) < c
        },
        counts=delta,
        failures=load.failures[failures:],
        fallbacks=load.fallbacks - fallbacks,
        moved=load.moved - moved,
        mirrored=mirrored,
    )
    return result, leader
