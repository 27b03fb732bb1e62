"""Prometheus metrics of one Messenger (its own registry, so several can share a process).
Counters updated as batches go out; the relays' and the stream's own counts read at scrape
time."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from clients.python.kv_stream import KvEventStream, SentBatch
from kvsched.api.messenger.v1 import messenger_service_pb2 as pb

if TYPE_CHECKING:
    from services.dataplane import NodePool, Transfer, Transfers
    from services.messenger.relay import EngineRelay

PREFIX = "kvsched_messenger_"

# Relay counts exposed as one counter each: (count key, metric name, help).
_RELAY_COUNTERS = (
    ("malformed_frames", "malformed_frames", "KV-event messages that were not batches."),
    ("skipped_events", "skipped_events", "Events dropped inside good batches (unknown type, bad "
     "shape, over the limits)."),
    ("replayed_batches", "replayed_batches", "Engine batches recovered from the replay socket."),
    ("unrecoverable_gaps", "unrecoverable_gaps", "Runs of engine batches lost for good (the "
     "replay socket could not give them)."),
    ("foreign_hashes", "foreign_block_hashes", "Chains whose first block the cluster hashes "
     "otherwise (the engine's hash algorithm or PYTHONHASHSEED is not the cluster's)."),
    ("stale_batches", "stale_batches", "Engine batches dropped as already in a snapshot."),
    ("engine_restarts", "engine_restarts", "Engine event numbering that started again."),
    ("malformed_answers", "malformed_engine_answers", "Engine HTTP answers off the contract."),
    ("registrations", "registrations", "Instance registrations with the Conductor."),
    ("deregistrations", "deregistrations", "Instances taken out of the Conductor."),
    ("engine_deaths", "engine_deaths", "Times an engine stopped answering."),
    ("relay_errors", "relay_errors", "Relay failures that made it start over (bugs)."),
)  # fmt: skip
_TRANSFER_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_OUTCOMES: dict[pb.TransferState.ValueType, str] = {
    pb.TRANSFER_STATE_DONE: "done",
    pb.TRANSFER_STATE_FAILED: "failed",
    pb.TRANSFER_STATE_CANCELLED: "cancelled",
}
_TRANSLATE_DROPS = (("wrong_block_size", "wrong_block_size"),)


class MessengerMetrics:
    """The Messenger's registry; `on_sent` is the stream's hook."""

    def __init__(
        self,
        relays: Callable[[], Sequence[EngineRelay]],
        stream: Callable[[], KvEventStream | None],
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self._clock = clock
        self.batches = Counter(
            PREFIX + "kv_event_batches",
            "KV event batches handed to the Conductor stream (resent ones included).",
            ["instance"],
            registry=r,
        )
        self.events = Counter(
            PREFIX + "kv_events",
            "KV events (load reports included) handed to the Conductor stream.",
            ["instance"],
            registry=r,
        )
        self.event_lag = Histogram(
            PREFIX + "kv_event_lag_seconds",
            "Time from the engine publishing a batch's oldest event to the Messenger sending it "
            "(engine clock against ours; first sends only).",
            registry=r,
            buckets=(1e-3, 2.5e-3, 5e-3, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0),
        )
        self.transfers = Counter(
            PREFIX + "transfers",
            "KV transfers this Messenger ran (as the target's), by outcome.",
            ["outcome"],
            registry=r,
        )
        self.transfer_bytes = Counter(
            PREFIX + "transfer_bytes", "KV bytes received and verified.", registry=r
        )
        self.chunks_retried = Counter(
            PREFIX + "transfer_chunks_retried",
            "Chunks read again because their checksum did not match.",
            registry=r,
        )
        self.transfer_seconds = Histogram(
            PREFIX + "transfer_seconds",
            "Time a successful transfer ran (queueing excluded).",
            registry=r,
            buckets=_TRANSFER_BUCKETS,
        )
        self.first_layer_seconds = Histogram(
            PREFIX + "transfer_first_layer_seconds",
            "Time from a transfer's start to its first layer verified (usable).",
            registry=r,
            buckets=_TRANSFER_BUCKETS,
        )
        r.register(_Collector(relays, stream))

    def watch_transfers(self, transfers: Transfers) -> None:
        """Report how many transfers run and wait on this Messenger (read at scrape time)."""
        running = Gauge(
            PREFIX + "transfers_running", "KV transfers moving bytes now.", registry=self.registry
        )
        running.set_function(lambda: transfers.running)
        queued = Gauge(
            PREFIX + "transfers_queued",
            "KV transfers accepted and waiting for a slot (--max-transfers).",
            registry=self.registry,
        )
        queued.set_function(lambda: transfers.queued)

    def watch_pool(self, pool: NodePool) -> None:
        """Report what the node's KV pool holds (read at scrape time)."""
        for field, what in (
            ("pages", "Blocks the node's KV pool can hold (0 until an engine attached)."),
            ("blocks", "Blocks held in the node's KV pool."),
            ("pinned", "Blocks of the pool pinned by loads and exports."),
            ("staged", "Pool pages reserved for saves and transfers not committed yet."),
            ("exports", "Pool exports (loads and transfers out) not ended."),
            ("imports", "Pool imports (saves and transfers in) not ended."),
        ):
            gauge = Gauge(PREFIX + f"pool_{field}", what, registry=self.registry)
            gauge.set_function(functools.partial(_usage, pool, field))
        self.registry.register(_PoolCopies(pool))
        self.registry.register(_PoolChecks(pool))

    def on_transfer_end(self, transfer: Transfer) -> None:
        """A transfer this Messenger ran ended (the `Transfers` hook)."""
        outcome = _OUTCOMES.get(transfer.state, "failed")
        self.transfers.labels(outcome).inc()
        self.transfer_bytes.inc(transfer.bytes_done)
        self.chunks_retried.inc(transfer.chunks_retried)
        if transfer.state == pb.TRANSFER_STATE_DONE and transfer.started_at:
            self.transfer_seconds.observe(transfer.elapsed_s)
            if transfer.first_layer_s >= 0:
                self.first_layer_seconds.observe(transfer.first_layer_s)

    def on_sent(self, sent: SentBatch) -> None:
        self.batches.labels(sent.instance_id).inc()
        self.events.labels(sent.instance_id).inc(sent.events)
        if sent.engine_ts is not None and not sent.resent:
            self.event_lag.observe(max(self._clock() - sent.engine_ts, 0.0))


class _PoolCopies(Collector):
    """The engines' copies into and out of the pool, as they report them."""

    def __init__(self, pool: NodePool) -> None:
        self._pool = pool

    def collect(self) -> Iterator[CounterMetricFamily]:
        copies = self._pool.copies
        nbytes = CounterMetricFamily(
            PREFIX + "pool_copied_bytes",
            "KV bytes the node's engines copied from the pool (load) and into it (save).",
            labels=["direction"],
        )
        seconds = CounterMetricFamily(
            PREFIX + "pool_copy_seconds",
            "Time the engines' copies from (load) and into (save) the pool took.",
            labels=["direction"],
        )
        for direction in ("load", "save"):
            nbytes.add_metric([direction], copies.bytes[direction])
            seconds.add_metric([direction], copies.seconds[direction])
        yield from (nbytes, seconds)


class _PoolChecks(Collector):
    """The pool's checksums of its blocks: their cost, and the blocks found corrupt."""

    def __init__(self, pool: NodePool) -> None:
        self._pool = pool

    def collect(self) -> Iterator[CounterMetricFamily]:
        checks = self._pool.checks
        nbytes = CounterMetricFamily(
            PREFIX + "pool_checksummed_bytes",
            "KV bytes the pool hashed: when saves and imports commit (commit) and before "
            "loads and exports are granted (export).",
            labels=["when"],
        )
        seconds = CounterMetricFamily(
            PREFIX + "pool_checksum_seconds",
            "Time the pool's hashing took (in a thread, off the event loop).",
            labels=["when"],
        )
        for when in ("commit", "export"):
            nbytes.add_metric([when], checks.checked[when])
            seconds.add_metric([when], checks.seconds[when])
        yield from (nbytes, seconds)
        yield CounterMetricFamily(
            PREFIX + "pool_corrupt_blocks",
            "Pool blocks whose bytes changed after they were saved, found by a load or "
            "export (not served: recomputed; counted each time one is found).",
            value=checks.corrupt,
        )
        yield CounterMetricFamily(
            PREFIX + "pool_dropped_blocks",
            "Blocks removed from the pool for corruption: the corrupt ones and those below "
            "them (announced as removed).",
            value=checks.dropped,
        )


def _usage(pool: NodePool, field: str) -> float:
    return float(getattr(pool.usage(), field))


class _Collector(Collector):
    def __init__(
        self,
        relays: Callable[[], Sequence[EngineRelay]],
        stream: Callable[[], KvEventStream | None],
    ) -> None:
        self._relays = relays
        self._stream = stream

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        labels = ["engine", "instance"]
        relays = [(r, [r.engine_url, r.instance_id or ""], r.counts()) for r in self._relays()]
        for key, name, text in _RELAY_COUNTERS:
            family = CounterMetricFamily(PREFIX + name, text, labels=labels)
            for _, names, counts in relays:
                family.add_metric(names, counts[key])
            yield family
        drops = CounterMetricFamily(
            PREFIX + "translate_drops",
            "Engine events that could not be translated, by reason.",
            labels=[*labels, "reason"],
        )
        resyncs = CounterMetricFamily(
            PREFIX + "resyncs",
            "Full syncs of an instance from its engine's snapshot or replay buffer, by reason.",
            labels=[*labels, "reason"],
        )
        up = GaugeMetricFamily(PREFIX + "engine_up", "1 while the engine answers.", labels=labels)
        registered = GaugeMetricFamily(
            PREFIX + "engine_registered",
            "1 while the instance is registered with the Conductor.",
            labels=labels,
        )
        for relay, names, counts in relays:
            for key, reason in _TRANSLATE_DROPS:
                drops.add_metric([*names, reason], counts[key])
            for reason, n in sorted(relay.resyncs.items()):
                resyncs.add_metric([*names, reason], n)
            up.add_metric(names, float(relay.up))
            registered.add_metric(names, float(relay.registered))
        yield from (drops, resyncs, up, registered)
        stream = self._stream()
        if stream is None:
            return
        c = stream.counters
        yield GaugeMetricFamily(
            PREFIX + "stream_connected",
            "1 while the KV event stream to the Conductor leader is open.",
            value=float(stream.connected_to is not None),
        )
        for name, text, value in (
            ("stream_reconnects", "KV event stream calls opened after the first.", c.connects - 1),
            ("stream_failures", "KV event stream calls that broke or were refused.", c.failures),
            (
                "stream_resume_points",
                "Calls the Conductor ended at a resume point.",
                c.resume_points,
            ),
            ("resent_batches", "Batches sent again after a reconnect or resume point.", c.resent),
            (
                "resent_blocks",
                "Blocks named by the batches sent again (the Conductor had not made them "
                "durable: a leader that died before its flush, or a resume point).",
                c.resent_blocks,
            ),
            ("dropped_batches", "Batches dropped while waiting for a resync.", c.dropped),
        ):
            yield CounterMetricFamily(PREFIX + name, text, value=max(value, 0))
        mirror = stream.mirror
        if mirror is not None:
            m = mirror.counters
            for name, text, value in (
                (
                    "mirrored_batches",
                    "KV event batches mirrored to standby Conductors.",
                    m.mirrored,
                ),
                (
                    "mirror_dropped_batches",
                    "Mirrored batches pushed out of a standby's full queue (slow or away).",
                    m.dropped,
                ),
                ("mirror_failures", "Mirror calls to a standby that broke.", m.failures),
            ):
                yield CounterMetricFamily(PREFIX + name, text, value=value)
