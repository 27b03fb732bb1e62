"""Load shedding at the Router: the bounded queues a request passes, and the 429 it gets when
one is full. A Router under overload answers at once, never late: it admits a request (the
Conductor placed it within its SLO, or the fallback's local bound took it) or refuses it with
429 + Retry-After.

Queues, each bounded by a flag and exported as `<name>` and `<name>_limit` gauges:

    in flight  completions open at this Router, from authentication to their last byte
               (`--max-in-flight`); refused before the body is read or tokenized
    placing    requests waiting for the Conductor's answer (`--max-placing`); beyond it the
               Conductor is behind, and a request that joined would wait past its deadline
    per instance (fallback only)  requests this Router has open at one instance while the
               Conductor is unreachable (`--fallback-max-in-flight`)

Why shed, not fall back, when a placement is late: a Conductor that answers slowly is busy,
and a Router deciding alone admits without the SLO estimate (it knows neither the other
Routers' load nor the engines' queues), so overload turns into requests admitted late and
client timeouts. The local fallback stays for a Conductor that is really unreachable, under a
per-instance bound (see `local_placement`).
"""

from __future__ import annotations

from typing import Final

from prometheus_client import Gauge

from services.common.serving.api_errors import ApiError, overloaded

# What a shed request is told to wait. The queues drain in well under a second when the
# overload passes (a placement takes milliseconds, a Conductor's queue as long as its wait
# bound); a second is the least Retry-After can say and retries soon without piling up.
SHED_RETRY_AFTER_S: Final = 1.0


class BoundedCount:
    """How many of one thing are open now, and at most how many may be. `enter()` admits one
    more (or says no, changing nothing); `leave()` ends one that was admitted."""

    def __init__(self, limit: int, depth: Gauge | None = None, bound: Gauge | None = None):
        if limit < 1:
            raise ValueError(f"a bound must be at least 1, got {limit}")
        self.limit = limit
        self.depth = 0
        self._gauge = depth
        if bound is not None:
            bound.set(limit)

    def enter(self) -> bool:
        """Count one more and return True if it fits under the limit; else False."""
        if self.depth >= self.limit:
            return False
        self.depth += 1
        if self._gauge is not None:
            self._gauge.set(self.depth)
        return True

    def leave(self) -> None:
        """One admitted by `enter()` ended."""
        if self.depth <= 0:
            raise RuntimeError("leave() without a matching enter()")
        self.depth -= 1
        if self._gauge is not None:
            self._gauge.set(self.depth)


def shed(what: str) -> ApiError:
    """The 429 for a request refused because `what` is full."""
    return overloaded(
        f"The service is overloaded ({what}); retry after the delay in Retry-After.",
        SHED_RETRY_AFTER_S,
    )


def fits_instance(open_here: int, limit: int) -> bool:
    """The fallback's admission rule: whether one more request fits an instance that has
    `open_here` requests open from this Router, under `limit` per instance."""
    return open_here < limit
