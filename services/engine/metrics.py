"""`/metrics` under vLLM's metric names, so dashboards and scrapers built for vLLM work.
Times are model seconds (the modelled GPU's), which equal wall seconds at time scale 1."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0)  # fmt: skip


class EngineMetrics:
    def __init__(self, model: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name", "engine"]
        self.labels = {"model_name": model, "engine": "0"}
        r = self.registry

        # One engine per process: every metric is used through its one labelled child.
        def gauge(name: str, text: str) -> Gauge:
            return Gauge(name, text, labels, registry=r).labels(**self.labels)

        def counter(name: str, text: str) -> Counter:
            return Counter(name, text, labels, registry=r).labels(**self.labels)

        def histogram(name: str, text: str) -> Histogram:
            metric = Histogram(name, text, labels, buckets=_LATENCY_BUCKETS, registry=r)
            return metric.labels(**self.labels)

        self.running = gauge("vllm:num_requests_running", "Requests in model execution batches.")
        self.waiting = gauge("vllm:num_requests_waiting", "Requests waiting to be processed.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent.")
        self.queries = counter("vllm:prefix_cache_queries", "Prefix cache queries, in tokens.")
        self.hits = counter("vllm:prefix_cache_hits", "Prefix cache hits, in tokens.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Generation tokens processed.")
        self.success = counter("vllm:request_success", "Successfully processed requests.")
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Time to first token.")
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "End to end request latency.")
        self.itl = histogram("vllm:inter_token_latency_seconds", "Inter-token latency.")
