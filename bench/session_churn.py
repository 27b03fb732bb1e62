"""What many distinct session ids leave behind: etcd's database and the Conductor's memory
after N requests, each of a fresh session, through a Conductor's gRPC Schedule and Finish,
with a short session TTL against none (0: sessions are never forgotten), each on its own
fresh etcd and Conductor.

Session ids are as long as a Router lets through (256 bytes). After the requests the bench
waits until the sweep has forgotten every session (TTL runs only), then compacts etcd's
history to its current revision and defragments it, as an operator's
`--auto-compaction-*` would: deleted keys only leave etcd's database once compacted. Sizes are
MB; "ratio" is the TTL run's figure over the no-TTL run's.

    .venv/bin/python -m bench.session_churn [--requests 100000] [--ttl 2] [--concurrency 32]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.duration_pb2 import Duration

from bench.grpc_placement.processes import ConductorProcess, rss_mb
from kvsched.api.common.v1 import common_pb2 as common
from kvsched.api.conductor.v1 import conductor_service_pb2 as pb
from kvsched.api.conductor.v1.conductor_service_pb2_grpc import ConductorServiceStub
from services.conductor import keys
from tests.fixtures.etcd import EtcdServer, start_etcd

SESSION_ID_BYTES = 256  # the Router's default bound on a session id
INSTANCE = "node-0/engine-0"
MB = 1 << 20
LEASE_S = 3600


def etcd_call(etcd: EtcdServer, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """One call of etcd's JSON gateway."""
    req = urllib.request.Request(
        f"{etcd.url}{path}", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        out: dict[str, Any] = json.loads(r.read())
    return out


def etcd_figures(etcd: EtcdServer) -> dict[str, float]:
    """etcd's database size and the session keys it holds."""
    status = etcd_call(etcd, "/v3/maintenance/status", {})
    prefix = keys.SESSIONS.encode()
    end = prefix[:-1] + bytes([prefix[-1] + 1])
    b64 = base64.b64encode
    counted = etcd_call(
        etcd,
        "/v3/kv/range",
        {"key": b64(prefix).decode(), "range_end": b64(end).decode(), "count_only": True},
    )
    return {
        "db_mb": int(status["dbSize"]) / MB,
        "db_in_use_mb": int(status.get("dbSizeInUse", 0)) / MB,
        "session_keys": int(counted.get("count", 0)),
        "revision": int(status["header"]["revision"]),
    }


def compact(etcd: EtcdServer) -> None:
    revision = etcd_figures(etcd)["revision"]
    etcd_call(etcd, "/v3/kv/compaction", {"revision": str(int(revision)), "physical": True})
    etcd_call(etcd, "/v3/maintenance/defragment", {})


def session_id(i: int) -> str:
    head = f"s{i:09d}-"
    return head + "x" * (SESSION_ID_BYTES - len(head))


async def churn(url: str, n: int, concurrency: int) -> float:
    """`n` requests, each of a new session, scheduled and finished; returns seconds."""
    async with grpc.aio.insecure_channel(url) as channel:
        stub: Any = ConductorServiceStub(channel)  # the async stub: same methods, awaited
        spec = pb.InstanceSpec(
            instance_id=INSTANCE, url="http://127.0.0.1:9", node="node-0", role=common.ROLE_BOTH
        )
        lease = Duration(seconds=LEASE_S)  # outlives the run: no keep-alives sent
        await stub.RegisterInstance(pb.RegisterInstanceRequest(spec=spec, lease_ttl=lease))
        todo = iter(range(n))
        started = time.perf_counter()

        async def worker() -> None:
            for i in todo:
                sid, rid = session_id(i), f"r{i}"
                req = pb.ScheduleRequest(
                    request_id=rid, prompt_tokens=17, output_tokens=16, block_hashes=[7],
                    session_id=sid,
                )  # fmt: skip
                placed = await stub.Schedule(req)
                done = pb.FinishRequest(
                    request_id=rid, session_id=sid, ok=True, prompt_tokens=17, output_tokens=16,
                    instance_id=placed.decision.instance_id,
                )  # fmt: skip
                await stub.Finish(done)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return time.perf_counter() - started


async def wait_leading(cond: ConductorProcess, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond.process.poll() is not None:
            raise RuntimeError(f"conductor exited:\n{cond.log.read_text()[-3000:]}")
        try:
            if cond.metric("kvsched_conductor_is_leader") == 1.0:
                return
        except OSError:
            pass
        await asyncio.sleep(0.1)
    raise RuntimeError("the conductor did not lead")


async def wait_swept(cond: ConductorProcess, timeout: float) -> float:
    """Seconds until the Conductor holds no session (the sweep forgot them all)."""
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        if cond.metric("kvsched_conductor_sessions") == 0:
            return time.monotonic() - started
        await asyncio.sleep(0.1)
    raise RuntimeError("sessions were not all forgotten in time")


async def one_run(args: argparse.Namespace, ttl: float, tmp: Path) -> dict[str, Any]:
    with start_etcd(tmp / f"etcd-{ttl:g}") as etcd:
        flags = ["--session-ttl", f"{ttl:g}", "--persist-interval", "0.05"]
        cond = ConductorProcess(etcd, "cache_aware", 2, tmp / f"conductor-{ttl:g}.log", flags)
        try:
            await wait_leading(cond)
            pid = cond.process.pid
            before = {"rss_mb": rss_mb(pid), **etcd_figures(etcd)}
            seconds = await churn(cond.url, args.requests, args.concurrency)
            swept = await wait_swept(cond, ttl * 3 + 30) if ttl > 0 else 0.0
            await asyncio.sleep(1.0)  # the last deletes' flush (persist interval 0.05 s)
            raw = etcd_figures(etcd)
            compact(etcd)
            after = {"rss_mb": rss_mb(pid), **etcd_figures(etcd)}
            return {
                "ttl_s": ttl,
                "requests": args.requests,
                "seconds": seconds,
                "requests_per_s": args.requests / seconds,
                "swept_after_s": swept,
                "sessions_held": cond.metric("kvsched_conductor_sessions"),
                "sessions_forgotten": cond.metric("kvsched_conductor_sessions_forgotten_total"),
                "before": before,
                "after_uncompacted": raw,
                "after": after,
            }
        finally:
            cond.stop()


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--requests", type=int, default=100_000, help="requests, each a new session")
    p.add_argument("--ttl", type=float, default=2.0, help="the short TTL, policy seconds")
    p.add_argument("--concurrency", type=int, default=32, help="requests in flight")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="session-churn-") as d:
        runs = [asyncio.run(one_run(args, ttl, Path(d))) for ttl in (args.ttl, 0.0)]
    short, never = runs
    for r in runs:
        b, a, u = r["before"], r["after"], r["after_uncompacted"]
        print(
            f"ttl {r['ttl_s']:g} s: {r['requests']} sessions in {r['seconds']:.1f} s "
            f"({r['requests_per_s']:.0f}/s); held {r['sessions_held']:.0f}, forgotten "
            f"{r['sessions_forgotten']:.0f}; etcd session keys {a['session_keys']}, db "
            f"{b['db_mb']:.1f} -> {u['db_mb']:.1f} MB ({a['db_mb']:.1f} MB compacted, "
            f"{a['db_in_use_mb']:.1f} in use); conductor RSS {b['rss_mb']:.0f} -> "
            f"{a['rss_mb']:.0f} MB"
        )
    ratio = {
        "db_compacted": short["after"]["db_mb"] / never["after"]["db_mb"],
        "db_uncompacted": short["after_uncompacted"]["db_mb"] / never["after_uncompacted"]["db_mb"],
        "rss_growth": (short["after"]["rss_mb"] - short["before"]["rss_mb"])
        / max(never["after"]["rss_mb"] - never["before"]["rss_mb"], 1e-9),
    }
    print("ttl over none: " + ", ".join(f"{k} {v:.3f}" for k, v in ratio.items()))
    print(json.dumps({"runs": runs, "ratio": ratio}))


if __name__ == "__main__":
    main()
