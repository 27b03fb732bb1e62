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
   turns the Routers placed alone while no Conductor answered.

    .venv/bin/python -m bench.failover [--runs 5] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from bench.common import percentile
from clients.python import ConductorClient, ConductorError
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


def summary(times: list[float]) -> str:
    return (
        f"median {statistics.median(times):.2f} s, p90 {percentile(times, 90):.2f} s, "
        f"max {max(times):.2f} s (runs: {' '.join(f'{t:.2f}' for t in times)})"
    )


async def main(runs: int, rounds: int) -> None:
    probed = [await one_failover(probe=True) for _ in range(runs)]
    waited = [await one_failover(probe=False) for _ in range(runs)]
    print(f"1. takeover after kill -9 of the leader, {runs} runs each (2 Conductors, real etcd)")
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
    print("reproduce: .venv/bin/python -m bench.failover")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=5, help="kills of a leader per setting")
    parser.add_argument(
        "--rounds", type=int, default=2, help="leader kills in the drill (0: no drill)"
    )
    args = parser.parse_args()
    asyncio.run(main(args.runs, args.rounds))
