"""Leader failover time: two Conductor processes on a real etcd, a client streaming session
placements; kill -9 the leader and time until the next placement is answered (by the standby,
found by the client on its own). The baseline is the leader lease's time to live (1 s), the
least any lease-based failover can take; the ratio says how much the rest (lease expiry in
etcd, the standby's campaign and catch-up, the client's rediscovery) adds.

    .venv/bin/python -m bench.failover [--runs 10]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from bench.common import percentile
from clients.python import ConductorClient
from tests.conductor.conftest import ConductorProcess, instance, leader_of
from tests.conductor.test_failover import request
from tests.fixtures.etcd import start_etcd
from tests.fixtures.poll import wait_for

LEADER_TTL_S = 1.0  # ConductorProcess runs with --leader-ttl 1


async def one_failover() -> float:
    workdir = Path(tempfile.mkdtemp(prefix="kvsched-failover-"))
    with start_etcd(workdir / "etcd") as etcd:
        procs = [
            ConductorProcess(etcd, f"c{i}", workdir / f"c{i}.log", policy="sticky")
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


async def main(runs: int) -> None:
    times = [await one_failover() for _ in range(runs)]
    median = statistics.median(times)
    print(f"failover after kill -9 of the leader, {runs} runs (2 Conductors, real etcd)")
    print("runs s: " + " ".join(f"{t:.2f}" for t in times))
    print(
        f"median {median:.2f} s, p90 {percentile(times, 90):.2f} s, max {max(times):.2f} s; "
        f"leader lease {LEADER_TTL_S:.0f} s (baseline): median {median / LEADER_TTL_S:.2f}x"
    )
    print("goal: a standby serves within 2 s")
    print("reproduce: .venv/bin/python -m bench.failover")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=10)
    asyncio.run(main(parser.parse_args().runs))
