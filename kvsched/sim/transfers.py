"""KV copies between simulated engines: session migrations and fetches of a cached prefix
(started when a decision plans them, landing later), and the prefill-to-decode hand-off
streamed once a prefill is done.

A copy locks its blocks on both ends while it runs. One nobody waits for lands as the live
import lands (`services.common.kv_transfer`): committed into the target's cache, then
unlocked, so the blocks are evictable and most recently used.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvsched.core.decision import TransferKind, TransferPlan
from kvsched.core.scheduler import SchedulerPort
from kvsched.sim.clock import TRANSFER_DONE, WAKE, EventQueue
from kvsched.sim.engine import Engine, Job, JobKind
from kvsched.sim.migrations import MigrationTracker
from kvsched.sim.network import Network


@dataclass(slots=True, eq=False)
class Transfer:
    """A KV transfer in flight."""

    plan: TransferPlan
    source_blocks: int  # blocks locked on the source for the copy
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

    def start(self, plan: TransferPlan, job: Job | None) -> bool:
        """Lock the blocks on both sides, book the links and schedule the arrival; returns
        whether it did not fail. The source moves what it still holds beyond the target's
        prefix: when that is nothing, the transfer is done at once (the target holds as much
        as the source). When the target has no room it fails at once: nothing moves. `job`,
        the request waiting for the copy, may start once the copy's first layer is in."""
        now = self._clock.now
        src, dst = self._engines[plan.source], self._engines[plan.target]
        hashes = plan.block_hashes
        have_src = src.cache.match(hashes, len(hashes))
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
        src.cache.lock_prefix(hashes, have_src, now, touch=False)  # reading is not using
        blocks = have_src - have_dst
        nbytes = blocks * dst.bs * self._kv_bytes_per_token
        start, end = self._network.schedule(plan.source, plan.target, nbytes, now)
        self._count(plan, nbytes, end - start)
        record = Transfer(plan, have_src, have_dst, job, start, end)
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
        src.cache.unlock_prefix(plan.block_hashes, record.source_blocks, now, touch=False)
        if record.job is None:
            hashes = plan.block_hashes
            dst.cache.commit(
                hashes, record.target_start, record.source_blocks, record.target_start, now
            )
            dst.cache.unlock_prefix(hashes, record.source_blocks, now)
            self._drain(plan.target)
        self._drain(plan.source)
        self._scheduler.transfer_done(plan.transfer_id, True, now)

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
