"""`google.protobuf.Duration` to and from float seconds, as every API of the project carries
times."""

from __future__ import annotations

import math

from google.protobuf.duration_pb2 import Duration


def duration(seconds: float) -> Duration:
    """`seconds` as a Duration: a negative one as zero, an infinite one as unset (zero)."""
    d = Duration()
    if math.isfinite(seconds):
        d.FromNanoseconds(round(max(seconds, 0.0) * 1e9))
    return d


def seconds(d: Duration) -> float:
    return float(d.seconds) + d.nanos * 1e-9
