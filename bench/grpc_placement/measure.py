"""One policy measured: etcd and a Conductor started, the index loaded, every phase run."""

from __future__ import annotations

import asyncio
import random
import re
from dataclasses import dataclass
from pathlib import Path

import grpc

from bench.grpc_placement.client import Bench
from bench.grpc_placement.processes import ConductorProcess, rss_mb
from bench.grpc_placement.profile import Profiler
from bench.grpc_placement.results import ModeResult, Op
from bench.grpc_placement.workload import Workload, make_requests
from kvsched.api.conductor.v1 import conductor_service_pb2 as pb
from kvsched.api.conductor.v1 import conductor_service_pb2_grpc as pb_grpc
from tests.fixtures.etcd import start_etcd


@dataclass
class Plan:
    warmup: int
    requests: int
    concurrency: int
    streams: int


async def measure(
    policy: str, work: Workload, plan: Plan, tmp: Path, profile: Path | None
) -> tuple[list[ModeResult], list[Op], dict[str, float]]:
    rng = random.Random(f"requests-{policy}")
    k, s = plan.concurrency, plan.streams
    profiled = {"unary Schedule", f"stream K={k}"}
    modes: list[tuple[str, str, int, int, int]] = [  # name, kind, count, in flight, streams
        # Sequential first: the replay of a sequential phase is exact (load reports applied
        # in the same order), so its agreement checks the baseline.
        ("warm unary", "unary", plan.warmup, 1, 1),
        ("unary Schedule", "unary", plan.requests, 1, 1),
        ("warm stream", "stream", plan.warmup, k, 1),
        ("stream K=1", "stream", plan.requests, 1, 1),
        (f"stream K={k}", "stream", plan.requests, k, 1),
        (f"{s} streams K={k} each", "stream", plan.requests, k, s),
    ]
    request_sets = [make_requests(work, m[2], f"m{i}", rng) for i, m in enumerate(modes)]
    info: dict[str, float] = {}
    with start_etcd(tmp / f"etcd-{policy}") as etcd:
        cond = ConductorProcess(etcd, policy, work.n, tmp / f"conductor-{policy}.log")
        try:
            channel = grpc.aio.insecure_channel(
                cond.url, options=[("grpc.max_receive_message_length", 64 << 20)]
            )
            async with channel:
                stub = pb_grpc.ConductorServiceStub(channel)
                bench = Bench(stub, cond, etcd.pid)
                await bench.wait_leader()
                info["load_s"] = await bench.load(work)
                listed = await bench.stub.ListInstances(pb.ListInstancesRequest())
                info["indexed"] = sum(i.gpu_blocks for i in listed.instances)
                info["server_rss_mb"] = rss_mb(cond.process.pid)
                results = []
                for (name, kind, _count, inflight, streams), reqs in zip(
                    modes, request_sets, strict=True
                ):
                    profiler = None
                    if profile is not None and name in profiled:
                        slug = re.sub(r"[^A-Za-z0-9]+", "_", f"{policy}-{name}")
                        profiler = Profiler(cond.process.pid, profile / f"conductor-{slug}.folded")
                        await asyncio.sleep(0.5)  # py-spy attaches
                    try:
                        if kind == "unary":
                            results.append(await bench.unary(name, reqs))
                        else:
                            results.append(await bench.streams(name, reqs, inflight, streams))
                    finally:
                        if profiler is not None:
                            profiler.stop()
                            results[-1].profile = profiler.out
                info["server_rss_end_mb"] = rss_mb(cond.process.pid)
        finally:
            cond.stop()
    return results, bench.log, info
