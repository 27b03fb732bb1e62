"""The simulator's engine model (`kvsched.sim.engine.Engine`) stepping in real time.

One asyncio task runs the step loop: plan a step at model time `t`, sleep until its end on the
wall clock (model seconds × `time_scale`), apply it, hand each request the tokens it now has,
and publish the cache's KV events. A decode step is at most `stream_interval` passes, so tokens
stream as vLLM streams them; a request arriving during a longer step cuts it short at the next
pass boundary (`Engine.interrupt`). Requests leaving early are aborted between steps.

The loop does not drift: while the engine stays busy, each step starts at the model time the
previous one ended, and every sleep targets an absolute wall-clock deadline, so timer and
scheduling latency never add up. Only when the host falls behind by more than `MAX_LAG_S` of
wall time does the model clock jump to the present (the model cannot run faster than its CPU).

Beside it: each request's record (`services.engine.request`), the model clock the loop sleeps
on (`services.engine.model_clock`), and the mirror that turns the cache's changes into KV memory
pages and KV events (`services.engine.cache_mirror`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Sequence

from kvsched.cache.prefix_cache import PrefixCache
from kvsched.core.vllm_hashing import AdapterKey, VllmBlockHasher, event_hash
from kvsched.sim.jobs import Job, JobKind, StepOutcome
from services.common.inference_api.openai_api import unavailable
from services.dataplane import EngineNames, KvMemory, KvTransfers, PoolLink
from services.engine.cache_mirror import CacheMirror
from services.engine.kv_publisher import KvEventPublisher
from services.engine.metrics import EngineMetrics
from services.engine.model import EngineModel
from services.engine.model_clock import ModelClock
from services.engine.request import Request

log = logging.getLogger("kvsched.engine")
MAX_LAG_S = 0.05  # wall seconds the loop may trail the model clock and still catch up


class LiveEngine:
    """The engine model in real time (on `clock`), with its block names, KV memory (kept in
    step with the cache by `mirror`), transfers and KV-event publisher."""

    def __init__(
        self,
        model: EngineModel,
        publisher: KvEventPublisher,
        metrics: EngineMetrics,
        memory: KvMemory,
        *,
        time_scale: float = 1.0,
        stream_interval: int = 1,
        hasher: VllmBlockHasher | None = None,
    ) -> None:
        self.model = model
        # The reference cache, whose `nodes` the KV memory, names and transfers follow.
        self.cache = PrefixCache(model.capacity_blocks)
        self.engine = model.new_engine(self.cache)
        self.publisher = publisher
        self.metrics = metrics
        self.clock = ModelClock(time_scale)
        self.stream_interval = stream_interval
        self.hasher = hasher or VllmBlockHasher(model.block_size)
        self.names = EngineNames(model.block_size)
        self.memory = memory
        self.mirror = CacheMirror(self.cache, memory, self.names, publisher)
        self.transfers = KvTransfers(
            self.cache,
            memory=memory,
            names=self.names,
            hasher=self.hasher,
            clock=self.clock.now,
            sync=self.mirror.sync,
            freed=self.clock.wake,
        )
        self.mirror.stored = self.transfers.blocks_stored  # (made after: they call `sync`)
        self.pool: PoolLink | None = None  # the node's KV pool, when the engine uses one
        self._saves: asyncio.Queue[Request] = asyncio.Queue()  # prefilled, to save to the pool
        self._saver: asyncio.Task[None] | None = None
        self.requests: dict[int, Request] = {}
        self.failed: str | None = None  # why the loop stopped, once it has
        self._ids = itertools.count()
        self._aborted: list[Request] = []
        self._arrived = False  # a request joined since the step was planned
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._task = loop.create_task(self._run())
        if self.pool is not None:
            self._saver = loop.create_task(self._save_prefilled(self.pool))

    async def stop(self) -> None:
        """Stop stepping; requests still in the engine end with an error, exports are
        released and imports aborted."""
        for task in (self._task, self._saver):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._task = self._saver = None
        while not self._saves.empty():  # saves that will not run now: their last tokens go
            request = self._saves.get_nowait()
            request.saving = False
            request.notify()
        self._fail_all("the engine is shutting down")
        self.transfers.close()
        if self.pool is not None:
            await self.pool.close()

    # ---- requests ----------------------------------------------------------------------

    async def admit(
        self,
        prompt_ids: Sequence[int],
        output: int,
        salt: str | None = None,
        session: str | None = None,
        adapter: AdapterKey | None = None,
    ) -> Request:
        """`submit`, once the prompt's blocks beyond the engine's own cache hit that the
        node's KV pool holds are loaded from it (when the engine uses a pool); for LoRA
        `adapter`'s request when one is named."""
        if self.failed is not None:
            raise unavailable(self.failed)
        digests = self.hasher.digests(prompt_ids, salt, adapter)
        loaded = 0
        if self.pool is not None:
            hashes = [event_hash(d) for d in digests]
            loaded = await self.pool.load(hashes, prompt_ids, salt, adapter)
        tokens = loaded * self.model.block_size
        load_s = self.model.pool_load_s(tokens)
        request = self.submit(
            prompt_ids, output, salt, session, digests=digests, load_s=load_s, adapter=adapter
        )
        request.loaded_tokens = tokens
        return request

    def submit(
        self,
        prompt_ids: Sequence[int],
        output: int,
        salt: str | None = None,
        session: str | None = None,
        *,
        digests: Sequence[bytes] | None = None,
        load_s: float = 0.0,
        adapter: AdapterKey | None = None,
    ) -> Request:
        """Queue a request for `output` tokens (checked by `EngineModel.output_tokens`);
        `Request.wait` reports its tokens as steps produce them. `digests`: the prompt's
        block digests, when already computed. `load_s`: model seconds its blocks loaded from
        the pool take over the host link, layer by layer as the simulator's engine model
        takes KV arriving by transfer: admissible once the first layer is in (`ready_at`),
        its first prefill step ending no sooner than the last layer's compute after the
        last layer's KV (`kv_done_at`). Raises `ApiError` 503 when the loop has stopped."""
        if self.failed is not None:
            raise unavailable(self.failed)
        if digests is None:
            digests = self.hasher.digests(prompt_ids, salt, adapter)
        hashes = [event_hash(d) for d in digests]
        now = self.clock.now()
        job = Job(next(self._ids), JobKind.FULL, len(prompt_ids), output, tuple(hashes), now)
        if load_s > 0:
            job.ready_at = now + load_s / self.model.spec.layers
            job.kv_done_at = now + load_s
        request = Request(job, prompt_ids, salt, adapter)
        self.names.hold(hashes, digests, prompt_ids, salt, session, adapter=adapter)
        self.requests[job.rid] = request
        self.engine.submit(job)
        self._arrived = True
        self.clock.wake()
        return request

    def abort(self, request: Request) -> None:
        """Drop a request whose client went away: applied between steps, which frees its
        pages and unlocks its blocks. Nothing happens to a request already done."""
        if not request.done:
            request.done = True
            self._aborted.append(request)
            self.clock.wake()

    # ---- the step loop -----------------------------------------------------------------

    async def _run(self) -> None:
        try:
            await self._steps()
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("the engine's step loop failed")
            self._fail_all("the engine's step loop failed")

    async def _steps(self) -> None:
        engine, clock, mirror = self.engine, self.clock, self.mirror
        max_lag = MAX_LAG_S / clock.scale
        prev_end: float | None = None  # model time the previous step ended, while busy
        while True:
            if self._aborted:
                self._apply_aborts()
                await mirror.publish()
            now = clock.now()
            start = now if prev_end is None or now - prev_end > max_lag else prev_end
            self._arrived = False
            end = engine.plan(start, self.stream_interval)
            await mirror.publish()  # admission may have evicted blocks
            if end is None:
                prev_end = None
                if not (self._arrived or self._aborted):  # (either may come during publish)
                    await clock.sleep(self._next_ready(start))
                continue
            step = engine.step
            assert step is not None
            while True:
                if self._arrived:  # cut a multi-pass decode short at the next pass
                    self._arrived = False
                    shorter = engine.interrupt(clock.now())
                    if shorter is not None:
                        end = shorter
                if not await clock.sleep(end):
                    break
            passes, decoding = step.passes, step.decode_seqs
            out = engine.complete(end)
            self._deliver(out, end, (end - step.start) / passes if decoding else 0.0)
            # Name the blocks this step stored before finished requests let go of their
            # token ids (a one-token answer stores and finishes in the same step).
            await mirror.publish()
            for job in out.finished:
                self._finish(job)
            prev_end = end
            # Let the handlers write this step's tokens before the next step makes more
            # (they would merge into one chunk when the loop runs behind schedule).
            await asyncio.sleep(0)

    def _next_ready(self, now: float) -> float | None:
        """The earliest model time after `now` a waiting request's first layer loaded from
        the pool is in (it becomes admissible then); None when none waits for one."""
        pending = [job.ready_at for job in self.engine.waiting if job.ready_at > now]
        return min(pending, default=None)

    def _deliver(self, out: StepOutcome, end: float, gap: float) -> None:
        """Hand every request the tokens it has after the step ending at `end`; `gap` is the
        model time between two decode passes of the step (0 when it decoded nothing)."""
        requests, m = self.requests, self.metrics
        produced = 0
        for job in out.first_tokens:
            request = requests.get(job.rid)
            if request is None:
                continue
            if self.pool is not None and self.pool.attached and job.hashes:
                request.saving = True
                self._saves.put_nowait(request)  # (none queue up while there is no pool)
            m.ttft.observe(max(end - job.arrival, 0.0))
            m.queries.inc(job.prompt)
            m.hits.inc(job.cached_tokens)
            m.prompt_tokens.inc(job.prompt)
            loaded = min(request.loaded_tokens, job.cached_tokens)
            m.loaded_tokens.inc(loaded)
            m.hit_tokens.inc(job.cached_tokens - loaded)
            m.computed_tokens.inc(job.prompt - job.cached_tokens)
            produced += job.generated - request.generated
            request.generated = job.generated
            request.notify()
        firsts = produced
        tick = self.engine.tick
        for job in self.engine.decoding:
            request = requests[job.rid]
            generated = job.output - (job.finish_tick - tick)
            if generated > request.generated:
                produced += generated - request.generated
                request.generated = generated
                request.notify()
        for job in out.finished:
            request = requests.get(job.rid)
            if request is None:
                continue
            produced += job.output - request.generated
            request.generated = job.output
            request.done = True
            request.notify()
            m.e2e.observe(max(end - job.arrival, 0.0))
            m.success.inc()
        if produced:
            m.generation_tokens.inc(produced)
        m.itl.observe(gap, produced - firsts)

    async def _save_prefilled(self, pool: PoolLink) -> None:
        """Save each prefilled prompt's blocks into the pool, off the step loop, in order
        (those evicted meanwhile are not saved)."""
        await pool.keep_attaching()
        while True:
            request = await self._saves.get()
            try:
                await pool.save(
                    request.job.hashes, request.prompt_ids, request.salt, request.adapter
                )
            except Exception:  # a bug here must not stop the engine from saving again
                log.exception("saving blocks into the KV pool failed")
            finally:
                request.saving = False
                request.notify()

    def _finish(self, job: Job) -> None:
        if self.requests.pop(job.rid, None) is not None:
            self.names.release(job.hashes)

    def _apply_aborts(self) -> None:
        now = self.clock.now()
        for request in self._aborted:
            job = request.job
            if self.requests.pop(job.rid, None) is not None:
                self.engine.abort(job, now)
                self.names.release(job.hashes)
        self._aborted.clear()

    def _fail_all(self, reason: str) -> None:
        self.failed = reason
        for request in self.requests.values():
            request.error = reason
            request.done = True
            request.notify()
        self.requests.clear()

    # ---- views -------------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Assert the engine model, its KV memory and its transfers agree: every cached block
        (and no other) has a page, and every page is cached, free or staged for an import."""
        self.engine.check_integrity()
        self.memory.check_integrity()
        assert self.memory.page_of.keys() == self.cache.nodes.keys(), "memory != cache"
        self.transfers.check_integrity()

    def snapshot(self) -> list[dict[str, object]]:
        """Every cached block in engine names, parents before children (the cache is
        prefix-closed and its dict keeps insertion order, so a parent always comes first)."""
        return self.names.snapshot(self.cache.nodes)
