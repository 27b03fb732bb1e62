"""How a service traces (`TelemetrySettings`, read from the standard OTel variables) and the
tracer provider built from it."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ALWAYS_ON, ParentBased, TraceIdRatioBased
from opentelemetry.trace import Tracer

TRACER_NAME: Final = "kvsched.services"


@dataclass(frozen=True, slots=True)
class TelemetrySettings:
    """How a service traces.  ``otlp_endpoint=None`` keeps spans in-process (no export)."""

    service_name: str
    otlp_endpoint: str | None = None
    otlp_insecure: bool = True
    sample_ratio: float = 1.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.sample_ratio <= 1.0:
            raise ValueError(f"sample_ratio must be in [0, 1], got {self.sample_ratio}")

    @classmethod
    def from_env(
        cls, default_service_name: str = "kvsched", environ: Mapping[str, str] | None = None
    ) -> TelemetrySettings:
        """Read the standard OTel variables.

        ``OTEL_SERVICE_NAME``; ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` or else
        ``OTEL_EXPORTER_OTLP_ENDPOINT`` (unset or empty: no export);
        ``OTEL_EXPORTER_OTLP_TRACES_INSECURE`` / ``OTEL_EXPORTER_OTLP_INSECURE`` (default
        true; an ``https://`` endpoint is always secure); ``OTEL_TRACES_SAMPLER_ARG``
        (ratio, default 1.0).
        """
        env = os.environ if environ is None else environ
        endpoint = (
            env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        ) or None
        insecure_raw = env.get("OTEL_EXPORTER_OTLP_TRACES_INSECURE") or env.get(
            "OTEL_EXPORTER_OTLP_INSECURE"
        )
        insecure = True if not insecure_raw else insecure_raw.strip().lower() == "true"
        ratio_raw = env.get("OTEL_TRACES_SAMPLER_ARG", "").strip()
        ratio = float(ratio_raw) if ratio_raw else 1.0
        return cls(
            service_name=env.get("OTEL_SERVICE_NAME") or default_service_name,
            otlp_endpoint=endpoint,
            otlp_insecure=insecure,
            sample_ratio=ratio,
        )


def setup_tracing(settings: TelemetrySettings, *, set_global: bool = False) -> TracerProvider:
    """A new provider: ``service.name`` resource, parent-based ratio sampler, and a
    BatchSpanProcessor over an OTLP/gRPC exporter when an endpoint is set.

    The global provider is left alone unless ``set_global`` (OTel lets it be set once per
    process; do that in a service's ``main``, never in tests).
    """
    root = ALWAYS_ON if settings.sample_ratio >= 1.0 else TraceIdRatioBased(settings.sample_ratio)
    provider = TracerProvider(
        resource=Resource.create({SERVICE_NAME: settings.service_name}),
        # With nowhere to send spans, record none (spans still carry the caller's context).
        sampler=ParentBased(root) if settings.otlp_endpoint else ALWAYS_OFF,
    )
    if settings.otlp_endpoint:
        exporter = OTLPSpanExporter(
            endpoint=settings.otlp_endpoint, insecure=settings.otlp_insecure
        )
        provider.add_span_processor(BatchSpanProcessor(exporter))
    if set_global:
        trace.set_tracer_provider(provider)
    return provider


def get_tracer(provider: TracerProvider, name: str = TRACER_NAME) -> Tracer:
    return provider.get_tracer(name)


def shutdown_tracing(provider: TracerProvider, timeout_s: float = 5.0) -> bool:
    """Flush queued spans (bounded by ``timeout_s``), then shut the provider down.

    Blocking: from a coroutine use ``await asyncio.to_thread(shutdown_tracing, provider)``,
    above all when the OTLP receiver runs on the same event loop.  Returns whether the
    flush completed in time.
    """
    flushed = provider.force_flush(int(timeout_s * 1000))
    provider.shutdown()
    return flushed
