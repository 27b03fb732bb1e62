"""Discrete-event replay of a trace through one policy on simulated engines.

The replay owns the virtual clock. Requests arrive (open loop: at the trace's timestamps,
scaled by the load; closed loop: turn k at finish(k−1) + its recorded gap, each agentic trace
starting at a seeded Poisson time), the policy places them exactly as the live Conductor
would, engines step, KV moves over the network, and engines' cache events flow back into the
policy's index as vLLM's KV events would.
"""

from __future__ import annotations

import heapq
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from kvsched.core.cluster import ClusterConfig, ClusterState
from kvsched.core.decision import Completion, Decision, RequestInfo, TransferKind, TransferPlan
from kvsched.core.events import BlocksRemoved, BlocksStored, KvEvent, split
from kvsched.core.models import model_config
from kvsched.core.policies import POLICIES, parse_spec
from kvsched.core.policies.base import ParamValue
from kvsched.core.requests import RequestError
from kvsched.core.scheduler import Scheduler, SchedulerPort
from kvsched.core.turn_host import TransferOutcome, turn_host
from kvsched.sim.engine import Engine, EngineSpec, Job, JobKind, StepOutcome
from kvsched.sim.meters import GapHistogram, HotspotMeter
from kvsched.sim.network import Network
from kvsched.sim.prepare import PreparedTrace
from kvsched.sim.traces.model import TraceCall

_ARRIVE, _STEP, _WAKE, _XFER_DONE = 0, 1, 2, 3


@dataclass(frozen=True)
class ReplayConfig:
    """How to replay: cluster, seed, load and loop mode (recorded in the report)."""

    cluster: ClusterConfig
    seed: int = 0
    load: float = 1.0
    closed_loop: bool = False
    warmup_fraction: float = 0.05
    # Closed loop: a rejected turn comes back after its retry delay (an agent retries a 429),
    # up to this many times; its TTFT counts from its first arrival.
    max_retries: int = 20
    check_integrity: bool = False  # assert engine invariants after every step (tests)
    keep_decisions: bool = False


@dataclass(slots=True, eq=False)
class Req:
    """One trace call's fate in this replay."""

    call: int
    arrival: float = -1.0
    attempts: int = 0
    slot: int = -1
    decode_slot: int = -1
    first_token_at: float = -1.0
    finished_at: float = -1.0
    local_hit: int = 0
    transfer_hit: int = 0
    rejected: bool = False
    done: bool = False
    decision: Decision | None = None


@dataclass(slots=True, eq=False)
class Transfer:
    """A KV transfer in flight."""

    plan: TransferPlan
    source_blocks: int  # blocks locked on the source for the copy
    target_start: int  # blocks the target already held (locked for the copy)
    job: Job | None  # the request waiting for it, when on the critical path
    start: float
    end: float


@dataclass(slots=True)
class MigrationLog:
    """Migration accounting (DESIGN: count, bytes, downtime and critical path, cooldown,
    whether the target stayed cool)."""

    count: int = 0
    on_path: int = 0
    bytes: int = 0
    # Copy time a turn waited for; also the session's downtime, since a session stalls only
    # while a copy is on its turn's critical path (a copy in its idle gap stalls nothing).
    critical_path_s: float = 0.0
    failed: int = 0
    cooldown_violations: int = 0
    follow_turns: int = 0  # turns served on a migration target within 3 turns after
    follow_cool: int = 0  # ... of which found the target not hot
    # (start, source, target, session) of every migration, in order.
    events: list[tuple[float, int, int, str]] = field(default_factory=list)


@dataclass
class ReplayResult:
    """Everything a report needs from one policy's run."""

    reqs: list[Req]
    cluster: ClusterState
    engines: list[Engine]
    hotspot: HotspotMeter
    gaps: GapHistogram
    migrations: MigrationLog
    transfers: dict[str, list[float]]  # kind -> [count, bytes, seconds]
    group_start: dict[str, float]
    end_time: float
    events: int
    wall_s: float = 0.0


class Replay:
    """One policy on one prepared trace. `run()` once."""

    def __init__(
        self,
        prepared: PreparedTrace,
        spec: str,
        config: ReplayConfig,
        scheduler: SchedulerPort | None = None,
    ) -> None:
        """`scheduler` defaults to the in-process control core, built as the Conductor builds
        its own; the parity test passes one that asks a live Conductor."""
        name, params = parse_spec(spec)
        trace = prepared.trace
        cluster_cfg = replace(
            config.cluster,
            block_size=trace.block_tokens,
            roles=POLICIES[name].roles(config.cluster.n_instances, params),
        )
        self.spec = spec
        self.prepared = prepared
        self.calls = trace.calls
        self.config = config
        core = Scheduler(
            cluster_cfg,
            spec,
            config.seed,
            max_prompt_tokens=model_config(cluster_cfg.model).max_model_len,
            transfer_prefix="sim",
        )
        self.cluster = core.cluster
        self.scheduler: SchedulerPort = scheduler or core
        self._max_blocks = core.limits.max_blocks
        self.params: dict[str, ParamValue] = {**POLICIES[name].defaults, **params}
        cost = self.cluster.cost
        engine_spec = EngineSpec(
            block_size=trace.block_tokens,
            capacity_pages=self.cluster.capacity_blocks,
            chunk_tokens=cluster_cfg.chunk_tokens,
            max_running=cluster_cfg.max_running,
            layers=cost.model.layers,
        )
        self.gaps = GapHistogram()
        self.engines = [
            Engine(slot, engine_spec, cost.latency, self.gaps.add)
            for slot in range(cluster_cfg.n_instances)
        ]
        self.network = Network(cost.topology)
        self.hotspot = HotspotMeter(cluster_cfg.n_instances, cluster_cfg.chunk_tokens)
        self.migrations = MigrationLog()
        self.transfer_stats: dict[str, list[float]] = {k.value: [0, 0, 0.0] for k in TransferKind}
        self.reqs = [Req(i) for i in range(len(self.calls))]
        self._handoffs: dict[int, TransferPlan] = {}
        self._heap: list[tuple[float, int, int, Any]] = []
        self._seq = 0
        self._version = [0] * cluster_cfg.n_instances
        self._dependents: dict[int, list[int]] = {}
        self._migrated_at: dict[str, tuple[int, int]] = {}  # session -> (target, turns left)
        self._last_migration: dict[str, float] = {}
        self._done_count = 0
        self.group_start: dict[str, float] = {}
        self.now = 0.0
        self.events = 0

    # ---- setup -------------------------------------------------------------------------

    def _schedule_arrivals(self) -> None:
        load = self.config.load
        if load <= 0:
            raise ValueError("load must be positive")
        if not self.config.closed_loop:
            t0 = self.calls[0].timestamp_s if self.calls else 0.0
            for call in self.calls:
                self._push((call.timestamp_s - t0) / load, _ARRIVE, call.index)
            return
        starts = draw_group_starts(self.calls, self.cluster.n, load, self.config.seed)
        self.group_start = starts
        for call in self.calls:
            if call.after < 0:
                self._push(starts[call.group] + call.start_offset_s, _ARRIVE, call.index)
            else:
                self._dependents.setdefault(call.after, []).append(call.index)

    # ---- event loop --------------------------------------------------------------------

    def run(self, progress: Callable[[float], None] | None = None) -> ReplayResult:
        self._schedule_arrivals()
        heap = self._heap
        total = len(self.calls)
        done_before = 0
        handlers: tuple[Callable[[Any], None], ...] = (
            self._on_arrive,
            self._on_step,
            self._on_wake,
            self._on_transfer_done,
        )
        while heap:
            t, _, kind, payload = heapq.heappop(heap)
            self.now = t
            self.events += 1
            handlers[kind](payload)
            if progress is not None and self._done_count != done_before:
                done_before = self._done_count
                progress(done_before / total)
        self.hotspot.finish(self.now)
        return ReplayResult(
            reqs=self.reqs,
            cluster=self.cluster,
            engines=self.engines,
            hotspot=self.hotspot,
            gaps=self.gaps,
            migrations=self.migrations,
            transfers=self.transfer_stats,
            group_start=self.group_start,
            end_time=self.now,
            events=self.events,
        )

    def _push(self, t: float, kind: int, payload: Any) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, kind, payload))

    # ---- arrivals and placement ----------------------------------------------------------

    def _on_arrive(self, call_idx: int) -> None:
        call = self.calls[call_idx]
        req = self.reqs[call_idx]
        now = self.now
        if req.attempts == 0:
            req.arrival = now
        req.attempts += 1
        info = RequestInfo(
            request_id=call_idx,
            prompt_tokens=call.input_tokens,
            output_tokens=call.output_tokens,
            block_hashes=self.prepared.hashes[call_idx],
            session_id=call.session or None,
        )
        try:
            decision = self.scheduler.place(info, now)
        except RequestError:  # refused before placement (a prompt longer than the model's)
            self._finish_rejected(req)
            return
        if self.config.keep_decisions:
            req.decision = decision
        if decision.rejected:
            if self.config.closed_loop and req.attempts <= self.config.max_retries:
                self._push(now + max(decision.retry_after_s, 0.001), _ARRIVE, call_idx)
            else:
                self._finish_rejected(req)
            return
        self._execute(req, info, decision)

    def _execute(self, req: Req, info: RequestInfo, decision: Decision) -> None:
        now = self.now
        handoff = next((t for t in decision.transfers if t.kind is TransferKind.HANDOFF), None)
        kind = JobKind.PREFILL_ONLY if handoff is not None else JobKind.FULL
        job = Job(req.call, kind, info.prompt_tokens, info.output_tokens, info.block_hashes, now)
        if handoff is not None:
            self._handoffs[req.call] = handoff
        outcomes: list[TransferOutcome[int]] = []
        for plan in decision.transfers:
            if plan.kind is TransferKind.HANDOFF:
                landed = True  # streamed once the prefill is done (`_hand_off`): it always lands
            else:
                landed = self._start_transfer(plan, job if plan.on_critical_path else None)
            outcomes.append(
                TransferOutcome(plan.kind, plan.source, plan.target, plan.on_critical_path, landed)
            )
        # Where the turn runs, by the rule a Router follows too: a failed migration sends it
        # back to its source, and the placed instance's charge for it goes with its next report.
        host = turn_host(decision.instance, outcomes)
        if host.prefill != decision.instance:
            self._report(decision.instance)
        slot = req.slot = host.prefill
        req.decode_slot = host.decode
        self._note_session_turn(info, slot)
        self.engines[slot].submit(job)
        if job.ready_at > now:
            self._push(job.ready_at, _WAKE, slot)
        self._kick(slot)

    def _note_session_turn(self, info: RequestInfo, slot: int) -> None:
        """Follow a migrated session's next turns: did its new host stay cool?"""
        sid = info.session_id
        if sid is None or sid not in self._migrated_at:
            return
        target, left = self._migrated_at[sid]
        if slot == target:
            self.migrations.follow_turns += 1
            hot = float(self.params.get("t_hot_tokens", self.cluster.config.chunk_tokens))
            if self.engines[target].pending_tokens <= hot:
                self.migrations.follow_cool += 1
        if left <= 1:
            del self._migrated_at[sid]
        else:
            self._migrated_at[sid] = (target, left - 1)

    def _finish_rejected(self, req: Req) -> None:
        req.rejected = True
        req.done = True
        req.finished_at = self.now
        self._done_count += 1
        self._release_dependents(req.call)

    # ---- transfers ---------------------------------------------------------------------

    def _start_transfer(self, plan: TransferPlan, job: Job | None) -> bool:
        """Lock the blocks on both sides, book the links and schedule the arrival; returns
        whether it did not fail. The source moves what it still holds beyond the target's
        prefix: when that is nothing, the transfer is done at once (the target holds as much
        as the source). When the target has no room it fails at once: nothing moves."""
        now = self.now
        src, dst = self.engines[plan.source], self.engines[plan.target]
        hashes = plan.block_hashes
        have_src = src.cache.match(hashes, len(hashes))
        have_dst = dst.cache.match(hashes, len(hashes))
        if have_src <= have_dst:
            if plan.kind is TransferKind.MIGRATE_SESSION:
                self._count_migration(plan, 0, now, now, job)
            self.scheduler.transfer_done(plan.transfer_id, True, now)
            return True
        dst.cache.lock_prefix(hashes, have_dst, now)  # before reserving: eviction must spare it
        if not dst.cache.reserve(have_src - have_dst):
            dst.cache.unlock_prefix(hashes, have_dst, now)
            self._transfer_failed(plan)
            return False
        src.cache.lock_prefix(hashes, have_src, now, touch=False)  # reading is not using
        blocks = have_src - have_dst
        nbytes = blocks * dst.bs * self.cluster.cost.kv_bytes_per_token
        start, end = self.network.schedule(plan.source, plan.target, nbytes, now)
        self._count_transfer(plan, nbytes, end - start)
        record = Transfer(plan, have_src, have_dst, job, start, end)
        if job is not None:
            job.held, job.fetched, job.private = have_dst, blocks, job.private + blocks
            job.ready_at = start + (end - start) / dst.layers
            job.kv_done_at = end
        if plan.kind is TransferKind.MIGRATE_SESSION:
            self._count_migration(plan, nbytes, start, end, job)
        self._push(end, _XFER_DONE, record)
        return True

    def _count_transfer(self, plan: TransferPlan, nbytes: int, seconds: float) -> None:
        stats = self.transfer_stats[plan.kind.value]
        stats[0] += 1
        stats[1] += nbytes
        stats[2] += seconds

    def _count_migration(
        self, plan: TransferPlan, nbytes: int, start: float, end: float, job: Job | None
    ) -> None:
        log = self.migrations
        log.count += 1
        log.bytes += nbytes
        log.events.append((start, plan.source, plan.target, plan.session_id or ""))
        if job is not None:
            log.on_path += 1
            log.critical_path_s += end - self.now
        if plan.session_id is not None:
            cooldown = float(self.params.get("t_cool_s", 0.0))
            last = self._last_migration.get(plan.session_id, -math.inf)
            if self.now - last < cooldown:
                log.cooldown_violations += 1
            self._last_migration[plan.session_id] = self.now
            self._migrated_at[plan.session_id] = (plan.target, 3)

    def _transfer_failed(self, plan: TransferPlan) -> None:
        if plan.kind is TransferKind.MIGRATE_SESSION:
            self.migrations.failed += 1
        self.scheduler.transfer_done(plan.transfer_id, False, self.now)

    def _on_transfer_done(self, record: Transfer) -> None:
        now = self.now
        plan = record.plan
        src, dst = self.engines[plan.source], self.engines[plan.target]
        src.cache.unlock_prefix(plan.block_hashes, record.source_blocks, now, touch=False)
        if record.job is None:
            # Nobody waits: the copied blocks join the target's cache, evictable.
            hashes = plan.block_hashes
            dst.cache.commit(
                hashes, record.target_start, record.source_blocks, record.target_start, now
            )
            dst.cache.unlock_prefix(hashes, record.source_blocks, now)
            self._drain(plan.target)
        self._drain(plan.source)
        self.scheduler.transfer_done(plan.transfer_id, True, now)

    # ---- engines -----------------------------------------------------------------------

    def _kick(self, slot: int) -> None:
        """New work reached `slot`: start a step if idle, or cut a decode macro-step short."""
        engine = self.engines[slot]
        end = engine.plan(self.now) if engine.idle else engine.interrupt(self.now)
        if end is not None:
            self._version[slot] += 1
            self._push(end, _STEP, (slot, self._version[slot]))
        self._report(slot)

    def _on_wake(self, slot: int) -> None:
        self._kick(slot)

    def _on_step(self, key: tuple[int, int]) -> None:
        slot, version = key
        if version != self._version[slot]:
            return  # superseded by an interrupt
        engine = self.engines[slot]
        out = engine.complete(self.now)
        self._handle_outcome(slot, out)
        if self.config.check_integrity:
            engine.check_integrity()
        self._drain(slot)
        end = engine.plan(self.now)
        if end is not None:
            self._version[slot] += 1
            self._push(end, _STEP, (slot, self._version[slot]))
        self._report(slot)

    def _handle_outcome(self, slot: int, out: StepOutcome) -> None:
        now = self.now
        for job in out.first_tokens:
            if job.kind is JobKind.DECODE_ONLY:
                continue
            req = self.reqs[job.rid]
            req.first_token_at = now
            req.local_hit = job.local_hit_tokens
            req.transfer_hit = job.cached_tokens - job.local_hit_tokens
        for job in out.finished:
            if job.kind is JobKind.PREFILL_ONLY:
                self._hand_off(job)
            else:
                self._complete(self.reqs[job.rid])

    def _hand_off(self, job: Job) -> None:
        """Prefill done on a prefill instance: stream the KV to the decode instance. Layers
        streamed while the prefill ran, so only what the link could not carry meanwhile (at
        least the last layer) remains."""
        now = self.now
        plan = self._handoffs.pop(job.rid)
        if job.output <= 1:
            self._complete(self.reqs[job.rid])
            return
        engine = self.engines[plan.target]
        nbytes = job.prompt * self.cluster.cost.kv_bytes_per_token
        start, end = self.network.schedule(plan.source, plan.target, nbytes, job.admitted_at)
        end = max(end, now + (end - start) / engine.layers)
        self._count_transfer(plan, nbytes, end - start)
        decode = Job(job.rid, JobKind.DECODE_ONLY, job.prompt, job.output, job.hashes, now)
        decode.generated = 1
        decode.ready_at = decode.kv_done_at = end
        engine.submit(decode)
        self._push(end, _WAKE, plan.target)

    def _complete(self, req: Req) -> None:
        now = self.now
        req.finished_at = now
        req.done = True
        self._done_count += 1
        call = self.calls[req.call]
        done = Completion(
            request_id=req.call,
            session_id=call.session or None,
            instance=req.slot,
            decode_instance=req.decode_slot,
            prompt_tokens=call.input_tokens,
            output_tokens=call.output_tokens,
            cached_tokens=req.local_hit + req.transfer_hit,
            block_hashes=self.prepared.hashes[req.call],
            arrival=req.arrival,
            first_token_at=req.first_token_at,
            finished_at=now,
        )
        for plan in self.scheduler.finish(done, now):
            self._start_transfer(plan, None)
        self._release_dependents(req.call)

    def _release_dependents(self, call_idx: int) -> None:
        for dep in self._dependents.pop(call_idx, ()):
            self._push(self.now + self.calls[dep].gap_s, _ARRIVE, dep)

    def _drain(self, slot: int) -> None:
        """Apply the engine's cache events to the scheduler's index, cut as a Messenger cuts
        them (no event longer than the longest prompt)."""
        events = self.engines[slot].cache.drain_events()
        if not events:
            return
        # As the replay always applied them: the stores of the window, then its removals.
        stored: list[KvEvent] = [e for e in events if isinstance(e, BlocksStored)]
        removed = tuple(h for e in events if isinstance(e, BlocksRemoved) for h in e.hashes)
        if removed:
            stored.append(BlocksRemoved(removed))
        self.scheduler.apply(slot, list(split(stored, self._max_blocks)))

    def _report(self, slot: int) -> None:
        engine = self.engines[slot]
        self.scheduler.apply(slot, (engine.report(),))
        self.hotspot.set(self.now, slot, float(engine.pending_tokens))


def draw_group_starts(
    calls: Sequence[TraceCall], n_instances: int, load: float, seed: int
) -> dict[str, float]:
    """Closed loop: Poisson start times of the groups (whole agentic traces), in first-call
    order; load 1.0 keeps on average one group per instance active when groups run at their
    recorded speed. The live load generator draws the same starts."""
    spans: dict[str, float] = {}
    order: list[str] = []
    for call in calls:
        end = call.timestamp_s + call.recorded_service_s
        if call.group not in spans:
            order.append(call.group)
            spans[call.group] = 0.0
        spans[call.group] = max(spans[call.group], end)
    mean_span = max(sum(spans.values()) / max(len(spans), 1), 1.0)
    rate = load * n_instances / mean_span
    arrivals = random.Random(f"group-starts:{seed}")
    starts: dict[str, float] = {}
    t = 0.0
    for group in order:
        starts[group] = t
        t += arrivals.expovariate(rate)
    return starts


def run_replay(
    prepared: PreparedTrace,
    spec: str,
    config: ReplayConfig,
    progress: Callable[[float], None] | None = None,
) -> ReplayResult:
    started = time.perf_counter()
    result = Replay(prepared, spec, config).run(progress)
    result.wall_s = time.perf_counter() - started
    if not math.isfinite(result.end_time):
        raise RuntimeError("replay ended at a non-finite time")
    return result
