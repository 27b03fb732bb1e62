"""(e) of `elastic` (`kvsched.core.policies.elastic`): refusing a request, with a retry delay,
when no instance meets the TTFT SLO, by staying or by moving its session's KV, although one
would on an idle cluster (`kvsched.core.admission`'s rule)."""

from __future__ import annotations

from collections.abc import Mapping

from kvsched.core import admission
from kvsched.core.cluster import ClusterState
from kvsched.core.cost import isolated_floor_s, moving_terms
from kvsched.core.decision import Decision
from kvsched.core.decision_builders import rejection
from kvsched.core.pickers import masked_min
from kvsched.core.request_view import FloatVec, RequestView
from kvsched.core.sessions import NO_HOST, Session


def slo_refusal(
    cluster: ClusterState,
    view: RequestView,
    estimated_ttft_s: float,
    placed_terms: Mapping[str, FloatVec],
    session: Session | None,
    *,
    moving: dict[str, FloatVec] | None = None,
) -> Decision | None:
    """The rejection of a placement estimated at `estimated_ttft_s` and scored by
    `placed_terms`, or None when it stands; `moving`: the session host's `moving_terms` when
    the caller has them (computed here otherwise). Changes nothing."""
    waited = view.req.waited_s
    if not estimated_ttft_s + waited > cluster.config.slo.ttft_s:
        return None
    terms = dict(placed_terms)
    best = masked_min(terms["ttft_s"], view.eligible, kernels=view.kernels)
    if session is not None and session.host != NO_HOST:
        # Moving the KV is an option.
        if moving is None:
            moving = moving_terms(cluster.cost, cluster.load, view, session.host)
        best = min(best, masked_min(moving["ttft_s"], view.eligible, kernels=view.kernels))
    slo = cluster.config.slo
    refusal = admission.check(best, isolated_floor_s(view, terms), slo, waited_s=waited)
    if refusal is None:
        return None
    return rejection(view, refusal.rule, refusal.retry_after_s, terms)
