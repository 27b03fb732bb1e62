"""SLO admission: refuse early, with a retry delay, what cannot be served in time."""

from __future__ import annotations

from dataclasses import dataclass

from kvsched.core.cluster import SloConfig


@dataclass(frozen=True, slots=True)
class Rejection:
    """Why a request is refused and when to try again."""

    rule: str
    retry_after_s: float


def check(
    best_ttft_s: float,
    floor_ttft_s: float,
    slo: SloConfig,
    *,
    tbt_s: float = 0.0,
    min_retry_s: float = 0.0,
    waited_s: float = 0.0,
) -> Rejection | None:
    """Refuse when the best estimated TTFT, plus the `waited_s` the request already spent
    before it was placed, misses the TTFT SLO, or the inter-token time misses the TPOT SLO. A
    request whose `floor_ttft_s` (its TTFT on an idle instance) already misses the SLO is
    never refused for TTFT: no wait would help it (a retry starts with nothing waited, so the
    floor is taken alone). The retry delay is the estimated excess of the best TTFT alone (at
    least `min_retry_s`, and never negative)."""
    if best_ttft_s + waited_s > slo.ttft_s and floor_ttft_s <= slo.ttft_s:
        retry = max(best_ttft_s - slo.ttft_s, min_retry_s, 0.0)
        return Rejection("estimated TTFT misses its SLO: reject", retry)
    if tbt_s > slo.tpot_s:
        return Rejection("estimated inter-token time misses its SLO: reject", max(min_retry_s, 1.0))
    return None
