"""One simulated engine instance: Mini-SGLang's scheduling loop on a virtual clock.

Each forward pass first gives every running decode one token of the budget (tokens reserved for
running decodes), then fills what is left with prompt chunks: unfinished chunked prompts first,
then new requests in arrival order (chunked prefill). A request is admitted only when the cache
can reserve pages for its uncached prompt and its whole output, so decodes never run out of
memory (Mini-SGLang's reservation); at least one prompt token is always recomputed to get
logits. When no prompt work is admissible, the engine decodes; consecutive decode-only passes
with an unchanged batch are simulated as one macro-step that ends at the next completion, and
is cut short at a pass boundary when new work arrives.

The engine never reads a clock: the replay loop passes `now` and schedules `step_end`.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

from kvsched.core.latency import LatencyModel
from kvsched.core.load import LoadReport
from kvsched.sim.cache import EngineCache, make_cache

if TYPE_CHECKING:
    from kvsched.sim.tiers import NodeTier


class JobKind(Enum):
    FULL = "full"  # prefill then decode here
    PREFILL_ONLY = "prefill"  # prefill here, decode elsewhere (disaggregated)
    DECODE_ONLY = "decode"  # KV handed over from a prefill instance


@dataclass(slots=True, eq=False)
class Job:
    """A request's work on one engine. The engine fills the fields below `arrival`."""

    rid: int
    kind: JobKind
    prompt: int
    output: int
    hashes: tuple[int, ...]
    arrival: float
    ready_at: float = 0.0  # admissible from here (first layer of incoming KV arrived)
    kv_done_at: float = 0.0  # last layer of incoming KV arrives
    held: int = 0  # leading prompt blocks this job holds locked in the cache
    fetched: int = 0  # blocks after `held` arriving by transfer into reserved pages
    private: int = 0  # pages reserved for this job and not holding a cached block
    cached_tokens: int = 0  # prompt tokens not computed here (local hit + fetched)
    local_hit_tokens: int = 0
    tier_hit_tokens: int = 0  # prompt tokens loaded from the node's DRAM/SSD tier
    computed: int = 0  # prompt tokens done (cached ones included)
    generated: int = 0
    admitted_at: float = -1.0
    first_token_at: float = -1.0
    finished_at: float = -1.0
    finish_tick: int = 0  # decode tick at which the last token is out
    est_prefill_s: float = 0.0  # this job's share of the engine's pending-prefill estimate

    @property
    def context(self) -> int:
        return self.prompt + self.generated


@dataclass(slots=True)
class StepOutcome:
    """What one step (or macro-step) produced."""

    first_tokens: list[Job] = field(default_factory=list)
    finished: list[Job] = field(default_factory=list)  # includes prefill-only jobs handed off


@dataclass(slots=True)
class _Step:
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


GapSink = Callable[[float, float, float], None]  # (first gap s, last gap s, count)
WakeSink = Callable[[int, float], None]  # (slot, time to wake it)


@dataclass(frozen=True, slots=True)
class Pin:
    """A chain's leading `blocks` held in GPU memory until `until` (`Engine.retain`)."""

    hashes: tuple[int, ...]
    blocks: int
    until: float


class Engine:
    """Scheduler state of one instance; see the module docstring for its loop."""

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
        # The compiled cache unless `KVSCHED_PURE_SIMCACHE` asks for the reference (or the
        # caller brings its own, as the live engine does).
        self.cache = cache if cache is not None else make_cache(spec.capacity_pages)
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
        self.step: _Step | None = None
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
        return len(self.prefilling) + len(self.decoding)

    @property
    def idle(self) -> bool:
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

    # ---- stepping ----------------------------------------------------------------------

    def plan(self, now: float, max_passes: int | None = None) -> float | None:
        """Choose the next step starting at `now`; returns its end time, None when idle.

        `max_passes` caps a decode macro-step at that many passes (the live engine streams
        every few passes instead of jumping to the next completion); None, the simulator's
        setting, lets it run to the next completion."""
        assert self.step is None, "plan() while a step runs"
        if self.pins:
            self._expire_pins(now)
        if self.handoffs:
            self._admit_handoffs(now)
        batch = len(self.decoding)
        budget = self.chunk_tokens - batch
        chunks: list[tuple[Job, int]] = []
        if budget > 0:
            for job in self.prefilling:
                take = min(budget, job.prompt - job.computed)
                if take > 0:
                    chunks.append((job, take))
                    budget -= take
                    if budget == 0:
                        break
            if budget > 0 and self.waiting:
                budget = self._admit(now, budget, chunks)
        if chunks:
            prefill_tokens = context = 0
            pairs = 0.0
            for job, take in chunks:
                prefill_tokens += take
                context += job.computed
                pairs += take * (job.computed + take * 0.5)
            dur = self.latency.step(prefill_tokens, pairs, batch, self.decode_ctx, context)
            end = now + dur
            for job, _ in chunks:
                if job.kv_done_at > now:  # layer-wise: the last layer's compute follows its KV
                    end = max(end, job.kv_done_at + dur / self.layers)
            self.step = _Step(now, end, 1, chunks, batch, self.decode_ctx)
            return end
        if batch:
            k = self._finish_heap[0][0] - self.tick
            if max_passes is not None:
                k = min(k, max(max_passes, 1))
            end = now + self.latency.decode_steps(batch, self.decode_ctx, k)
            self.step = _Step(now, end, k, [], batch, self.decode_ctx)
            return end
        return None

    def interrupt(self, now: float) -> float | None:
        """New work arrived while a decode macro-step runs: end it at the first pass boundary
        after `now`. Returns the new end time, or None when nothing changes."""
        step = self.step
        if step is None or step.chunks or step.passes <= 1:
            return None
        done = self.latency.steps_within(step.decode_seqs, step.decode_ctx, now - step.start)
        keep = min(done + 1, step.passes)
        if keep >= step.passes:
            return None
        step.passes = keep
        step.end = step.start + self.latency.decode_steps(step.decode_seqs, step.decode_ctx, keep)
        return step.end

    def complete(self, now: float) -> StepOutcome:
        """Apply the running step's effects at its end time `now`."""
        step = self.step
        assert step is not None and abs(step.end - now) < 1e-9, "complete() off the step end"
        self.step = None
        out = StepOutcome()
        dur = now - step.start
        self.busy_s += dur
        self.kv_area += self.cache.locked * dur
        self.batch_area += step.decode_seqs * dur
        self.passes += step.passes
        if step.decode_seqs:
            self.decode_passes += step.passes
            if step.chunks:
                self.mixed_passes += 1
            if self.gap_sink is not None:
                self._record_gaps(step, dur)
            self.tick += step.passes
            self.decode_ctx += step.decode_seqs * step.passes
            self._retire_decodes(now, out)
        for job, take in step.chunks:
            self._progress(job, take, now, out)
        return out

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

    def _record_gaps(self, step: _Step, dur: float) -> None:
        """Every decoding job saw one inter-token gap per pass of this step."""
        assert self.gap_sink is not None
        seqs = step.decode_seqs
        if step.chunks:
            self.gap_sink(dur, dur, seqs)
            return
        lat = self.latency  # `decode_step`, inlined: once per engine step
        fixed = lat.step_s + lat.decode_seq_s * seqs
        first = fixed + lat.decode_ctx_s * step.decode_ctx
        last = fixed + lat.decode_ctx_s * (step.decode_ctx + seqs * (step.passes - 1))
        self.gap_sink(first, last, seqs * step.passes)

    def _admit_handoffs(self, now: float) -> None:
        """Start decoding handed-over requests whose KV has landed, in order, while memory
        and slots allow."""
        queue, cache = self.handoffs, self.cache
        while queue and queue[0].ready_at <= now and self.running < self.max_running:
            job = queue[0]
            pages = max(-(-(job.prompt + job.output) // self.bs) - job.private, 0)
            if not cache.reserve(pages):
                return
            job.private += pages
            queue.popleft()
            job.admitted_at = now
            self._start_decoding(job)

    def _admit(self, now: float, budget: int, chunks: list[tuple[Job, int]]) -> int:
        """Admit waiting jobs in order while budget, slots and memory allow."""
        cache, bs = self.cache, self.bs
        skipped: list[Job] = []
        while budget > 0 and self.waiting and self.running < self.max_running:
            job = self.waiting[0]
            if job.ready_at > now:  # its KV is still on the wire: later jobs may go first
                skipped.append(self.waiting.popleft())
                continue
            limit = (job.prompt - 1) // bs
            extra = job.held + job.fetched
            local = cache.match(job.hashes, limit) if job.fetched == 0 else job.held
            if job.fetched == 0 and local > job.held:
                cache.lock_prefix(job.hashes, local, now)
                if job.held:
                    cache.unlock_prefix(job.hashes, job.held, now)
                job.held = local
                extra = local
            loaded = 0
            if self.tier is not None and job.fetched == 0:
                # The rest of the prefix from the node's pool, when it holds more than the GPU.
                loaded = max(self.tier.match(job.hashes, limit) - job.held, 0)
            total = job.prompt + (job.output if job.kind is JobKind.FULL else 0)
            pages = max(-(-total // bs) - job.held - job.private, 0)
            if not cache.reserve(pages):
                if self.running <= 1 and self._free_a_pin(now):
                    continue  # the same job again, with the pinned blocks evictable
                break
            job.private += pages
            if loaded:
                assert self.tier is not None
                load = self.tier.load(self.slot, job.hashes, job.held, job.held + loaded, now)
                job.fetched = loaded
                job.ready_at, job.kv_done_at = load.ready_at, load.done_at
                extra = job.held + loaded
                job.tier_hit_tokens = min(extra * bs, job.prompt - 1) - min(
                    job.held * bs, job.prompt - 1
                )
                if load.start > now:  # the link is busy: wait for the first layer, pages held
                    skipped.append(self.waiting.popleft())
                    if self.wake_sink is not None:
                        self.wake_sink(self.slot, load.ready_at)
                    else:
                        self.wakes.append(load.ready_at)
                    continue
            self.waiting.popleft()
            self.queued_s -= job.est_prefill_s  # the provisional estimate it was queued with
            job.admitted_at = now
            if self.pins and job.hashes:
                self._unpin(job.hashes[0], now)  # it holds its own prefix now
            cached_tokens = min(extra * bs, job.prompt - 1)
            job.local_hit_tokens = min(job.held * bs, cached_tokens)
            job.cached_tokens = cached_tokens
            # Replace the provisional pending estimate with the one for the real hit.
            self.pending_tokens += job.computed - cached_tokens
            job.computed = cached_tokens
            new_est = self.latency.prefill_scalar(
                job.prompt - cached_tokens, cached_tokens, self.chunk_tokens
            )
            self.pending_s += new_est - job.est_prefill_s
            job.est_prefill_s = new_est
            self.prefilling.append(job)
            take = min(budget, job.prompt - job.computed)
            chunks.append((job, take))
            budget -= take
        if skipped:
            self.waiting.extendleft(reversed(skipped))
        if not self.waiting:
            self.queued_s = 0.0  # no float drift survives an empty queue
        return budget

    def _unqueue(self, job: Job) -> None:
        """`job` has left `waiting`: its estimate leaves `queued_s`."""
        self.queued_s -= job.est_prefill_s
        if not self.waiting:
            self.queued_s = 0.0  # no float drift survives an empty queue

    def _progress(self, job: Job, take: int, now: float, out: StepOutcome) -> None:
        bs = self.bs
        job.computed += take
        self.pending_tokens -= take
        remaining_est = (
            self.latency.prefill_scalar(job.prompt - job.computed, job.computed, self.chunk_tokens)
            if job.computed < job.prompt
            else 0.0
        )
        self.pending_s -= job.est_prefill_s - remaining_est
        job.est_prefill_s = remaining_est
        if not self.pending_tokens:
            self.pending_s = 0.0  # no float drift survives an empty queue
        # Commit fetched blocks on the first pass (their KV has landed), then computed ones.
        if job.fetched:
            end = job.held + job.fetched
            self.cache.commit(job.hashes, job.held, end, job.held, now)
            job.private -= job.fetched
            job.held, job.fetched = end, 0
        full = min(job.computed // bs, len(job.hashes))
        if full > job.held:
            self.cache.commit(job.hashes, job.held, full, job.held, now)
            job.private -= full - job.held
            job.held = full
        if job.computed < job.prompt:
            return
        self.prefilling.remove(job)
        job.generated = 1
        job.first_token_at = now
        out.first_tokens.append(job)
        if job.kind is JobKind.PREFILL_ONLY or job.output <= 1:
            self._release(job, now)
            out.finished.append(job)
        else:
            self._start_decoding(job)

    def _start_decoding(self, job: Job) -> None:
        self.decoding.add(job)
        self.decode_ctx += job.context
        job.finish_tick = self.tick + job.output - job.generated
        self._seq += 1
        heapq.heappush(self._finish_heap, (job.finish_tick, self._seq, job))

    def _retire_decodes(self, now: float, out: StepOutcome) -> None:
        heap = self._finish_heap
        while heap and heap[0][0] <= self.tick:
            _, _, job = heapq.heappop(heap)
            self.decoding.discard(job)
            job.generated = job.output
            self.decode_ctx -= job.context
            self._release(job, now)
            out.finished.append(job)

    def _release(self, job: Job, now: float) -> None:
        job.finished_at = now
        if job.held:
            self.cache.unlock_prefix(job.hashes, job.held, now)
            job.held = 0
        if job.private:
            self.cache.release(job.private)
            job.private = 0

    def check_integrity(self) -> None:
        self.cache.check_integrity()
        assert self.pending_tokens >= 0
        queued = sum(j.est_prefill_s for j in self.waiting)
        assert abs(self.queued_s - queued) <= 1e-9 * max(1.0, queued), (self.queued_s, queued)
        assert self.decode_ctx == sum(
            j.prompt + j.output - (j.finish_tick - self.tick) for j in self.decoding
        )
