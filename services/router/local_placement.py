"""What this Router places alone, without the Conductor: a request while the Conductor is
unreachable (the fallback: `Placer` says when), and one no prefix places (`any_instance`, for
`passthrough`).

The fallback's candidates are the instances that serve the request's model. A session goes to
the instance the Conductor last placed it on, as this Router saw it (`session_hosts.py`:
during a leader change the session's turns keep finding their KV), else to its
rendezvous-hash instance (highest `xxh3_64(instance_id ‖ session)`; every Router computes
the same from the same list, so a session stays together across Routers), anything else to
the instance with the fewest requests in flight from this Router. Its admission rule is a
per-instance bound (`fallback_max_in_flight`) on the requests this Router has open there: a
session whose instance is full, or a request when every instance is, gets 429. It is coarser
than the Conductor's TTFT estimate (the Router sees neither the other Routers' load nor the
engines' caches), which is why it serves only while the Conductor cannot. An instance that
refused a connection is skipped for `suspect_s` seconds.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Sequence

import xxhash

from kvsched.core.adapters import AdapterChange
from services.common.inference_api.openai_api import unavailable
from services.router.metrics import RouterMetrics
from services.router.overload import fits_instance, shed
from services.router.placement import KnownInstance, Placement, PlacementQuery
from services.router.session_hosts import SessionHosts

log = logging.getLogger(__name__)


class LocalPlacer:
    """This Router's own placement over the last instance list (which `Placer.refresh` keeps),
    fed by the relay with the requests it has open at each instance and the instances that
    refused a connection."""

    def __init__(
        self,
        metrics: RouterMetrics,
        *,
        suspect_s: float,
        fallback_max_in_flight: int,
        clock: Callable[[], float],
    ) -> None:
        self._metrics = metrics
        self._suspect_s = suspect_s
        self._clock = clock
        self._instances: tuple[KnownInstance, ...] = ()  # the last list (`Placer.refresh`)
        self._suspects: dict[str, float] = {}  # instance id -> skipped until (clock)
        self._in_flight: dict[str, int] = {}
        self._rr = 0
        self._per_instance = fallback_max_in_flight
        metrics.fallback_instance_limit.set(fallback_max_in_flight)
        # Where the Conductor last placed each session (`Placer` records its decisions).
        self._session_hosts = SessionHosts()
        self.fallback_decisions = 0

    @property
    def instances(self) -> tuple[KnownInstance, ...]:
        return self._instances

    # ---- in-flight and suspects (fed by the relay) -----------------------------------

    def begin(self, instance_id: str) -> None:
        self._in_flight[instance_id] = self._in_flight.get(instance_id, 0) + 1

    def end(self, instance_id: str) -> None:
        left = self._in_flight.get(instance_id, 0) - 1
        if left > 0:
            self._in_flight[instance_id] = left
        else:
            self._in_flight.pop(instance_id, None)

    def suspect(self, instance_id: str) -> None:
        """`instance_id` refused a connection: the fallback skips it for a while."""
        if instance_id not in self._suspects:
            log.warning(
                "instance %s refused a connection; skipped for %.0f s", instance_id, self._suspect_s
            )
        self._suspects[instance_id] = self._clock() + self._suspect_s

    # ---- placement -------------------------------------------------------------------

    def fallback(
        self, query: PlacementQuery, reason: str, exclude: Collection[str] = ()
    ) -> Placement:
        """Decide locally (see the module docstring); raises `ApiError` 503 with no candidate,
        429 when the chosen instance is at the per-instance bound."""
        now = self._clock()
        if self._suspects:
            for iid in [i for i, until in self._suspects.items() if until <= now]:
                del self._suspects[iid]
        candidates = [
            i
            for i in self._instances
            if i.instance_id not in self._suspects
            and i.instance_id not in exclude
            and (not query.model or i.model in ("", query.model))
        ]
        if not candidates:
            raise unavailable("No inference instance is available; try again shortly.")
        last = self._session_hosts.host(query.session_id) if query.session_id else None
        remembered = [i for i in candidates if i.instance_id == last]
        if remembered:
            chosen, rule = remembered[0], "fallback_session_last_host"
        elif query.session_id:
            chosen = rendezvous(candidates, query.session_id)
            rule = "fallback_session_hash"
        else:
            chosen = self._least_in_flight(candidates)
            rule = "fallback_least_in_flight"
        if not fits_instance(self._in_flight.get(chosen.instance_id, 0), self._per_instance):
            self._metrics.shed.labels("fallback_bound").inc()
            raise shed("the scheduler is unreachable and the instance is at its local bound")
        self.fallback_decisions += 1
        self._metrics.fallback.labels(reason).inc()
        return Placement(
            request_id=query.request_id,
            instance_id=chosen.instance_id,
            url=chosen.url,
            policy="",
            rule=rule,
            expected_cached_tokens=0,
            fallback=reason,
            # Nobody knows what the instance holds: load the adapter (a no-op where held).
            adapter_change=AdapterChange(load=query.adapter),
        )

    def any_instance(self, model: str, exclude: Collection[str] = ()) -> KnownInstance:
        """An instance serving `model` for a request no prefix places (`passthrough`): the
        one with the fewest requests in flight from this Router, suspects and `exclude`
        skipped; raises `ApiError` 503 when none is up."""
        now = self._clock()
        candidates = [
            i
            for i in self._instances
            if self._suspects.get(i.instance_id, 0.0) <= now
            and i.instance_id not in exclude
            and i.model in ("", model)
        ]
        if not candidates:
            raise unavailable("No inference instance is available; try again shortly.")
        return self._least_in_flight(candidates)

    def _least_in_flight(self, candidates: Sequence[KnownInstance]) -> KnownInstance:
        # Start the scan at a rotating position so ties (an idle cluster) spread round-robin.
        n = len(candidates)
        start = self._rr % n
        self._rr += 1
        best = candidates[start]
        best_load = self._in_flight.get(best.instance_id, 0)
        for k in range(1, n):
            inst = candidates[(start + k) % n]
            load = self._in_flight.get(inst.instance_id, 0)
            if load < best_load:
                best, best_load = inst, load
        return best


def rendezvous(candidates: Sequence[KnownInstance], session_id: str) -> KnownInstance:
    """Highest-random-weight choice: deterministic for a session and an instance set, and
    removing an instance moves only the sessions it had."""
    key = b"\x00" + session_id.encode()
    return max(
        candidates, key=lambda i: (xxhash.xxh3_64_intdigest(i.instance_id.encode() + key), i.url)
    )
