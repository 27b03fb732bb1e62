"""Leader failover: how long a takeover takes and what it costs.

1. Takeover time, Conductors only: two Conductor processes on a real etcd, a client streaming
   session placements; kill -9 the leader and time until the next placement is answered (by
   the standby, found by the client on its own). Measured with the standby probing the
   leader's port (`--dead-leader-probe`, the default) and, as the baseline in the same run,
   without it: the standby then waits for the dead leader's lease (2 s, as in `kvsched up`)
   to lapse in etcd.
2. The drill on a whole cluster (`tests/e2e/failover_drill.py`): `kvsched up --conductors 2`,
   8 clients streaming chat turns through the Routers, an engine killed, then the leader
   SIGKILLed `--rounds` times in a row (restarted as a standby after each). Per round: the
   takeover time, session bindings changed, instances resynced or registered again, KV event
   batches and blocks sent again (the dead leader's unflushed tail), requests failed, and
   turns the Routers placed alone while no Conductor answered, and the batches the new
   leader applied from the Messengers' mirror instead.
3. What the mirror costs: one event stream (as a Messenger's) pushes `--mirror-batches`
   KV event batches (16 blocks each, 4 instances) through a leader with a standby, with the
   mirror to the standby and, as the baseline in the same run, without (`mirror_batches=0`):
   batches/s until the leader applied the last, and CPU per batch of the sender, the leader
   and the standby (from /proc).

    .venv/bin/python -m bench.failover [--runs 5] [--rounds 2] [--mirror-batches 6000]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path

from bench.common import percentile
from clients.python import ConductorClient, ConductorError
from clients.python.kv_stream import KvEventStream
from kvsched.api.common.v1 import common_pb2 as common
from kvsched.api.conductor.v1 import conductor_service_pb2 as pb
from tests.conductor.conftest import ConductorProcess, instance, leader_of
from tests.conductor.test_failover import request
from tests.e2e.conftest import local_cluster
from tests.e2e.failover_drill import drill
from tests.fixtures.etcd import start_etcd
from tests.fixtures.poll import wait_for

LEADER_TTL_S = 2  # the leader lease of `kvsched up`


async def one_failover(probe: bool) -> float:
    """Seconds from kill -9 of the leader to the next placement answered."""
    workdir = Path(tempfile.mkdtemp(prefix="kvsched-failover-"))
    flags: dict[str, float] = {"leader_ttl": LEADER_TTL_S}
    if not probe:
        flags["dead_leader_probe"] = 0
    with start_etcd(workdir / "etcd") as etcd:
        procs = [
            ConductorProcess(etcd, f"c{i}", workdir / f"c{i}.log", policy="sticky", **flags)
            for i in range(2)
        ]
        try:
            addresses = [p.url for p in procs]
            async with ConductorClient(
                addresses, deadline_s=1.0, retries=40, max_backoff_s=0.1
            ) as client:
                leader = await wait_for(
                    lambda: leader_of(client), 15.0, message="a leader is elected"
                )
                standby = next(p.url for p in procs if p.url != leader)
                await wait_for(
                    lambda: follows(standby), 30.0, message="the standby follows the leader"
                )
                for i in range(4):
                    await client.register_instance(instance(i), lease_ttl_s=60)
                async with client.placement_stream() as stream:
                    for s in range(16):
                        await stream.schedule(request(s, 0))
                    next(p for p in procs if p.url == leader).kill()
                    killed = time.monotonic()
                    await stream.schedule(request(0, 1))
                    return time.monotonic() - killed
        finally:
            for p in procs:
                p.stop()


async def follows(address: str) -> bool:
    """Whether the Conductor at `address` serves as a standby that knows the leader (the
    measurement starts only once there is a standby to take over)."""
    async with ConductorClient([address], deadline_s=1.0, retries=0) as one:
        try:
            answer = await one.get_leader()
        except ConductorError:
            return False
    return not answer.is_leader and bool(answer.leader_id)


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _batch(n: int) -> list[pb.KvEvent]:
    """Even batches store 16 new blocks, odd ones remove the previous batch's (the index
    stays small, every batch changes it)."""
    hashes = [((n // 2) << 8) + b + 1 for b in range(16)]
    if n % 2 == 0:
        return [
            pb.KvEvent(blocks_stored=pb.BlocksStored(block_hashes=hashes, tier=common.TIER_GPU))
        ]
    return [pb.KvEvent(blocks_removed=pb.BlocksRemoved(block_hashes=hashes, tier=common.TIER_GPU))]


async def mirror_cost(batches: int, mirror: bool) -> tuple[float, float, float, float]:
    """(batches/s, sender, leader and standby CPU µs per batch) streaming `batches` through
    a leader with a standby, mirrored to it or not."""
    workdir = Path(tempfile.mkdtemp(prefix="kvsched-mirror-"))
    with start_etcd(workdir / "etcd") as etcd:
        procs = [ConductorProcess(etcd, f"c{i}", workdir / f"c{i}.log") for i in range(2)]
        try:
            addresses = [p.url for p in procs]
            async with ConductorClient(addresses, deadline_s=2.0, retries=40) as client:
                leader_url = await wait_for(lambda: leader_of(client), 15.0, message="a leader")
                leader = next(p for p in procs if p.url == leader_url)
                standby = next(p for p in procs if p is not leader)
                await wait_for(lambda: follows(standby.url), 30.0, message="a standby")
                ids = [instance(i).instance_id for i in range(4)]
                for i in range(4):
                    await client.register_instance(instance(i), lease_ttl_s=60)
                stream = KvEventStream(
                    client,
                    on_resync=lambda _: None,
                    on_unregistered=lambda _: None,
                    mirror_batches=1024 if mirror else 0,
                )
                stream.start()
                try:
                    ends = {}
                    for iid in ids:
                        first = (await client.keep_alive(iid)).next_event_sequence
                        stream.open(iid, first)
                        stream.send(iid, [], resync=True, merge=True)
                        ends[iid] = first + 1
                    cpu = [time.process_time(), _cpu_s(leader.process.pid)]
                    cpu.append(_cpu_s(standby.process.pid))
                    started = time.monotonic()
                    for n in range(batches):
                        iid = ids[n % len(ids)]
                        while stream.unsent(iid) > 256:  # the stream's pace, not the log's cap
                            await asyncio.sleep(0.001)
                        stream.send(iid, _batch(n // len(ids)))
                        ends[iid] += 1

                    async def applied() -> bool:
                        for iid, end in ends.items():
                            answer = await client.keep_alive(iid)
                            if answer.next_event_sequence != end:
                                return False
                        return True

                    await wait_for(applied, 120.0, interval=0.005, message="all applied")
                    elapsed = time.monotonic() - started
                    if stream.mirror is not None:
                        mirror_ = stream.mirror
                        await wait_for(lambda: mirror_.queued(standby.url) == 0, 60.0)
                    await asyncio.sleep(0.2)  # the standby reads what is in flight
                    used = [
                        time.process_time() - cpu[0],
                        _cpu_s(leader.process.pid) - cpu[1],
                        _cpu_s(standby.process.pid) - cpu[2],
                    ]
                finally:
                    await stream.close()
        finally:
            for p in procs:
                p.stop()
    per = [u / batches * 1e6 for u in used]
    return batches / elapsed, per[0], per[1], per[2]


def summary(times: list[float]) -> str:
    return (
        f"median {statistics.median(times):.2f} s, p90 {percentile(times, 90):.2f} s, "
        f"max {max(times):.2f} s (runs: {' '.join(f'{t:.2f}' for t in times)})"
    )


async def main(runs: int, rounds: int, mirror_batches: int) -> None:
    if runs:
        probed = [await one_failover(probe=True) for _ in range(runs)]
        waited = [await one_failover(probe=False) for _ in range(runs)]
        print(
            f"1. takeover after kill -9 of the leader, {runs} runs each (2 Conductors, real etcd)"
        )
        print(f"   standby probing the leader's port:  {summary(probed)}")
        print(f"   baseline, waiting for its {LEADER_TTL_S} s lease: {summary(waited)}")
        ratio = statistics.median(probed) / statistics.median(waited)
        print(f"   median ratio probe / lease: {ratio:.2f}x; goal: a standby serves within 2 s")
    if rounds:
        workdir = Path(tempfile.mkdtemp(prefix="kvsched-failover-drill-"))
        with local_cluster(workdir, "--conductors", "2", "--policy", "sticky") as cluster:
            results = await drill(cluster, rounds, workdir)
        print(f"2. drill on kvsched up --conductors 2 (8 streaming clients, an engine killed, "
              f"the leader killed {rounds} times)")  # fmt: skip
        for n, result in enumerate(results, 1):
            print("   " + result.line(n))
    if mirror_batches:
        print(f"3. mirror cost: {mirror_batches} KV event batches (16 blocks each, 4 instances), "
              "leader + standby, 2 runs each way alternating")  # fmt: skip
        rows: dict[bool, list[tuple[float, float, float, float]]] = {True: [], False: []}
        for _ in range(2):
            for mirror in (False, True):
                rows[mirror].append(await mirror_cost(mirror_batches, mirror))
        for mirror in (False, True):
            med = [statistics.median(r[k] for r in rows[mirror]) for k in range(4)]
            print(
                f"   {'mirror on ' if mirror else 'mirror off'}: {med[0]:.0f} batches/s; CPU per "
                f"batch: sender {med[1]:.0f} µs, leader {med[2]:.0f} µs, standby {med[3]:.0f} µs"
            )
        on = [statistics.median(r[k] for r in rows[True]) for k in range(4)]
        off = [statistics.median(r[k] for r in rows[False]) for k in range(4)]
        print(
            f"   ratio on/off: throughput {on[0] / off[0]:.2f}x, sender CPU {on[1] / off[1]:.2f}x, "
            f"leader CPU {on[2] / off[2]:.2f}x; standby +{on[3] - off[3]:.0f} µs per batch"
        )
    print("reproduce: .venv/bin/python -m bench.failover")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=5, help="kills of a leader per setting")
    parser.add_argument(
        "--rounds", type=int, default=2, help="leader kills in the drill (0: no drill)"
    )
    parser.add_argument(
        "--mirror-batches",
        type=int,
        default=6000,
        help="KV event batches streamed per run of the mirror's cost (0: not measured)",
    )
    args = parser.parse_args()
    asyncio.run(main(args.runs, args.rounds, args.mirror_batches))
