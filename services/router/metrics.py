"""Prometheus metrics of one Router (its own registry, so several can share a process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# Router overhead and placement: tens of microseconds to tens of milliseconds.
_FAST_BUCKETS = (
    1e-4, 2e-4, 4e-4, 6e-4, 8e-4, 1e-3, 1.5e-3, 2e-3, 3e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25,
    0.5, 1.0,
)  # fmt: skip
_TTFT_BUCKETS = (
    5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0,
)  # fmt: skip


class RouterMetrics:
    """Counters, histograms and gauges updated on the request path."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter(
            "kvsched_router_requests",
            "Requests answered, by route and HTTP status.",
            ["route", "status"],
            registry=r,
        )
        self.ttft = Histogram(
            "kvsched_router_ttft_seconds",
            "Time to first token as the Router sees it: request in to the first response "
            "bytes relayed to the client.",
            registry=r,
            buckets=_TTFT_BUCKETS,
        )
        self.overhead = Histogram(
            "kvsched_router_overhead_seconds",
            "Router overhead: request in to the upstream request sent (auth, parsing, "
            "tokenizing, hashing, placement).",
            registry=r,
            buckets=_FAST_BUCKETS,
        )
        self.placement = Histogram(
            "kvsched_router_placement_seconds",
            "Time to get a placement (Conductor answer or local fallback).",
            registry=r,
            buckets=_FAST_BUCKETS,
        )
        self.streams_open = Gauge(
            "kvsched_router_streams_open", "Responses being relayed now.", registry=r
        )
        self.fallback = Counter(
            "kvsched_router_fallback",
            "Requests placed by the local fallback, by reason (timeout, unavailable, "
            "conductor_down, refused).",
            ["reason"],
            registry=r,
        )
        self.conductor_up = Gauge(
            "kvsched_router_conductor_up",
            "1 while the Conductor answers (placements go to it), 0 while the fallback decides.",
            registry=r,
        )
        self.upstream_errors = Counter(
            "kvsched_router_upstream_errors",
            "Engine failures, by kind (refused, timeout, broken, status).",
            ["kind"],
            registry=r,
        )
        self.transfer_wait = Histogram(
            "kvsched_router_transfer_wait_seconds",
            "Time a request waited for a KV transfer on its critical path (or a hand-off), by "
            "kind.",
            ["kind"],
            registry=r,
            buckets=_TTFT_BUCKETS,
        )
        self.transfer_outcomes = Counter(
            "kvsched_router_transfer_outcomes",
            "KV transfers a request waited for, by kind and outcome (done, failed, running: "
            "still moving when the wait ended, unspecified: the Conductor did not answer).",
            ["kind", "outcome"],
            registry=r,
        )
        self.shed = Counter(
            "kvsched_router_shed",
            "Requests refused with 429 before admission because a bound was reached, by reason "
            "(in_flight, placing, timeout: the Conductor did not answer in time, deadline: its "
            "stream gave up on it, fallback_bound: the fallback's per-instance bound).",
            ["reason"],
            registry=r,
        )
        self.in_flight = Gauge(
            "kvsched_router_in_flight",
            "Completions open at this Router (authenticated, not yet answered).",
            registry=r,
        )
        self.in_flight_limit = Gauge(
            "kvsched_router_in_flight_limit",
            "Most completions open at once (--max-in-flight); more get 429.",
            registry=r,
        )
        self.placing = Gauge(
            "kvsched_router_placing",
            "Requests waiting for the Conductor's placement answer.",
            registry=r,
        )
        self.placing_limit = Gauge(
            "kvsched_router_placing_limit",
            "Most requests waiting for a placement at once (--max-placing); more get 429.",
            registry=r,
        )
        self.fallback_instance_limit = Gauge(
            "kvsched_router_fallback_instance_limit",
            "Most requests this Router sends one instance while the fallback decides "
            "(--fallback-max-in-flight); more get 429.",
            registry=r,
        )
        self.instances_known = Gauge(
            "kvsched_router_instances_known",
            "Instances in the last list from the Conductor (the fallback's candidates).",
            registry=r,
        )
