"""What a simulated engine runs on, apart from its step loop (`kvsched.sim.engine`).

`EngineState` owns one instance's queues, the memory its jobs hold, its pending-prefill
estimate, its pins and its counters, together with what a driver does between steps (submit,
retain, abort) and reads (report). `EngineSpec` is its static configuration and
`PlannedStep` the step it runs; `Engine` adds the loop that plans and completes steps.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvsched.cache.prefix_cache import EngineCache, make_cache
from kvsched.core.latency import LatencyModel
from kvsched.core.load import LoadReport
from kvsched.sim.jobs import Job, JobKind

if TYPE_CHECKING:
    from kvsched.sim.tiers import NodeTier


@dataclass(slots=True)
class PlannedStep:
    """The step an engine runs (`EngineState.step`): from `plan` until `complete`."""

    start: float
    end: float
    passes: int  # 1 for a mixed pass, k for a decode macro-step
    chunks: list[tuple[Job, int]]
    decode_seqs: int
    decode_ctx: int


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """Static configuration of a simulated engine."""

    block_size: int
    capacity_pages: int
    chunk_tokens: int
    max_running: int
    layers: int
    pure_cache: bool = False  # the reference prefix cache rather than the compiled one


GapSink = Callable[[float, float, float], None]  # (first gap s, last gap s, count)
WakeSink = Callable[[int, float], None]  # (slot, time to wake it)


@dataclass(frozen=True, slots=True)
class Pin:
    """A chain's leading `blocks` held in GPU memory until `until` (`Engine.retain`)."""

    hashes: tuple[int, ...]
    blocks: int
    until: float


class EngineState:
    """One instance's scheduler state and the edits made to it between steps; see the module
    docstring. Not used alone: `Engine` is this plus its step loop."""

    def __init__(
        self,
        slot: int,
        spec: EngineSpec,
        latency: LatencyModel,
        gap_sink: GapSink | None = None,
        *,
        cache: EngineCache | None = None,
        tier: NodeTier | None = None,
        wake_sink: WakeSink | None = None,
    ) -> None:
        """`tier`: the node KV pool this engine loads from (shared with the node's other
        instances); None, the default, models GPU memory only. `wake_sink(slot, at)` hears
        when a prompt deferred on a busy tier link may start (the caller wakes the engine
        then); without one they are kept for `take_wakes`."""
        self.slot = slot
        self.tier = tier
        self.wake_sink = wake_sink
        self.latency = latency
        self.bs = spec.block_size
        # The spec's cache unless the caller brings its own, as the live engine does.
        self.cache = (
            cache if cache is not None else make_cache(spec.capacity_pages, spec.pure_cache)
        )
        self.chunk_tokens = spec.chunk_tokens
        self.max_running = spec.max_running
        self.layers = spec.layers
        self.waiting: deque[Job] = deque()
        self.handoffs: deque[Job] = deque()  # decode-only jobs waiting for their KV or room
        self.prefilling: list[Job] = []
        self.decoding: set[Job] = set()
        self._finish_heap: list[tuple[int, int, Job]] = []
        self._seq = 0
        self.tick = 0  # decode passes run so far (each gives every decoding job one token)
        self.decode_ctx = 0  # context tokens of decoding jobs at the current tick
        self.pending_tokens = 0  # prompt tokens queued or mid-prefill, not computed yet
        self.pending_s = 0.0  # isolated prefill estimate of those tokens
        # The part of `pending_s` still queued: jobs in `waiting`, not admitted yet (the hotspot
        # index's measure of work that waits); changes only on submit, admission and abort.
        self.queued_s = 0.0
        self.step: PlannedStep | None = None
        # Times a job deferred on its node-tier load may start (its first layer is in), when
        # no `wake_sink` hears them: whoever drives the engine wakes it then (`take_wakes`).
        self.wakes: list[float] = []
        self.gap_sink = gap_sink
        # Counters for the report.
        self.passes = 0
        self.mixed_passes = 0  # decode passes that also carried prompt tokens
        self.decode_passes = 0
        self.busy_s = 0.0
        self.kv_area = 0.0  # ∫ locked pages dt: how full the KV memory runs
        self.batch_area = 0.0  # ∫ decoding requests dt
        # Sessions' contexts kept from eviction until a time (`retain`), by first block.
        self.pins: dict[int, Pin] = {}
        self.pins_freed_early = 0  # pins let go before their time to admit a request

    # ---- queue -------------------------------------------------------------------------

    @property
    def running(self) -> int:
        """Jobs admitted and not finished: prefilling or decoding."""
        return len(self.prefilling) + len(self.decoding)

    @property
    def idle(self) -> bool:
        """No step runs: none planned since the last `complete`."""
        return self.step is None

    def submit(self, job: Job) -> None:
        """Queue a job; prompt work counts as pending at once (decode-only jobs have none).
        A job with prompt work is admissible no sooner than the profile's request overhead
        after its arrival."""
        if job.kind is not JobKind.DECODE_ONLY:
            overhead = self.latency.request_overhead_s
            if overhead > 0:  # (none: admissible at once, whatever clock the caller plans on)
                job.ready_at = max(job.ready_at, job.arrival + overhead)
            limit = (job.prompt - 1) // self.bs
            guess = max(job.held + job.fetched, self.cache.match(job.hashes, limit))
            if self.tier is not None:  # what the node's pool holds is loaded, not computed
                guess = max(guess, self.tier.match(job.hashes, limit))
            n_new = job.prompt - min(guess * self.bs, job.prompt - 1)
            job.est_prefill_s = self.latency.prefill_scalar(
                n_new, job.prompt - n_new, self.chunk_tokens
            )
            self.pending_tokens += n_new
            self.pending_s += job.est_prefill_s
            self.queued_s += job.est_prefill_s
            job.computed = job.prompt - n_new  # provisional until admission
            self.waiting.append(job)
        else:
            self.handoffs.append(job)

    def retain(self, hashes: Sequence[int], until: float, now: float) -> int:
        """Keep what the cache holds of chain `hashes` from eviction until `until`, or until a
        request of the same chain is admitted (it then holds the blocks itself); replaces an
        earlier pin of the chain. Returns the blocks pinned. (Continuum's time-to-live pin:
        the pinned blocks count against free memory for every other request.)"""
        if not hashes:
            return 0
        self._unpin(hashes[0], now)
        blocks = self.cache.match(hashes, len(hashes)) if until > now else 0
        if blocks:
            self.cache.lock_prefix(hashes, blocks, now, touch=False)
            self.pins[hashes[0]] = Pin(tuple(hashes), blocks, until)
        return blocks

    def _unpin(self, first: int, now: float) -> None:
        pin = self.pins.pop(first, None)
        if pin is not None:
            self.cache.unlock_prefix(pin.hashes, pin.blocks, now, touch=False)

    def _expire_pins(self, now: float) -> None:
        """Let go of pins whose time is up, unless a request of their chain waits here (it
        is about to use them)."""
        waiting = {job.hashes[0] for job in self.waiting if job.hashes}
        for first in [f for f, pin in self.pins.items() if pin.until <= now and f not in waiting]:
            self._unpin(first, now)

    def _free_a_pin(self, now: float) -> bool:
        """A request cannot get memory while little else runs: let go of the pin due last
        (Continuum's guard against pins starving the queue). Whether there was one."""
        if not self.pins:
            return False
        first = max(self.pins, key=lambda f: (self.pins[f].until, f))
        self._unpin(first, now)
        self.pins_freed_early += 1
        return True

    def take_wakes(self) -> list[float]:
        """The wake-up times `plan` asked for since the last call (emptied), when no
        `wake_sink` hears them."""
        wakes, self.wakes = self.wakes, []
        return wakes

    def report(self) -> LoadReport:
        """The engine's load as a scheduler would read it from its metrics."""
        batch = len(self.decoding)
        overhead = 0.0
        if self.pending_tokens and batch:  # decodes ride along every pass of the queue
            passes = -(-self.pending_tokens // max(self.chunk_tokens - batch, 1))
            lat = self.latency
            overhead = passes * (lat.decode_seq_s * batch + lat.decode_ctx_s * self.decode_ctx)
        cache = self.cache
        return LoadReport(  # positional, in field order: once per engine step
            self.pending_tokens,
            self.pending_s + overhead,
            len(self.waiting) + len(self.handoffs),
            len(self.prefilling) + batch,  # `running`
            self.decode_ctx,
            cache.available,
        )

    def abort(self, job: Job, now: float) -> bool:
        """Drop `job` wherever it is (queued, prefilling or decoding): its pending prefill
        leaves the load, its held blocks are unlocked (they stay cached) and its private pages
        go back to the free pool. Only between steps, since a running step counts the job in
        its batch. False when the job is not here (finished, or never submitted)."""
        assert self.step is None, "abort() while a step runs"
        if job in self.decoding:
            self.decoding.discard(job)
            self.decode_ctx -= job.prompt + job.output - (job.finish_tick - self.tick)
            self._finish_heap = [e for e in self._finish_heap if e[2] is not job]
            heapq.heapify(self._finish_heap)
        elif job in self.prefilling or job in self.waiting:
            if job in self.prefilling:
                self.prefilling.remove(job)
            else:
                self.waiting.remove(job)
                self._unqueue(job)
            self.pending_tokens -= job.prompt - job.computed
            self.pending_s -= job.est_prefill_s
            job.est_prefill_s = 0.0
            if not self.pending_tokens:
                self.pending_s = 0.0
        elif job in self.handoffs:
            self.handoffs.remove(job)
        else:
            return False
        self._release(job, now)
        return True

    # ---- internals ---------------------------------------------------------------------

    def _unqueue(self, job: Job) -> None:
        """`job` has left `waiting`: its estimate leaves `queued_s`."""
        self.queued_s -= job.est_prefill_s
        if not self.waiting:
            self.queued_s = 0.0  # no float drift survives an empty queue

    def _release(self, job: Job, now: float) -> None:
        """`job` is done here: its held blocks are unlocked (they stay cached) and its private
        pages go back to the free pool."""
        job.finished_at = now
        if job.held:
            self.cache.unlock_prefix(job.hashes, job.held, now)
            job.held = 0
        if job.private:
            self.cache.release(job.private)
            job.private = 0

    def check_integrity(self) -> None:
        """Assert that the counters agree with the jobs they count (for tests)."""
        self.cache.check_integrity()
        assert self.pending_tokens >= 0
        queued = sum(j.est_prefill_s for j in self.waiting)
        assert abs(self.queued_s - queued) <= 1e-9 * max(1.0, queued), (self.queued_s, queued)
        assert self.decode_ctx == sum(
            j.prompt + j.output - (j.finish_tick - self.tick) for j in self.decoding
        )
