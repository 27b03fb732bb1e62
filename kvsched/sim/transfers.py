"""KV copies between simulated engines: session migrations and fetches of a cached prefix
(started when a decision plans them, landing later), and the prefill-to-decode hand-off
streamed once a prefill is done; and idle-gap prefetches, loads of a session's context from
its host's node pool (DRAM tier) into the host's GPU, started when due (`prefetch_due`).

A copy locks its blocks on both ends while it runs (on the source, those in its GPU: a copy to
another node also reads what the source's node pool holds beyond them). One nobody waits for
lands as the live import lands (`services.dataplane.kv_transfer`): committed into the target's
cache, then unlocked, so the blocks are evictable and most recently used.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvsched.core.decision import TransferKind, TransferPlan
from kvsched.core.prefetch import may_start
from kvsched.core.scheduler import SchedulerPort
from kvsched.sim.clock import PREFETCH_DUE, TRANSFER_DONE, WAKE, EventQueue
from kvsched.sim.engine import Engine
from kvsched.sim.jobs import Job, JobKind
from kvsched.sim.migrations import MigrationTracker
from kvsched.sim.network import Network


@dataclass(slots=True, eq=False)
class Transfer:
    """A KV transfer in flight."""

    plan: TransferPlan
    source_blocks: int  # blocks the copy brings the target up to
    source_locked: int  # of them, those locked in the source's GPU (the rest: its node pool's)
    target_start: int  # blocks the target already held (locked for the copy)
    job: Job | None  # the request waiting for it, when on the critical path
    start: float
    end: float


class Transfers:
    """Runs the KV copies between engines over the network, tells the scheduler how each
    ended and counts them (per kind: count, bytes, seconds)."""

    def __init__(
        self,
        engines: Sequence[Engine],
        network: Network,
        scheduler: SchedulerPort,
        *,
        migrations: MigrationTracker,
        drain: Callable[[int], None],
        kv_bytes_per_token: int,
        clock: EventQueue,
    ) -> None:
        """`drain(slot)` forwards an engine's cache events to the scheduler."""
        self._engines = engines
        self._network = network
        self._scheduler = scheduler
        self._migrations = migrations
        self._drain = drain
        self._kv_bytes_per_token = kv_bytes_per_token
        self._clock = clock
        self._handoffs: dict[int, TransferPlan] = {}  # request -> its hand-off, once prefilled
        self.stats: dict[str, list[float]] = {k.value: [0, 0, 0.0] for k in TransferKind}
        # Due prefetches by outcome: loaded, not needed (the GPU kept the context), skipped
        # (queued work or no room on the host), none (the host's node has no pool).
        self.prefetches = {"loaded": 0, "not_needed": 0, "skipped": 0, "no_pool": 0}
        self.prefetch_pending = 0  # prefetches planned, not due yet

    def start(self, plan: TransferPlan, job: Job | None) -> bool:
        """Lock the blocks on both sides, book the links and schedule the arrival; returns
        whether it did not fail. The source moves what it still holds beyond the target's
        prefix, in its GPU or, for a target on another node, in its node's DRAM (read from
        there as Mooncake Store reads a node's pool: what the GPU evicted during a session's
        idle gap still moves): when that is nothing, the transfer is done at once (the target
        holds as much as the source). When the target has no room it fails at once: nothing
        moves. `job`, the request waiting for the copy, may start once the copy's first layer
        is in."""
        now = self._clock.now
        if plan.kind is TransferKind.PREFETCH:
            self._clock.push(max(plan.not_before, now), PREFETCH_DUE, plan)
            self.prefetch_pending += 1
            return True
        if plan.kind is TransferKind.RETAIN:  # nothing moves: the host keeps what it holds
            pinned = self._engines[plan.target].retain(
                plan.block_hashes, now + plan.est_seconds, now
            )
            self._count(
                plan, pinned * self._engines[plan.target].bs * self._kv_bytes_per_token, 0.0
            )
            self._scheduler.transfer_done(plan.transfer_id, True, now)
            return True
        src, dst = self._engines[plan.source], self._engines[plan.target]
        hashes = plan.block_hashes
        in_gpu = src.cache.match(hashes, len(hashes))
        have_src = max(in_gpu, self._pooled(src, dst, hashes))
        have_dst = dst.cache.match(hashes, len(hashes))
        if have_src <= have_dst:
            if plan.kind is TransferKind.MIGRATE_SESSION:
                self._migrations.started(
                    plan, 0, start=now, end=now, on_path=job is not None, now=now
                )
            self._scheduler.transfer_done(plan.transfer_id, True, now)
            return True
        dst.cache.lock_prefix(hashes, have_dst, now)  # before reserving: eviction must spare it
        if not dst.cache.reserve(have_src - have_dst):
            dst.cache.unlock_prefix(hashes, have_dst, now)
            self._failed(plan)
            return False
        src.cache.lock_prefix(hashes, in_gpu, now, touch=False)  # reading is not using
        blocks = have_src - have_dst
        nbytes = blocks * dst.bs * self._kv_bytes_per_token
        start, end = self._network.schedule(plan.source, plan.target, nbytes, now)
        self._count(plan, nbytes, end - start)
        record = Transfer(plan, have_src, in_gpu, have_dst, job, start, end)
        if job is not None:
            job.held, job.fetched, job.private = have_dst, blocks, job.private + blocks
            job.ready_at = start + (end - start) / dst.layers
            job.kv_done_at = end
        if plan.kind is TransferKind.MIGRATE_SESSION:
            self._migrations.started(
                plan, nbytes, start=start, end=end, on_path=job is not None, now=now
            )
        self._clock.push(end, TRANSFER_DONE, record)
        return True

    def landed(self, record: Transfer) -> None:
        """A copy arrived: unlock its source; when nobody waits for it, its blocks join the
        target's cache, evictable. Forwards both engines' cache events and tells the
        scheduler it is done."""
        now = self._clock.now
        plan = record.plan
        src, dst = self._engines[plan.source], self._engines[plan.target]
        if plan.kind is not TransferKind.PREFETCH:  # a prefetch's source is the node's pool
            src.cache.unlock_prefix(plan.block_hashes, record.source_locked, now, touch=False)
        if record.job is None:
            hashes = plan.block_hashes
            dst.cache.commit(
                hashes, record.target_start, record.source_blocks, record.target_start, now
            )
            dst.cache.unlock_prefix(hashes, record.source_blocks, now)
            self._drain(plan.target)
        self._drain(plan.source)
        self._scheduler.transfer_done(plan.transfer_id, True, now)

    @staticmethod
    def _pooled(src: Engine, dst: Engine, hashes: Sequence[int]) -> int:
        """Leading blocks of `hashes` the source's node DRAM holds, for a target on another
        node (one on the same node loads them from the pool itself); 0 without a pool. As
        with the GPU's, reading them is not using them; unlike the GPU's, they are not pinned
        while the copy reads them (an eviction in that window is not modelled)."""
        pool = src.tier
        if pool is None or pool is dst.tier:
            return 0
        return pool.in_dram(hashes, len(hashes))

    def prefetch_due(self, plan: TransferPlan) -> None:
        """A prefetch is due: load what the host's node pool holds of the context beyond the
        GPU's prefix into reserved pages, over the host link (booked as a turn's load is),
        if `may_start` lets it; the blocks join the host's cache when the last layer is in
        (`landed`). Otherwise tell the scheduler at once: done when nothing was missing,
        failed when skipped."""
        now = self._clock.now
        self.prefetch_pending -= 1
        engine = self._engines[plan.target]
        tier, cache, hashes = engine.tier, engine.cache, plan.block_hashes
        if tier is None:
            self.prefetches["no_pool"] += 1
            self._scheduler.transfer_done(plan.transfer_id, False, now)
            return
        gpu = cache.match(hashes, len(hashes))
        needed = tier.match(hashes, len(hashes)) - gpu
        if needed <= 0:
            self.prefetches["not_needed"] += 1
            self._scheduler.transfer_done(plan.transfer_id, True, now)
            return
        cache.lock_prefix(hashes, gpu, now)  # before reserving: eviction must spare it
        room = cache.available
        if not may_start(
            queued_jobs=len(engine.waiting), room_pages=room, needed_pages=needed
        ) or not cache.reserve(needed):
            cache.unlock_prefix(hashes, gpu, now)
            self.prefetches["skipped"] += 1
            self._scheduler.transfer_done(plan.transfer_id, False, now)
            return
        self._drain(plan.target)  # what the reservation evicted is written back first
        load = tier.load(plan.target, hashes, gpu, gpu + needed, now)
        nbytes = needed * engine.bs * self._kv_bytes_per_token
        self._count(plan, nbytes, load.done_at - load.start)
        self.prefetches["loaded"] += 1
        record = Transfer(plan, gpu + needed, 0, gpu, None, load.start, load.done_at)
        self._clock.push(load.done_at, TRANSFER_DONE, record)

    def await_prefill(self, request: int, plan: TransferPlan) -> None:
        """Hold `request`'s hand-off until its prefill is done (`hand_off`)."""
        self._handoffs[request] = plan

    def hand_off(self, job: Job) -> bool:
        """Prefill done on a prefill instance: stream the KV to the decode instance and submit
        the decode there. Layers streamed while the prefill ran, so only what the link could
        not carry meanwhile (at least the last layer) remains. Returns False, streaming
        nothing, when the prefill's first token was the whole output: the request is done."""
        now = self._clock.now
        plan = self._handoffs.pop(job.rid)
        if job.output <= 1:
            return False
        engine = self._engines[plan.target]
        nbytes = job.prompt * self._kv_bytes_per_token
        start, end = self._network.schedule(plan.source, plan.target, nbytes, job.admitted_at)
        end = max(end, now + (end - start) / engine.layers)
        self._count(plan, nbytes, end - start)
        decode = Job(job.rid, JobKind.DECODE_ONLY, job.prompt, job.output, job.hashes, now)
        decode.generated = 1
        decode.ready_at = decode.kv_done_at = end
        engine.submit(decode)
        self._clock.push(end, WAKE, plan.target)
        return True

    def _count(self, plan: TransferPlan, nbytes: int, seconds: float) -> None:
        stats = self.stats[plan.kind.value]
        stats[0] += 1
        stats[1] += nbytes
        stats[2] += seconds

    def _failed(self, plan: TransferPlan) -> None:
        if plan.kind is TransferKind.MIGRATE_SESSION:
            self._migrations.failed()
        self._scheduler.transfer_done(plan.transfer_id, False, self._clock.now)
