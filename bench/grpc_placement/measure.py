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
from bench.grpc_placement.results import BATCHED, ModeResult, Op, pooled
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
    forms: tuple[str, ...] = ("repeated",)  # hash forms (workload.HASH_FORMS), each phase in each
    rounds: int = 1  # times the timed phases run (warm-ups once); a phase's rounds are pooled
    batched: bool = True  # each streamed phase also run with batched stream messages


def phases(plan: Plan) -> list[tuple[str, str, str, int, int, int]]:
    """(name, form, kind, count, in flight, streams) of every phase, in order: each phase of
    the plan once per hash form (and each streamed one also batched, beside it), the forms'
    (and the batched run's) order alternating from one phase to the next and from one round
    to the next, so that neither always runs first (on a Conductor whose state the earlier
    ones changed, on a machine whose load drifts)."""
    k, s = plan.concurrency, plan.streams
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
    out = []
    for r in range(plan.rounds):
        for i, (name, kind, count, inflight, streams) in enumerate(modes):
            if r and name.startswith("warm"):
                continue
            variants = [(name, kind)]
            if plan.batched and kind == "stream" and not name.startswith("warm"):
                # The same phase with batched messages, beside it, the two alternating.
                variants.append((f"{name} {BATCHED}", "batched"))
                if (i + r) % 2:
                    variants.reverse()
            forms = plan.forms if (i + r) % 2 == 0 else plan.forms[::-1]
            for variant, variant_kind in variants:
                for form in forms:
                    label = variant if len(plan.forms) == 1 else f"{variant}, {form}"
                    out.append((label, form, variant_kind, count, inflight, streams))
    return out


async def measure(
    policy: str, work: Workload, plan: Plan, tmp: Path, profile: Path | None
) -> tuple[list[ModeResult], list[Op], dict[str, float]]:
    rng = random.Random(f"requests-{policy}")
    profiled = ("unary Schedule", f"stream K={plan.concurrency}")
    modes = phases(plan)
    request_sets = [
        make_requests(work, count, f"m{i}", rng, form)
        for i, (_, form, _, count, _, _) in enumerate(modes)
    ]
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
                results: list[ModeResult] = []
                for (name, form, kind, _count, inflight, streams), reqs in zip(
                    modes, request_sets, strict=True
                ):
                    profiler = None
                    first_round = not any(r.name == name for r in results)
                    if profile is not None and name.startswith(profiled) and first_round:
                        slug = re.sub(r"[^A-Za-z0-9]+", "_", f"{policy}-{name}")
                        profiler = Profiler(cond.process.pid, profile / f"conductor-{slug}.folded")
                        await asyncio.sleep(0.5)  # py-spy attaches
                    try:
                        if kind == "unary":
                            results.append(await bench.unary(name, reqs))
                        else:
                            results.append(
                                await bench.streams(
                                    name, reqs, inflight, streams, batched=kind == "batched"
                                )
                            )
                        results[-1].form, results[-1].unary = form, kind == "unary"
                    finally:
                        if profiler is not None:
                            profiler.stop()
                            res = results[-1]  # (its first round: what the profile covers)
                            res.profile = profiler.out
                            res.profile_span = (len(res.latencies), res.wall_s)
                info["server_rss_end_mb"] = rss_mb(cond.process.pid)
        finally:
            cond.stop()
    return pooled(results), bench.log, info
