"""`/metrics` under vLLM's metric names and labels (`model_name`, `engine="0"`), so dashboards
and scrapers built for vLLM work unchanged.

Latencies are model seconds (the modelled GPU's clock), which equal wall seconds at time
scale 1. The histograms take many equal observations at once: one decode pass gives every
running request the same inter-token gap, so a step is one bucket update, not one per token.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

# vLLM's buckets for these histograms (vllm/v1/metrics/loggers.py).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)  # fmt: skip
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
LABELS = ("model_name", "engine")
_INF = float("inf")


class BulkHistogram:
    """A Prometheus histogram whose `observe` takes a count of equal observations."""

    __slots__ = ("_counts", "_upper", "doc", "labels", "name", "sum")

    def __init__(self, name: str, doc: str, buckets: Sequence[float], labels: Sequence[str]):
        self.name = name
        self.doc = doc
        self.labels = list(labels)
        self._upper = [*map(float, buckets), _INF]
        self._counts = [0] * len(self._upper)
        self.sum = 0.0

    def observe(self, value: float, count: int = 1) -> None:
        if count > 0:
            self._counts[bisect_left(self._upper, value)] += count  # `le` is inclusive
            self.sum += value * count

    @property
    def count(self) -> int:
        return sum(self._counts)

    def family(self) -> HistogramMetricFamily:
        family = HistogramMetricFamily(self.name, self.doc, labels=LABELS)
        cumulative, buckets = 0, []
        for upper, n in zip(self._upper, self._counts, strict=True):
            cumulative += n
            buckets.append(("+Inf" if upper == _INF else repr(upper), cumulative))
        family.add_metric(self.labels, buckets, self.sum)
        return family


class _Histograms(Collector):
    def __init__(self, histograms: Sequence[BulkHistogram]) -> None:
        self.histograms = histograms

    def collect(self) -> Iterator[Metric]:
        for h in self.histograms:
            yield h.family()

    def describe(self) -> Iterator[Metric]:
        return self.collect()


class EngineMetrics:
    """One engine's metrics in a registry of its own (several engines can share a test
    process). Counters and histograms are updated by the step loop; gauges at scrape time."""

    def __init__(self, model: str) -> None:
        self.registry = CollectorRegistry()
        values = [model, "0"]
        r = self.registry

        def gauge(name: str, text: str) -> Gauge:
            return Gauge(name, text, LABELS, registry=r).labels(*values)

        def counter(name: str, text: str) -> Counter:
            return Counter(name, text, LABELS, registry=r).labels(*values)

        self._registry = r
        self._lora: Gauge | None = None
        self.running = gauge("vllm:num_requests_running", "Requests in model execution batches.")
        self.waiting = gauge("vllm:num_requests_waiting", "Requests waiting to be processed.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent.")
        self.queries = counter("vllm:prefix_cache_queries", "Prefix cache queries, in tokens.")
        self.hits = counter("vllm:prefix_cache_hits", "Prefix cache hits, in tokens.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Generation tokens processed.")
        by_source = Counter(
            "vllm:prompt_tokens_by_source",
            "Prompt tokens by where their KV came from.",
            [*LABELS, "source"],
            registry=r,
        )
        # The node pool's blocks count as vLLM counts its KV connector's loads.
        self.computed_tokens = by_source.labels(*values, "local_compute")
        self.hit_tokens = by_source.labels(*values, "local_cache_hit")
        self.loaded_tokens = by_source.labels(*values, "external_kv_transfer")
        self.success = Counter(
            "vllm:request_success",
            "Successfully processed requests.",
            [*LABELS, "finished_reason"],
            registry=r,
        ).labels(*values, "length")
        self.ttft = BulkHistogram(
            "vllm:time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS, values
        )
        self.itl = BulkHistogram(
            "vllm:inter_token_latency_seconds", "Inter-token latency.", ITL_BUCKETS, values
        )
        self.e2e = BulkHistogram(
            "vllm:e2e_request_latency_seconds", "End to end request latency.", E2E_BUCKETS, values
        )
        r.register(_Histograms((self.ttft, self.itl, self.e2e)))

    def lora_requests(self, max_loras: int, running: Sequence[str], waiting: Sequence[str]) -> None:
        """Publish `vllm:lora_requests_info` as vLLM does where it serves adapters: its
        `--max-loras` and the adapters of the running and the waiting requests as labels, on
        a gauge set to the time (vLLM keeps every label set it saw; a reader takes the newest:
        here there is only the one)."""
        if self._lora is None:
            self._lora = Gauge(
                "vllm:lora_requests_info",
                "Running stats on lora requests.",
                ["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
                registry=self._registry,
            )
        self._lora.clear()
        self._lora.labels(str(max_loras), ",".join(waiting), ",".join(running)).set(time.time())

    def cache_config(self, config: dict[str, str]) -> None:
        """Publish `vllm:cache_config_info`: the engine's cache settings as labels (vLLM's
        CacheConfig fields, as strings) on a gauge set to 1, where vLLM's clients find the
        block size, the KV capacity and the prefix-caching settings."""
        labels = {**config, "engine": "0"}
        info = Gauge(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            list(labels),
            registry=self._registry,
        )
        info.labels(**labels).set(1)
