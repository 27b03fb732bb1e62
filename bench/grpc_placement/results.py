"""What the client did (`Op`, replayed by the baseline) and what one mode measured."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from kvsched.api.conductor.v1 import conductor_service_pb2 as pb


@dataclass
class Op:
    """One placement (`finish` None) or one finish with its load report, as sent."""

    mode: str
    now: float
    request: pb.ScheduleRequest
    finish: pb.FinishRequest | None = None
    report: pb.KvEventBatch | None = None


@dataclass
class ModeResult:
    name: str
    requests: int
    latencies: list[float] = field(default_factory=list)
    wall_s: float = 0.0
    rate: float = 0.0
    answers: dict[str, str] = field(default_factory=dict)  # request id -> instance or "rejected"
    rejected: int = 0
    errors: int = 0
    server_cpu_s: float = 0.0
    client_cpu_s: float = 0.0
    etcd_cpu_s: float = 0.0
    server_place_s: float = 0.0  # the Conductor's own decision histogram, summed
    base_latencies: list[float] = field(default_factory=list)
    base_work_s: float = 0.0
    base_rate: float = 0.0
    agree: int = 0
    rebinds: int = 0
    rebound_ids: set[str] = field(default_factory=set)
    by_id: dict[str, float] = field(default_factory=dict)  # request id -> gRPC latency
    profile: Path | None = None
