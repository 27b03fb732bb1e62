"""What the client did (`Op`, replayed by the baseline) and what one mode measured."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from kvsched.api.conductor.v1 import conductor_service_pb2 as pb

BATCHED = "batched"  # the suffix of a batched streamed phase's name


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
    messages_in: float = 0.0  # ScheduleStream messages the Conductor received (a batch: one)
    messages_out: float = 0.0  # and sent
    base_latencies: list[float] = field(default_factory=list)
    base_work_s: float = 0.0
    base_rate: float = 0.0
    agree: int = 0
    rebinds: int = 0
    rebound_ids: set[str] = field(default_factory=set)
    by_id: dict[str, float] = field(default_factory=dict)  # request id -> gRPC latency
    profile: Path | None = None
    profile_span: tuple[int, float] = (0, 0.0)  # decisions and wall seconds it covers
    form: str = "repeated"  # how its requests carried their hashes (workload.HASH_FORMS)
    unary: bool = False  # Schedule calls one at a time (else placement streams)
    batched: bool = False  # stream items queued together sent as one ScheduleStreamBatch


def pooled(results: list[ModeResult]) -> list[ModeResult]:
    """One result per phase name, in first-run order: a phase run in several rounds gets its
    rounds' latencies, answers, counts and times together, its rate over their sum."""
    out: dict[str, ModeResult] = {}
    for r in results:
        into = out.get(r.name)
        if into is None:
            out[r.name] = r
            continue
        into.requests += r.requests
        into.latencies += r.latencies
        into.wall_s += r.wall_s
        into.answers.update(r.answers)
        into.by_id.update(r.by_id)
        into.rejected += r.rejected
        into.errors += r.errors
        into.server_cpu_s += r.server_cpu_s
        into.client_cpu_s += r.client_cpu_s
        into.etcd_cpu_s += r.etcd_cpu_s
        into.server_place_s += r.server_place_s
        into.messages_in += r.messages_in
        into.messages_out += r.messages_out
        # (as each phase measures it: unary one call at a time, streams over their wall time)
        into.rate = len(into.latencies) / (sum(into.latencies) if into.unary else into.wall_s)
    return list(out.values())
