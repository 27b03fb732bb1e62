"""The simulator's engine model (`kvsched.sim.engine.Engine`) stepping in real time.

One asyncio task runs the step loop: plan a step at the current model time, sleep until its
end on the wall clock (model seconds × `time_scale`), apply it, hand each request the tokens
the step produced, and publish the cache's KV events. Requests join between steps, as in
vLLM. Model time is read from the wall clock at every step, never accumulated from sleeps,
so the loop does not drift; when the host falls behind, the next step simply starts later.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvsched.core.cluster import build_cluster
from kvsched.core.hashing import BlockHasher, salt_bytes
from kvsched.sim.engine import Engine, EngineSpec, Job, JobKind
from services.common.kv_events import Event
from services.engine.kv_names import EngineNames
from services.engine.kv_publisher import KvEventPublisher
from services.engine.settings import EngineSettings


@dataclass(slots=True, eq=False)
class Request:
    """One request in the engine; `tokens` receives how many tokens exist so far."""

    job: Job
    prompt_ids: Sequence[int]
    tokens: asyncio.Queue[int] = field(default_factory=asyncio.Queue)
    delivered: int = 0
    done: bool = False


class LiveEngine:
    """The engine model, its clock and its KV-event publisher."""

    def __init__(self, settings: EngineSettings, publisher: KvEventPublisher) -> None:
        cluster = build_cluster(settings.cluster_config())
        self.settings = settings
        self.scale = settings.time_scale
        self.max_model_len = settings.max_model_len or cluster.cost.model.max_model_len
        self.capacity_blocks = cluster.capacity_blocks
        spec = EngineSpec(
            block_size=settings.block_size,
            capacity_pages=cluster.capacity_blocks,
            chunk_tokens=settings.chunk_tokens,
            max_running=settings.max_running,
            layers=cluster.cost.model.layers,
        )
        self.engine = Engine(0, spec, cluster.cost.latency)
        self.hasher = BlockHasher(settings.block_size)
        self.names = EngineNames(settings.block_size, settings.engine_hash_seed)
        self.publisher = publisher
        self.requests: dict[int, Request] = {}
        self._ids = itertools.count()
        self._wake = asyncio.Event()
        self._aborted: list[Request] = []
        self._t0 = time.monotonic()
        self._task: asyncio.Task[None] | None = None
        self.on_first_token: list[object] = []

    def now(self) -> float:
        """Model seconds since the engine started."""
        return (time.monotonic() - self._t0) / self.scale

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    # ---- requests ----------------------------------------------------------------------

    def submit(self, prompt_ids: Sequence[int], output: int, salt: str | None) -> Request:
        """Queue a request; its tokens arrive on `Request.tokens` as steps produce them."""
        hashes = self.hasher.hash_tokens(prompt_ids, salt_bytes(salt) if salt else b"")
        rid = next(self._ids)
        job = Job(rid, JobKind.FULL, len(prompt_ids), output, tuple(hashes), self.now())
        request = Request(job, prompt_ids)
        self.names.hold(hashes, prompt_ids, salt)
        self.requests[rid] = request
        self.engine.submit(job)
        self._wake.set()
        return request

    def abort(self, request: Request) -> None:
        """Drop a request whose client went away (applied between steps)."""
        if not request.done:
            request.done = True
            self._aborted.append(request)
            self._wake.set()

    # ---- the step loop -----------------------------------------------------------------

    async def _run(self) -> None:
        engine = self.engine
        interval = self.settings.stream_interval
        while True:
            self._apply_aborts()
            end = engine.plan(self.now(), max_passes=interval)
            if end is None:
                self._wake.clear()
                await self._wake.wait()
                continue
            self._wake.clear()
            while True:  # sleep to the step's end; a multi-pass decode yields to arrivals
                delay = end * self.scale - (time.monotonic() - self._t0)
                if delay <= 0:
                    break
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), delay)
                if self._wake.is_set():
                    self._wake.clear()
                    shorter = engine.interrupt(self.now())
                    if shorter is not None:
                        end = shorter
            out = engine.complete(end)
            for job in out.first_tokens:
                self._deliver(job, job.generated)
            tick = engine.tick
            for job in engine.decoding:
                self._deliver(job, job.output - (job.finish_tick - tick))
            for job in out.finished:
                self._deliver(job, job.output)
            # Name the blocks this step stored before finished requests let go of their
            # token ids (a one-token answer stores and finishes in the same step).
            await self._publish()
            for job in out.finished:
                self._finish(job)

    def _deliver(self, job: Job, generated: int) -> None:
        request = self.requests.get(job.rid)
        if request is not None and generated > request.delivered:
            request.tokens.put_nowait(generated)
            request.delivered = generated

    def _finish(self, job: Job) -> None:
        request = self.requests.pop(job.rid, None)
        if request is not None:
            request.done = True
            self.names.release(job.hashes)

    def _apply_aborts(self) -> None:
        if not self._aborted:
            return
        now = self.now()
        for request in self._aborted:
            if self.requests.pop(request.job.rid, None) is not None:
                self.engine.abort(request.job, now)
                self.names.release(request.job.hashes)
        self._aborted.clear()

    async def _publish(self) -> None:
        """The cache's changes since the last step, as one vLLM KV-event batch."""
        changes = self.engine.cache.drain_events()
        if not changes.stored and not changes.removed:
            return
        events: list[Event] = [self.names.stored(h, p) for h, p in changes.stored]
        if changes.removed:
            events.append(self.names.removed(changes.removed))
        await self.publisher.publish(events, time.time())

    # ---- views -------------------------------------------------------------------------

    def snapshot(self) -> list[dict[str, object]]:
        """Every cached block in engine names, parents before children (the cache is
        prefix-closed and its dict keeps insertion order, so a parent always comes first)."""
        names = self.names
        out: list[dict[str, object]] = []
        for h, node in self.engine.cache.nodes.items():
            parent = node.parent.hash if node.parent is not None else None
            salt = names.salt.get(h) if parent is None else None
            out.append(
                {
                    "block_hash": names.engine_hash[h],
                    "parent_block_hash": names.engine_hash[parent] if parent is not None else None,
                    "token_ids": list(names.tokens[h]),
                    "extra_keys": [[salt]] if salt else None,
                    "medium": "GPU",
                }
            )
        return out
