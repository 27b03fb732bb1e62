"""--profile: py-spy on the Conductor for a phase, and where the GIL holder's time went."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
from pathlib import Path

from bench.grpc_placement.results import ModeResult

PROFILE_HZ = 200
# The Conductor's modules converting protobuf messages to and from core values.
_CONVERSIONS = tuple(
    f"conductor/{name}.py"
    for name in ("block_hash_fields", "instance_messages", "kv_event_batches", "placement_messages")
)
# Where a sampled stack is charged: the innermost frame naming one of these (when it is
# below the Conductor's own innermost frame), else the Conductor code it runs in (second
# list), else the grpc core / uvloop (no Python frame).
_INNER = (
    ("index.match: scan of speculative claims (common_prefix)", ("common_prefix",)),
    ("index.match: block walk", ("PrefixIndex.match",)),
    ("index.expire", ("PrefixIndex.expire",)),
    ("metrics (prometheus_client)", ("prometheus_client",)),
    ("tracing (interceptor, OpenTelemetry)", ("opentelemetry", "common/telemetry/")),
    # Before the rest of the conversions, which it is part of: its own line in the summary.
    (
        "block hashes out of the message (block_hash_fields.block_hashes)",
        ("block_hashes (", "request_info (", "packed_hashes.py"),
    ),
    ("proto <-> core conversion (*_messages.py, kv_event_batches.py)", _CONVERSIONS),
    ("protobuf parse of each message (grpc_requests)", ("common/serving/grpc_requests.py",)),
    ("persister + etcd client + watch", ("persist.py", "common/store/interface.py", "replica.py")),
    ("grpc.aio Python layer", ("grpc/aio/", "grpc/_")),
)
_OUTER = (
    ("Finish (scheduler.finish, recording.finish)", ("PlacementRpcs._finish",)),
    ("load reports (cursors.apply)", ("KvEventRpcs._apply",)),
    ("recording.place: decide + record", ("core/recording.py",)),
    (
        "Scheduler.place: validation, idempotency, transfer names, sessions",
        ("Scheduler.place",),
    ),
    ("ScheduleStream loop: grpc receive of each message, queue", ("ScheduleStream",)),
    ("unary handler", ("Rpcs.",)),
    ("other Conductor code", ("services/", "kvsched/")),
)
_ROOTS = (
    "runpy",
    "conductor/__main__.py",
    "common/serving/process.py",
    "uvloop/__init__",
    "asyncio/runners.py",
)


def profile_summary(path: Path) -> list[tuple[str, float]]:
    """(category, samples) of a folded py-spy profile, largest first."""
    counts: dict[str, float] = {}
    for line in path.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        frames = [f for f in stack.split(";") if not any(r in f for r in _ROOTS)]
        what = "grpc core (Cython), uvloop, GC: no Python frame"
        found = False
        for frame in reversed(frames):
            for name, keys in _INNER:
                if any(k in frame for k in keys):
                    what, found = name, True
                    break
            if found or "services/conductor/" in frame or "kvsched/" in frame:
                break  # below the Conductor's own code: charged to its handler
        if not found and frames:
            joined = ";".join(frames)
            what = next((nm for nm, ks in _OUTER if any(k in joined for k in ks)), what)
        counts[what] = counts.get(what, 0.0) + int(n)
    return sorted(counts.items(), key=lambda kv: -kv[1])


def print_profile(res: ModeResult) -> None:
    if res.profile is None or not res.profile.exists():
        return
    rows = profile_summary(res.profile)
    total = sum(n for _, n in rows)
    decisions, wall_s = res.profile_span  # (one round of a phase run in several)
    n = max(decisions, 1)
    busy = total / PROFILE_HZ / wall_s if wall_s else 0.0
    print(
        f"\nConductor profile, {res.name} (py-spy --gil {PROFILE_HZ} Hz, {res.profile}): "
        f"the GIL was held {busy:.0%} of the phase, {total / PROFILE_HZ / n * 1e3:.2f} ms per "
        f"decision{' (Schedule + Finish + PublishKvEvents calls)' if 'unary' in res.name else ''}"
    )
    for name, count in rows:
        print(f"  {count / total:6.1%} {count / PROFILE_HZ / n * 1e3:7.3f} ms  {name}")


class Profiler:
    """py-spy attached to a process for one phase: folded Python stacks of whichever thread
    holds the GIL (the Conductor's bottleneck: one event loop). Time inside grpc's Cython
    and the uvloop core shows as stacks with no Conductor frame."""

    def __init__(self, pid: int, out: Path) -> None:
        exe = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
        self.out = out
        self.process = subprocess.Popen(
            [exe, "record", "--pid", str(pid), "--gil", "--rate", str(PROFILE_HZ),
             "--format", "raw", "--output", str(out)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
