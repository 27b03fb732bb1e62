"""One engine's relay: keep it registered with the Conductor while it answers, and carry its
KV events and load there.

A session with the engine goes: ask it who it is (its engine port: vLLM's own API, or the
simulated engine's); subscribe to its KV events; register the instance (with a lease, kept
alive every third of its TTL, registered again when the Conductor says the lease lapsed);
start with a full sync; then translate every batch of events into ours and hand them,
coalesced, to the Messenger's one event stream, together with the engine's load whenever it
changes.

A full sync rebuilds the instance's index from what the engine can tell: its snapshot where it
has one (the simulated engine), else its replay buffer from the first batch on (vLLM keeps the
latest 10,000 batches). When the buffer still starts at the engine's first batch, the history
is whole and replaces the index; when it does not, the replayed batches are applied on top of
what the Conductor holds (replaying an event twice changes nothing), so a Messenger restart or
a lost batch costs at most the blocks whose events are gone, never the rest of the cache. A
gap the replay socket cannot fill is counted (and, where there is a snapshot, resynced); an
engine restart or a resume point the stream no longer holds leads to another full sync. When
the engine stops answering (`engine_gone`: refused for `engine_dead_after_s`, timing out for
`engine_hung_after_s`, and `DEAD_AFTER_MISSES` load polls in a row), the instance is
deregistered at once and the engine probed until it answers again; then a
new session starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import Awaitable
from typing import Any

import aiohttp

from clients.python import ConductorClient
from clients.python.kv_stream import KvEventStream
from kvsched.api.conductor.v1 import conductor_service_pb2 as pb
from kvsched.core.load import LoadReport
from services.dataplane import SIM_FORMAT, NodePool
from services.kv_events.messages import event_message
from services.kv_events.vllm_wire import Event, EventBatch
from services.messenger.batcher import Batcher
from services.messenger.engine_api import (
    EngineApi,
    EngineInfo,
    EngineLacksRoute,
    EngineMalformed,
    EngineSilent,
    EngineUnreachable,
    Snapshot,
)
from services.messenger.engines import EnginePort, EngineTarget
from services.messenger.kv_subscriber import KvEventSubscriber, Resync
from services.messenger.membership import ROLES, Membership
from services.messenger.settings import MessengerSettings
from services.messenger.translate import EventTranslator
from services.messenger.vllm_engine import VllmEngine

log = logging.getLogger(__name__)


class SessionEnded(Exception):
    """The session with the engine is over (it stopped answering, or became another)."""


LOAD_REFRESH_POLLS = 10
# Polls in a row an engine must leave unanswered, besides the time, to count as gone: when
# this process's own loop stalls (a busy 2-core host, a large resync), the poll in flight
# times out though the engine answered; the next one, after the stall, is answered.
DEAD_AFTER_MISSES = 3


def engine_gone(
    silent_s: float, misses: int, *, timed_out: bool, settings: MessengerSettings
) -> bool:
    """Whether an engine unanswered for `silent_s` over `misses` polls in a row is gone: after
    `engine_dead_after_s` when the last poll was refused or reset (nothing listens), after
    `engine_hung_after_s` when it timed out (the engine takes the connection: busy or hung)."""
    limit_s = settings.engine_hung_after_s if timed_out else settings.engine_dead_after_s
    return silent_s >= limit_s and misses >= DEAD_AFTER_MISSES


class EngineRelay:
    """The relay of the engine `target`; `run()` until cancelled, then `leave()`."""

    def __init__(
        self,
        target: EngineTarget,
        settings: MessengerSettings,
        *,
        client: ConductorClient,
        stream: KvEventStream,
        http: aiohttp.ClientSession,
        pool: NodePool | None = None,
    ) -> None:
        s = settings
        self.pool = pool  # the node's, which its engines save to and load from
        self.target = target
        self.engine_url = target.url
        self.settings = s
        timeout_s = min(s.engine_timeout_s, s.engine_dead_after_s / 2)
        self._sim = EngineApi(
            self.engine_url, http, timeout_s=timeout_s, snapshot_timeout_s=s.snapshot_timeout_s
        )
        self._vllm = VllmEngine(
            target,
            http,
            node=s.node,
            block_hashes=s.block_hashes,
            timeout_s=timeout_s,
            metrics_interval_s=s.vllm_metrics_interval_s,
        )
        self.api: EnginePort = self._vllm if target.kind == "vllm" else self._sim
        self._client = client
        self._stream = stream
        self.info: EngineInfo | None = None
        self.up = False  # the engine answers
        self._membership: Membership | None = None  # while the engine answers
        # What happened, cumulated over sessions (the subscriber's and translator's own
        # counters are added when they are replaced; see `counts`).
        self.totals: Counter[str] = Counter()
        self.resyncs: Counter[str] = Counter()  # by reason
        self._sub: KvEventSubscriber | None = None
        self._translator: EventTranslator | None = None
        self._batcher = Batcher(self._cut, window_s=s.batch_window_s, max_events=s.batch_max_events)
        self._resync_wanted = asyncio.Event()
        self._resync_reason = ""
        self._load: LoadReport | None = None  # the engine's latest
        self._load_sent: LoadReport | None = None
        self._floor = 0  # engine batches below it are in the last snapshot

    @property
    def uses_pool(self) -> bool:
        """Whether the node's KV pool holds blocks for this engine, which saves to it and
        loads from it (kvsched's KV connector in vLLM, the simulated engine's pool link): the
        pool is in the block format of this engine's kind (engines of one node share one)."""
        pool = self.pool
        if pool is None or not pool.attached or pool.format is None:
            return False
        return (pool.format.kind == SIM_FORMAT) == (self.api is self._sim)

    def send_local(self, events: list[Event]) -> None:
        """Announce blocks this node holds for the engine beyond its own cache (the pool's)."""
        if self._translator is not None:
            self._batcher.add(self._translator.translate(events), None)

    @property
    def instance_id(self) -> str | None:
        return None if self.info is None else self.info.instance_id

    @property
    def registered(self) -> bool:
        return self._membership is not None and self._membership.registered

    # ---- signals from the stream (they must not block) -------------------------------------

    def want_resync(self, reason: str) -> None:
        """Send the engine's whole state again at the next chance."""
        if not self._resync_wanted.is_set():
            self._resync_reason = reason
        self._resync_wanted.set()

    def lost_registration(self) -> None:
        """The Conductor no longer knows the instance: register it again."""
        if self._membership is not None:
            self._membership.lost()

    # ---- counters --------------------------------------------------------------------------

    def counts(self) -> Counter[str]:
        """Every counter of the relay (cumulated, live parts included)."""
        out = Counter(self.totals)
        out.update(_sub_counts(self._sub))
        out.update(_translator_counts(self._translator))
        return out

    def _retire_subscriber(self) -> None:
        if self._sub is not None:
            self.totals.update(_sub_counts(self._sub))
            self._sub.close()
            self._sub = None

    def _retire_translator(self) -> None:
        if self._translator is not None:
            self.totals.update(_translator_counts(self._translator))
            self._translator = None

    # ---- lifecycle -------------------------------------------------------------------------

    async def run(self) -> None:
        """Serve the engine's sessions one after the other, until cancelled."""
        while True:
            info = await self._wait_for_engine()
            try:
                await self._session(info)
            except SessionEnded as exc:
                log.warning("engine %s (%s): %s", info.instance_id, self.engine_url, exc)
            except Exception:  # a bug must not end the relay: start over
                self.totals["relay_errors"] += 1
                log.exception("relay of %s failed; starting over", self.engine_url)
                await asyncio.sleep(self.settings.probe_interval_s)
            finally:
                self.up = False
            await self.leave()

    async def leave(self) -> None:
        """Take the instance out of the Conductor at once (its events stop)."""
        membership, self._membership = self._membership, None
        if membership is not None and await membership.leave():
            self.totals["deregistrations"] += 1

    async def _wait_for_engine(self) -> EngineInfo:
        """Ask the engine who it is until it answers well."""
        said = ""
        while True:
            try:
                return await self._identify()
            except (EngineUnreachable, EngineMalformed) as exc:
                if isinstance(exc, EngineMalformed):
                    self.totals["malformed_answers"] += 1
                if str(exc) != said:  # say each new reason once, not every probe
                    said = str(exc)
                    log.warning("engine %s is not ready: %s", self.engine_url, exc)
            await asyncio.sleep(self.settings.probe_interval_s)

    async def _identify(self) -> EngineInfo:
        """Who the engine is; with `kind=auto`, a 404 from the simulated engine's route
        means a vLLM server. Raises `EngineMalformed` for an engine whose KV blocks are not
        the cluster's size (its hashes could never match the Routers')."""
        info = None
        if self.target.kind == "auto":
            try:
                self.api = self._sim
                info = await self._sim.info()
            except EngineLacksRoute:
                self.api = self._vllm
        info = info or await self.api.info()
        if info.block_size != self.settings.block_size:
            raise EngineMalformed(
                f"the engine's KV blocks hold {info.block_size} tokens, this cluster's "
                f"{self.settings.block_size} (--block-size)"
            )
        return info

    async def _session(self, info: EngineInfo) -> None:
        """Serve one engine session; raises `SessionEnded` when it is over."""
        self.info = info
        self.up = True
        self._load = self._load_sent = None
        self._floor = 0
        self._batcher.clear()
        self._resync_wanted.clear()
        spec = pb.InstanceSpec(
            instance_id=info.instance_id,
            url=self.engine_url,
            node=self.settings.node,
            role=ROLES[info.role],
            model=info.model,
            messenger_url=self.settings.url,
            max_model_len=info.max_model_len,
        )
        membership = self._membership = Membership(
            spec,
            client=self._client,
            stream=self._stream,
            lease_ttl_s=self.settings.instance_ttl_s,
            on_registered=self._on_registered,
        )
        log.info(
            "engine %s at %s answers (block size %d, KV events at %s)",
            info.instance_id,
            self.engine_url,
            info.block_size,
            info.kv_events.endpoint,
        )
        await _first_failure(
            self._watch_load(), self._registered(info, membership), self._batcher.run()
        )

    async def _registered(self, info: EngineInfo, membership: Membership) -> None:
        """Subscribe to the engine's KV events, register, then relay them and keep the lease
        alive. The subscription comes first: batches the engine publishes once the instance is
        known (its first requests' blocks) wait on our socket instead of reaching no one, which
        is what an engine without a replay buffer would otherwise lose for good."""
        kv = info.kv_events
        sub = self._sub = KvEventSubscriber(
            kv.endpoint,
            kv.replay_endpoint,
            topic=kv.topic.encode(),
            drop=self.settings.fault_drop_batches,
        )
        self._translator = EventTranslator(
            info.block_size, self.settings.block_hashes.hasher(info.block_size)
        )
        try:
            if not await sub.joined(self.settings.engine_dead_after_s):
                log.warning(
                    "KV events of %s: not connected to %s yet", info.instance_id, kv.endpoint
                )
            await membership.register()
            await _first_failure(self._relay_events(info, sub), membership.keep_alive())
        finally:
            self._retire_subscriber()
            self._retire_translator()

    def _on_registered(self) -> None:
        self.totals["registrations"] += 1
        self.want_resync("registered")

    # ---- load and health -------------------------------------------------------------------

    async def _watch_load(self) -> None:
        """Read the engine's load; pass it on when it changed, and at least every
        `LOAD_REFRESH_POLLS` polls: the Conductor charges each placement to the instance until
        the next report overwrites it, and a request that came and went between two polls
        changes nothing we see. Raises `SessionEnded` once the engine has not answered for
        `engine_dead_after_s` (`engine_hung_after_s` when its polls time out) and
        `DEAD_AFTER_MISSES` polls in a row."""
        loop = asyncio.get_running_loop()
        answered = loop.time()
        unchanged = misses = 0
        while True:
            try:
                load = await self.api.load()
            except EngineUnreachable as exc:
                misses += 1
                silent_s = loop.time() - answered
                timed_out = isinstance(exc, EngineSilent)
                if engine_gone(silent_s, misses, timed_out=timed_out, settings=self.settings):
                    self.totals["engine_deaths"] += 1
                    raise SessionEnded(f"stopped answering ({exc})") from None
            except EngineMalformed as exc:
                answered, misses = loop.time(), 0  # it answers, wrongly
                self.totals["malformed_answers"] += 1
                log.debug("engine %s: %s", self.engine_url, exc)
            else:
                answered, misses = loop.time(), 0
                self._load = load
                unchanged = unchanged + 1 if load == self._load_sent else 0
                if self.registered and (unchanged == 0 or unchanged >= LOAD_REFRESH_POLLS):
                    unchanged = 0
                    self._load_sent = load
                    self._batcher.set_load(event_message(load))
            await asyncio.sleep(self.settings.load_interval_s)

    # ---- events ----------------------------------------------------------------------------

    def _cut(self, events: list[pb.KvEvent], engine_ts: float | None) -> None:
        if self.info is not None and self.registered:
            self._stream.send(self.info.instance_id, events, engine_ts=engine_ts)

    async def _relay_events(self, info: EngineInfo, sub: KvEventSubscriber) -> None:
        items = sub.batches()
        pending: asyncio.Future[EventBatch | Resync] | None = None
        try:
            while True:
                if self._resync_wanted.is_set():
                    await self._resync(info, sub)
                    continue
                if pending is None:
                    pending = asyncio.ensure_future(anext(items))
                wanted = asyncio.ensure_future(self._resync_wanted.wait())
                waiting: set[asyncio.Future[Any]] = {pending, wanted}
                try:
                    await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    wanted.cancel()
                if pending.done():
                    item, pending = pending.result(), None
                    await self._handle(item, info)
        finally:
            if pending is not None:
                pending.cancel()
                with contextlib.suppress(BaseException):
                    await pending
            with contextlib.suppress(RuntimeError):
                await items.aclose()

    async def _handle(self, item: EventBatch | Resync, info: EngineInfo) -> None:
        if isinstance(item, Resync):
            if item.restarted:
                await self._check_same_engine(info)
                self.want_resync("engine_restarted")
            elif self.api.has_snapshot:
                self.want_resync("gap")
            else:  # the batches are gone: their blocks stay unknown (counted by the subscriber)
                assert self._sub is not None
                self._sub.skip_to(item.next_seq)
            return
        if item.seq < self._floor or self._translator is None:
            self.totals["stale_batches"] += 1  # already in the snapshot
            return
        translator = self._translator
        foreign = translator.counters.foreign_hashes
        self._batcher.add(translator.translate(item.events), item.ts)
        if foreign == 0 and translator.counters.foreign_hashes:
            log.error(
                "engine %s names blocks otherwise than this cluster hashes prompts: give the "
                "Messengers, Routers and Conductor its --prefix-caching-hash-algo and "
                "PYTHONHASHSEED (--prefix-hash-seed)",
                info.instance_id,
            )

    async def _check_same_engine(self, info: EngineInfo) -> None:
        """After a restart the engine may be another (id, block size, endpoints)."""
        try:
            now = await self.api.info()
        except (EngineUnreachable, EngineMalformed):
            return  # the load watcher decides whether it is gone
        if now != info:
            raise SessionEnded("restarted with another identity or endpoints")

    async def _resync(self, info: EngineInfo, sub: KvEventSubscriber) -> None:
        """Rebuild the instance's index from the engine's snapshot, or else from its replay
        buffer."""
        reason = self._resync_reason or "asked"
        self._resync_wanted.clear()
        self._resync_reason = ""
        translator = self._translator
        assert translator is not None
        next_seq: int | None
        if self.api.has_snapshot:
            snapshot = await self._snapshot(info)
            events = translator.translate(snapshot.events)
            whole, next_seq, what = True, snapshot.next_seq, f"{snapshot.blocks} blocks"
        else:
            history = await sub.history()
            events = [e for batch in history.batches for e in translator.translate(batch.events)]
            whole, next_seq = history.whole, history.next_seq
            what = f"{len(history.batches)} replayed batches ({'whole' if whole else 'partial'})"
        if self.uses_pool:  # the instance's index is replaced: the pool's blocks too
            assert self.pool is not None
            events += translator.translate(self.pool.snapshot())
        if self._load is not None:
            self._load_sent = self._load
            events.append(event_message(self._load))
        self._batcher.clear()
        sequence = self._stream.send(info.instance_id, events, resync=True, merge=not whole)
        if next_seq is not None:
            self._floor = next_seq
            sub.skip_to(next_seq)
        self.resyncs[reason] += 1
        log.info(
            "sync of %s (%s): %s up to engine batch %s, sent as batch %s",
            info.instance_id,
            reason,
            what,
            next_seq,
            sequence,
        )

    async def _snapshot(self, info: EngineInfo) -> Snapshot:
        """The engine's snapshot, asked until it gives one (the load watcher decides whether
        the engine is gone)."""
        while True:
            try:
                snapshot = await self.api.snapshot()
                break
            except EngineUnreachable as exc:
                log.debug("snapshot of %s: %s", info.instance_id, exc)
            except EngineMalformed as exc:
                self.totals["malformed_answers"] += 1
                log.warning("snapshot of %s refused: %s", info.instance_id, exc)
            await asyncio.sleep(self.settings.probe_interval_s)
        if snapshot.block_size != info.block_size:
            log.warning(
                "snapshot of %s has block size %d, the engine said %d",
                info.instance_id,
                snapshot.block_size,
                info.block_size,
            )
        return snapshot


def _sub_counts(sub: KvEventSubscriber | None) -> dict[str, int]:
    if sub is None:
        return {}
    return {
        "malformed_frames": sub.malformed,
        "skipped_events": sub.skipped_events,
        "replayed_batches": sub.replayed,
        "unrecoverable_gaps": sub.resyncs,
        "engine_restarts": sub.restarts,
        "duplicate_batches": sub.duplicates,
    }


def _translator_counts(translator: EventTranslator | None) -> dict[str, int]:
    if translator is None:
        return {}
    c = translator.counters
    return {"wrong_block_size": c.wrong_block_size, "foreign_hashes": c.foreign_hashes}


async def _first_failure(*steps: Awaitable[None]) -> None:
    """Run the steps together until one ends; cancel the others; raise what it raised."""
    tasks = [asyncio.ensure_future(step) for step in steps]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    for task in done:
        error = None if task.cancelled() else task.exception()
        if error is not None:
            raise error
    raise SessionEnded("a relay task ended")
