"""Prometheus metrics of one Conductor (its own registry, so several can share a process)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from services.conductor.backpressure import PendingPlacements
from services.conductor.leadership import Leadership
from services.conductor.term import CurrentTerm

_LATENCY_BUCKETS = (
    25e-6, 50e-6, 100e-6, 200e-6, 400e-6, 800e-6, 1.6e-3, 3.2e-3, 6.4e-3, 12.8e-3, 25.6e-3, 0.1,
)  # fmt: skip


class ConductorMetrics:
    """Counters and histograms updated on the request path; the gauges (`StateGauges`)
    are read at scrape time."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.decision_seconds = Histogram(
            "kvsched_conductor_decision_seconds",
            "Time to decide one placement, policy and bookkeeping included.",
            registry=r,
            buckets=_LATENCY_BUCKETS,
        )
        self.decisions = Counter(
            "kvsched_conductor_decisions",
            "Placement requests by outcome (placed, rejected by SLO admission, overloaded: "
            "refused by a bound before deciding, error).",
            ["outcome"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "kvsched_conductor_prompt_tokens", "Prompt tokens placed.", registry=r
        )
        self.cached_tokens = Counter(
            "kvsched_conductor_expected_cached_tokens",
            "Prompt tokens expected to hit the chosen instance's cache (hit rate = this over "
            "prompt tokens).",
            registry=r,
        )
        self.reported_cached_tokens = Counter(
            "kvsched_conductor_reported_cached_tokens",
            "Cached prompt tokens reported by finished requests.",
            registry=r,
        )
        self.event_batches = Counter(
            "kvsched_conductor_kv_event_batches",
            "KV event batches by outcome.",
            ["outcome"],
            registry=r,
        )
        self.mirrored_batches = Counter(
            "kvsched_conductor_mirrored_kv_event_batches",
            "KV event batches mirrored to this Conductor by outcome: kept (a standby), not_kept "
            "(already durable, or of an unknown instance), ignored (while leading), applied "
            "(at takeover, the dead leader's unflushed tail).",
            ["outcome"],
            registry=r,
        )
        self.mirror_calls = Gauge(
            "kvsched_conductor_kv_event_mirror_calls",
            "MirrorKvEvents calls open to this Conductor (one per Messenger keeping it warm).",
            registry=r,
        )
        self.event_lag = Histogram(
            "kvsched_conductor_kv_event_lag_seconds",
            "Time from a KV event batch being cut to it being applied.",
            registry=r,
            buckets=(1e-3, 5e-3, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0),
        )
        self.sessions_forgotten = Counter(
            "kvsched_conductor_sessions_forgotten",
            "Sessions forgotten: idle past the TTL, or over the cap.",
            registry=r,
        )
        self.stream_messages = Counter(
            "kvsched_conductor_placement_stream_messages",
            "ScheduleStream messages, by direction (received, sent): a batch counts once.",
            ["direction"],
            registry=r,
        )
        self.stream_items = Counter(
            "kvsched_conductor_placement_stream_items",
            "ScheduleStream items (placements, completions and their answers), by direction "
            "(received, sent): over the messages, how many a message carries on average.",
            ["direction"],
            registry=r,
        )
        self.transfers = Counter(
            "kvsched_conductor_transfers",
            "KV transfers ended, by kind and outcome (done, failed).",
            ["kind", "outcome"],
            registry=r,
        )
        self.transfer_bytes = Counter(
            "kvsched_conductor_transfer_bytes", "KV bytes moved, by kind.", ["kind"], registry=r
        )
        self.transfer_seconds = Histogram(
            "kvsched_conductor_transfer_seconds",
            "Wall time of a KV transfer from its order to its end, by kind.",
            ["kind"],
            registry=r,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
        )


class StateGauges(Collector):
    """Gauges of the current term, the leadership and the transfers, read at scrape time
    (register it in `ConductorMetrics.registry`)."""

    def __init__(
        self,
        current: CurrentTerm,
        leadership: Leadership,
        transfers_running: Callable[[], int],
        pending: PendingPlacements | None = None,
    ) -> None:
        self.current = current
        self.leadership = leadership
        self.transfers_running = transfers_running
        self.pending = pending

    def collect(self) -> Iterator[GaugeMetricFamily]:
        term = self.current()
        state = term.state
        load = state.cluster.load
        yield GaugeMetricFamily(
            "kvsched_conductor_is_leader",
            "1 on the leader.",
            value=float(self.leadership.is_leader),
        )
        yield GaugeMetricFamily(
            "kvsched_conductor_index_blocks",
            "Blocks in the global index.",
            value=float(len(state.cluster.index)),
        )
        yield GaugeMetricFamily(
            "kvsched_conductor_sessions",
            "Sessions held (idle ones are forgotten after the TTL or over the cap).",
            value=float(len(state.cluster.sessions)),
        )
        yield GaugeMetricFamily(
            "kvsched_conductor_migrations",
            "Sessions rebound to another instance (a migration ends once its KV landed).",
            value=state.scheduler.migrations,
        )
        yield GaugeMetricFamily(
            "kvsched_conductor_transfers_running",
            "KV transfers ordered and not yet ended.",
            value=self.transfers_running(),
        )
        yield GaugeMetricFamily(
            "kvsched_conductor_sessions_evicted",
            "Idle sessions forgotten to make room for their tenant's new one (this term).",
            value=state.scheduler.sessions_evicted,
        )
        yield GaugeMetricFamily(
            "kvsched_conductor_rejections",
            "Requests rejected by admission.",
            value=state.scheduler.rejections,
        )
        yield GaugeMetricFamily(
            "kvsched_conductor_persist_pending", "Writes waiting for etcd.", value=len(term.outbox)
        )
        yield GaugeMetricFamily(
            "kvsched_conductor_persist_pending_bindings",
            "Session bindings among the writes waiting for etcd.",
            value=term.outbox.bindings,
        )
        if self.pending is not None:
            bounds = self.pending.bounds
            yield GaugeMetricFamily(
                "kvsched_conductor_persist_pending_bindings_limit",
                "Session bindings waiting for etcd beyond which placements are refused "
                "(--max-persist-pending).",
                value=bounds.max_outbox,
            )
            yield GaugeMetricFamily(
                "kvsched_conductor_placements_pending",
                "Placements accepted on the streams and not yet answered.",
                value=self.pending.depth,
            )
            yield GaugeMetricFamily(
                "kvsched_conductor_placements_pending_limit",
                "Placements pending beyond which new ones are refused (--max-pending-placements).",
                value=bounds.max_pending,
            )
            yield GaugeMetricFamily(
                "kvsched_conductor_placement_wait_limit_seconds",
                "Longest a placement may wait to be decided before it is refused "
                "(--max-placement-wait).",
                value=bounds.max_wait_s,
            )
        per = {
            "pending_prefill_tokens": load.pending_prefill_tokens,
            "in_flight": load.in_flight,
            "running": load.running,
            "free_blocks": load.free_blocks,
        }
        for name, values in per.items():
            g = GaugeMetricFamily(
                f"kvsched_conductor_instance_{name}", f"Per-instance {name}.", labels=["instance"]
            )
            for iid, inst in state.instances.items():
                g.add_metric([iid], float(values[inst.slot]))
            yield g


class FailoverCounters(Collector):
    """What this Conductor did in leader changes, read at scrape time: the dead leaders'
    terms it ended without waiting for their leases (`takeover.py`), and its own writes
    refused because its term was over (`fencing.py`)."""

    def __init__(self, takeovers: Callable[[], int], fenced: Callable[[], int]) -> None:
        self.takeovers = takeovers
        self.fenced = fenced

    def collect(self) -> Iterator[CounterMetricFamily]:
        yield CounterMetricFamily(
            "kvsched_conductor_takeovers",
            "Terms of a dead leader (its address refusing connections) this standby ended.",
            value=self.takeovers(),
        )
        yield CounterMetricFamily(
            "kvsched_conductor_fenced_writes",
            "etcd writes of this Conductor refused because another term leads.",
            value=self.fenced(),
        )
