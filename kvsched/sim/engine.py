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

This module owns that loop (plan, interrupt, complete, and the admission and progress they
drive); the queues, holdings and counters it steps, and the edits made to them between steps,
are `kvsched.sim.engine_state`'s; the jobs it runs are `kvsched.sim.jobs`'s.
"""

from __future__ import annotations

import heapq

from kvsched.sim.engine_state import EngineState, PlannedStep
from kvsched.sim.jobs import Job, JobKind, StepOutcome


class Engine(EngineState):
    """One instance's scheduler: its state (`EngineState`) and the loop of the module
    docstring that steps it."""

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
            self.step = PlannedStep(now, end, 1, chunks, batch, self.decode_ctx)
            return end
        if batch:
            k = self._finish_heap[0][0] - self.tick
            if max_passes is not None:
                k = min(k, max(max_passes, 1))
            end = now + self.latency.decode_steps(batch, self.decode_ctx, k)
            self.step = PlannedStep(now, end, k, [], batch, self.decode_ctx)
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

    # ---- internals ---------------------------------------------------------------------

    def _record_gaps(self, step: PlannedStep, dur: float) -> None:
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
