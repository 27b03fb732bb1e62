"""Discrete-event replay of a trace through one policy on simulated engines.

The replay owns the virtual clock (`clock`). Requests arrive (`arrivals`), the policy places
them exactly as the live Conductor would, engines step, KV moves over the network
(`transfers`), and engines' cache events and loads flow back into the policy's index as
vLLM's KV events and load reports would (`feedback`). This module is the loop composing
them: placement, engine steps and completions.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from kvsched.core.decision import Completion, Decision, RequestInfo, TransferKind
from kvsched.core.models import model_config
from kvsched.core.policies import POLICIES, parse_spec
from kvsched.core.policies.base import ParamValue
from kvsched.core.requests import RequestError
from kvsched.core.scheduler import Scheduler, SchedulerPort
from kvsched.core.turn_host import TransferOutcome, turn_host
from kvsched.sim.arrivals import Arrivals
from kvsched.sim.clock import PREFETCH_DUE, STEP, WAKE, EventQueue
from kvsched.sim.engine import Engine
from kvsched.sim.engine_state import EngineSpec
from kvsched.sim.feedback import EngineFeedback
from kvsched.sim.jobs import Job, JobKind, StepOutcome
from kvsched.sim.meters import GapHistogram, HotspotMeter
from kvsched.sim.migrations import MigrationTracker
from kvsched.sim.network import Network
from kvsched.sim.prepare import PreparedTrace
from kvsched.sim.records import ReplayConfig, ReplayResult, Req
from kvsched.sim.summary import measured_calls
from kvsched.sim.tiers import NodeTier, build_tiers
from kvsched.sim.transfers import Transfers
from kvsched.sim.verdict import SloVerdict, TargetOutOfReach


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
            max_prompt_tokens=config.max_model_len or model_config(cluster_cfg.model).max_model_len,
            transfer_prefix="sim",
            runs_engine_orders=True,
            pure=config.pure,
        )
        self.cluster = core.cluster
        self.scheduler: SchedulerPort = scheduler or core
        self.params: dict[str, ParamValue] = {**POLICIES[name].defaults, **params}
        cost = self.cluster.cost
        engine_spec = EngineSpec(
            block_size=trace.block_tokens,
            capacity_pages=self.cluster.capacity_blocks,
            chunk_tokens=cluster_cfg.chunk_tokens,
            max_running=cluster_cfg.max_running,
            layers=cost.model.layers,
            pure_cache=config.pure,
        )
        self.gaps = GapHistogram()
        tiers = build_tiers(
            config.tier,
            cost.topology.node_of,
            gpu_pages=self.cluster.capacity_blocks,
            block_size=trace.block_tokens,
            kv_bytes_per_token=cost.kv_bytes_per_token,
            layers=cost.model.layers,
            chains=prepared.hashes,
            pure=config.pure,
        )
        self.engines = [
            Engine(
                slot,
                engine_spec,
                cost.latency,
                self.gaps.add,
                tier=tiers[slot],
                wake_sink=self._wake_later,
            )
            for slot in range(cluster_cfg.n_instances)
        ]
        self.tiers: list[NodeTier] = list({id(t): t for t in tiers if t is not None}.values())
        self.clock = EventQueue()
        self.hotspot = HotspotMeter(cluster_cfg.n_instances, cluster_cfg.chunk_tokens)
        self.feedback = EngineFeedback(
            self.engines, self.scheduler, self.hotspot, core.limits.max_blocks, self.clock
        )
        self.migrations = MigrationTracker(
            self.engines,
            cooldown_s=float(self.params.get("t_cool_s", 0.0)),
            hot_tokens=float(self.params.get("t_hot_tokens", cluster_cfg.chunk_tokens)),
        )
        self.transfers = Transfers(
            self.engines,
            Network(cost.topology),
            self.scheduler,
            migrations=self.migrations,
            drain=self.feedback.drain,
            kv_bytes_per_token=cost.kv_bytes_per_token,
            clock=self.clock,
        )
        self.arrivals = Arrivals(self.calls, self.clock)
        self.reqs = [Req(i) for i in range(len(self.calls))]
        self._version = [0] * cluster_cfg.n_instances  # per engine: its current step's number
        self._done_count = 0
        self._progress: Callable[[float], None] | None = None  # hears the share of calls done
        self.verdict: SloVerdict | None = None  # set by a run told to stop below a target

    # ---- event loop --------------------------------------------------------------------

    def run(
        self,
        progress: Callable[[float], None] | None = None,
        stop_below: float | None = None,
    ) -> ReplayResult:
        """Replay the whole trace; `progress` hears the share of calls done as it grows. With
        `stop_below`, stop as soon as SLO attainment cannot reach it (`SloVerdict`): the
        result's `attainment_bound` then says so, and its calls are partly replayed."""
        config = self.config
        self.arrivals.schedule(config.load, config.closed_loop, self.cluster.n, config.seed)
        clock = self.clock
        self._progress = progress
        if stop_below is not None:
            measured = measured_calls(self.prepared.trace, config, self.arrivals.group_start)
            self.verdict = SloVerdict(
                measured.tolist(),
                [call.output_tokens for call in self.calls],
                self.cluster.config.slo,
                stop_below,
            )
        # Indexed by the event kinds of `kvsched.sim.clock`: ARRIVE, STEP, WAKE, TRANSFER_DONE,
        # PREFETCH_DUE.
        handlers: tuple[Callable[[Any], None], ...] = (
            self._on_arrive,
            self._on_step,
            self._on_wake,
            self.transfers.landed,
            self.transfers.prefetch_due,
        )
        bound = None
        try:
            clock.run(handlers)
        except TargetOutOfReach:
            bound = self.verdict.attainment_bound if self.verdict else None
        self.hotspot.finish(clock.now)
        return ReplayResult(
            reqs=self.reqs,
            cluster=self.cluster,
            engines=self.engines,
            hotspot=self.hotspot,
            gaps=self.gaps,
            migrations=self.migrations.log,
            transfers=self.transfers.stats,
            group_start=self.arrivals.group_start,
            end_time=clock.now,
            events=clock.handled,
            tiers=self._tier_stats(),
            attainment_bound=bound,
        )

    def _tier_stats(self) -> dict[str, int] | None:
        if not self.tiers:
            return None
        total: dict[str, int] = {}
        for tier in self.tiers:
            for key, value in tier.stats().items():
                total[key] = total.get(key, 0) + value
        return total

    # ---- arrivals and placement ----------------------------------------------------------

    def _on_arrive(self, call_idx: int) -> None:
        call = self.calls[call_idx]
        req = self.reqs[call_idx]
        now = self.clock.now
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
                self.arrivals.retry(call_idx, decision.retry_after_s)
            else:
                self._finish_rejected(req)
            return
        self._execute(req, info, decision)

    def _execute(self, req: Req, info: RequestInfo, decision: Decision) -> None:
        now = self.clock.now
        handoff = next((t for t in decision.transfers if t.kind is TransferKind.HANDOFF), None)
        kind = JobKind.PREFILL_ONLY if handoff is not None else JobKind.FULL
        job = Job(req.call, kind, info.prompt_tokens, info.output_tokens, info.block_hashes, now)
        if handoff is not None:
            self.transfers.await_prefill(req.call, handoff)
        outcomes: list[TransferOutcome[int]] = []
        for plan in decision.transfers:
            if plan.kind is TransferKind.HANDOFF:
                landed = True  # streamed once the prefill is done (`hand_off`): it always lands
            else:
                landed = self.transfers.start(plan, job if plan.on_critical_path else None)
            outcomes.append(
                TransferOutcome(plan.kind, plan.source, plan.target, plan.on_critical_path, landed)
            )
        if outcomes:
            # Where the turn runs, by the rule a Router follows too: a failed migration sends
            # it back to its source, and the placed instance's charge for it goes with its
            # next report.
            host = turn_host(decision.instance, outcomes)
            if host.prefill != decision.instance:
                self.feedback.report(decision.instance)
            slot = req.slot = host.prefill
            req.decode_slot = host.decode
        else:  # no transfer: the turn runs where it was placed (what `turn_host` says then)
            slot = req.slot = req.decode_slot = decision.instance
        self.migrations.turn_placed(info.session_id, slot)
        self.engines[slot].submit(job)
        if job.ready_at > now:
            self.clock.push(job.ready_at, WAKE, slot)
        self._kick(slot)

    def _finish_rejected(self, req: Req) -> None:
        if self.verdict is not None:
            self.verdict.refused(req.call)
        req.rejected = True
        req.done = True
        req.finished_at = self.clock.now
        self._call_done()
        self.arrivals.finished(req.call)

    def _call_done(self) -> None:
        self._done_count += 1
        self._drop_prefetches_when_done()
        if self._progress is not None:
            self._progress(self._done_count / len(self.calls))

    def _drop_prefetches_when_done(self) -> None:
        """Every call is done: no turn is left to prefetch for, and a due check would only
        stretch the run's end (its makespan, its meters' time averages)."""
        if self._done_count == len(self.calls) and self.transfers.prefetch_pending:
            self.clock.discard(PREFETCH_DUE)
            self.transfers.prefetch_pending = 0

    # ---- engines -----------------------------------------------------------------------

    def _kick(self, slot: int) -> None:
        """New work reached `slot`: start a step if idle, or cut a decode macro-step short."""
        engine = self.engines[slot]
        now = self.clock.now
        end = engine.plan(now) if engine.idle else engine.interrupt(now)
        if end is not None:
            self._version[slot] += 1
            self.clock.push(end, STEP, (slot, self._version[slot]))
        self.feedback.report(slot)

    def _wake_later(self, slot: int, at: float) -> None:
        """Wake `slot` at `at`, when a prompt it deferred on a busy node-tier link may start
        (the engines' `wake_sink`)."""
        self.clock.push(at, WAKE, slot)

    def _on_wake(self, slot: int) -> None:
        self._kick(slot)

    def _on_step(self, key: tuple[int, int]) -> None:
        slot, version = key
        if version != self._version[slot]:
            return  # superseded by an interrupt
        engine = self.engines[slot]
        out = engine.complete(self.clock.now)
        self._handle_outcome(out)
        if self.config.check_integrity:
            engine.check_integrity()
        self.feedback.drain(slot)
        end = engine.plan(self.clock.now)
        if end is not None:
            self._version[slot] += 1
            self.clock.push(end, STEP, (slot, self._version[slot]))
        self.feedback.report(slot)

    def _handle_outcome(self, out: StepOutcome) -> None:
        now = self.clock.now
        for job in out.first_tokens:
            if job.kind is JobKind.DECODE_ONLY:
                continue
            req = self.reqs[job.rid]
            req.first_token_at = now
            if self.verdict is not None:
                self.verdict.first_token(job.rid, now - req.arrival)
            req.local_hit = job.local_hit_tokens
            req.tier_hit = job.tier_hit_tokens
            req.transfer_hit = job.cached_tokens - job.local_hit_tokens - job.tier_hit_tokens
        for job in out.finished:
            if job.kind is JobKind.PREFILL_ONLY:
                if not self.transfers.hand_off(job):
                    self._complete(self.reqs[job.rid])  # the first token was the whole output
            else:
                self._complete(self.reqs[job.rid])

    def _complete(self, req: Req) -> None:
        now = self.clock.now
        if self.verdict is not None:
            first = req.first_token_at
            self.verdict.finished(req.call, first - req.arrival, now - first)
        req.finished_at = now
        req.done = True
        self._call_done()
        call = self.calls[req.call]
        done = Completion(
            request_id=req.call,
            session_id=call.session or None,
            instance=req.slot,
            decode_instance=req.decode_slot,
            prompt_tokens=call.input_tokens,
            output_tokens=call.output_tokens,
            cached_tokens=req.local_hit + req.transfer_hit + req.tier_hit,
            block_hashes=self.prepared.hashes[req.call],
            arrival=req.arrival,
            first_token_at=req.first_token_at,
            finished_at=now,
            tool_call=call.tool_call,
        )
        for plan in self.scheduler.finish(done, now):
            self.transfers.start(plan, None)
        self._drop_prefetches_when_done()  # the last completion may still plan some
        self.arrivals.finished(req.call)


def run_replay(
    prepared: PreparedTrace,
    spec: str,
    config: ReplayConfig,
    progress: Callable[[float], None] | None = None,
    stop_below: float | None = None,
) -> ReplayResult:
    """Replay `prepared` through the policy `spec`, timing it (`Replay.run`); the run must end
    at a finite time."""
    started = time.perf_counter()
    result = Replay(prepared, spec, config).run(progress, stop_below)
    result.wall_s = time.perf_counter() - started
    if not math.isfinite(result.end_time):
        raise RuntimeError("replay ended at a non-finite time")
    return result
